"""What one RL update does to a policy, and where its greedy failures come from:

    python experiments/update_probe.py --run-dir runs/probe --set 'env.imports=["experiments.envs.cards"]' --set env.name=cards

On the configured run's starting policy (the SFT warm start of a new run directory, or its
latest checkpoint):
1. greedy rollouts on the held-out tasks: success, and for each failure its task, the last
   assistant turn and the policy's five likeliest tokens (temperature 1) at the last number it
   wrote there, i.e. whether the right answer was within the sampler's reach;
2. --steps RL steps exactly as the trainer takes them (rollouts at rollout.temperature, the
   configured advantages, one PPO update); after each, the mean change of log-probability of
   the batch's trained tokens, split by the sign of their advantage, and the update's gradient
   norm. `--only positive|negative` zeroes the other sign's advantages, to see each half alone;
3. after each step, retention: the probability the policy now gives to the tokens of its own
   successful greedy rollouts from 1., all of them and the number tokens among them, i.e.
   whether the updates keep what the starting policy already does right.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np


def is_number(tok, token_id) -> bool:
    """Whether a token is (part of) a number: counts, indices, answers."""
    return tok.decode([int(token_id)]).strip().isdigit()


def greedy_failures(run, cfg, log=print) -> list:
    """Logs the greedy failures; returns the segments of the greedy successes."""
    import jax

    from supo_jax.envs.datasets import load_tasks
    from supo_jax.rl import trainer as T
    from supo_jax.sampling.sampler import SamplingParams

    tasks = load_tasks(cfg.env.name, "eval", cfg.env.eval_tasks, seed=cfg.env.seed,
                       **{**cfg.env.knobs, **cfg.env.eval_knobs})
    ro = T.rollout_batch(run.policy, run.fmt, cfg, tasks, seed=cfg.train.seed, group_size=1,
                         sampling=SamplingParams(0.0))
    bad = [r for r in ro if r.reward <= 0]
    log(f"greedy: {1 - len(bad) / len(ro):.3f} success on {len(ro)} held-out tasks")
    by_id = {t["task_id"]: t for t in tasks}
    tok = run.policy.tokenizer
    for r in bad:
        fields = {k: v for k, v in by_id[r.task_id].items() if k not in ("task_id", "family")}
        last = next((m["content"] for m in reversed(r.transcript) if m["role"] == "assistant"), "")
        log(f"- {r.task_id} {fields} ({r.reason}): {last!r}")
        seg = r.segments[-1]
        pos = [i for i, t in enumerate(seg.tokens) if seg.mask[i] and is_number(tok, t)]
        if pos:
            x = np.asarray([seg.tokens[:pos[-1]]], np.int32)
            logits, _ = run.policy.model(x, np.arange(pos[-1], dtype=np.int32)[None])
            p = np.asarray(jax.nn.softmax(np.asarray(logits, np.float32)[0, -1]))
            top = np.argsort(-p)[:5]
            log("    last number token: " + ", ".join(f"{tok.decode([int(t)])!r} {p[t]:.3f}"
                                                     for t in top))
    return [s for r in ro if r.reward > 0 for s in r.segments]


class Retention:
    """What the updates do to what the starting policy already gets right: the probability (at
    the sampling temperature) of the trained tokens of segments of successful rollouts (in
    `main`, the policy's own greedy successes), all of them and the number tokens among them
    (counts, indices, answers): mean probability and mean change of log-probability since the
    start."""

    def __init__(self, run, cfg, segs, loss_cfg):
        from supo_jax.rl import trainer as T
        from supo_jax.rl.batch import build_batch

        self.run, self.loss_cfg = run, loss_cfg
        self.batch = build_batch(segs, [0.0] * len(segs), max_len=T.row_len(cfg, run.fmt),
                                 rows_multiple=cfg.optim.minibatch_rows) if segs else None
        if self.batch is not None:
            targets = self.batch.targets
            numbers = [t for t in np.unique(targets) if is_number(run.policy.tokenizer, t)]
            m = self.batch.mask > 0
            self.sel = {"all": m, "numbers": m & np.isin(targets, numbers)}
            self.start = self.logp()

    def logp(self):
        from supo_jax.rl.train_step import recompute_logprobs
        return np.asarray(recompute_logprobs(self.run.graphdef, self.run.params, self.batch,
                                             self.loss_cfg))

    def report(self) -> str:
        if self.batch is None:
            return "retention: no successful rollout to measure"
        now = self.logp()
        parts = []
        for name, sel in self.sel.items():
            if sel.any():
                parts.append(f"{name} {sel.sum()} tokens P {np.exp(self.start[sel]).mean():.3f} -> "
                             f"{np.exp(now[sel]).mean():.3f} (log-probability "
                             f"{(now - self.start)[sel].mean():+.4f})")
        return "retention of the successful rollouts: " + "; ".join(parts)


def probe_updates(run, cfg, steps: int, only: str, log=print, kept=()) -> None:
    from supo_jax.envs.datasets import load_tasks
    from supo_jax.rl import trainer as T
    from supo_jax.rl.batch import build_batch, rollout_advantages
    from supo_jax.rl.train_step import recompute_logprobs

    tasks = load_tasks(cfg.env.name, "train", cfg.env.train_tasks, seed=cfg.env.seed,
                       **cfg.env.knobs)
    loss_cfg = dataclasses.replace(cfg.loss, temperature=cfg.rollout.temperature or 1.0)
    B = cfg.rollout.tasks_per_step
    retention = Retention(run, cfg, kept, loss_cfg)
    for step in range(steps):
        rollouts, trained, _ = T.step_rollouts(run, step, tasks[step * B:(step + 1) * B], tasks)
        segs, seg_adv, _, _ = rollout_advantages(trained, cfg.advantage)
        if only == "positive":
            seg_adv = [max(a, 0.0) for a in seg_adv]
        elif only == "negative":
            seg_adv = [min(a, 0.0) for a in seg_adv]
        batch = build_batch(segs, seg_adv, max_len=T.row_len(cfg, run.fmt),
                            rows_multiple=cfg.optim.minibatch_rows)
        before = np.asarray(recompute_logprobs(run.graphdef, run.params, batch, loss_cfg))
        run.params, run.opt_state, upd = T.ppo_update(
            run.policy, run.graphdef, run.params, run.opt_state, batch, tx=run.tx,
            loss_cfg=loss_cfg, optim=cfg.optim, mesh=run.mesh, seed=step)
        after = np.asarray(recompute_logprobs(run.graphdef, run.params, batch, loss_cfg))
        m, A, d = batch.mask > 0, batch.advantages, after - before
        rewards = [r.reward for r in rollouts]
        parts = [f"{name} {sel.sum()} tokens {d[sel].mean():+.4f}"
                 for name, sel in (("A>0", m & (A > 0)), ("A<0", m & (A < 0)), ("A=0", m & (A == 0)))
                 if sel.any()]
        log(f"step {step + 1}: {len(rollouts)} rollouts, success {np.mean(rewards):.3f}, "
            f"{upd['updates']} updates, grad norm {upd['grad_norm']:.4f}; mean change of "
            f"log-probability: " + "; ".join(parts))
        log(f"step {step + 1}: " + retention.report())


def main(argv=None, log=print) -> int:
    from supo_jax import config as C
    from supo_jax.rl import trainer as T

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", choices=("both", "positive", "negative"), default="both")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.getcwd())      # env.imports from the working directory
    cfg = C.load_config(args.config, [*args.set, f"train.run_dir={args.run_dir}"])
    run = T.open_run(cfg)
    kept = greedy_failures(run, cfg, log)
    probe_updates(run, cfg, args.steps, args.only, log, kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())
