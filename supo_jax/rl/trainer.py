"""The trainer loop: task stream -> rollouts -> advantages -> updates -> metrics ->
checkpoint -> eval. The loop owns I/O only; the math is in algo.py / train_step.py.

Multi-process runs (jax.distributed initialized, e.g. a TPU pod or several CPU processes):
the mesh spans every process's devices and the policy is sharded over it. Every process
samples every rollout on that mesh, stepping the environments of its own rows and
exchanging their outcomes (see rollout_batch), so every process builds the same global
batch, and each process places just the rows of that batch that live on its own devices;
the train step is one SPMD program over the global mesh. Orbax writes checkpoints collectively; only
process 0 writes metrics.jsonl, TensorBoard events, config.json, the HF export and
progress bars. The run directory must be shared by the processes.

Resume: everything random is derived from (train.seed, step) — the sampler key, the
minibatch order — and the task stream position is a function of the step (with partial
rollouts, rollout.budget_tokens, it and the suspended rollouts and unfinished groups are in
the checkpoint), so a run restored from step k replays steps k+1.. as an uninterrupted run
would.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from supo_jax import storage
from supo_jax.agent.context import ENV_FAILURES, ContextConfig
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import PolicyActor, Rollout, Suspended, rollout_phase, summarize
from supo_jax.checkpoint import RunCheckpoints
from supo_jax.config import Config, ConfigError, OptimSection, to_dict
from supo_jax.model.policy import Policy
from supo_jax.model.sharding import mesh_scope, put, replicated
from supo_jax.model.weights import host_array
from supo_jax.rl.algo import behaviour_weights
from supo_jax.rl.batch import (Advantages, TrainBatch, build_batch, permute_rewards,
                               rollout_advantages)
from supo_jax.rl.configs import LossConfig
from supo_jax.rl.metrics import MetricsLog, eval_row, progress_bar, summarize_scalars
from supo_jax.rl.multihost import ProcessPeers, barrier, is_main, make_run_mesh, place_batch
from supo_jax.rl.runs import (build_policy, check_prompt_fits, check_resume_config, check_run_dir,
                              load_configured_policy, model_fingerprint, row_len,
                              sampler_rows, save_policy, serving_policy)
from supo_jax.rl.sft import SFTStopped
from supo_jax.rl.train_step import (init_opt_state, join_trainable, learning_rate,
                                    make_optimizer, split_trainable, step_programs, trainable)
from supo_jax.sampling.sampler import SamplingParams
from supo_jax.utils import json_safe

log = logging.getLogger(__name__)


def rollout_batch(policy: Policy, fmt: ChatFormat, cfg: Config, tasks: Sequence[dict], *,
                  seed: int, context: ContextConfig | None = None, group_size: int | None = None,
                  sampling: SamplingParams | None = None,
                  progress: Callable[[int], object] | None = None) -> list[Rollout]:
    """Rollouts of `tasks` with the current policy (a fresh sampler: params changed).

    Multi-process (jax.process_count() = P > 1): every process calls this with the same
    tasks and seed and runs the same rollout driver over all rollout.rows sampler rows, on
    the policy's serving layout over the same devices (supo_jax.model.serving; no
    per-process copy): one global prefill or decode call at a time, the KV cache's rows
    over its groups and its kv heads over each group's chips. Process p resets and steps the environments of the rows it owns
    (ProcessPeers: slot % P == p) and shares their outcomes, so every process returns the
    same rollouts, equal to a single process's for the same seed; advantages, batches and
    metrics are then computed identically everywhere and each process feeds the train step
    only the batch rows of its own devices (place_batch).
    """
    g = group_size or cfg.rollout.group_size
    items = [Suspended(t, gi, s) for gi, t in enumerate(tasks) for s in range(g)]
    done, _, _ = policy_rollouts(policy, fmt, cfg, items, seed=seed, context=context,
                                 group_size=g, sampling=sampling, progress=progress)
    out = [done[(gi, s)] for gi in range(len(tasks)) for s in range(g)]
    report_env_errors(out)
    return out


def policy_rollouts(policy: Policy, fmt: ChatFormat, cfg: Config, items: Sequence[Suspended], *,
                    seed: int, context: ContextConfig | None = None, group_size: int,
                    sampling: SamplingParams | None = None, budget_tokens: int = 0,
                    version: int = 0, progress: Callable[[int], object] | None = None,
                    envs: dict | None = None):
    """rollout_batch's phase over rollouts to start or resume (agent.rollout.rollout_phase's
    result)."""
    ctx = context or cfg.context
    r = cfg.rollout
    sampling = sampling or SamplingParams(r.temperature, r.top_k, r.top_p)
    max_len = ctx.row_bound(fmt)
    # sampled on the serving layout (a copy freed with the sampler, before the update)
    policy = serving_policy(cfg, policy)
    rows = sampler_rows(cfg, len(items), policy.mesh)
    actor = PolicyActor(policy, fmt, rows=rows, max_len=max_len, sampling=sampling, seed=seed)
    return rollout_phase(actor, env_maker(cfg), items, fmt, ctx,
                         group_size=group_size, rows=rows, budget_tokens=budget_tokens,
                         version=version, reproducible=r.reproducible, envs=envs,
                         env_timeout_s=cfg.env.timeout_s, progress=progress,
                         peers=ProcessPeers() if jax.process_count() > 1 else None)


# harness mode (env.harness): the make_env of the rollouts, installed for a run by the layer
# that serves the harness's sessions (supo_jax.serve.harness.harness_mode: rl is below serve)
_HARNESS_ENVS: list[Callable[[], object]] = []


@contextlib.contextmanager
def harness_envs_installed(make_env: Callable[[], object]):
    """Within: the rollouts of a run in harness mode (training, evals) make their environments
    with `make_env` (one harness session a rollout)."""
    _HARNESS_ENVS.append(make_env)
    try:
        yield
    finally:
        _HARNESS_ENVS.remove(make_env)


def env_maker(cfg: Config) -> Callable[[], object]:
    """The make_env of cfg's rollouts: env.name's environment, or in harness mode the sessions
    that harness_mode installed (a ConfigError where none is)."""
    if not cfg.env.harness:
        from supo_jax.envs import make_env
        return lambda: make_env(cfg.env.name)
    if not _HARNESS_ENVS:
        raise ConfigError(f"env.harness={cfg.env.harness!r}: a harness's rollouts need the "
                          "sessions server; run `supo-jax train`, or train(cfg) within "
                          "supo_jax.serve.harness.harness_mode(cfg)")
    return _HARNESS_ENVS[-1]


_REPORTED_ERRORS: set = set()
_REPORTED_UNTRAINED: list = []


def report_untrained(row: dict, log: Callable[[str], None] = print) -> None:
    """One line, the first time in this process a step takes no update, saying why (no group
    of rollouts carried an advantage); metrics.jsonl counts such steps as updates = 0."""
    if row.get("updates") or _REPORTED_UNTRAINED or not is_main():
        return
    _REPORTED_UNTRAINED.append(row["step"])
    why = ("no rollout succeeded: the warm start solves none of these tasks (more SFT: "
           "sft.steps / sft.num_demos; or a task it cannot do)" if not row.get("success_rate")
           else "every rollout ended without an answer and is masked"
           if row.get("masked_rate", 0) >= 1 else
           "within each group every rollout scored alike (all solved or all failed)")
    log(f"step {row['step']} trained nothing: no group of rollouts carried an advantage, {why}; "
        "updates = 0 in metrics.jsonl counts such steps (this is not printed again)")


def report_env_errors(rollouts: Sequence[Rollout], log: Callable[[str], None] = print) -> None:
    """One line for each kind of environment error (an exception or timeout in reset / step,
    which fails only its rollout) the first time it occurs in this process; every step's
    metrics count them as env_error_rate."""
    failed = [r for r in rollouts if r.reason in ENV_FAILURES]
    for r in failed:
        msg = next((m["content"] for m in reversed(r.transcript) if m["role"] == "error"),
                   r.reason)[:300]
        if msg not in _REPORTED_ERRORS and is_main():
            _REPORTED_ERRORS.add(msg)
            log(f"environment error ({r.task_id}): {msg}; {len(failed)} of {len(rollouts)} "
                "rollouts of this batch failed in the environment (env_error_rate in "
                "metrics.jsonl counts them; this error is not printed again)")


def _solved_none(cfg: Config, ro) -> ValueError:
    hint = (f"; under context.manager={cfg.context.manager} a reply holds its <state> block as "
            "well as its call: raise context.max_state_tokens"
            if cfg.context.state_request else "")
    return ValueError(f"the scripted expert solved none of {len(ro)} demonstration tasks under "
                      f"this context config (reasons: {summarize(ro)['reasons']}); raise "
                      f"context.max_steps / max_summaries / working_context{hint}")


# what ran out, by the reason a rollout ended, for the expert's-ceiling line
_RAN_OUT = {"context_limit": "the working context (context.working_context)",
            "max_steps": "steps (context.max_steps)",
            "max_summaries": "summaries (context.max_summaries)",
            "summary_cut": "the summary budget (context.max_summary_tokens)"}


def expert_ceiling(cfg: Config, fmt: ChatFormat, n: int | None = None,
                   log: Callable[[str], None] = print) -> dict:
    """The scripted expert on n (default train.expert_ceiling) training tasks under this run's
    context settings: the ideal agent's reach under this manager at this W, the ceiling an RL
    run can approach ({} where n is 0 or the environment has no expert). One line when it
    solves none, naming what ran out; a ConfigError when every one of its actions was cut at
    its budget (a setting that makes every action unparseable)."""
    from supo_jax.envs import make_tasks
    from supo_jax.envs.experts import has_expert

    name = cfg.env.name
    n = cfg.train.expert_ceiling if n is None else n
    if not n or not has_expert(name):
        return {}
    tasks = make_tasks(name, "train", n, seed=30_000 + cfg.env.seed, **cfg.env.knobs)
    ro, actor = scripted_rollouts(cfg, fmt, tasks)
    s = summarize(ro)
    if s["success_rate"] == 0 and is_main():
        log(solved_none_line(cfg, ro, actor, fmt) + ". Rewards will be rare: change those "
            "settings or the task's knobs (env.knobs)")
    if s["observation_cut_rate"] > 0.5 and is_main():
        log(f"context.max_observation_tokens={cfg.context.max_observation_tokens} cut "
            f"{100 * s['observation_cut_rate']:.0f}% of the scripted expert's observations on "
            f"{name}: its observations are longer; a manager meant to handle long results "
            "(clear, fold) sees them cut (metrics: observation_cut_rate); raise it with --set "
            "context.max_observation_tokens=N")
    return {"expert_success_rate": s["success_rate"], "expert_reasons": s["reasons"],
            "expert_cut_actions": actor.cut_actions, "expert_actions": actor.actions}


def solved_none_line(cfg: Config, ro: Sequence[Rollout], actor,
                     fmt: ChatFormat | None = None) -> str:
    """One line: the scripted expert solved none of `ro`, and what ran out; given fmt, and
    where the task has a size knob, the largest size at which it solves its tasks here."""
    c, reasons = cfg.context, summarize(ro)["reasons"]
    ran_out = [_RAN_OUT[k] for k in reasons if k in _RAN_OUT]
    if actor.cut_actions:
        ran_out.append(f"the action budget ({_action_budget(c)}: {actor.cut_actions} of "
                       f"{actor.actions} actions cut)")
    size = _size_it_solves(cfg, fmt) if fmt is not None else None
    return (f"expert ceiling: the scripted expert solves none of {len(ro)} {cfg.env.name} tasks "
            f"under context.manager={c.manager} at W = {c.working_context} (reasons: {reasons}, "
            f"knobs: {cfg.env.knobs or 'the environment defaults'}); what ran out: "
            f"{', '.join(ran_out) or 'nothing named'}"
            + (f"; it solves env.knobs.size={size} here" if size else ""))


SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)   # the capacity benchmark's ladder


def _size_it_solves(cfg: Config, fmt: ChatFormat, n: int = 2) -> int | None:
    """The largest size on SIZES (up to the configured one) at which the scripted expert solves
    n of n tasks under cfg (None: not the smallest, or the task has no `size` knob)."""
    from supo_jax.envs import make_tasks

    now = cfg.env.knobs.get("size")
    top = min(now) if isinstance(now, (list, tuple)) else now
    best = None
    for size in SIZES:
        if top is not None and size >= top:
            break
        knobs = {**cfg.env.knobs, "size": size}
        try:
            tasks = make_tasks(cfg.env.name, "train", n, seed=30_000 + cfg.env.seed, **knobs)
            ro, _ = scripted_rollouts(dataclasses.replace(
                cfg, env=dataclasses.replace(cfg.env, knobs=knobs)), fmt, tasks)
        except (ValueError, TypeError):   # no size knob, out of range, every action cut
            break
        if summarize(ro)["success_rate"] < 1.0:
            break
        best = size
    return best


def _action_budget(c: ContextConfig) -> str:
    """The setting that bounds an action, with its figure."""
    if c.state_request and not c.max_state_tokens:
        return ("the reply budget of a <state> block sized from W (context.max_state_tokens=0: "
                "what L leaves beside each task's prompt and one observation)")
    return "context.max_action_tokens" + (" + context.max_state_tokens"
                                          if c.state_request else "") + f" = {c.action_tokens}"


def scripted_rollouts(cfg: Config, fmt: ChatFormat, tasks: Sequence[dict]):
    """(rollouts, actor) of the environment's scripted expert on `tasks` under cfg.context; a
    ConfigError naming the action budget when every one of its actions was cut at it (then no
    action parses: a configuration error, not a result)."""
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_env
    from supo_jax.envs.experts import expert_for, for_context

    name, c = cfg.env.name, cfg.context
    actor = ScriptedActor(for_context(expert_for(name), c), fmt)
    ro = run_rollouts(actor, lambda: make_env(name), tasks, fmt, c,
                      rows=min(cfg.rollout.rows, len(tasks)), env_timeout_s=cfg.env.timeout_s,
                      # frozen_summarizer: the expert writes the summaries a frozen one would
                      summarizer=actor if c.manager == "frozen_summarizer" else None)
    if actor.actions and actor.cut_actions == actor.actions:
        raise ConfigError(f"{_action_budget(c)}: every action of the scripted "
                          f"expert on {name} was cut at it ({actor.actions} of {actor.actions}), "
                          f"so none parses under context.manager={c.manager}; raise it")
    return ro, actor


def warm_start(policy: Policy, fmt: ChatFormat, cfg: Config, progress: bool = True, *,
               stop: Callable[[], bool] | None = None, ckpt_dir: str | None = None) -> dict:
    """SFT on demonstrations (scripted experts by default). Returns a small report. stop /
    ckpt_dir: sft_train's (stopped between SFT steps, its progress saved to go on from)."""
    from supo_jax.envs import make_tasks
    from supo_jax.rl.sft import expert_segments, jsonl_segments, sft_train

    s = cfg.sft
    max_len = row_len(cfg, fmt)
    if s.demos == "expert":
        tasks = make_tasks(cfg.env.name, "train", s.num_demos, seed=20_000 + cfg.env.seed,
                           **cfg.env.knobs)
        n_full = int(round(s.full_context_demos * len(tasks)))
        segs, ro = expert_segments(fmt, cfg.env.name, tasks[n_full:], cfg.context,
                                   summary_drop=s.summary_drop, seed=cfg.train.seed)
        if ro and not segs:   # (the full-context share below does not show this manager)
            raise _solved_none(cfg, ro)
        if n_full:   # single-segment demonstrations in a context that holds the whole history
            c = cfg.context
            full = dataclasses.replace(c, manager="full",
                                       working_context=c.working_context * (c.max_summaries + 1))
            fsegs, fro = expert_segments(fmt, cfg.env.name, tasks[:n_full], full)
            segs, ro = segs + fsegs, ro + fro
            max_len = max(max_len, full.row_bound(fmt))
        demo_success = summarize(ro)["success_rate"]
        report = {"sft_full_context_demos": n_full}
        if not segs:
            raise _solved_none(cfg, ro)
    else:
        from supo_jax.envs import make_env
        task = make_tasks(cfg.env.name, "train", 1, seed=cfg.env.seed, **cfg.env.knobs)[0]
        tools = [t.schema() for t in make_env(cfg.env.name).reset(task).tools]
        segs = jsonl_segments(fmt, s.demos, default_tools=tools, max_len=max_len,
                              ctx=cfg.context)
        demo_success, report = float("nan"), {"sft_demos_file": s.demos}
    bar = progress_bar(s.steps, "sft (warm start steps)", progress)
    hist = sft_train(policy, segs, steps=s.steps, lr=s.lr, batch_rows=s.batch_rows,
                     max_len=max_len, seed=cfg.train.seed, stop=stop, ckpt_dir=ckpt_dir,
                     collective_matmul=cfg.mesh.collective_matmul,
                     progress=(lambda m: (bar.update(1), bar.set_postfix(loss=f"{m['loss']:.3f}")))
                     if bar else None)
    if bar:
        bar.close()
    lengths = [len(sg.tokens) for sg in segs]
    # rows that end long before L teach summaries at points a rollout never summarizes at
    return {"sft_segments": len(segs), "sft_demo_success": demo_success, **report,
            "sft_row_tokens_mean": float(np.mean(lengths)), "sft_row_tokens_max": max(lengths),
            "summary_trigger_tokens": cfg.context.limit(fmt),
            "sft_loss_first": hist[0]["loss"], "sft_loss_last": hist[-1]["loss"]}


