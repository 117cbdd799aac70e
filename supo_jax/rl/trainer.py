"""The trainer loop: task stream -> rollouts -> advantages -> updates -> metrics ->
checkpoint -> eval. The loop owns I/O only; the math is in algo.py / train_step.py.

Multi-process runs (jax.distributed initialized, e.g. a TPU pod or several CPU processes):
the mesh spans every process's devices and the policy is sharded over it. Each process
runs the rollouts of its share of each step's tasks only (see rollout_batch), the
rollouts are exchanged so that every process builds the same global batch, and each
process places just the rows of that batch that live on its own devices; the train step
is one SPMD program over the global mesh. Orbax writes checkpoints collectively; only
process 0 writes metrics.jsonl, TensorBoard events, config.json, the HF export and
progress bars. The run directory must be shared by the processes.

Exact resume: everything random is derived from (train.seed, step) — the
sampler key, the minibatch order — and the task stream position is a function
of the step, so a run restored from step k replays steps k+1.. exactly as an
uninterrupted run would.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from supo_jax import config as C
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import PolicyActor, Rollout, run_rollouts, start_state, summarize
from supo_jax.checkpoint import RunCheckpoints
from supo_jax.model.policy import Policy, load_policy, new_policy, shard_model
from supo_jax.model.sharding import batch_sharding, make_mesh, put, replicated
from supo_jax.model.weights import host_array
from supo_jax.rl.batch import build_batch
from supo_jax.rl.train_step import (make_optimizer, recompute_logprobs, rollout_advantages,
                                     train_step)
from supo_jax.sampling.sampler import SamplingParams

log = logging.getLogger(__name__)



def _is_main() -> bool:
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    """Every process reaches this point before any goes on (a no-op in a single process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _share(items):
    """This process's share of a list: items[process_index::process_count]."""
    return list(items)[jax.process_index()::jax.process_count()]


def make_run_mesh(cfg: C.Config):
    """The mesh over every device of every process (None on a single device)."""
    if jax.device_count() == 1:
        return None
    return make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)


def _sample_value(schema: dict):
    """A plausible value of a JSON-schema type (for calls the corpus shows without an expert)."""
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and schema.get("enum"):
        return schema["enum"][0]
    return {"integer": 1, "number": 1.5, "boolean": True, "array": [],
            "object": {}}.get(t, "text")


def env_corpus(cfg: C.Config, n: int = 24) -> list[str]:
    """Texts of the environment for a tiny policy's tokenizer: the summary and continuation
    templates, task prompts, tool schemas, and turns: the scripted expert's where the
    environment has one, else one call of each tool with schema-typed arguments and its
    observation; plus the JSONL demonstrations when sft.demos is a file."""
    from supo_jax.envs import make_env, make_tasks
    from supo_jax.envs.experts import expert_for, has_expert
    from supo_jax.text.parsing import format_tool_call

    texts = [cfg.context.summary_instruction, cfg.context.continuation] * 4
    expert = expert_for(cfg.env.name) if has_expert(cfg.env.name) else None
    for task in make_tasks(cfg.env.name, "train", n, seed=10_000 + cfg.env.seed, **cfg.env.knobs):
        env = make_env(cfg.env.name)
        rs = env.reset(task)
        texts += [rs.prompt, rs.system or "", json.dumps([t.schema() for t in rs.tools])]
        if expert is None:
            for tool in rs.tools:   # the answer tool last: it ends the episode
                props = tool.parameters.get("properties", {})
                call = format_tool_call(tool.name, {k: _sample_value(v) for k, v in props.items()})
                texts.append(call)
                try:
                    texts.append(env.act(call).observation)
                except Exception:   # noqa: BLE001  (a sample call the environment rejects)
                    pass
            continue
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
    if cfg.sft.demos != "expert" and os.path.isfile(cfg.sft.demos):
        with open(cfg.sft.demos) as f:
            texts += [line for _, line in zip(range(256), f)]
    return texts


def env_tokenizer(cfg: C.Config, out_dir: str | None = None):
    """The tiny policy's tokenizer for this config (every command builds the same one)."""
    from supo_jax.model.tiny import tiny_tokenizer

    m = cfg.model
    return tiny_tokenizer(out_dir, vocab_size=m.tiny_vocab, extra_corpus=env_corpus(cfg),
                          template=m.tiny_template)


