"""Task sets as TFDS datasets stored as array_record, read with `as_data_source` (random
access, no TensorFlow needed: tensorflow-datasets writes and reads array_record itself).

    tasks = load_tasks("search", "train", 12_800, seed=0, corpus_size=10_000)
    len(tasks), tasks[7], tasks[-1], tasks[10:20]      # task dicts, decoded on access

On first use the task set is generated with the environment's registered generator
(`make_tasks(env_name, split, n, seed, **knobs)`) and written by a TFDS builder
(`SupoTasks`, one record per task: the task dict JSON-encoded in a `Text` feature, kept
in generation order) to

    <data_dir>/supo_tasks/<env>-<split>-n<n>-seed<seed>-<hash>/1.0.0/
        supo_tasks-<split>.array_record-00000-of-00001, dataset_info.json, metadata.json

where <hash> is a digest of (env, split, n, seed, knobs) (knobs canonicalized as JSON:
tuples = lists), so different knobs never collide; metadata.json records them. Later
calls reuse it. data_dir defaults to $SUPO_JAX_DATA, else ~/.cache/supo_jax/tfds.
Preparation holds a file lock, so concurrent processes build a set once.

Staleness: the key cannot see the generator's code. On reuse, the first `verify` tasks
(default 4) are regenerated and compared (registered generators return the first tasks
of a longer list for a smaller n); a mismatch rebuilds the set. verify=0 skips this.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from functools import lru_cache

from supo_jax.envs.base import make_tasks

FORMAT_VERSION = "1.0.0"
BUILDER_NAME = "supo_tasks"


def default_data_dir() -> str:
    return os.environ.get("SUPO_JAX_DATA") or os.path.join(
        os.path.expanduser("~"), ".cache", "supo_jax", "tfds")


def dataset_spec(env_name: str, split: str, n: int, seed: int = 0, **knobs) -> dict:
    """The identity of a task set (JSON-canonical)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    try:
        canon = json.loads(json.dumps(knobs, sort_keys=True))
    except (TypeError, ValueError) as e:
        raise TypeError(f"task knobs must be JSON-serializable: {e}") from None
    return {"env": env_name, "split": split, "n": n, "seed": int(seed), "knobs": canon}


def config_name(spec: dict) -> str:
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9_]+", "_", spec["env"]).strip("_") or "env"
    return f"{slug}-{spec['split']}-n{spec['n']}-seed{spec['seed']}-{digest}"


@lru_cache(maxsize=1)
def builder_class():
    """The TFDS builder class (defined lazily: importing tfds takes ~0.5 s)."""
    import tensorflow_datasets as tfds

    class SupoTasks(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """One task set of a supo_jax environment: record i = JSON of task i."""
        VERSION = tfds.core.Version(FORMAT_VERSION)
        RELEASE_NOTES = {FORMAT_VERSION: "Task dicts as JSON text, in generation order."}

        # tfds 4.9.10 looks up `importlib_resources` (a backport it only requires on Python
        # < 3.9) to locate a builder defined in a package; the path is only used to find a
        # checksums file, which this builder has none of.
        @tfds.core.utils.classproperty
        @classmethod
        def code_path(cls):
            return None

        def __init__(self, *, spec: dict, **kwargs):
            self.spec = spec
            super().__init__(config=tfds.core.BuilderConfig(name=config_name(spec)), **kwargs)

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                description=f"supo_jax task set: {json.dumps(self.spec, sort_keys=True)}",
                features=tfds.features.FeaturesDict({"task": tfds.features.Text()}),
                disable_shuffling=True,  # record i is task i
                metadata=tfds.core.MetadataDict(spec=self.spec))

        def _split_generators(self, dl_manager):
            return {self.spec["split"]: self._generate_examples()}

        def _generate_examples(self):
            s = self.spec
            for i, task in enumerate(make_tasks(s["env"], s["split"], s["n"], s["seed"],
                                                **s["knobs"])):
                yield i, {"task": json.dumps(task)}

    return SupoTasks


class _QuietTfds(logging.Filter):
    """Drops two tfds warnings that every set triggers: each is a custom builder config, and
    its version folder has no dataset_info.json until it is prepared."""
    def filter(self, record):
        msg = record.getMessage()
        return not (msg.startswith("Using custom data configuration")
                    or (msg.startswith("Variant folder") and "no dataset_info.json" in msg))


@contextlib.contextmanager
def _quiet_tfds():
    log, quiet = logging.getLogger("absl"), _QuietTfds()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _make_builder(spec: dict, data_dir: str):
    return builder_class()(spec=spec, data_dir=data_dir, file_format="array_record")


@contextlib.contextmanager
def _file_lock(path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: no cross-process lock
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class TaskSet(Sequence):
    """Random-access, read-only sequence of task dicts backed by an array_record data source."""

    def __init__(self, source, spec: dict, path: str | None):
        self._source, self.spec, self.path = source, spec, path

    def __len__(self) -> int:
        return 0 if self._source is None else len(self._source)

    def _decode(self, i: int) -> dict:
        text = self._source[i]["task"]
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._decode(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"task index {i} out of range for {n} tasks")
        return self._decode(i % n)

    def __repr__(self):
        return (f"TaskSet({self.spec['env']!r}, {self.spec['split']!r}, n={len(self)}, "
                f"path={self.path!r})")


def load_tasks(env_name: str, split: str, n: int, seed: int = 0, data_dir: str | None = None,
               *, verify: int = 4, **knobs) -> TaskSet:
    """n tasks of `env_name` (as make_tasks(env_name, split, n, seed, **knobs)), generated
    into data_dir on first use and read back as a random-access sequence of task dicts."""
    spec = dataset_spec(env_name, split, n, seed, **knobs)
    if n == 0:
        return TaskSet(None, spec, None)
    data_dir = os.path.abspath(os.path.expanduser(data_dir or default_data_dir()))
    name = config_name(spec)
    with _file_lock(os.path.join(data_dir, BUILDER_NAME, f".{name}.lock")), _quiet_tfds():
        builder = _make_builder(spec, data_dir)
        if builder.is_prepared() and verify > 0:
            m = min(verify, n)
            head = TaskSet(builder.as_data_source(split=split), spec, str(builder.data_dir))[:m]
            if head != make_tasks(env_name, split, m, seed, **knobs):
                logging.getLogger(__name__).warning(
                    "task set %s is stale (its generator changed): rebuilding", name)
                shutil.rmtree(str(builder.data_dir))
                builder = _make_builder(spec, data_dir)
        if not builder.is_prepared():
            # tfds prints its own progress bars and a "downloaded and prepared" banner
            import tensorflow_datasets as tfds
            tfds.disable_progress_bar()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                builder.download_and_prepare()
        source = builder.as_data_source(split=split)
    if len(source) != n:
        raise RuntimeError(f"task set {builder.data_dir} holds {len(source)} tasks, expected {n}")
    return TaskSet(source, spec, str(builder.data_dir))