def evaluate(policy: Policy, fmt: ChatFormat, cfg: Config, *, max_summaries: int | None = None,
             tasks: Sequence[dict] | None = None, seed: int = 0, progress: bool = True,
             label: str = "eval") -> dict:
    """Success etc. on the held-out split with an optional summary cap: greedy (one rollout
    per task) by default, or train.eval_samples rollouts per task at train.eval_temperature.
    `label` names the phase on the progress line."""
    import dataclasses

    from supo_jax.envs.datasets import load_tasks

    tasks = tasks or list(load_tasks(cfg.env.name, "eval", cfg.env.eval_tasks, seed=cfg.env.seed,
                                     **{**cfg.env.knobs, **cfg.env.eval_knobs}))
    ctx = cfg.context if max_summaries is None else dataclasses.replace(
        cfg.context, max_summaries=int(max_summaries))
    t = cfg.train
    g = t.eval_samples if t.eval_temperature > 0 else 1
    bar = progress_bar(len(tasks) * g, f"{label} S={ctx.max_summaries}" if ctx.summarizes
                       else f"{label} {ctx.manager}", progress)
    ro = rollout_batch(policy, fmt, cfg, tasks, seed=seed, context=ctx, group_size=g,
                       sampling=SamplingParams(t.eval_temperature),
                       progress=bar.update if bar else None)
    if bar:
        bar.close()
    out = summarize(ro)
    out["max_summaries"] = ctx.max_summaries
    return out


