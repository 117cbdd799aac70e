"""The trainer loop: task stream -> rollouts -> advantages -> updates -> metrics ->
checkpoint -> eval. The loop owns I/O only; the math is in algo.py / train_step.py.

Exact resume: everything random is derived from (train.seed, step) — the
sampler key, the minibatch order — and the task stream position is a function
of the step, so a run restored from step k replays steps k+1.. exactly as an
uninterrupted run would.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time

import jax
import numpy as np
from flax import nnx

from supo_jax import config as C
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import PolicyActor, run_rollouts, summarize, write_jsonl
from supo_jax.checkpoint import RunCheckpoints
from supo_jax.model.policy import Policy, load_policy, new_policy
from supo_jax.rl.batch import build_batch
from supo_jax.rl.train_step import (make_optimizer, recompute_logprobs, rollout_advantages,
                                     train_step)
from supo_jax.sampling.sampler import SamplingParams

log = logging.getLogger(__name__)

INSTRUCTION_ALLOWANCE = 160   # tokens reserved for the summary instruction turn in cache sizing


def _is_main() -> bool:
    return jax.process_index() == 0


def make_run_mesh(cfg: C.Config):
    if jax.device_count() == 1:
        return None
    from supo_jax.model.sharding import make_mesh
    return make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)


def _env_corpus(cfg: C.Config, n: int = 24) -> list[str]:
    """Texts of the environment (prompts, tool schemas, expert turns) for a tiny tokenizer."""
    from supo_jax.envs import make_env, make_tasks
    from supo_jax.envs.experts import expert_for

    texts = [cfg.context.summary_instruction, cfg.context.continuation] * 4
    expert = expert_for(cfg.env.name)
    for task in make_tasks(cfg.env.name, "train", n, seed=10_000 + cfg.env.seed, **cfg.env.knobs):
        env = make_env(cfg.env.name)
        rs = env.reset(task)
        texts += [rs.prompt, json.dumps([t.schema() for t in rs.tools])]
        msgs = [{"role": "user", "content": rs.prompt}]
        for _ in range(12):
            a = expert.act(msgs, False)
            res = env.act(a)
            texts.append(a)
            if res.done:
                break
            texts.append(res.observation)
            msgs += [{"role": "assistant", "content": a}, {"role": "tool", "content": res.observation}]
        texts.append(expert.act(msgs, True))
    return texts


def build_policy(cfg: C.Config, run_dir: str | None = None, mesh=None) -> Policy:
    """The configured policy: a checkpoint (model.path / train.init_from) or a tiny random one
    whose tokenizer is trained on the environment's texts (saved in the run directory)."""
    m = cfg.model
    path = cfg.train.init_from or m.path
    if path:
        return load_policy(path, dtype=m.dtype, mesh=mesh, compute_dtype=m.compute_dtype or None,
                           remat=m.remat)
    from supo_jax.model.policy import load_tokenizer
    from supo_jax.model.tiny import tiny_config, tiny_tokenizer

    tok_dir = os.path.join(run_dir, "tokenizer") if run_dir else None
    if tok_dir and os.path.isdir(tok_dir):
        tok = load_tokenizer(tok_dir)
    else:
        tok = tiny_tokenizer(tok_dir if _is_main() else None, vocab_size=m.tiny_vocab,
                             extra_corpus=_env_corpus(cfg), template=m.tiny_template)
    vocab = int(math.ceil(len(tok) / 8) * 8)
    mc = tiny_config(m.tiny_family, vocab_size=vocab, hidden=m.tiny_hidden, layers=m.tiny_layers,
                     heads=m.tiny_heads, kv_heads=m.tiny_kv_heads, mlp=m.tiny_mlp)
    return new_policy(mc, dtype=m.dtype, compute_dtype=m.compute_dtype or None, mesh=mesh,
                      seed=cfg.train.seed, tokenizer=tok, remat=m.remat)


def model_fingerprint(policy: Policy) -> str:
    d = policy.config.to_hf_dict()
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim")
    return hashlib.sha1(json.dumps({k: d.get(k) for k in keys}, sort_keys=True).encode()).hexdigest()[:16]


def row_len(cfg: C.Config, fmt: ChatFormat) -> int:
    return cfg.optim.max_row_len or cfg.context.cache_len(INSTRUCTION_ALLOWANCE, len(fmt.gen_prompt))