def build_policy(cfg: C.Config, run_dir: str | None = None, mesh=None) -> Policy:
    """The configured policy: a checkpoint (model.path / train.init_from) or a tiny random one
    whose tokenizer is trained on the environment's texts (saved in the run directory)."""
    m = cfg.model
    path = cfg.train.init_from or m.path
    if path:
        return load_policy(path, dtype=m.dtype, mesh=mesh, compute_dtype=m.compute_dtype or None,
                           **m.decoder_options())
    from supo_jax.model.policy import load_tokenizer
    from supo_jax.model.tiny import tiny_config

    tok_dir = os.path.join(run_dir, "tokenizer") if run_dir else None
    fresh = not (tok_dir and os.path.isdir(tok_dir))
    _barrier("supo_jax:tokenizer:looked")   # every process looked before process 0 writes
    tok = None
    if fresh and (_is_main() or not tok_dir):
        tok = env_tokenizer(cfg, tok_dir)
    _barrier("supo_jax:tokenizer:written")  # the others load process 0's tokenizer
    if tok is None:
        tok = load_tokenizer(tok_dir)
    vocab = int(math.ceil(len(tok) / 8) * 8)
    mc = tiny_config(m.tiny_family, vocab_size=vocab, hidden=m.tiny_hidden, layers=m.tiny_layers,
                     heads=m.tiny_heads, kv_heads=m.tiny_kv_heads, mlp=m.tiny_mlp)
    return new_policy(mc, dtype=m.dtype, compute_dtype=m.compute_dtype or None, mesh=mesh,
                      seed=cfg.train.seed, tokenizer=tok, **m.decoder_options())


def model_signature(policy: Policy) -> dict:
    """The architecture fields a checkpoint must match (saved in the run directory)."""
    d = policy.config.to_hf_dict()
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim")
    return {k: d.get(k) for k in keys}


def model_fingerprint(policy: Policy) -> str:
    sig = model_signature(policy)
    return hashlib.sha1(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:16]


def check_prompt_fits(cfg: C.Config, fmt: ChatFormat, split: str = "train") -> None:
    """Fail at start (a ValueError naming context.working_context) when the first task's
    initial prompt, rendered with the policy's tokenizer, does not fit the working context."""
    from supo_jax.envs import make_env, make_tasks

    knobs = {**cfg.env.knobs, **(cfg.env.eval_knobs if split == "eval" else {})}
    task = make_tasks(cfg.env.name, split, 1, seed=cfg.env.seed, **knobs)[0]
    start_state(fmt, cfg.context, make_env(cfg.env.name).reset(task))


def row_len(cfg: C.Config, fmt: ChatFormat) -> int:
    return cfg.optim.max_row_len or cfg.context.row_bound(fmt)


def rollout_batch(policy, fmt, cfg: C.Config, tasks, *, seed: int, context=None, group_size=None,
                  sampling=None, progress=None):
    """Rollouts of `tasks` with the current policy (a fresh sampler: params changed).

    Multi-process (jax.process_count() = P > 1), per-process task sharding: every process
    calls this with the same tasks; process p runs only tasks[p::P] (rollout.rows sampler
    rows per process), on its own copy of the policy (process_local_policy: sampling on
    the global mesh would need every process to decode the same rows in lockstep). The
    rollouts are then exchanged (exchange_rollouts), so every process returns the same
    list of all rollouts, in (task, sample) order as in a single process; advantages,
    batches and metrics are then computed identically everywhere and each process feeds
    the train step only the batch rows of its own devices (place_batch). The exchange is
    host-side token ids and logprobs, small next to the parameters.
    """
    from supo_jax.envs import make_env

    ctx = context or cfg.context
    r = cfg.rollout
    sampling = sampling or SamplingParams(r.temperature, r.top_k, r.top_p)
    max_len = ctx.row_bound(fmt)
    g = group_size or r.group_size
    multi = jax.process_count() > 1
    mine = _share(tasks) if multi else tasks
    if multi:
        policy = process_local_policy(policy)
        seed = hash_seed(seed, jax.process_index())
    out = []
    if mine:
        rows = min(r.rows, len(mine) * g)
        actor = PolicyActor(policy, fmt, rows=rows, max_len=max_len, sampling=sampling, seed=seed)
        out = run_rollouts(actor, lambda: make_env(cfg.env.name), mine, fmt, ctx, group_size=g,
                           rows=rows, env_timeout_s=cfg.env.timeout_s, progress=progress)
    return exchange_rollouts(out) if multi else out


