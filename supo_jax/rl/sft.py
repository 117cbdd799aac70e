"""SFT warm start with the same segment machinery: loss only on assistant tokens
(actions and summaries). Demonstrations are the scripted experts' rollouts
through the real loop, or a JSONL of conversations.
"""
from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from supo_jax import storage
from supo_jax.agent.context import ContextConfig, Segment
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import ScriptedActor, run_rollouts
from supo_jax.model.sharding import mesh_scope
from supo_jax.text.parsing import format_tool_call, parse_action


def expert_segments(fmt: ChatFormat, env_name: str, tasks: Sequence[dict], ctx: ContextConfig,
                    *, summary_drop: float = 0.0, seed: int = 0, only_successful: bool = True,
                    dropped: bool = True):
    """Segments of scripted-expert rollouts (mask 1 on the expert's actions and summaries).

    dropped: also the actions the context manager dropped because they reached L (each as
    context + action). RL never trains them (SUPO), but without them a demonstration never
    shows what to do at that point of a context, and a policy may do anything there, e.g.
    answer early (which ends the rollout before the summary turn)."""
    from supo_jax.envs import make_env
    from supo_jax.envs.experts import expert_for, for_context

    actor = ScriptedActor(for_context(expert_for(env_name, summary_drop=summary_drop, seed=seed),
                                      ctx), fmt)
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


def conversation_segments(fmt: ChatFormat, messages: Sequence[dict], tools=None,
                          ctx: ContextConfig | None = None) -> list[Segment]:
    """A chat (the OpenAI / transformers messages format) as SUPO's training rows: the prompt up
    to the first assistant turn, then turns; assistant turns (content and tool_calls, plus their
    end-of-turn token) are trained, everything else is context.

    Summary turns split it as SUPO splits a rollout: an assistant message marked
    `"summary": true` closes the row (after ctx.summary_instruction as a ctx.summary_role
    turn, unless the message before it is that turn; <summary> tags are added when its content
    has none), and the next row starts from the prompt and ctx.continuation holding the summary. Rollout
    transcripts carry the same marks: a user message marked `"continuation": true` is rebuilt
    from ctx, and messages marked `"dropped": true` (the action and observation SUPO cut from
    the context when they reached L) are left out."""
    from supo_jax.text.parsing import extract_summary

    ctx = ctx or ContextConfig()
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("a demonstration needs a prompt followed by at least one assistant turn")
    prompt_text = next((m["content"] for m in reversed(messages[:first]) if m["role"] == "user"),
                       None)
    if not isinstance(prompt_text, str):
        raise ValueError("a demonstration's prompt needs a user message")
    prefix = list(fmt.prompt(list(messages[:first]), tools))
    segments, toks, mask = [], list(prefix), [0] * len(prefix)
    prev, prev_text, last_action = "user", None, ()

    def add(ids, bit):
        toks.extend(ids)
        mask.extend([bit] * len(ids))

    for m in messages[first:]:
        if m.get("dropped") or m.get("continuation"):
            continue
        if m["role"] != "assistant":
            add(fmt.turn(prev, m["role"], m["content"], last_action), 0)
            prev, prev_text = m["role"], m["content"]
            continue
        if m.get("summary"):
            if m.get("tool_calls"):
                raise ValueError("a summary turn cannot make tool calls")
            text = m.get("content") or ""
            if extract_summary(text) is None:
                text = f"<summary>{text.strip()}</summary>"
            if not (prev == ctx.summary_role and prev_text == ctx.summary_instruction):
                add(fmt.turn(prev, ctx.summary_role, ctx.summary_instruction, last_action), 0)
        else:
            text = assistant_text(m)
        add(fmt.gen_prompt, 0)
        last_action = tuple(fmt.encode(text)) + (fmt.stop_id,)
        add(last_action, 1)
        prev, prev_text = "assistant", text
        if m.get("summary"):   # the row ends; the next restarts from the prompt + summary
            segments.append(Segment(tuple(toks), tuple(mask), (0.0,) * len(toks)))
            cont = ctx.continuation.format(prompt=prompt_text, summary=extract_summary(text))
            toks, mask = list(prefix), [0] * len(prefix)
            add(fmt.turn("user", "user", cont), 0)
            prev, prev_text, last_action = "user", cont, ()
    if any(mask):
        segments.append(Segment(tuple(toks), tuple(mask), (0.0,) * len(toks)))
    return segments


ROLES = ("system", "user", "assistant", "tool")


def check_demonstration(messages, tools) -> None:
    """A hand-written demonstration as the rollout loop would accept it: known roles, a summary
    turn only after an action, and every tool call parsed and validated against `tools`
    (JSON-schema function dicts) as a rollout's actions are. Raises ValueError naming the cause."""
    schemas = {}
    for t in tools or ():
        fn = (t.get("function") or t) if isinstance(t, dict) else {}
        if isinstance(fn.get("name"), str):
            schemas[fn["name"]] = fn.get("parameters") or {}
    acted = False
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise ValueError(f"a message of role {role!r}: roles are {', '.join(ROLES)}")
        if m["role"] != "assistant":
            continue
        if m.get("summary"):
            if not acted:
                raise ValueError("a summary turn before any action (SUPO summarizes when a "
                                 "context that actions filled nears W)")
            continue
        acted = True
        text = assistant_text(m)
        if schemas and "<tool_call>" in text:
            parsed = parse_action(text, schemas, answer_tool="",
                                  max_calls=text.count("<tool_call>"))
            if parsed.kind == "error":
                raise ValueError(f"a tool call the rollout loop would reject: {parsed.error}")