def rollout_batch(policy, fmt, cfg: C.Config, tasks, *, seed: int, context=None, group_size=None,
                  sampling=None, progress=None):
    """Rollouts of `tasks` with the current policy (a fresh sampler: params changed)."""
    from supo_jax.envs import make_env

    ctx = context or cfg.context
    r = cfg.rollout
    sampling = sampling or SamplingParams(r.temperature, r.top_k, r.top_p)
    max_len = ctx.cache_len(INSTRUCTION_ALLOWANCE, len(fmt.gen_prompt))
    g = group_size or r.group_size
    rows = min(r.rows, len(tasks) * g)
    actor = PolicyActor(policy, fmt, rows=rows, max_len=max_len, sampling=sampling, seed=seed)
    return run_rollouts(actor, lambda: make_env(cfg.env.name), tasks, fmt, ctx, group_size=g,
                        rows=rows, env_timeout_s=cfg.env.timeout_s, progress=progress)


def _bar(total, desc, enabled):
    if not enabled or not _is_main():
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


class MetricsLog:
    """metrics.jsonl (one object per step) + TensorBoard event files, process 0 only."""

    def __init__(self, run_dir: str, resume_step: int):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        if not _is_main():
            return
        kept = []
        if os.path.exists(self.path):  # drop rows of steps that will be replayed
            with open(self.path) as f:
                kept = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= resume_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        try:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
        except ImportError:  # pragma: no cover - tensorboardX is a dependency
            self.tb = None

    def write(self, row: dict) -> None:
        if not _is_main():
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()


def _check_run_dir(run_dir: str, cfg: C.Config, fingerprint: str) -> None:
    meta = os.path.join(run_dir, "run.json")
    if os.path.exists(meta):
        with open(meta) as f:
            old = json.load(f)
        if old.get("model_fingerprint") != fingerprint:
            raise ValueError(f"run directory {run_dir} holds a run of a different model "
                             f"({old.get('model_fingerprint')} != {fingerprint}); "
                             "use another train.run_dir")
    elif _is_main():
        with open(meta, "w") as f:
            json.dump({"model_fingerprint": fingerprint}, f)


def warm_start(policy, fmt, cfg: C.Config, progress=True) -> dict:
    """SFT on demonstrations (scripted experts by default). Returns a small report."""
    from supo_jax.envs import make_tasks
    from supo_jax.rl.sft import expert_segments, jsonl_segments, sft_train

    s = cfg.sft
    if s.demos == "expert":
        tasks = make_tasks(cfg.env.name, "train", s.num_demos, seed=20_000 + cfg.env.seed,
                           **cfg.env.knobs)
        segs, ro = expert_segments(fmt, cfg.env.name, tasks, cfg.context,
                                   summary_drop=s.summary_drop, seed=cfg.train.seed)
        demo_success = summarize(ro)["success_rate"]
        if not segs:
            raise ValueError(f"the scripted expert solved none of {len(ro)} demonstration tasks "
                             f"under this context config (reasons: {summarize(ro)['reasons']}); "
                             "raise context.max_steps / max_summaries / working_context")
    else:
        segs, demo_success = jsonl_segments(fmt, s.demos), float("nan")
    bar = _bar(s.steps, "sft", progress)
    hist = sft_train(policy, segs, steps=s.steps, lr=s.lr, batch_rows=s.batch_rows,
                     max_len=row_len(cfg, fmt), seed=cfg.train.seed,
                     progress=(lambda m: (bar.update(1), bar.set_postfix(loss=f"{m['loss']:.3f}")))
                     if bar else None)
    if bar:
        bar.close()
    return {"sft_segments": len(segs), "sft_demo_success": demo_success,
            "sft_loss_first": hist[0]["loss"], "sft_loss_last": hist[-1]["loss"]}