def evaluate_caps(policy: Policy, fmt: ChatFormat, cfg: Config, caps: Sequence[int | None], *,
                  seed: int = 0, progress: bool = True, made: dict | None = None) -> list[dict]:
    """evaluate() at each summary cap (None: the configured one), once a distinct context: a
    cap changes nothing where the manager does not summarize, nor where it is the configured
    one (`made`: that evaluation, when already made). Evaluations are seeded, so a repeat
    would give the same figures."""
    ctx = cfg.context
    done: dict = {} if made is None else {ctx.max_summaries: made}
    out = []
    for c in caps:
        key = ctx.max_summaries if c is None or not ctx.summarizes else int(c)
        if key not in done:
            done[key] = evaluate(policy, fmt, cfg, max_summaries=key, seed=seed,
                                 progress=progress)
        out.append(dict(done[key], max_summaries=ctx.max_summaries if c is None else int(c)))
    return out


@dataclasses.dataclass
class Run:
    """One RL run's live state. The parameters and optimizer state are replaced by every
    update (the policy's model follows them); `report` collects what eval.json records
    besides the final eval (resumed_from, the warm start's figures, eval_before)."""
    cfg: Config
    policy: Policy
    fmt: ChatFormat
    mesh: Mesh | None              # None on a single device
    ckpts: RunCheckpoints
    fingerprint: str               # model_fingerprint(policy)
    tx: optax.GradientTransformation
    graphdef: nnx.GraphDef
    params: nnx.State
    opt_state: optax.OptState
    start: int = 0
    report: dict = dataclasses.field(default_factory=dict)
    ref_params: nnx.State | None = None   # the starting policy's parameters (loss.kl_coef > 0)
    # partial rollouts (rollout.budget_tokens): what carries from step to step (JSON values,
    # in the checkpoint): the task stream's position, the next group's number, the suspended
    # rollouts (Suspended.to_json), the ended rollouts of unfinished groups (Rollout.to_json)
    # and the [group, sample] of the rollouts restarted once (never again)
    carry: dict = dataclasses.field(default_factory=lambda: dict(
        task_position=0, next_group=0, suspended=[], ended=[], restarted=[]))
    # the live environments of this process's suspended rollouts (rollout_phase's envs; not
    # in the checkpoint: a resumed run replays their actions instead)
    envs: dict = dataclasses.field(default_factory=dict)


