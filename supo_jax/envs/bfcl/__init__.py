"""BFCL's multi-turn tasks (bfcl-eval) as environments, scored as BFCL scores them."""
from supo_jax.envs.bfcl.calls import format_call, parse_call, score, verdict  # noqa: F401
from supo_jax.envs.bfcl.data import CATEGORIES  # noqa: F401
from supo_jax.envs.bfcl import environment  # noqa: F401,E402  (registers bfcl/<category>)