def evaluate(policy, fmt, cfg: C.Config, *, max_summaries=None, tasks=None, seed: int = 0,
             progress=True) -> dict:
    """Success etc. on the held-out split (G = 1, greedy) with an optional summary cap."""
    import dataclasses

    from supo_jax.envs.datasets import load_tasks

    tasks = tasks or list(load_tasks(cfg.env.name, "eval", cfg.env.eval_tasks, seed=cfg.env.seed,
                                     **{**cfg.env.knobs, **cfg.env.eval_knobs}))
    ctx = cfg.context if max_summaries is None else dataclasses.replace(
        cfg.context, max_summaries=int(max_summaries))
    bar = _bar(len(tasks), f"eval S={ctx.max_summaries}", progress)
    ro = rollout_batch(policy, fmt, cfg, tasks, seed=seed, context=ctx, group_size=1,
                       sampling=SamplingParams(0.0), progress=bar.update if bar else None)
    if bar:
        bar.close()
    out = summarize(ro)
    out["max_summaries"] = ctx.max_summaries
    return out


def train(cfg: C.Config) -> dict:
    """Run (or resume) the configured RL run. Returns the final metrics and eval."""
    run_dir = cfg.train.run_dir
    os.makedirs(run_dir, exist_ok=True)
    mesh = make_run_mesh(cfg)
    policy = build_policy(cfg, run_dir, mesh)
    fmt = ChatFormat(policy.tokenizer)
    fp = model_fingerprint(policy)
    _check_run_dir(run_dir, cfg, fp)
    if _is_main():
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(C.to_dict(cfg), f, indent=2, default=str)

    o = cfg.optim
    tx = make_optimizer(o.lr, schedule=o.schedule, warmup_steps=o.warmup_steps,
                        total_steps=cfg.train.steps, weight_decay=o.weight_decay,
                        clip_norm=o.clip_norm)
    graphdef, params = policy.split()
    opt_state = init_opt_state(tx, params, mesh)
    ckpts = RunCheckpoints(os.path.join(run_dir, "checkpoints"), keep=cfg.train.keep)
    restored = ckpts.restore_latest(params, opt_state)
    report: dict = {}
    if restored is not None:
        start, params, opt_state, meta = restored
        nnx.update(policy.model, params)
        report["resumed_from"] = start
        if _is_main():
            print(f"resumed from {run_dir} step {start}")
    else:
        start = 0
        if not (cfg.train.init_from or cfg.model.path) and cfg.train.sft_warm_start:
            report.update(warm_start(policy, fmt, cfg, cfg.train.progress))
            graphdef, params = policy.split()
            opt_state = init_opt_state(tx, params, mesh)
            ckpts.save(0, params, opt_state, {"step": 0, "seed": cfg.train.seed,
                                              "task_position": 0, "model_fingerprint": fp,
                                              "warm_start": report})
    metrics_log = MetricsLog(run_dir, start)

    from supo_jax.envs.datasets import load_tasks
    train_tasks = load_tasks(cfg.env.name, "train", cfg.env.train_tasks, seed=cfg.env.seed,
                             **cfg.env.knobs)   # a tfds array_record task set, built on first use
    B = cfg.rollout.tasks_per_step
    max_len = row_len(cfg, fmt)
    history = []
    outer = _bar(cfg.train.steps - start, "train", cfg.train.progress)
    for step in range(start, cfg.train.steps):
        t0 = time.time()
        pos = (step * B) % len(train_tasks)
        tasks = [train_tasks[(pos + i) % len(train_tasks)] for i in range(B)]
        bar = _bar(B * cfg.rollout.group_size, f"rollouts {step + 1}", cfg.train.progress)
        rollouts = rollout_batch(policy, fmt, cfg, tasks, seed=hash_seed(cfg.train.seed, step),
                                 progress=bar.update if bar else None)
        if bar:
            bar.close()
        t1 = time.time()
        segs, seg_adv, adv, trained = rollout_advantages(rollouts, cfg.advantage)
        upd = {}
        if segs:
            batch = build_batch(segs, seg_adv, max_len=max_len, rows_multiple=o.minibatch_rows,
                                pack=o.pack)
            if o.recompute_old_logprobs:
                import dataclasses
                batch = dataclasses.replace(batch, old_logp=np.asarray(recompute_logprobs(
                    graphdef, params, batch, cfg.loss.temperature)))
            rng = np.random.default_rng(hash_seed(cfg.train.seed, step) + 1)
            ms = []
            for _ in range(o.ppo_epochs):
                perm = rng.permutation(batch.rows)
                for i in range(0, batch.rows, o.minibatch_rows):
                    mb = batch.take(perm[i:i + o.minibatch_rows])
                    params, opt_state, m = train_step(graphdef, params, opt_state, mb, tx=tx,
                                                      cfg=cfg.loss, micro=o.micro)
                    nnx.update(policy.model, params)
                    ms.append(m)
            ms = jax.device_get(ms)
            w = np.asarray([float(m["tokens"]) for m in ms])
            for k in ("loss", "clip_fraction", "approx_kl", "entropy", "grad_norm"):
                if k in ms[0]:
                    upd[k] = float(np.average([float(m[k]) for m in ms], weights=np.maximum(w, 1e-9)))
            upd["updates"] = len(ms)
            upd["rows"] = int(batch.rows)
        t2 = time.time()
        row = {"step": step + 1, "loss": upd.get("loss", 0.0), **summarize_scalars(rollouts),
               **{k: v for k, v in upd.items() if k != "loss"},
               "masked_rate": float(1 - np.mean(trained)), "segments": len(segs),
               "rollout_seconds": t1 - t0, "update_seconds": t2 - t1}
        metrics_log.write(row)
        history.append(row)
        if outer:
            outer.update(1)
            outer.set_postfix(success=f"{row['success_rate']:.2f}", loss=f"{row['loss']:.3f}")
        if (step + 1) % cfg.train.save_every == 0 or step + 1 == cfg.train.steps:
            ckpts.save(step + 1, params, opt_state, {
                "step": step + 1, "seed": cfg.train.seed, "task_position": (pos + B) % len(train_tasks),
                "model_fingerprint": fp})
        if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 and step + 1 < cfg.train.steps:
            ev = evaluate(policy, fmt, cfg, seed=cfg.train.seed, progress=cfg.train.progress)
            metrics_log.write({"step": step + 1, **{f"eval/{k}": v for k, v in ev.items()
                                                    if isinstance(v, (int, float))}})
    if outer:
        outer.close()
    ckpts.close()
    final = evaluate(policy, fmt, cfg, seed=cfg.train.seed, progress=cfg.train.progress)
    scaling = [evaluate(policy, fmt, cfg, max_summaries=s, seed=cfg.train.seed,
                        progress=cfg.train.progress) for s in cfg.train.eval_max_summaries]
    metrics_log.close()
    result = {"history": history, "eval": final, "eval_scaling": scaling, **report}
    if _is_main():
        with open(os.path.join(run_dir, "eval.json"), "w") as f:
            json.dump({"eval": final, "eval_scaling": scaling, **report}, f, indent=2, default=str)
        export = os.path.join(run_dir, "hf")
        policy.save_pretrained(export)
        result["export"] = export
    return result