def process_local_policy(policy: Policy) -> Policy:
    """This process's full copy of a policy sharded over processes, on its own devices.

    The parameters are all-gathered over the global mesh (a jitted identity with
    replicated outputs); each process keeps the copy on its local devices, sharded over
    a mesh of them by the usual rules. A policy whose arrays all live on this process
    is returned as it is."""
    graphdef, params = policy.split()
    if policy.mesh is None or all(x.is_fully_addressable for x in jax.tree.leaves(params)):
        return policy
    from jax.sharding import NamedSharding, PartitionSpec as P

    full = jax.jit(lambda p: p, out_shardings=replicated(policy.mesh))(params)
    devices = jax.local_devices()
    mesh = make_mesh(1, -1, 1, devices=devices) if len(devices) > 1 else None

    def local(x):
        shards = [s.data for s in x.addressable_shards]
        if mesh is None:
            return shards[0]
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(mesh, P()), shards)

    model = nnx.merge(graphdef, jax.tree.map(local, full))
    if mesh is not None:
        shard_model(model, mesh)
    return Policy(model, policy.tokenizer, mesh)


def _allgather_json(obj) -> list:
    """`obj` (JSON-serializable) from every process, in process order."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32)))
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:data.size] = data
    every = np.asarray(multihost_utils.process_allgather(buf))
    return [json.loads(every[p, :int(n)].tobytes()) for p, n in enumerate(sizes.reshape(-1))]


def exchange_rollouts(mine: list) -> list:
    """All processes' rollouts (each ran _share(tasks)), in global (task, sample) order."""
    n = jax.process_count()
    out = []
    for p, rows in enumerate(_allgather_json([ro.to_json() for ro in mine])):
        for d in rows:
            ro = Rollout.from_json(d)
            out.append(dataclasses.replace(ro, group_id=p + ro.group_id * n))  # local -> global
    return sorted(out, key=lambda ro: (ro.group_id, ro.sample))


def place_batch(batch, mesh):
    """Multi-process: a batch every process holds in full, as global arrays sharded over the
    mesh's batch axes; each process transfers only the rows of its own devices."""
    if mesh is None or jax.process_count() == 1:
        return batch
    return jax.tree.map(lambda x: jax.make_array_from_callback(
        x.shape, batch_sharding(mesh, x.shape), lambda idx: x[idx]), batch)


class LineProgress:
    """Progress as plain log lines (when stderr is not a terminal, e.g. a log file): the
    tqdm calls the trainer makes (update, set_postfix, close), printed at most every
    `every` seconds and once at the end."""

    def __init__(self, total: int, desc: str, every: float = 30.0, stream=None):
        self.total, self.desc, self.every = total, desc, every
        self.stream = stream or sys.stderr
        self.n, self.postfix = 0, ""
        self.t0 = self.last = time.time()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.time() - self.last >= self.every:
            self._line()

    def set_postfix(self, **kw) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in kw.items())

    def _line(self) -> None:
        self.last = time.time()
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        print(f"{self.desc}: {self.n}/{self.total}{pct} {self.last - self.t0:.0f}s {self.postfix}"
              .rstrip(), file=self.stream, flush=True)

    def close(self) -> None:
        self._line()


def _bar(total, desc, enabled):
    """A progress bar on a terminal or in a notebook, plain periodic lines otherwise."""
    if not enabled or not _is_main():
        return None
    if not sys.stderr.isatty() and "ipykernel" not in sys.modules:
        return LineProgress(total, desc)
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


class MetricsLog:
    """metrics.jsonl (one object per step) + TensorBoard event files, process 0 only."""

    def __init__(self, run_dir: str, resume_step: int):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        self.kept: list[dict] = []   # rows of the steps before a resume
        if not _is_main():
            return
        kept = []
        if os.path.exists(self.path):  # drop rows of steps that will be replayed
            with open(self.path) as f:
                kept = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= resume_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        self.kept = [json.loads(ln) for ln in kept]
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


def check_run_dir(run_dir: str, policy: Policy, *, record: bool = False) -> None:
    """Refuse a run directory whose run.json names a different model, naming the directory
    and the architecture fields that differ; record=True writes run.json if absent."""
    meta = os.path.join(run_dir, "run.json")
    fp, sig = model_fingerprint(policy), model_signature(policy)
    old = None
    if os.path.exists(meta):
        with open(meta) as f:
            old = json.load(f)
    _barrier("supo_jax:run.json:read")   # every process read it before process 0 writes
    if old is not None and old.get("model_fingerprint") != fp:
        was = old.get("model") or {}
        diff = "; ".join(f"{k} {was[k]} there, {sig[k]} here" for k in sig
                         if k in was and was[k] != sig[k])
        raise ValueError(f"run directory {run_dir} holds a checkpoint of a different model "
                         f"({diff or 'model fingerprint ' + str(old.get('model_fingerprint'))}); "
                         "use another train.run_dir or that run's model settings")
    if old is None and record and _is_main():
        with open(meta, "w") as f:
            json.dump({"model_fingerprint": fp, "model": sig}, f, indent=2)