class Preempted(Exception):
    """The run stopped at a step boundary on SIGTERM, its checkpoint saved."""


class _Preemption:
    """SIGTERM (a TPU VM's preemption notice, a scheduler's stop) sets a flag; `agreed` says,
    at a step boundary, whether any process of the run got one (one small exchange a step
    when there are several processes), so that all save the same step and stop together."""

    def __init__(self) -> None:
        import signal
        import threading

        self.flag, self.old = False, None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum, frame) -> None:
        self.flag = True

    def agreed(self) -> bool:
        if jax.process_count() == 1:
            return self.flag
        from supo_jax.rl.multihost import allgather_json
        return any(allgather_json(self.flag))

    def restore(self) -> None:
        import signal
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


def train(cfg: Config) -> dict:
    """Run (or resume) the configured RL run. Returns the final metrics and eval. Raises
    Preempted after saving the step a SIGTERM arrived in (at the end of that step)."""
    preemption = _Preemption()
    try:
        return _train(cfg, preemption)
    finally:
        preemption.restore()


def _train(cfg: Config, preemption: _Preemption) -> dict:
    env_maker(cfg)   # harness mode without its sessions fails here, not in the first rollout
    run = open_run(cfg, stop=preemption.agreed)
    metrics_log = MetricsLog(cfg.train.run_dir, run.start)
    if cfg.train.eval_before:
        eval_before(run, metrics_log)
        if run.start < cfg.train.steps and preemption.agreed():   # step 0 is saved
            run.ckpts.close()
            metrics_log.close()
            raise Preempted(f"stopped by SIGTERM before step 1 of {cfg.train.steps}; rerun the "
                            "same command to resume")
    from supo_jax.envs.datasets import load_tasks
    train_tasks = load_tasks(cfg.env.name, "train", cfg.env.train_tasks, seed=cfg.env.seed,
                             **cfg.env.knobs)   # a tfds array_record task set, built on first use
    max_len = row_len(cfg, run.fmt)
    # the loss's logprobs use the convention of the sampler that produced the old logprobs
    loss_cfg = dataclasses.replace(cfg.loss, temperature=cfg.rollout.temperature or 1.0)
    B, history = cfg.rollout.tasks_per_step, []
    if run.start >= cfg.train.steps and is_main():
        print(f"{cfg.train.run_dir} is at step {run.start} of train.steps={cfg.train.steps}: "
              "no steps to run; evaluating its policy (raise train.steps to train on)")
    outer = (progress_bar(cfg.train.steps, "train (RL steps)", cfg.train.progress,
                          initial=run.start) if run.start < cfg.train.steps else None)
    for step in range(run.start, cfg.train.steps):
        pos = (step * B) % len(train_tasks)
        tasks = [train_tasks[(pos + i) % len(train_tasks)] for i in range(B)]
        row = rl_step(run, step, tasks, max_len=max_len, loss_cfg=loss_cfg, pool=train_tasks)
        report_untrained(row)
        metrics_log.write(row)
        history.append(row)
        if outer:
            outer.update(1)
            loss = row["loss"]   # nan: no row of the step carried an advantage
            outer.set_postfix(success=f"{row['success_rate']:.2f}",
                              loss=f"{loss:.3f}" if math.isfinite(loss) else "- (nothing trained)")
        end_step(run, step + 1, metrics_log, task_position=(pos + B) % len(train_tasks))
        if step + 1 < cfg.train.steps and preemption.agreed():
            if (step + 1) % cfg.train.save_every:    # end_step saved it otherwise
                save_step(run, step + 1, task_position=(pos + B) % len(train_tasks))
            run.ckpts.close()
            metrics_log.close()
            raise Preempted(f"stopped by SIGTERM after step {step + 1} of {cfg.train.steps}, "
                            f"its checkpoint saved in {cfg.train.run_dir}; rerun the same "
                            "command to resume")
    if outer:
        outer.close()
    return finish(run, history, metrics_log)


