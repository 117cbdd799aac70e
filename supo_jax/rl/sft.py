"""SFT warm start with the same segment machinery: loss only on assistant tokens
(actions and summaries). Demonstrations are the scripted experts' rollouts
through the real loop, or a JSONL of conversations.
"""
from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from supo_jax.agent.context import ContextConfig, Segment
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import ScriptedActor, run_rollouts
from supo_jax.text.parsing import format_tool_call


def expert_segments(fmt: ChatFormat, env_name: str, tasks: Sequence[dict], ctx: ContextConfig,
                    *, summary_drop: float = 0.0, seed: int = 0, only_successful: bool = True,
                    dropped: bool = True):
    """Segments of scripted-expert rollouts (mask 1 on the expert's actions and summaries).

    dropped: also the actions the context manager dropped because they reached L (each as
    context + action). RL never trains them (SUPO), but without them a demonstration never
    shows what to do at that point of a context, and a policy may do anything there, e.g.
    answer early (which ends the rollout before the summary turn)."""
    from supo_jax.envs import make_env
    from supo_jax.envs.experts import expert_for

    actor = ScriptedActor(expert_for(env_name, summary_drop=summary_drop, seed=seed), fmt)
    ro = run_rollouts(actor, lambda: make_env(env_name), tasks, fmt, ctx, rows=16)
    keep = [r for r in ro if r.reward > 0 or not only_successful]
    return [s for r in keep for s in (r.segments + (r.dropped if dropped else []))], ro


def assistant_text(message: dict) -> str:
    """An assistant message as the action text the policy writes: its content, then each of
    its standard `tool_calls` ({"function": {"name", "arguments"}}, arguments a dict or a JSON
    string) in the <tool_call> format."""
    text = message.get("content") or ""
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"tool call {fn.get('name')!r}: its arguments string is not "
                                 f"JSON ({e})") from None
        if not isinstance(fn.get("name"), str) or not isinstance(args, dict):
            raise ValueError(f"a tool call needs a name and an arguments object: {call!r}"[:200])
        text = (text + "\n" if text else "") + format_tool_call(fn["name"], args)
    return text


def conversation_segment(fmt: ChatFormat, messages: Sequence[dict], tools=None) -> Segment:
    """One segment from a chat (the OpenAI / transformers messages format): the prompt up to
    the first assistant turn, then turns. Assistant turns (content and tool_calls) are trained
    (plus their end-of-turn token); everything else is context."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("a demonstration needs a prompt followed by at least one assistant turn")
    toks = list(fmt.prompt(list(messages[:first]), tools))
    mask = [0] * len(toks)
    prev, last_action = "user", ()
    for m in messages[first:]:
        if m["role"] == "assistant":
            ids = list(fmt.gen_prompt)
            toks += ids
            mask += [0] * len(ids)
            action = fmt.encode(assistant_text(m)) + [fmt.stop_id]
            toks += action
            mask += [1] * len(action)
            last_action = tuple(action)
        else:
            ids = fmt.turn(prev, m["role"], m["content"], last_action)
            toks += ids
            mask += [0] * len(ids)
        prev = m["role"]
    return Segment(tuple(toks), tuple(mask), (0.0,) * len(toks))


def _check_tool_names(messages, tools) -> None:
    """Every assistant tool call names one of `tools` (when any are given)."""
    names = {(t.get("function") or t).get("name") for t in tools or () if isinstance(t, dict)}
    for m in messages:
        for call in (m.get("tool_calls") or ()) if m.get("role") == "assistant" else ():
            name = (call.get("function") or call).get("name")
            if names and name not in names:
                raise ValueError(f"a tool call to {name!r}, not one of the tools "
                                 f"({', '.join(sorted(map(str, names)))})")


def jsonl_segments(fmt: ChatFormat, path: str, default_tools=None,
                   max_len: int | None = None) -> list[Segment]:
    """One demonstration per line: {"messages": [...], "tools": [...]} ("tools" optional:
    JSON-schema function dicts; default_tools where absent). A bad line, or one longer than
    a training row of `max_len` tokens, fails naming its number."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict) or not isinstance(d.get("messages"), list):
                    raise ValueError('a JSON object with a "messages" list expected, got '
                                     + (f"keys {sorted(d)}" if isinstance(d, dict)
                                        else type(d).__name__))
                tools = d.get("tools", default_tools)
                _check_tool_names(d["messages"], tools)
                out.append(conversation_segment(fmt, d["messages"], tools))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{path}:{i}: bad demonstration ({e})") from None
            if max_len and len(out[-1].tokens) > max_len + 1:   # as build_batch counts
                raise ValueError(
                    f"{path}:{i}: a demonstration of {len(out[-1].tokens)} tokens, where a "
                    f"training row holds {max_len + 1} under this context config: shorten it, "
                    "split it into conversations that fit (as SUPO's rows restart from the "
                    "prompt and a summary), or raise context.working_context")
    return out


def sft_train(policy, segments: Sequence[Segment], *, steps: int, lr: float, batch_rows: int,
              max_len: int, seed: int = 0, progress=None) -> list[dict]:
    """Train `policy` in place on the segments' masked tokens; returns per-step metrics."""
    import optax
    from flax import nnx

    from supo_jax.rl.batch import build_batch
    from supo_jax.rl.train_step import LossConfig, make_optimizer, train_step

    if not segments:
        raise ValueError("no demonstrations to train on")
    graphdef, params = policy.split()
    warmup = max(1, steps // 10)   # one update per step: the schedule counts updates
    tx = make_optimizer(optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1)))
    opt_state = tx.init(params)
    cfg = LossConfig(objective="sft")
    rng = np.random.default_rng(seed)
    history = []
    for step in range(steps):
        idx = rng.choice(len(segments), size=min(batch_rows, len(segments)), replace=False)
        batch = build_batch([segments[i] for i in idx], [0.0] * len(idx), max_len=max_len,
                            rows_multiple=batch_rows)
        params, opt_state, m = train_step(graphdef, params, opt_state, batch, tx=tx, cfg=cfg)
        nnx.update(policy.model, params)
        history.append({"step": step, "loss": float(m["loss"]), "entropy": float(m["entropy"])})
        if progress:
            progress(history[-1])
    return history
