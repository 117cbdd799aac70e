"""The row bound holds: 4800 random rollouts (480 per manager and trigger rule) (random
action, summary and observation lengths, generations cut at their budget, every context
manager, both trigger rules, the summary instruction as a system or a user turn, random W and
caps); no request plus its generation and no training row ever exceeds
ContextConfig.row_bound (W; under the paper's rule, L + instruction + generation prompt + max
summary tokens for a summarizing manager), every budget is >= 1, a summary request gets
max_summary_tokens whole (reserve: within W; paper: beyond it), and a summary cut at its
budget is never trained (the rollout ends: summary_cut)."""
import dataclasses
import random

import pytest

from supo_jax.agent.context import MANAGERS, SUMMARY_ROLES, TRIGGER_RULES, ContextConfig
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import run_rollouts
from supo_jax.envs.base import Environment, Reset, StepResult, ToolSpec
from supo_jax.model.tiny import tiny_tokenizer
from supo_jax.sampling.sampler import Generation


class _Walk(Environment):
    """go(n) answers with n words; finish ends the episode."""
    tools = (ToolSpec("go", "walk", {"type": "object", "properties": {"n": {"type": "integer"}},
                                     "required": ["n"]}),
             ToolSpec("finish", "stop", {"type": "object", "properties": {}}))

    def reset(self, task):
        return Reset("Walk. " + "step " * task["prompt_words"], list(self.tools))

    def step(self, name, arguments):
        if name == "finish":
            return StepResult("done", done=True, reward=1.0)
        return StepResult("x " * int(arguments.get("n", 0)))


class _RandomActor:
    """Random lengths: a valid call padded with filler, or filler alone; summaries of random
    length; each generation cut at its budget (then without a stop token)."""

    def __init__(self, fmt, rng, cfg, bound_errors):
        self.fmt, self.rng, self.cfg, self.errors = fmt, rng, cfg, bound_errors

    def act(self, requests):
        out = []
        W = self.cfg.row_bound(self.fmt)
        for r in requests:
            if r.max_new < 1 or len(r.tokens) + r.max_new > W:
                self.errors.append(("request", len(r.tokens), r.max_new, W))
            if r.summarize and r.max_new != self.cfg.max_summary_tokens:
                self.errors.append(("summary budget", r.max_new, self.cfg.max_summary_tokens))
            rng = self.rng
            if r.summarize:
                text = "<summary>" + " s" * rng.randint(0, 3 * self.cfg.max_summary_tokens) + "</summary>"
            elif self.cfg.manager == "fold" and rng.random() < 0.3:   # branch / return
                text = ('<tool_call>{"name": "branch", "arguments": {"description": "d"}}'
                        '</tool_call>' if rng.random() < 0.5 else
                        '<tool_call>{"name": "return", "arguments": {"message": "%s"}}'
                        '</tool_call>' % (" m" * rng.randint(0, 3 * self.cfg.max_observation_tokens)))
            elif rng.random() < 0.05:
                text = '<tool_call>{"name": "finish", "arguments": {}}</tool_call>'
            else:
                n = rng.randint(0, 3 * self.cfg.max_observation_tokens)
                text = '<tool_call>{"name": "go", "arguments": {"n": %d}}</tool_call>' % n
                text += " pad" * rng.randint(0, self.cfg.max_action_tokens)
                if self.cfg.manager == "state" and rng.random() < 0.8:   # a state block
                    text = ("<state>" + " s" * rng.randint(0, 2 * self.cfg.max_action_tokens)
                            + "</state>" + text)
            ids = self.fmt.encode(text) + [self.fmt.stop_id]
            ids = ids[:max(r.max_new, 0)]
            out.append(Generation(ids, [-1.0] * len(ids)))
        return out


@pytest.mark.parametrize("rule", TRIGGER_RULES)
@pytest.mark.parametrize("manager", MANAGERS)
def test_no_request_or_row_exceeds_W(manager, rule):
    fmt = ChatFormat(tiny_tokenizer())
    rng = random.Random(f"{manager} {rule}")
    errors, rollouts = [], 0
    for trial in range(5):
        cfg = ContextConfig(
            manager, working_context=rng.randint(500, 1400), trigger_ratio=rng.uniform(0.6, 1.0),
            max_summaries=rng.randint(0, 4), max_steps=rng.randint(3, 40),
            max_action_tokens=rng.randint(8, 120), max_summary_tokens=rng.randint(8, 96),
            max_observation_tokens=rng.randint(8, 150), window_turns=rng.randint(1, 5),
            show_dropped_to_summarizer=rng.random() < 0.5, trigger_rule=rule,
            summary_role=rng.choice(SUMMARY_ROLES),
            summary_instruction="Summarize the progress so far in <summary></summary>."
            + " Keep the state." * rng.choice([0, 0, 4, 16]))
        if cfg.limit(fmt) < 200:
            cfg = dataclasses.replace(cfg, working_context=cfg.working_context + 400)
        actor = _RandomActor(fmt, rng, cfg, errors)
        tasks = [{"task_id": f"{trial}:{i}", "prompt_words": rng.randint(0, 60)} for i in range(8)]
        ro = run_rollouts(actor, _Walk, tasks, fmt, cfg, group_size=12, rows=48,
                          summarizer=actor)
        rollouts += len(ro)
        bound = cfg.row_bound(fmt)
        assert bound == cfg.working_context if rule == "reserve" or not cfg.summarizes else (
            bound == max(cfg.working_context, cfg.limit(fmt) + cfg.instruction_len(fmt)
                         + len(fmt.gen_prompt) + cfg.max_summary_tokens))
        for r in ro:
            assert r.counters["max_context"] <= bound
            if cfg.summarizes:
                assert r.counters["effective_context"] <= bound * (r.counters["summaries"] + 1)
                cut = [m for m in r.transcript if m.get("cut")]
                assert (r.reason == "summary_cut") == bool(cut)
                if cut and manager == "supo":   # rows: one a whole summary, then the open one
                    assert len(r.segments) - r.counters["summaries"] in (0, 1)
            for s in r.segments + r.dropped:
                if len(s.tokens) > bound:
                    errors.append(("row", len(s.tokens), bound))
    assert rollouts >= 480     # x 5 managers
    assert not errors, errors[:5]
