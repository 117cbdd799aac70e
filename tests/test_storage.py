"""Run files in a bucket (supo_jax.storage) against a GCS API server on a loopback port
(tests/gcs.py): the same calls as on a local disk, a missing or read-only bucket one line."""
import os

import pytest

from supo_jax import storage
from tests import gcs


@pytest.fixture(scope="module")
def bucket():
    server, host = gcs.start()
    old = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                                          "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    os.environ["STORAGE_EMULATOR_HOST"] = host
    os.environ.pop("TENSORSTORE_GCS_HTTP_URL", None)
    # now, not at the first storage call: gcsfs reads its variables when imported, and a
    # test that imports it first (on an xdist worker, the first) got the gRPC bucket checks
    storage.configure()
    yield f"gs://{gcs.BUCKET}"
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_paths_join_and_split_alike_locally_and_in_a_bucket(tmp_path):
    assert storage.join("gs://b/run/", "hf", "config.json") == "gs://b/run/hf/config.json"
    assert storage.dirname("gs://b/run/hf") == "gs://b/run"
    assert storage.abspath("gs://b/x") == "gs://b/x" and storage.is_url("gs://b/x")
    assert storage.join(str(tmp_path), "a") == os.path.join(str(tmp_path), "a")
    assert not storage.is_url(str(tmp_path)) and not storage.is_url("file:///tmp/x")


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_files_and_directories_round_trip(where, bucket, tmp_path):
    root = storage.join(bucket, "files") if where == "bucket" else str(tmp_path / "files")
    storage.ensure_dir(root, "the test directory")
    f = storage.join(root, "log.jsonl")
    storage.write_text(f, "a\n")
    storage.append_text(f, "b\n")
    assert storage.read_text(f) == "a\nb\n" and storage.isfile(f) and not storage.isdir(f)
    with storage.staged_dir(storage.join(root, "hf")) as d:
        os.makedirs(os.path.join(d, "sub"))
        with open(os.path.join(d, "sub", "w.bin"), "wb") as fh:
            fh.write(b"\x00\x01")
        with open(os.path.join(d, "config.json"), "w") as fh:
            fh.write("{}")
    hf = storage.resolve(storage.join(root, "hf"))    # in a bucket: its current version
    assert sorted(storage.listdir(hf)) == ["config.json", "sub"]
    with storage.local_copy(hf) as d:
        with open(os.path.join(d, "sub", "w.bin"), "rb") as fh:
            assert fh.read() == b"\x00\x01"
    storage.replace(f, storage.join(root, "old.jsonl"))
    assert not storage.exists(f) and storage.read_text(storage.join(root, "old.jsonl")) == "a\nb\n"
    storage.rmtree(storage.join(root, "hf"))
    assert not storage.exists(storage.join(root, "hf"))
    assert sorted(storage.listdir(root)) == ["old.jsonl"]


def test_an_export_killed_mid_upload_leaves_the_old_one_whole(bucket, monkeypatch):
    """staged_dir in a bucket uploads a new version beside the old and switches the export's
    pointer last: an upload that dies after k of its files (any k) leaves the old export
    standing, whole, for every reader; a whole upload is read whole and the version before
    it is kept (a reader may be copying it), older ones deleted."""
    import gcsfs

    hf = storage.join(bucket, "export", "hf")

    def export(tag, files=6):
        with storage.staged_dir(hf) as d:
            for i in range(files):
                with open(os.path.join(d, f"part{i}.txt"), "w") as fh:
                    fh.write(f"{tag} {i}")

    def read():
        with storage.local_copy(storage.resolve(hf)) as d:
            return {f: open(os.path.join(d, f)).read() for f in sorted(os.listdir(d))}

    export("old")
    old = read()
    assert old == {f"part{i}.txt": f"old {i}" for i in range(6)}
    put = gcsfs.GCSFileSystem._put_file
    for k in range(6):
        calls = []

        async def dying(self, *a, _k=k, **kw):
            if len(calls) == _k:
                raise ConnectionError("killed")
            calls.append(a)
            return await put(self, *a, **kw)
        monkeypatch.setattr(gcsfs.GCSFileSystem, "_put_file", dying)
        with pytest.raises(ConnectionError):
            export("new")
        monkeypatch.setattr(gcsfs.GCSFileSystem, "_put_file", put)
        assert read() == old, k
    export("new")
    assert read() == {f"part{i}.txt": f"new {i}" for i in range(6)}
    export("newer")
    versions = [n for n in storage.listdir(hf) if n != storage.EXPORT]
    assert len(versions) == 2     # newer, and the one before it


