"""A scripted policy that plays both sides of a tau2-bench conversation from the ground truth
(docs/HARNESS.md, "tau2-bench"): served by `supo_jax.serve.scripted.ScriptedEngine` as the
model of tau2's own agent (LLMAgent) and of its user simulator (UserSimulator), it checks
tau2's runner and evaluator against our endpoint with a policy whose score is known.

- Asked as the user simulator (its system prompt holds tau2's `<scenario>` block): the first
  time, it states the scenario (word for word); after that, `###STOP###`, tau2's end of a
  conversation.
- Asked as the agent: it finds the task whose scenario the user stated, makes the ground
  truth's calls in order, one a turn (`<tool_call>` blocks, the server's parser makes them
  tool_calls), then says the task's `communicate_info` (or "Done.") to the user. Before the
  user has stated a scenario (a task that starts from a message history) it asks "How can I
  help you?".

`tasks` is supo_jax/harnesses/tau2_tasks.py's JSON of the domain (tau2 read in its own venv),
tasks whose scenarios are the same must have the same calls (ValueError otherwise), and only
tasks with ground-truth calls are played (as tau2's own ground-truth agent, `llm_agent_gt`).
"""
from __future__ import annotations

import re

from supo_jax.text.parsing import format_tool_call

STOP = "###STOP###"
_SCENARIO = re.compile(r"<scenario>\n?(.*?)\n?</scenario>", re.S)
_GREETING = re.compile(r"^(Assistant: [^\n]*\n\n)+")


def _norm(text: str) -> str:
    return " ".join((text or "").split())


class Tau2Expert:
    def __init__(self, tasks: list[dict]):
        self.by_scenario: dict[str, dict] = {}
        for t in tasks:
            if not t["actions"]:
                continue
            key = _norm(t["scenario"])
            seen = self.by_scenario.get(key)
            if seen is None:
                self.by_scenario[key] = {"ids": [t["id"]], "actions": t["actions"],
                                         "say": list(t["communicate_info"])}
                continue
            if seen["actions"] != t["actions"]:
                raise ValueError(f"tasks {seen['ids'][0]} and {t['id']} share a scenario but "
                                 "not their ground-truth calls")
            seen["ids"].append(t["id"])
            seen["say"] += [s for s in t["communicate_info"] if s not in seen["say"]]

    def act(self, messages: list[dict], summarize: bool = False) -> str:
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        scenario = _SCENARIO.search(system)
        if scenario:
            return self._user(scenario.group(1), messages)
        return self._agent(messages)

    def _user(self, scenario: str, messages: list[dict]) -> str:
        # tau2 flips the roles for its user simulator: its own turns are "assistant" ones
        said = any(_norm(scenario) in _norm(m["content"]) for m in messages
                   if m["role"] == "assistant")
        return STOP if said else scenario.strip()

    def _agent(self, messages: list[dict]) -> str:
        start = task = None
        for i, m in enumerate(messages):
            if m["role"] != "user":
                continue
            # (a session folds the agent's greeting into its prompt: sessions.first_turn)
            said = _norm(_GREETING.sub("", m["content"]))
            if said in self.by_scenario:
                start, task = i, self.by_scenario[said]
        if task is None:
            return "How can I help you?"
        done = sum(m["content"].count("<tool_call>") for m in messages[start:]
                   if m["role"] == "assistant")
        if done < len(task["actions"]):
            a = task["actions"][done]
            return format_tool_call(a["name"], a["arguments"])
        return " ".join(task["say"]) or "Done."
