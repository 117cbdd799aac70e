"""A verifiers environment (PyPI `verifiers` 0.4.0, its `verifiers.v1` API) of a built-in
fncall family, for harness mode (docs/HARNESS.md, "A verifiers environment").

It runs in a virtual environment of its own (verifiers pins openai<3: supo_jax.harnesses.
verifiers_venv), where supo_jax is installed without its dependencies: supo_jax.envs imports
without JAX. Everything of the task is ours, nothing is written out again:

- the taskset: `make_tasks(f"fncall/{family}", ...)` in memory (offline), one vf.Task each,
  its prompt the environment's own (`reset(task).prompt`);
- the harness (`FncallHarness`, in process: verifiers' Harness contract lets a harness run
  its loop in process so long as every model call goes through the rollout's interception
  endpoint): a chat loop whose tools are the family's (`env.reset(task).tools`), each call
  answered by our environment's `step`; it ends at the step that ends the episode, or on a
  reply without a call (after `nudges` reminders), or at `max_turns`;
- the reward (`FncallTask.reward`, a `@vf.reward`): verifiers scores the finished trace by
  replaying its tool calls through a fresh environment: our environment's reward.

    env = load_environment(family="pages", size=6)          # a vf.SingleAgentEnv
    task = env.taskset.task_for(task_dict)                  # a task of supo-jax's generator

The bridge (supo_jax/harnesses/verifiers_bridge.py) runs it against a run's sessions.
"""
from __future__ import annotations

import json
import sys

import verifiers.v1 as vf
from openai import AsyncOpenAI
from pydantic import Field

from supo_jax.envs.base import make_env, make_tasks

__all__ = ["FncallTaskset", "FncallHarness"]   # verifiers' plugins: one of each kind

# verifiers finds a plugin by a module name without dots (its taskset and harness ids): this
# module answers to that name too, once imported
MODULE = "supo_verifiers_fncall"
sys.modules.setdefault(MODULE, sys.modules[__name__])


class FncallData(vf.TaskData):
    task: dict = Field(default_factory=dict)   # the supo-jax task (its generator's dict)


class FncallTask(vf.Task[FncallData]):

    @vf.reward
    async def reward(self, task: FncallData, trace: vf.Trace) -> float:
        """Our environment's reward for the trace: its tool calls replayed in order through a
        fresh environment of the task; 0 when no call ended the episode."""
        return replay(task.task, trace.messages)


class FncallTasksetConfig(vf.TasksetConfig):
    family: str = "pages"
    split: str = "train"
    count: int = 8
    seed: int = 0
    knobs: dict = Field(default_factory=dict)   # the generator's knobs, e.g. {"size": 6}


class FncallTaskset(vf.Taskset[FncallTask, FncallTasksetConfig]):
    def load(self):
        c = self.config
        for t in make_tasks(f"fncall/{c.family}", c.split, c.count, seed=c.seed, **c.knobs):
            yield self.task_for(t)

    def task_for(self, t: dict) -> FncallTask:
        """The vf.Task of one supo-jax task dict (what a session's claim carries)."""
        prompt = make_env(f"fncall/{t['family']}").reset(t).prompt
        return FncallTask(FncallData(id=t.get("task_id"), prompt=prompt, task=t))


class FncallHarnessConfig(vf.HarnessConfig):
    max_turns: int = 200
    nudges: int = 0      # user turns "Call one of the tools." after a reply without a call


class FncallHarness(vf.Harness[FncallHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        t = data.task if isinstance(data, FncallData) else dict(getattr(data, "task", {}))
        env = make_env(f"fncall/{t['family']}")
        start = env.reset(t)
        tools = [s.schema() for s in start.tools]
        messages = [{"role": "user", "content": start.prompt}]
        if start.system:
            messages.insert(0, {"role": "system", "content": start.system})
        nudges = self.config.nudges
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for _ in range(self.config.max_turns):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                             tools=tools)
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    if nudges <= 0:
                        break
                    nudges -= 1
                    messages.append({"role": "user", "content": "Call one of the tools."})
                    continue
                for call in message.tool_calls:
                    result = env.step(call.function.name, _arguments(call.function.arguments))
                    if result.done:
                        return vf.ProgramResult(0, "", "")
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": result.observation})
        return vf.ProgramResult(0, "", "")


def _arguments(text) -> dict:
    try:
        args = json.loads(text or "{}")
    except ValueError:
        return {}
    return args if isinstance(args, dict) else {}


def replay(task: dict, messages) -> float:
    """Our environment's reward for a conversation: its assistant tool calls stepped in order
    through a fresh environment of `task`; 0.0 where no call ended the episode."""
    env = make_env(f"fncall/{task['family']}")
    env.reset(task)
    for m in messages:
        for call in getattr(m, "tool_calls", None) or ():
            result = env.step(call.name, _arguments(call.arguments))
            if result.done:
                return float(result.reward)
    return 0.0


def load_environment(family: str = "pages", split: str = "train", count: int = 8, seed: int = 0,
                     max_turns: int = 200, nudges: int = 0, **knobs) -> vf.SingleAgentEnv:
    """The verifiers environment of fncall/`family`: its tasks (split, count, seed, the
    generator's `knobs`), the in-process harness over its tools, its reward; the agent runs
    on the host (a subprocess runtime). Its model and endpoint are each episode's
    (vf.ModelContext: the bridge points each one at its session)."""
    config = vf.SingleAgentEnvConfig(
        taskset=FncallTasksetConfig(id=MODULE, family=family, split=split, count=count,
                                    seed=seed, knobs=knobs),
        agent=vf.AgentConfig(
            harness=FncallHarnessConfig(id=MODULE, max_turns=max_turns, nudges=nudges),
            runtime=vf.SubprocessConfig()))
    return vf.SingleAgentEnv(config)
