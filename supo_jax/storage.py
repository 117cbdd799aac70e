"""Run files on a local disk or in a bucket: every read and write of a run's files (run
directories, checkpoints, exports, demonstrations, sweep tables, `--out` and `plan --json`
files) goes through these functions, which take a local path (`file://` allowed) or a
bucket's URL (`gs://bucket/path`). Local paths keep the os module's behaviour; URLs go
through fsspec (gcsfs for gs://), and Orbax writes arrays to them through tensorstore. Other
schemes fsspec knows pass these functions, but a run refuses them at its start (ensure_dir):
Orbax and TensorBoard would not write there.

Google's clients read STORAGE_EMULATOR_HOST (a GCS API server to use instead of
storage.googleapis.com, e.g. an emulator); gcsfs and google-cloud-storage (TensorBoard's
writer) read it themselves, and tensorstore, which has its own variable, gets
TENSORSTORE_GCS_HTTP_URL derived from it here (configure()). With it set, requests go
unauthenticated, as emulators expect, and gcsfs does not ask for the bucket's type (a gRPC
API emulators lack).
"""
from __future__ import annotations

import builtins
import contextlib
import io
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid

_DERIVED: dict[str, str] = {}   # environment variables configure() set, and to what


def is_url(path) -> bool:
    """A path with a scheme other than file:// (gs://bucket/dir)."""
    return "://" in str(path) and not str(path).startswith("file://")


def _local(path):
    """A local path without its `file://` (os functions take `file:///x` for a relative
    path named `file:`)."""
    return str(path)[len("file://"):] if str(path).startswith("file://") else path


def configure() -> None:
    """Point tensorstore (Orbax's array writer) at STORAGE_EMULATOR_HOST when that is set and
    tensorstore's own endpoint is not (or is what an earlier call derived: the emulator
    moved), and quiet gcsfs's warnings about the credentials an emulator does not need.
    Called before any remote access (cheap)."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if host:
        url = (host if "://" in host else f"http://{host}").rstrip("/")
        key = "TENSORSTORE_GCS_HTTP_URL"
        if os.environ.get(key) in (None, _DERIVED.get(key)):
            os.environ[key] = _DERIVED[key] = url
        # gcsfs asks GCS's gRPC control API for each bucket's type (zonal, hierarchical),
        # which an emulator does not serve: it retries for minutes. A plain bucket it is.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        logging.getLogger("gcsfs").setLevel(logging.ERROR)


def filesystem(path):
    """(fsspec filesystem, path within it) of a URL."""
    import fsspec

    configure()
    opts = {}
    if str(path).startswith(("gs://", "gcs://")):
        # listings are not cached: another process (a resumed run, another host) may have
        # written since; with an emulator, no credentials
        opts["use_listings_cache"] = False
        host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
        if host:   # (the endpoint also keys fsspec's cache of filesystems)
            opts["token"] = "anon"
            opts["endpoint_url"] = (host if "://" in host else f"http://{host}").rstrip("/")
    return fsspec.core.url_to_fs(str(path), **opts)


def join(path, *parts) -> str:
    if not is_url(path):
        return os.path.join(_local(path), *parts)
    out = str(path).rstrip("/")
    for p in parts:
        out = f"{out}/{str(p).strip('/')}"
    return out


def dirname(path) -> str:
    if not is_url(path):
        return os.path.dirname(_local(path))
    scheme, rest = str(path).rstrip("/").split("://", 1)
    return f"{scheme}://{rest.rsplit('/', 1)[0]}" if "/" in rest else str(path)


def abspath(path) -> str:
    return str(path) if is_url(path) else os.path.abspath(_local(path))


def _info(path) -> dict | None:
    """fsspec's info on a URL, None where nothing is there. fsspec's exists/isfile/isdir
    answer False to any error: a transient or permission error would read as absent (and a
    run's config.json be overwritten), so only FileNotFoundError does here."""
    fs, p = filesystem(path)
    try:
        return fs.info(p)
    except FileNotFoundError:
        return None
    except Exception as e:   # noqa: BLE001  (gcsfs's HttpError, PermissionError, timeouts)
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise OSError(f"{path}: cannot tell whether it exists ({type(e).__name__}: {why})") from e


def exists(path) -> bool:
    if not is_url(path):
        return os.path.exists(_local(path))
    return _info(path) is not None


def isfile(path) -> bool:
    if not is_url(path):
        return os.path.isfile(_local(path))
    info = _info(path)
    return info is not None and info["type"] == "file"


def isdir(path) -> bool:
    """A directory; in a bucket, a prefix that holds at least one object."""
    if not is_url(path):
        return os.path.isdir(_local(path))
    info = _info(path)
    return info is not None and info["type"] == "directory"


def listdir(path) -> list[str]:
    """The names in a directory (in a bucket: under a prefix), not full paths."""
    if not is_url(path):
        return os.listdir(_local(path))
    fs, p = filesystem(path)
    return [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False)]


