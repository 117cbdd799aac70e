"""The reproduction (experiments/reproduce_cpu.py) on a task where every context manager's
scripted expert can finish: `fncall/reports` with 3-6 reports (the sum of their figures; each
report ~100-200 tokens, cut to 64, the figure first, dead weight once read) at W = 640. The
CPU reproduction's own task (count, W = 512) suits SUPO's claims but not the other managers:
there the expert solves none under fold or clear, so their rows compared managers that cannot
work. Each run's eval.json holds its manager's expert ceiling (train.expert_ceiling), and
each of state, fold and clear warm-starts on demonstrations its own expert recorded under it
(OWN_DEMONSTRATIONS). Everything else is cpu_reproduce.py's."""
import dataclasses

from supo_jax.config import Config

from cpu_reproduce import config as cpu_reproduce  # experiments/configs/, as cpu_listing.py


def config() -> Config:
    base = cpu_reproduce()
    return dataclasses.replace(
        base,
        env=dataclasses.replace(base.env, name="fncall/reports", knobs={"size": [3, 6]}),
        context=dataclasses.replace(base.context, working_context=640),
        train=dataclasses.replace(base.train, run_dir="runs/cpu_reproduce_managers"),
    )