def check_resume_config(run_dir: str, cfg: C.Config, steps) -> None:
    """A run directory holding checkpoints resumes only with the settings that produced them
    (C.RESUMABLE_KEYS may change): otherwise a ConfigError lists the differences and the two
    ways on. With train.accept_config_change the saved config is kept as config.step<N>.json."""
    fn = os.path.join(run_dir, "config.json")
    if not steps or not os.path.exists(fn):
        return
    with open(fn) as f:
        saved = json.load(f)
    changes = C.config_changes(saved, cfg)
    if not changes:
        return
    if not cfg.train.accept_config_change:
        raise C.ConfigError(
            f"{run_dir} holds a run (checkpoint step {max(steps)}) made with other settings:\n  "
            + "\n  ".join(changes) + "\nstart a new run with another train.run_dir, or continue "
            "this one with the new settings: --set train.accept_config_change=true")
    if _is_main():
        os.replace(fn, os.path.join(run_dir, f"config.step{max(steps)}.json"))
        print(f"resuming {run_dir} with changed settings ({'; '.join(changes)}); the old "
              f"config is kept as config.step{max(steps)}.json")


def warm_start(policy, fmt, cfg: C.Config, progress=True) -> dict:
    """SFT on demonstrations (scripted experts by default). Returns a small report."""
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
            raise ValueError(f"the scripted expert solved none of {len(ro)} demonstration tasks "
                             f"under this context config (reasons: {summarize(ro)['reasons']}); "
                             "raise context.max_steps / max_summaries / working_context")
    else:
        from supo_jax.envs import make_env
        task = make_tasks(cfg.env.name, "train", 1, seed=cfg.env.seed, **cfg.env.knobs)[0]
        tools = [t.schema() for t in make_env(cfg.env.name).reset(task).tools]
        segs = jsonl_segments(fmt, s.demos, default_tools=tools)
        demo_success, report = float("nan"), {"sft_demos_file": s.demos}
    bar = _bar(s.steps, "sft", progress)
    hist = sft_train(policy, segs, steps=s.steps, lr=s.lr, batch_rows=s.batch_rows,
                     max_len=max_len, seed=cfg.train.seed,
                     progress=(lambda m: (bar.update(1), bar.set_postfix(loss=f"{m['loss']:.3f}")))
                     if bar else None)
    if bar:
        bar.close()
    return {"sft_segments": len(segs), "sft_demo_success": demo_success, **report,
            "sft_loss_first": hist[0]["loss"], "sft_loss_last": hist[-1]["loss"]}