def open_run(cfg: Config, stop: Callable[[], bool] | None = None) -> Run:
    """Set up (or reopen) the run directory: mesh, policy, the run-directory and resume
    checks, config.json, the optimizer; then restore the latest checkpoint, or on a new
    run warm-start the tiny policy by SFT and checkpoint it as step 0."""
    from supo_jax.envs.datasets import builder_class

    # import tensorflow_datasets before any checkpoint is saved: its import patches Python's
    # import hook for the duration (etils lazy_imports), and an Orbax save thread importing
    # meanwhile got a LazyModule ('LazyModule' object is not callable in humanize)
    builder_class()
    run_dir = cfg.train.run_dir
    storage.ensure_dir(run_dir, "train.run_dir")
    mesh = make_run_mesh(cfg)
    if jax.process_count() > 1:
        print(f"process {jax.process_index()} of {jax.process_count()}: mesh "
              f"{dict(mesh.shape) if mesh else None} over {jax.device_count()} devices; "
              f"sampling on a serving layout of the same devices; this process steps the environments of rows "
              f"{jax.process_index()}, {jax.process_index() + jax.process_count()}, ...",
              flush=True)
    policy = build_policy(cfg, run_dir, mesh)
    fmt = ChatFormat(policy.tokenizer)
    check_prompt_fits(cfg, fmt)
    check_run_dir(run_dir, policy, record=True)
    ckpts = RunCheckpoints(storage.join(run_dir, "checkpoints"), keep=cfg.train.keep)
    check_resume_config(run_dir, cfg, ckpts.steps())
    if is_main():
        storage.write_text(storage.join(run_dir, "config.json"),
                           json.dumps(to_dict(cfg), indent=2, default=str))
    o = cfg.optim
    tx = make_optimizer(o.lr, weight_decay=o.weight_decay, clip_norm=o.clip_norm)
    graphdef, params = policy.split()
    run = Run(cfg, policy, fmt, mesh, ckpts, model_fingerprint(policy), tx, graphdef, params,
              init_opt_state(tx, params, mesh))
    # checkpoints hold the trained parameters: with LoRA the adapters, not the frozen base
    # (rebuilt from the same settings, as here)
    trained, frozen = split_trainable(run.params)
    restored = ckpts.restore_latest(trained, run.opt_state)
    if restored is None and ckpts.steps():
        raise ValueError(
            f"{run_dir}: none of its checkpoints (steps {ckpts.steps()}) can be restored into "
            "this model and optimizer (corrupt, or written by another version of supo_jax: the "
            "warnings above say why); nothing was overwritten. Use another train.run_dir, or move "
            "the checkpoints away to start over")
    if cfg.rollout.budget_tokens and is_main():
        print(f"partial rollouts (rollout.budget_tokens={cfg.rollout.budget_tokens}): the "
              "update's old log-probs recomputed, resumed tokens weighed by "
              f"loss.behaviour_correction={cfg.loss.behaviour_correction}")
    if restored is not None:
        run.start, trained, run.opt_state, meta = restored
        if cfg.rollout.budget_tokens and "carry" in meta:
            run.carry = meta["carry"]
        run.params = join_trainable(trained, frozen)
        nnx.update(policy.model, run.params)
        run.report["resumed_from"] = run.start
        if is_main():
            print(f"resumed from {run_dir} step {run.start}")
    if restored is None:
        run.report.update(expert_ceiling(cfg, fmt))
    if (restored is None and not (cfg.train.init_from or cfg.model.path)
            and cfg.train.sft_warm_start):
        try:   # a SIGTERM (stop) ends it between SFT steps; a rerun goes on from there
            run.report.update(warm_start(policy, fmt, cfg, cfg.train.progress, stop=stop,
                                         ckpt_dir=storage.join(run_dir, "sft_progress")))
        except SFTStopped as e:
            ckpts.close()
            raise Preempted(f"{e}; rerun the same command to resume") from None
        # the warm start as an HF directory, as `supo-jax sft` saves it: a policy to score
        # (experiments/reeval.py), roll out or train from (train.init_from)
        save_policy(policy, cfg, storage.join(run_dir, "sft"),   # collective; process 0 writes
                    storage.join(run_dir, "sft_peft"))
        barrier("supo_jax:sft:written")
        run.graphdef, run.params = policy.split()
        run.opt_state = init_opt_state(tx, run.params, mesh)
        ckpts.save(0, trainable(run.params), run.opt_state, {
            "step": 0, "seed": cfg.train.seed, "task_position": 0,
            "model_fingerprint": run.fingerprint, "warm_start": run.report})
    if cfg.loss.kl_coef:
        run.ref_params = reference_params(run)
    return run