def test_a_missing_or_read_only_bucket_is_one_line_naming_the_setting(bucket):
    with pytest.raises(OSError, match=r"^train.run_dir gs://no-such-bucket/run: cannot write "
                                      r"there \(FileNotFoundError"):
        storage.ensure_dir("gs://no-such-bucket/run", "train.run_dir")
    with gcs.refusing(), pytest.raises(OSError, match=r"cannot write there .*Forbidden"):
        storage.ensure_dir(storage.join(bucket, "run"), "train.run_dir")
    assert not storage.exists(storage.join(bucket, "run"))


def test_appending_to_a_bucket_log_uploads_each_row_once(bucket):
    """A bucket's log grows by composing each appended row into it (GCS's compose, server
    side): 200 appends of a 3 KB row upload about 200 rows' bytes (the old read-and-rewrite
    uploaded the whole log each time: 100 times that), and the log reads back whole, with no
    part object left beside it."""
    log = storage.join(bucket, "appends", "metrics.jsonl")
    row = '{"step": %04d, "pad": "' + "x" * 3000 + '"}\n'
    storage.write_text(log, row % 0)
    before = gcs.UPLOADED["bytes"]
    for i in range(1, 201):
        storage.append_text(log, row % i)
    sent = gcs.UPLOADED["bytes"] - before
    assert sent < 2 * 200 * len(row % 0), sent
    assert storage.read_text(log) == "".join(row % i for i in range(201))
    assert storage.listdir(storage.join(bucket, "appends")) == ["metrics.jsonl"]


def test_a_server_without_object_generations_is_one_line_at_start(bucket):
    """A server that ignores GCS's generation preconditions (the stock emulator) would fail
    in the first Orbax save with a tensorstore traceback: the write check stops it at start,
    in one line saying what the server lacks, and leaves nothing behind."""
    run = storage.join(bucket, "stock")
    with gcs.stock(), pytest.raises(OSError, match=r"^train.run_dir gs://.*/stock: the storage "
                                    r"server ignores GCS's object generation preconditions") as e:
        storage.ensure_dir(run, "train.run_dir")
    assert "\n" not in str(e.value)
    storage.ensure_dir(run, "train.run_dir")       # GCS's behaviour: the check passes
    assert not storage.exists(run) or storage.listdir(run) == []


def test_tensorstore_endpoint_is_derived_from_storage_emulator_host(bucket):
    """Orbax writes arrays through tensorstore, which reads its own variable: the project
    sets it from STORAGE_EMULATOR_HOST, and a checkpoint round-trips through the bucket."""
    import jax.numpy as jnp
    import numpy as np

    from supo_jax.checkpoint import RunCheckpoints

    ck = RunCheckpoints(storage.join(bucket, "ck"), keep=2, async_save=True)
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == os.environ["STORAGE_EMULATOR_HOST"]
    tree = {"w": jnp.arange(6.0), "b": jnp.ones((2, 3))}
    for step in (1, 2, 3):
        ck.save(step, {k: v * step for k, v in tree.items()}, {"n": jnp.array(step)},
                {"step": step})
    ck.wait()
    assert ck.steps() == [2, 3]
    step, params, opt, meta = ck.restore_latest(tree, {"n": jnp.array(0)})
    assert step == 3 and meta == {"step": 3} and int(opt["n"]) == 3
    np.testing.assert_array_equal(params["b"], np.ones((2, 3)) * 3)
    ck.close()


