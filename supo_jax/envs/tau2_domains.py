"""tau2-bench's domains as task sets of harness mode (docs/HARNESS.md, "tau2-bench"): `tau2/mock`
yields tasks `{"task_id": ID, "domain": "mock"}` of tau2's `mock` domain, which the tau2 bridge
(env.harness="tau2:mock", supo_jax/harnesses/tau2_bridge.py) plays with tau2's own orchestrator
and scores with tau2's own evaluator. tau2 itself lives in the harnesses' venv: this module
imports nothing of it, and its environment is the bridge's (a rollout of `tau2/mock` outside
harness mode is refused).

MOCK is the mock domain's tasks (tau2 26.3's, as supo_jax/harnesses/tau2_tasks.py prints
them: tests/test_tau2_harness.py checks the list) less the two that start from a message
history (`update_task_with_message_history`, `update_task_with_history_and_env_assertions`):
their agent's first request holds a past conversation with tool calls, which a session
refuses (400 unsupported_first_request).
"""
from __future__ import annotations

import random

from supo_jax.envs.base import Environment, register_env

MOCK = ("create_task_1", "create_task_1_with_env_assertions", "create_task_1_nl_eval",
        "update_task_1", "update_task_with_initialization_data",
        "update_task_with_initialization_actions", "impossible_task_1")


def mock_tasks(split: str, n: int, seed: int = 0) -> list[dict]:
    """n tasks of the mock domain: its MOCK ids in an order shuffled by (split, seed), cycled
    (tau2's mock domain has one split: train and eval draw from the same 7)."""
    ids = list(MOCK)
    random.Random(f"tau2/mock-{split}-{seed}").shuffle(ids)
    return [{"task_id": ids[i % len(ids)], "domain": "mock"} for i in range(n)]


@register_env("tau2/mock", tasks=mock_tasks)
class Tau2Mock(Environment):
    """A stand-in: tau2's tools, policy and database are the bridge's (harness mode)."""
    name = "tau2/mock"
    harness_only = True     # its prompt and tools are tau2's agent's (runs.check_prompt_fits)

    def reset(self, task: dict):
        raise NotImplementedError("tau2/mock is played by tau2's own orchestrator in the tau2 "
                                  "bridge: train it with env.harness=tau2:mock")

    def step(self, name: str, arguments: dict):
        raise NotImplementedError("tau2/mock's tools are tau2's (env.harness=tau2:mock)")
