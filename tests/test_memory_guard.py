"""No silent memory regressions (benchmarks/memory_guard.py): the committed plan setups'
programs, scaled to compile in seconds for their TPU slice, need at most the committed bytes
a chip (+5%). A change that grows them fails here until the figures are updated with it."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import memory_guard  # noqa: E402

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                 reason="libtpu is not installed (CI installs it)"),
              pytest.mark.xdist_group("tpu_compile")]


def test_the_guards_figures_are_committed():
    assert set(memory_guard.committed()) == set(memory_guard.GUARDS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(memory_guard.GUARDS))
def test_no_program_needs_more_memory_than_committed(name):
    now = memory_guard.measure(name)
    assert not memory_guard.grown(name, now, memory_guard.committed()[name])


def test_a_program_grown_past_the_tolerance_is_named():
    then = {"train_step": 100 << 20, "prefill": 50 << 20, "decode": 10 << 20}
    now = dict(then, train_step=int(then["train_step"] * 1.06), decode=then["decode"] * 1.04)
    lines = memory_guard.grown("g", now, then)
    assert len(lines) == 1 and lines[0].startswith("g: train_step needs 106.0 MiB a chip, "
                                                   "+6.0% over the committed 100.0 MiB")