def reference_params(run: Run) -> nnx.State:
    """The KL penalty's reference: the run's starting policy (after the warm start or as
    loaded). A new run saves it to run_dir/reference (safetensors), a resumed run loads it
    from there, so the reference of steps after a resume is the one before it. With LoRA
    adapters, the starting adapters alone (a PEFT adapter there; train_step joins them to
    the frozen base): a warm start or train.init_from's adapter is part of the reference."""
    from supo_jax.model.lora import peft_state
    from supo_jax.rl.runs import save_adapters

    lora = run.policy.model.lora
    path = storage.join(run.cfg.train.run_dir, "reference")
    if run.start == 0:
        if lora is not None:
            save_adapters(run.policy, run.cfg, path)
        else:
            run.policy.save_pretrained(path)     # collective gathers; process 0 writes
        barrier("supo_jax:reference:written")
        return jax.tree.map(jnp.copy, trainable(run.params))   # train_step donates the params
    if not storage.isfile(storage.join(storage.resolve(path),
                                       "adapter_config.json" if lora else "config.json")):
        raise ConfigError(
            f"loss.kl_coef > 0 needs the run's reference policy, {path}, which this run did not "
            "write (it started without the KL penalty, or with LoRA adapters before supo_jax "
            "saved their reference): start a new run directory")
    if lora is not None:
        return peft_state(trainable(run.params), lora, path)
    return load_configured_policy(path, run.cfg.model, mesh=run.mesh).split()[1]


def eval_before(run: Run, metrics_log: MetricsLog) -> None:
    """The starting policy's eval, into run.report and metrics.jsonl as step 0; a resumed
    run reads it back from metrics.jsonl (process 0) instead."""
    row = next((r for r in metrics_log.kept if r["step"] == 0 and "loss" not in r), None)
    if row:
        run.report["eval_before"] = {k[5:]: v for k, v in row.items() if k.startswith("eval/")}
    elif run.start == 0:
        cfg = run.cfg
        run.report["eval_before"] = evaluate(run.policy, run.fmt, cfg, seed=cfg.train.seed,
                                             progress=cfg.train.progress,
                                             label="eval (before step 1)")
        metrics_log.write({"step": 0, **eval_row(run.report["eval_before"])})


def step_rollouts(run: Run, step: int, tasks: Sequence[dict], pool: Sequence[dict] = ()
                  ) -> tuple[list[Rollout], list[Rollout], dict]:
    """The rollouts of RL step `step` + 1 and those it trains on, with how they were sampled.

    rollout.dynamic_rounds = 0: one round over `tasks`, every rollout trains. k >= 1 (DAPO's
    dynamic sampling): only the groups that carry an advantage train; while fewer than
    tasks_per_step have been found and fewer than k rounds ran, another round samples
    tasks_per_step tasks drawn from `pool` at random positions fixed by (seed, step, round),
    so a resumed run replays them. Returns (the first round's rollouts, the trained rollouts,
    metrics)."""
    cfg = run.cfg
    if cfg.rollout.budget_tokens:
        return partial_rollouts(run, step, pool)
    B, k = cfg.rollout.tasks_per_step, cfg.rollout.dynamic_rounds
    first, kept, rounds, informative = [], [], 0, 0
    seed = hash_seed(cfg.train.seed, step)
    while rounds == 0 or (rounds < k and informative < B):
        if rounds:
            pick = np.random.default_rng(hash_seed(seed, rounds)).choice(len(pool), B)
            tasks = [pool[int(i)] for i in pick]
        bar = progress_bar(len(tasks) * cfg.rollout.group_size,
                           f"rollouts {step + 1}" + (f" round {rounds + 1}" if rounds else ""),
                           cfg.train.progress, closing_line=False)
        got = rollout_batch(run.policy, run.fmt, cfg, tasks,
                            seed=hash_seed(seed, rounds) if rounds else seed,
                            progress=bar.update if bar else None)
        if bar:
            bar.close()
        first = first or got
        rounds += 1
        if not k:
            return got, got, {}
        adv = run_advantages(run, got, step=step, draw=rounds)   # rounds >= 1
        useful = {r.group_id for r, a, t in zip(got, adv.advantages, adv.trained) if t and a != 0}
        for g in sorted(useful)[:B - informative]:
            kept += [dataclasses.replace(r, group_id=informative) for r in got if r.group_id == g]
            informative += 1
    return first, kept, {"rounds": rounds, "groups_trained": informative}