def test_two_write_checks_with_one_process_id_do_not_collide(bucket, monkeypatch):
    """Identical hosts may run the same process id: two write checks on one directory, the
    first deleting its probe after the second did, both pass (the probe named by the process
    id alone was one object, deleted twice: 'cannot write there')."""
    import threading

    monkeypatch.setattr(os, "getpid", lambda: 4242)
    real, first_at_remove, second_removed = storage.remove, threading.Event(), threading.Event()

    def remove(path):
        if threading.current_thread().name == "first":
            first_at_remove.set()
            assert second_removed.wait(30)
            return real(path)
        assert first_at_remove.wait(30)
        try:
            return real(path)
        finally:
            second_removed.set()
    monkeypatch.setattr(storage, "remove", remove)
    errors = []

    def check():
        try:
            storage.ensure_dir(storage.join(bucket, "twins"), "train.run_dir")
        except Exception as e:   # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=check, name=n) for n in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and second_removed.is_set()
    assert not storage.exists(storage.join(bucket, "twins"))


def test_a_write_check_probe_already_gone_is_no_error(bucket, monkeypatch):
    real = storage.remove

    def remove(path):
        real(path)
        raise FileNotFoundError(path)
    monkeypatch.setattr(storage, "remove", remove)
    storage.ensure_dir(storage.join(bucket, "gone"), "train.run_dir")


def test_a_finished_sft_checkpoint_is_removed_by_the_main_process_only(monkeypatch):
    """Every process of a run ends sft_train: the main one removes its checkpoint, the others
    wait at a barrier until it is gone (each removing it, all but one failed in a bucket)."""
    import jax
    from jax.experimental import multihost_utils

    from supo_jax.rl import sft

    removed, synced = [], []
    monkeypatch.setattr(storage, "rmtree", removed.append)
    monkeypatch.setattr(multihost_utils, "sync_global_devices", synced.append)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for me in (1, 0):
        monkeypatch.setattr(jax, "process_index", lambda me=me: me)
        sft.drop_checkpoint("gs://b/run/sft_ckpt")
        assert removed == ([] if me else ["gs://b/run/sft_ckpt"]) and len(synced) == 2 - me


def test_removing_a_bucket_directory_emptied_meanwhile_is_no_error(bucket, monkeypatch):
    """Objects another process deleted between the listing and the delete: gcsfs raises
    FileNotFoundError when none was left to delete."""
    d = storage.join(bucket, "emptied")
    storage.write_text(storage.join(d, "a.txt"), "a")
    fs = storage.filesystem(d)[0]     # (one instance, cached by fsspec)
    rm = fs.rm

    def emptied_meanwhile(path, *a, **kw):
        rm(path, *a, **kw)
        raise FileNotFoundError(path)
    monkeypatch.setattr(fs, "rm", emptied_meanwhile)
    storage.rmtree(d)
    storage.rmtree(storage.join(bucket, "never-there"))
    monkeypatch.undo()
    assert not storage.exists(d)


def test_an_error_asking_a_bucket_is_not_taken_for_absent(bucket, monkeypatch):
    """fsspec's exists/isfile answer False to any error: a 503 or a refused read would make a
    run's config.json look absent (and be overwritten). Only 'not found' is absent here."""
    f = storage.join(bucket, "probe", "config.json")
    storage.write_text(f, "{}")
    assert storage.exists(f) and storage.isfile(f) and storage.isdir(storage.dirname(f))
    missing = storage.join(bucket, "probe", "none.json")
    assert not storage.exists(missing) and not storage.isfile(missing)
    assert not storage.isdir(missing) and not storage.isfile(storage.dirname(f))
    for error in (PermissionError("403 Forbidden"), OSError("503 Service Unavailable")):
        def failing(path, *a, _e=error, **kw):
            raise _e
        monkeypatch.setattr(storage.filesystem(f)[0], "info", failing)
        for ask in (storage.exists, storage.isfile, storage.isdir):
            with pytest.raises(OSError, match=r"^gs://.*/probe/config.json: cannot tell whether "
                                              rf"it exists \({type(error).__name__}: ") as e:
                ask(f)
            assert "\n" not in str(e.value)