def makedirs(path) -> None:
    """mkdir -p; in a bucket nothing (prefixes exist once an object is written under them)."""
    if not is_url(path):
        os.makedirs(_local(path), exist_ok=True)


def remove(path) -> None:
    if not is_url(path):
        os.remove(_local(path))
        return
    fs, p = filesystem(path)
    fs.rm_file(p)


def rmtree(path) -> None:
    """Remove a directory and everything under it; nothing if it does not exist. In a bucket
    objects another process removes meanwhile (a run's processes all removing it) are no
    error: gcsfs raises FileNotFoundError when it finds nothing left to delete."""
    if not is_url(path):
        shutil.rmtree(_local(path), ignore_errors=True)
        return
    fs, p = filesystem(path)
    try:
        fs.rm(p, recursive=True)
    except FileNotFoundError:
        pass


def ensure_dir(path, what: str = "the directory") -> None:
    """Create a directory (locally) and check that files can be written there: in a bucket,
    by writing and deleting a small object, so that a missing bucket, a read-only one or
    missing credentials stop a run at its start with one line (an OSError) naming `what`.
    A URL of another scheme than gs:// is refused (Orbax and TensorBoard would not write
    there)."""
    if not is_url(path):
        os.makedirs(_local(path), exist_ok=True)
        return
    scheme = str(path).split("://", 1)[0]
    if scheme != "gs":
        raise OSError(f"{what} {path}: only gs:// buckets and local paths are supported "
                      f"(not {scheme}://)")
    # unique across hosts and processes: identical VMs may run the same process id, and
    # two checks on one object would delete it twice
    probe = join(path, f".write_check.{socket.gethostname()}.{os.getpid()}."
                       f"{uuid.uuid4().hex[:8]}")
    try:
        write_text(probe, "supo_jax write check")
        honoured = _generations_honoured(probe)
        try:
            remove(probe)
        except FileNotFoundError:   # already gone: the write check still held
            pass
    except Exception as e:   # noqa: BLE001  (gcsfs's HttpError, PermissionError, auth errors)
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise OSError(f"{what} {path}: cannot write there ({type(e).__name__}: {why})") from None
    if not honoured:
        raise OSError(f"{what} {path}: the storage server ignores GCS's object generation "
                      "preconditions (a write to an existing object with ifGenerationMatch=0 "
                      "succeeded), which Orbax's checkpoints (tensorstore) need to commit "
                      "safely; use GCS, or an emulator that implements them")


def _generations_honoured(probe: str) -> bool:
    """Whether the server refuses a write conditioned on a generation the object does not
    have: creating `probe`, which exists, with ifGenerationMatch=0 (as GCS answers: 412)."""
    fs, p = filesystem(probe)
    try:
        fs.pipe_file(p, b"supo_jax generation check", mode="create")
    except FileExistsError:
        return True
    except OSError as e:      # another failure is the write check's own error
        if "412" in str(e) or "recondition" in str(e):
            return True
        raise
    return False


class _Upload:
    """An object's new content, kept in memory and uploaded whole by close() or a with-block
    that ends without an error. A block that raises, or a writer dropped unclosed, uploads
    nothing: fsspec's writer would upload the part written (a truncated plot, say)."""

    def __init__(self, fs, path: str, create: bool) -> None:
        super().__init__()
        self._fs, self._path, self._create, self._discard = fs, path, create, False

    def __exit__(self, kind, value, tb):
        self._discard = kind is not None
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._discard:
                data = self.getvalue()
                data = data.encode("utf-8") if isinstance(data, str) else data
                self._fs.pipe_file(self._path, data, mode="create" if self._create else "overwrite")
        finally:
            super().close()

    def __del__(self) -> None:   # not close(): the content may be partial
        pass


class _TextUpload(_Upload, io.StringIO):
    pass


class _BytesUpload(_Upload, io.BytesIO):
    pass