def evaluate(policy, fmt, cfg: C.Config, *, max_summaries=None, tasks=None, seed: int = 0,
             progress=True) -> dict:
    """Success etc. on the held-out split with an optional summary cap: greedy (one rollout
    per task) by default, or train.eval_samples rollouts per task at train.eval_temperature."""
    import dataclasses

    from supo_jax.envs.datasets import load_tasks

    tasks = tasks or list(load_tasks(cfg.env.name, "eval", cfg.env.eval_tasks, seed=cfg.env.seed,
                                     **{**cfg.env.knobs, **cfg.env.eval_knobs}))
    ctx = cfg.context if max_summaries is None else dataclasses.replace(
        cfg.context, max_summaries=int(max_summaries))
    t = cfg.train
    g = t.eval_samples if t.eval_temperature > 0 else 1
    bar = _bar(len(_share(tasks)) * g, f"eval S={ctx.max_summaries}", progress)
    ro = rollout_batch(policy, fmt, cfg, tasks, seed=seed, context=ctx, group_size=g,
                       sampling=SamplingParams(t.eval_temperature),
                       progress=bar.update if bar else None)
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
    B = cfg.rollout.tasks_per_step
    if jax.process_count() > 1:
        print(f"process {jax.process_index()} of {jax.process_count()}: mesh "
              f"{dict(mesh.shape) if mesh else None} over {jax.device_count()} devices; "
              f"rollouts of {len(_share(range(B)))} of the {B} tasks of each step", flush=True)
    policy = build_policy(cfg, run_dir, mesh)
    fmt = ChatFormat(policy.tokenizer)
    check_prompt_fits(cfg, fmt)
    fp = model_fingerprint(policy)
    check_run_dir(run_dir, policy, record=True)
    ckpts = RunCheckpoints(os.path.join(run_dir, "checkpoints"), keep=cfg.train.keep)
    check_resume_config(run_dir, cfg, ckpts.steps())
    if _is_main():
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(C.to_dict(cfg), f, indent=2, default=str)

    o = cfg.optim
    tx = make_optimizer(o.lr, schedule=o.schedule, warmup_steps=o.warmup_steps,
                        total_steps=cfg.train.steps, weight_decay=o.weight_decay,
                        clip_norm=o.clip_norm)
    graphdef, params = policy.split()
    opt_state = init_opt_state(tx, params, mesh)
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
    if cfg.train.eval_before:   # the starting policy; a resumed run reads it back (process 0)
        row = next((r for r in metrics_log.kept if r["step"] == 0 and "loss" not in r), None)
        if row:
            report["eval_before"] = {k[5:]: v for k, v in row.items() if k.startswith("eval/")}
        elif start == 0:
            report["eval_before"] = evaluate(policy, fmt, cfg, seed=cfg.train.seed,
                                             progress=cfg.train.progress)
            metrics_log.write({"step": 0, **_eval_row(report["eval_before"])})

    from supo_jax.envs.datasets import load_tasks
    train_tasks = load_tasks(cfg.env.name, "train", cfg.env.train_tasks, seed=cfg.env.seed,
                             **cfg.env.knobs)   # a tfds array_record task set, built on first use
    max_len = row_len(cfg, fmt)
    # the loss's logprobs use the convention of the sampler that produced the old logprobs
    loss_cfg = dataclasses.replace(cfg.loss, temperature=cfg.rollout.temperature or 1.0)
    history = []
    outer = _bar(cfg.train.steps - start, "train", cfg.train.progress)
    for step in range(start, cfg.train.steps):
        t0 = time.time()
        pos = (step * B) % len(train_tasks)
        tasks = [train_tasks[(pos + i) % len(train_tasks)] for i in range(B)]
        bar = _bar(len(_share(tasks)) * cfg.rollout.group_size, f"rollouts {step + 1}",
                   cfg.train.progress)
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
                batch = dataclasses.replace(batch, old_logp=host_array(recompute_logprobs(
                    graphdef, params, place_batch(batch, mesh), loss_cfg)))
            rng = np.random.default_rng(hash_seed(cfg.train.seed, step) + 1)
            ms = []
            for _ in range(o.ppo_epochs):
                perm = rng.permutation(batch.rows)
                for i in range(0, batch.rows, o.minibatch_rows):
                    mb = place_batch(batch.take(perm[i:i + o.minibatch_rows]), mesh)
                    params, opt_state, m = train_step(graphdef, params, opt_state, mb, tx=tx,
                                                      cfg=loss_cfg, micro=o.micro)
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
            metrics_log.write({"step": step + 1, **_eval_row(ev)})
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
    policy.save_pretrained(export)   # collective gathers; process 0 writes
    result["export"] = export
    return result


def _eval_row(ev: dict) -> dict:
    return {f"eval/{k}": v for k, v in ev.items() if isinstance(v, (int, float))}


def init_opt_state(tx, params, mesh):
    """Optimizer state with every leaf placed: moments follow their parameters' shardings,
    scalars (step counts) are replicated over the mesh (restores then match exactly)."""
    opt_state = tx.init(params)
    if mesh is None:
        return opt_state
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
                        else put(x, replicated(mesh)), opt_state)


def hash_seed(seed: int, step: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:4], "little")


def summarize_scalars(rollouts) -> dict:
    s = summarize(rollouts)
    return {k: v for k, v in s.items() if isinstance(v, (int, float))}


def summary_table(history: list[dict], final: dict | None = None,
                  before: dict | None = None) -> str:
    """A terminal table: the eval before training, the first / last step, the final eval."""
    keys = ["success_rate", "reward_mean", "loss", "p_summary", "summaries_mean", "tool_calls_mean",
            "working_context_mean", "working_context_max", "effective_context_mean",
            "overlong_rate", "summary_state_share",
            "rollout_seconds", "update_seconds"]
    if not history:
        return "(no steps run)"
    cols = ([("eval before", before)] if before else []) + [
        (f"step {history[0]['step']}", history[0]), (f"step {history[-1]['step']}", history[-1])
    ] + ([("eval after" if before else "eval", final)] if final else [])

    def cell(d, k):
        v = d.get(k) if d else None
        return f"{v:12.3f}" if isinstance(v, (int, float)) else f"{'-':>12s}"
    lines = [f"{'metric':28s}" + "".join(f" {name:>12s}" for name, _ in cols)]
    for k in keys:
        lines.append(f"{k:28s}" + "".join(f" {cell(d, k)}" for _, d in cols))
    return "\n".join(lines)