def test_file_urls_are_local_paths(tmp_path):
    base = f"file://{tmp_path}"
    f = storage.join(base, "run", "a.txt")
    storage.ensure_dir(storage.join(base, "run"))
    storage.write_text(f, "x")
    assert storage.read_text(f) == "x" and storage.exists(f) and storage.isfile(f)
    assert (tmp_path / "run" / "a.txt").read_text() == "x"
    assert storage.abspath(f"{base}/run/a.txt") == str(tmp_path / "run" / "a.txt")
    assert storage.isdir(f"{base}/run") and storage.listdir(f"{base}/run") == ["a.txt"]
    with storage.local_copy(f"{base}/run") as d:
        assert os.listdir(d) == ["a.txt"]
    storage.rmtree(f"{base}/run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("scheme", ["gcs", "s3"])
def test_a_run_directory_in_another_scheme_is_refused_at_start(scheme, monkeypatch):
    """Orbax takes only gs:// (KeyError: 'gcs://') and TensorBoard would write gcs:// paths
    locally: a run stops at its start, before any request."""
    def no_network(*a, **kw):
        raise AssertionError("network access")
    monkeypatch.setattr(storage, "filesystem", no_network)
    with pytest.raises(OSError, match=rf"^train.run_dir {scheme}://b/x: only gs:// buckets and "
                                      rf"local paths are supported \(not {scheme}://\)$"):
        storage.ensure_dir(f"{scheme}://b/x", "train.run_dir")


@pytest.mark.parametrize("mode", ["w", "wb"])
def test_a_bucket_file_whose_block_raises_is_not_uploaded(bucket, mode):
    """fsspec's writer uploads on exit whatever was written (a truncated plot): a with-block
    that raises leaves the object as it was, absent or old; a clean block writes it whole."""
    text = (lambda s: s.encode()) if "b" in mode else (lambda s: s)
    new, old = storage.join(bucket, "partial", f"new.{mode}"), storage.join(bucket, "partial",
                                                                             f"old.{mode}")
    storage.write_text(old, "old content")
    for path in (new, old):
        with pytest.raises(RuntimeError), storage.open(path, mode) as f:
            f.write(text("half of "))
            raise RuntimeError("plot failed")
    assert not storage.exists(new) and storage.read_text(old) == "old content"
    with storage.open(new, mode) as f:
        f.write(text("all ") * 100_000)
        f.write(text("done"))
    assert storage.read_text(new) == "all " * 100_000 + "done"
    f = storage.open(old, mode)
    f.write(text("closed by hand"))
    f.close()
    assert storage.read_text(old) == "closed by hand"


HOST_SCRIPT = r'''
import os, sys, time
os.getpid = lambda: 4242                      # identical VMs: the same process id
from supo_jax import storage
root, go = sys.argv[1], sys.argv[2]
while not os.path.exists(go):                 # both start together
    time.sleep(0.01)
for _ in range(5):
    storage.ensure_dir(storage.join(root, "run"), "train.run_dir")
storage.rmtree(storage.join(root, "sft_ckpt"))   # both remove what the other removes too
print("ok")
'''


def test_two_hosts_check_and_clean_one_bucket_directory_at_once(bucket, tmp_path):
    """Two processes (two hosts of one run, with the same process id) check that the run
    directory is writable and remove one checkpoint directory at the same moment, on the
    emulator: neither fails (the write check's probe named by the process id alone was one
    object both deleted; an rmtree that found the other's deletions raised)."""
    import subprocess
    import sys

    root = storage.join(bucket, "hosts")
    for i in range(40):
        storage.write_text(storage.join(root, "sft_ckpt", f"shard_{i}"), "x")
    go = tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))))
    procs = [subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, root, str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    import time
    time.sleep(2)                     # both imported and waiting
    go.write_text("go")
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    assert not storage.exists(storage.join(root, "sft_ckpt"))
    assert not storage.exists(storage.join(root, "run"))      # no probe left behind