def partial_rollouts(run: Run, step: int, pool: Sequence[dict]
                     ) -> tuple[list[Rollout], list[Rollout], dict]:
    """Step `step` + 1's rollouts under a token budget (rollout.budget_tokens): the
    suspended rollouts go on first (restarted from their task where their first tokens are
    more than rollout.max_staleness updates old, once: a restarted rollout runs to its end
    however many phases it takes, so every group completes), then the first samples of new groups from
    the task stream, as many groups as keep tasks_per_step groups in flight; the phase ends
    at the budget (rollout_phase). A group trains in the step in which its last rollout
    ends. Returns (the rollouts that ended in this step, the rollouts of the groups it
    completed, metrics: rollouts_suspended / resumed / restarted, groups_completed, the
    trained rollouts' staleness in updates)."""
    cfg, c = run.cfg, run.carry
    r, G = cfg.rollout, cfg.rollout.group_size
    items, resumed, restarted = [], 0, 0
    once = {tuple(x) for x in c.get("restarted", [])}     # (a checkpoint of an older version)
    for d in c["suspended"]:
        it = Suspended.from_json(d)
        if (it.versions and (it.group_id, it.sample) not in once
                and step - it.versions[0][0] > r.max_staleness):
            it, restarted = Suspended(it.task, it.group_id, it.sample), restarted + 1
            once.add((it.group_id, it.sample))
        resumed += it.state is not None
        items.append(it)
    ended_before = [Rollout.from_json(x) for x in c["ended"]]
    in_flight = {it.group_id for it in items} | {x.group_id for x in ended_before}
    for _ in range(max(0, r.tasks_per_step - len(in_flight))):
        task = pool[c["task_position"] % len(pool)]
        c["task_position"] = (c["task_position"] + 1) % len(pool)
        items += [Suspended(task, c["next_group"], s) for s in range(G)]
        c["next_group"] += 1
    bar = progress_bar(len(items), f"rollouts {step + 1}", cfg.train.progress,
                       closing_line=False)
    done, suspended, stats = policy_rollouts(
        run.policy, run.fmt, cfg, items, seed=hash_seed(cfg.train.seed, step), group_size=G,
        budget_tokens=r.budget_tokens, version=step, progress=bar.update if bar else None,
        envs=run.envs)
    if bar:
        bar.close()
    ended = [done[k] for k in sorted(done)]
    report_env_errors(ended)
    by_group: dict[int, list[Rollout]] = {}
    for x in ended_before + ended:
        by_group.setdefault(x.group_id, []).append(x)
    complete = sorted(g for g, xs in by_group.items() if len(xs) == G)
    trained = [x for g in complete for x in sorted(by_group[g], key=lambda x: x.sample)]
    c["ended"] = [x.to_json() for g in sorted(by_group) if g not in complete
                  for x in by_group[g]]
    c["suspended"] = [x.to_json() for x in suspended]
    c["restarted"] = sorted([g, s] for g, s in once if g not in complete)
    stale = [step - x.versions[0][0] for x in trained if x.versions]
    return ended, trained, {
        "rollouts_suspended": len(suspended), "rollouts_resumed": resumed,
        "rollouts_restarted": restarted, "groups_completed": len(complete),
        "staleness_mean": float(np.mean(stale)) if stale else 0.0,
        "staleness_max": max(stale, default=0)}


def run_advantages(run: Run, rollouts: Sequence[Rollout], *, step: int, draw: int = 0
                   ) -> Advantages:
    """rollout_advantages of `rollouts` under the run's config (their rewards permuted first
    for a placebo control, advantage.permute_rewards, by a permutation fixed by train.seed,
    the step and `draw`: a resumed run permutes as the straight one, seeds differently)."""
    if run.cfg.advantage.permute_rewards:
        rng = np.random.default_rng([hash_seed(run.cfg.train.seed, step), draw])
        rollouts = permute_rewards(rollouts, rng)
    return rollout_advantages(rollouts, run.cfg.advantage)


def rl_step(run: Run, step: int, tasks: Sequence[dict], *, max_len: int, loss_cfg: LossConfig,
            pool: Sequence[dict] = ()) -> dict:
    """RL step `step` + 1 on `tasks`: rollouts, advantages, the PPO update. Returns the
    step's metrics row (the rollout metrics are those of `tasks`, the first round)."""
    cfg, o = run.cfg, run.cfg.optim
    t0 = time.time()
    rollouts, trainable, sampled = step_rollouts(run, step, tasks, pool)
    t1 = time.time()
    adv = run_advantages(run, trainable, step=step)
    upd = {}
    if adv.segments:
        batch = build_batch(adv.segments, adv.segment_advantages, max_len=max_len,
                            rows_multiple=o.minibatch_rows, pack=o.pack)
        run.params, run.opt_state, upd = ppo_update(
            run.policy, run.graphdef, run.params, run.opt_state, batch, tx=run.tx,
            loss_cfg=loss_cfg, optim=o, mesh=run.mesh, seed=hash_seed(cfg.train.seed, step) + 1,
            ref_params=run.ref_params, collective_matmul=cfg.mesh.collective_matmul,
            lr=learning_rate(step, o.lr, schedule=o.schedule, warmup_steps=o.warmup_steps,
                             total_steps=cfg.train.steps))
    t2 = time.time()
    return {"step": step + 1, "loss": upd.get("loss", float("nan")),   # nan: no update
            **summarize_scalars(rollouts), "updates": 0,
            **{k: v for k, v in upd.items() if k != "loss"}, **sampled,
            "masked_rate": float(np.mean([r.reason in cfg.advantage.masked_reasons
                                          for r in rollouts])) if rollouts else 0.0,
            "segments": len(adv.segments), "rollout_seconds": t1 - t0, "update_seconds": t2 - t1}