def jsonl_segments(fmt: ChatFormat, path: str, default_tools=None,
                   max_len: int | None = None, ctx: ContextConfig | None = None) -> list[Segment]:
    """One demonstration per line: {"messages": [...], "tools": [...]} ("tools" optional:
    JSON-schema function dicts; default_tools where absent), split at its summary turns
    (conversation_segments), or a rollout record as `supo-jax rollout --out` writes it (its
    transcript, when its reward is positive). A bad line, or a row longer than `max_len`
    tokens, fails naming its number."""
    out, failed = [], 0
    with storage.open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rollout = isinstance(d, dict) and "messages" not in d and "transcript" in d
                if rollout:   # made by the rollout loop: its turns are the loop's own
                    if not d.get("reward", 0) > 0:   # a rollout that failed: not a demonstration
                        failed += 1
                        continue
                    d = {"messages": d["transcript"]}
                if not isinstance(d, dict) or not isinstance(d.get("messages"), list):
                    raise ValueError('a JSON object with a "messages" list expected, got '
                                     + (f"keys {sorted(d)}" if isinstance(d, dict)
                                        else type(d).__name__))
                tools = d.get("tools", default_tools)
                if not rollout:
                    check_demonstration(d["messages"], tools)
                segs = conversation_segments(fmt, d["messages"], tools, ctx)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{path}:{i}: bad demonstration ({e})") from None
            for k, seg in enumerate(segs):
                if max_len and len(seg.tokens) > max_len + 1:   # as build_batch counts
                    what = (f"row {k + 1} of {len(segs)} of a demonstration" if len(segs) > 1
                            else "a demonstration")
                    raise ValueError(
                        f"{path}:{i}: {what}, {len(seg.tokens)} tokens, where "
                        f"a training row holds at most {max_len + 1} under this context config "
                        f"(a row of {max_len} inputs, W here, plus one last target token): shorten "
                        'it, split it with summary turns ({"role": "assistant", "summary": true, '
                        '"content": ...}: README, "Adding an environment"), or raise '
                        "context.working_context")
            out += segs
    if not out and failed:
        raise ValueError(f"{path}: none of its {failed} rollouts has a positive reward, and a "
                         "rollout without one is not a demonstration")
    return out


class SFTStopped(Exception):
    """SFT stopped between two steps on request (a SIGTERM), its progress saved."""


def sft_train(policy, segments: Sequence[Segment], *, steps: int, lr: float, batch_rows: int,
              max_len: int, seed: int = 0, progress=None, stop=None,
              ckpt_dir: str | None = None, collective_matmul: bool = False) -> list[dict]:
    """Train `policy` in place on the segments' masked tokens; returns per-step metrics.

    stop() -> bool, asked after every step: when true, the parameters, optimizer state and
    step go to ckpt_dir (an Orbax checkpoint, collective) and SFTStopped is raised; a later
    call with the same arguments and ckpt_dir goes on from that step as if never stopped
    (the batches are redrawn from the seed) and removes ckpt_dir when it ends."""
    import jax
    import optax
    from flax import nnx

    from supo_jax.checkpoint import RunCheckpoints
    from supo_jax.rl.batch import build_batch
    from supo_jax.rl.train_step import (LossConfig, init_opt_state, join_trainable,
                                        make_optimizer, split_trainable, step_programs,
                                        trainable)

    if not segments:
        raise ValueError("no demonstrations to train on")
    train_step = step_programs(jax.default_backend(), collective_matmul)[0]
    graphdef, params = policy.split()
    warmup = max(1, steps // 10)   # one update per step: the schedule counts updates
    tx = make_optimizer(optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1)))
    opt_state = init_opt_state(tx, params, policy.mesh)
    cfg = LossConfig(objective="sft")
    rng = np.random.default_rng(seed)
    history, start = [], 0
    ckpts = RunCheckpoints(ckpt_dir, keep=1, async_save=False) if ckpt_dir else None
    got = ckpts.restore_latest(trainable(params), opt_state) if ckpts is not None else None
    if got is not None:
        start, trained, opt_state, meta = got
        params = join_trainable(trained, split_trainable(params)[1])
        history = meta["history"]
        for _ in range(start):          # the batches drawn before the stop
            rng.choice(len(segments), size=min(batch_rows, len(segments)), replace=False)
    for step in range(start, steps):
        idx = rng.choice(len(segments), size=min(batch_rows, len(segments)), replace=False)
        batch = build_batch([segments[i] for i in idx], [0.0] * len(idx), max_len=max_len,
                            rows_multiple=batch_rows)
        with mesh_scope(policy.mesh):
            params, opt_state, m = train_step(graphdef, params, opt_state, batch, tx=tx,
                                              cfg=cfg)
        nnx.update(policy.model, params)
        history.append({"step": step, "loss": float(m["loss"]), "entropy": float(m["entropy"])})
        if progress:
            progress(history[-1])
        if stop is not None and step + 1 < steps and stop():
            if ckpts is None:
                raise SFTStopped(f"stopped after SFT step {step + 1} of {steps}")
            ckpts.save(step + 1, trainable(params), opt_state, {"history": history})
            ckpts.close()
            raise SFTStopped(f"stopped after SFT step {step + 1} of {steps}, saved in {ckpt_dir}")
    if ckpts is not None:
        ckpts.close()
        drop_checkpoint(ckpt_dir)
    return history


def drop_checkpoint(ckpt_dir: str) -> None:
    """Remove a finished SFT's stop checkpoint: on the main process only (in a bucket the
    others would find its objects gone and fail); no process goes on before it is gone."""
    from supo_jax.rl import multihost

    if multihost.is_main():
        storage.rmtree(ckpt_dir)
    multihost.barrier("sft_checkpoint_removed")