def init_opt_state(tx, params, mesh):
    """Optimizer state with every leaf placed: moments follow their parameters' shardings,
    scalars (step counts) are replicated over the mesh (restores then match exactly)."""
    opt_state = tx.init(params)
    if mesh is None:
        return opt_state
    from jax.sharding import NamedSharding

    from supo_jax.model.sharding import replicated
    return jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
                        else jax.device_put(x, replicated(mesh)), opt_state)


def hash_seed(seed: int, step: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:4], "little")


def summarize_scalars(rollouts) -> dict:
    s = summarize(rollouts)
    return {k: v for k, v in s.items() if isinstance(v, (int, float))}


def summary_table(history: list[dict], final: dict | None = None) -> str:
    """A terminal table: first / last step and the final eval."""
    keys = ["success_rate", "reward_mean", "loss", "p_summary", "summaries_mean", "tool_calls_mean",
            "working_context_mean", "working_context_max", "overlong_rate", "summary_state_share",
            "rollout_seconds", "update_seconds"]
    if not history:
        return "(no steps run)"
    first, last = history[0], history[-1]
    lines = [f"{'metric':28s} {'step ' + str(first['step']):>12s} {'step ' + str(last['step']):>12s}"
             + (f" {'eval':>12s}" if final else "")]
    for k in keys:
        def fmt(d):
            v = d.get(k) if d else None
            return f"{v:12.3f}" if isinstance(v, (int, float)) else f"{'-':>12s}"
        lines.append(f"{k:28s} {fmt(first)} {fmt(last)}" + (f" {fmt(final)}" if final else ""))
    return "\n".join(lines)