def save_step(run: Run, done: int, *, task_position: int) -> None:
    """Checkpoint the run after `done` steps (asynchronously; collective)."""
    run.ckpts.save(done, trainable(run.params), run.opt_state, {
        "step": done, "seed": run.cfg.train.seed, "task_position": task_position,
        "model_fingerprint": run.fingerprint,
        **({"carry": run.carry} if run.cfg.rollout.budget_tokens else {})})


def end_step(run: Run, done: int, metrics_log: MetricsLog, *, task_position: int) -> None:
    """After `done` steps: a checkpoint every train.save_every steps and at the last, an
    eval every train.eval_every steps (the last step's eval is `finish`'s)."""
    t = run.cfg.train
    if done % t.save_every == 0 or done == t.steps:
        save_step(run, done, task_position=task_position)
    if t.eval_every and done % t.eval_every == 0 and done < t.steps:
        ev = evaluate(run.policy, run.fmt, run.cfg, seed=t.seed, progress=t.progress,
                      label=f"eval (after step {done})")
        metrics_log.write({"step": done, **eval_row(ev)})


def finish(run: Run, history: list, metrics_log: MetricsLog) -> dict:
    """The final eval and the summary-cap scaling evals, eval.json, the HF export."""
    cfg, t = run.cfg, run.cfg.train
    run.ckpts.close()
    final = evaluate(run.policy, run.fmt, cfg, seed=t.seed, progress=t.progress,
                     label=f"eval (after step {t.steps}, the last)")
    metrics_log.write_eval(t.steps, eval_row(final))
    scaling = evaluate_caps(run.policy, run.fmt, cfg, t.eval_max_summaries, seed=t.seed,
                            progress=t.progress, made=final)
    metrics_log.close()
    result = {"history": history, "eval": final, "eval_scaling": scaling, **run.report}
    if is_main():
        storage.write_text(storage.join(t.run_dir, "eval.json"), json.dumps(
            json_safe({"eval": final, "eval_scaling": scaling, **run.report}), indent=2,
            default=str, allow_nan=False))
    export = storage.join(t.run_dir, "hf")
    save_policy(run.policy, cfg, export, storage.join(t.run_dir, "peft"))   # collective
    result["export"] = export
    if run.policy.model.lora is not None:
        result["peft"] = storage.join(t.run_dir, "peft")
    return result


def ppo_update(policy: Policy, graphdef: nnx.GraphDef, params: nnx.State,
               opt_state: optax.OptState, batch: TrainBatch, *, tx: optax.GradientTransformation,
               loss_cfg: LossConfig, optim: OptimSection, mesh: Mesh | None, seed: int,
               ref_params: nnx.State | None = None, lr: float | None = None,
               collective_matmul: bool = False) -> tuple[nnx.State, optax.OptState, dict]:
    """One RL step's update: optim.ppo_epochs passes over the batch in minibatches of
    optim.minibatch_rows, shuffled by `seed` (old logprobs recomputed first when
    optim.recompute_old_logprobs, the sampler's then corrected for as
    loss.behaviour_correction says), all at learning rate `lr` (None: the optimizer's own). The
    policy follows the new parameters. Returns (params, opt_state, metrics: token-weighted
    means over the updates, updates, rows)."""
    with mesh_scope(mesh):
        return _ppo_update(policy, graphdef, params, opt_state, batch, tx=tx,
                           loss_cfg=loss_cfg, optim=optim, mesh=mesh, seed=seed,
                           ref_params=ref_params, lr=lr, collective_matmul=collective_matmul)


def _ppo_update(policy, graphdef, params, opt_state, batch, *, tx, loss_cfg, optim, mesh, seed,
                ref_params, lr, collective_matmul):
    o = optim
    # on TPU without XLA's windowed einsum unless mesh.collective_matmul
    train_step, recompute_logprobs = step_programs(jax.default_backend(), collective_matmul)
    correction = {}
    if o.recompute_old_logprobs:
        prox = host_array(recompute_logprobs(graphdef, params, place_batch(batch, mesh),
                                             loss_cfg))
        weight, mask, correction = behaviour_weights(
            prox, batch.old_logp, batch.mask, loss_cfg.behaviour_correction,
            loss_cfg.behaviour_cap)
        batch = dataclasses.replace(batch, old_logp=prox, mask=mask,
                                    advantages=batch.advantages * weight)
    rng = np.random.default_rng(seed)
    lr = None if lr is None else np.float32(lr)
    max_kl = np.float32(o.max_kl) if o.max_kl > 0 else None
    ms, stopped = [], False
    for _ in range(o.ppo_epochs):
        perm = rng.permutation(batch.rows)
        for i in range(0, batch.rows, o.minibatch_rows):
            mb = place_batch(batch.take(perm[i:i + o.minibatch_rows]), mesh)
            params, opt_state, m = train_step(graphdef, params, opt_state, mb, tx=tx,
                                              cfg=loss_cfg, micro=o.micro, ref_params=ref_params,
                                              lr=lr, max_kl=max_kl)
            nnx.update(policy.model, params)   # (the old buffers were donated)
            ms.append(m)
            # optim.max_kl: the policy left the trust region; this update was not applied and
            # the step's remaining ones are dropped
            stopped = max_kl is not None and bool(jax.device_get(m["skipped"]))
            if stopped:
                break
        if stopped:
            break
    ms = jax.device_get(ms)
    w = np.maximum(np.asarray([float(m["tokens"]) for m in ms]), 1e-9)
    upd = {k: float(np.average([float(m[k]) for m in ms], weights=w))
           for k in ("loss", "clip_fraction", "approx_kl", "entropy", "grad_norm", "kl_ref")
           if k in ms[0]}
    if max_kl is not None:
        upd["kl_stopped"] = float(stopped)
    return params, opt_state, {**upd, **correction, "updates": len(ms) - stopped,
                               "rows": int(batch.rows)}


def hash_seed(seed: int, step: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:4], "little")


