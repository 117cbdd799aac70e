"""Environments: the protocol and registry (base) and the built-in suites, which register
themselves on import."""
from supo_jax.envs import fncall  # noqa: F401  (registers fncall, fncall/<family>)
from supo_jax.envs import search  # noqa: F401  (registers search and its expert)
from supo_jax.envs import bfcl  # noqa: F401  (registers bfcl/<category>; data: bfcl-eval)
from supo_jax.envs import tau2_domains  # noqa: F401  (registers tau2/mock: harness mode)
from supo_jax.envs.base import (Environment, Reset, StepResult, ToolSpec, list_envs, make_env,
                                make_tasks, register_env)

__all__ = ["Environment", "Reset", "StepResult", "ToolSpec", "list_envs", "make_env",
           "make_tasks", "register_env"]