def open(path, mode: str = "r"):  # noqa: A001 - the builtin's counterpart
    """A file object; text modes decode UTF-8. In a bucket "a" (append) is not offered: use
    append_text(); a write ("w", "x") uploads the whole object when the file is closed, and
    nothing when its with-block raises."""
    if not is_url(path):
        return builtins.open(_local(path), mode,
                             **({} if "b" in mode else {"encoding": "utf-8"}))
    if "a" in mode or "+" in mode:
        raise ValueError(f"{path}: objects in a bucket cannot be appended to; use append_text")
    fs, p = filesystem(path)
    if "w" in mode or "x" in mode:
        if "x" in mode and exists(path):
            raise FileExistsError(path)
        return (_BytesUpload if "b" in mode else _TextUpload)(fs, p, create="x" in mode)
    return fs.open(p, mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def read_text(path) -> str:
    with open(path) as f:
        return f.read()


def write_text(path, text: str) -> None:
    """Write a whole file at once: locally through a temporary file and a rename, so a reader
    sees the old or the new file, never half of one (an object upload is already atomic)."""
    if is_url(path):
        with open(path, "w") as f:
            f.write(text)
        return
    path = _local(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def append_text(path, text: str) -> None:
    """Append to a file. In a bucket, O(text) bytes a call: the text goes up as an object of
    its own, and GCS composes the file and it into the file (server-side, what its docs give
    for appends); the part is deleted after. A reader sees the file before or after the
    append, whole; a kill in between leaves at most a stray part object beside it."""
    if not is_url(path):
        with open(path, "a") as f:
            f.write(text)
        return
    if not exists(path):
        write_text(path, text)
        return
    fs, p = filesystem(path)
    head, _, name = p.rpartition("/")
    part = f"{head}/.{name}.append-{uuid.uuid4().hex[:12]}"
    fs.pipe_file(part, text.encode("utf-8"))
    try:
        fs.merge(p, [p, part])
    finally:
        fs.rm_file(part)


def replace(src, dst) -> None:
    """Move the file src onto dst (locally os.replace, atomic; in a bucket its bytes written
    to dst, then src deleted)."""
    if not is_url(src) and not is_url(dst):
        os.replace(_local(src), _local(dst))
        return
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data)
    remove(src)


@contextlib.contextmanager
def local_copy(path):
    """A local path holding `path` (a file or a directory) for code that reads only local
    files (safetensors, tokenizers): `path` itself when local, else a temporary download."""
    if not is_url(path):
        yield str(_local(path))
        return
    fs, p = filesystem(path)
    with tempfile.TemporaryDirectory(prefix="supo_jax_dl_") as tmp:
        dest = os.path.join(tmp, p.rstrip("/").rsplit("/", 1)[-1])
        if fs.isdir(p):
            fs.get(p.rstrip("/") + "/", dest + "/", recursive=True)
        else:
            fs.get(p, dest)
        yield dest


EXPORT = "EXPORT.json"   # a bucket directory's pointer to its current version (staged_dir)


@contextlib.contextmanager
def staged_dir(path):
    """A local directory to write into for code that writes only local files (an HF
    export): `path` itself when local. In a bucket, a temporary directory uploaded when the
    block ends without an error, as a new version of `path`: its files go to
    `path/v-<time>-<id>/`, then `path/EXPORT.json` (one small object, written last) names
    that version, so a reader (`resolve`) sees the old export or the new one, whole, and a
    process killed mid-upload leaves the old one standing. Versions other than the new and
    the one before it (a reader may still be copying it) are deleted after the switch."""
    if not is_url(path):
        os.makedirs(_local(path), exist_ok=True)
        yield str(_local(path))
        return
    with tempfile.TemporaryDirectory(prefix="supo_jax_up_") as tmp:
        yield tmp
        fs, p = filesystem(path)
        p = p.rstrip("/")
        before = _export_version(path)
        version = f"v-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        fs.put(tmp.rstrip("/") + "/", f"{p}/{version}/", recursive=True)
        write_text(join(path, EXPORT), json.dumps({"version": version}))
        for name in listdir(path):    # older versions, and a plain export written before
            if name in (EXPORT, version, before):
                continue
            if isdir(join(path, name)):
                rmtree(join(path, name))
            else:
                remove(join(path, name))


def _export_version(path) -> str | None:
    marker = join(path, EXPORT)
    if not is_url(path) or not isfile(marker):
        return None
    try:
        version = json.loads(read_text(marker))["version"]
    except (ValueError, KeyError, TypeError):
        raise OSError(f"{marker}: not an export pointer ({{\"version\": ...}} expected)") from None
    if not isinstance(version, str) or "/" in version or not version.startswith("v-"):
        raise OSError(f"{marker}: names {version!r}, not a version of {path}")
    return version


def resolve(path) -> str:
    """The directory holding an export's files: in a bucket, the version `path/EXPORT.json`
    names (staged_dir), else `path` itself (a local directory, or a bucket directory
    written another way)."""
    version = _export_version(path)
    return join(path, version) if version else (path if is_url(path) else _local(path))
