"""`supo-jax` command line. Every command fails fast with one clear line on bad input."""
from __future__ import annotations

import argparse
import math
import sys


def _cmd_generate(args) -> None:
    import jax

    from supo_jax.model.policy import load_policy
    from supo_jax.sampling.sampler import Sampler, SamplingParams

    policy = load_policy(args.model, dtype=args.dtype)
    tok = policy.tokenizer
    if tok is None:
        raise ValueError(f"{args.model} has no tokenizer files; cannot render a prompt")
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    stops = policy.eos_ids | {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>",)
                              if t in tok.get_vocab()}
    sampler = Sampler(policy, batch=1, max_len=len(ids) + args.max_new_tokens)
    sampler.append({0: ids})
    out = sampler.generate([0], args.max_new_tokens, stops,
                           SamplingParams(temperature=args.temperature), jax.random.key(args.seed))
    print(tok.decode(out[0].tokens, skip_special_tokens=True))


def _cmd_export(args) -> None:
    from supo_jax.model.policy import load_policy

    policy = load_policy(args.model, dtype=args.dtype)
    policy.save_pretrained(args.out)
    print(f"wrote {args.out} ({policy.config.num_params / 1e6:.1f}M parameters)")


def _config(args, announce: bool = True):
    """The command's config; its first line of output names it (unless `announce` is false:
    the caller names what it runs). With --print-config: print the resolved settings
    (departures from the paper's algorithm marked) and exit."""
    from supo_jax.config import describe, load_config

    if announce:
        print(describe(args.config), flush=True)
    cfg = load_config(args.config, args.set or [])
    _no_summarizer(cfg)
    if announce and getattr(args, "print_config", False):
        _print_config(cfg)
    return cfg


def _harness_mode(cfg):
    """Harness mode's sessions server for the command's rollouts where env.harness is set."""
    import contextlib

    if not cfg.env.harness:
        return contextlib.nullcontext()
    from supo_jax.serve.harness import harness_mode
    return harness_mode(cfg)


def _no_summarizer(cfg) -> None:
    """No command has a second (summarizer) policy: frozen_summarizer is the Python API's."""
    from supo_jax.config import ConfigError

    if cfg.context.manager == "frozen_summarizer":
        raise ConfigError("context.manager=frozen_summarizer writes summaries with a separate "
                          "frozen policy, which no supo-jax command has: the Python API "
                          "(supo_jax.agent.rollout.run_rollouts(..., summarizer=...)) runs it")


def _print_config(cfg) -> None:
    from supo_jax.config import format_config

    print(format_config(cfg, _resolved_limit(cfg)))
    raise SystemExit(0)


def _resolved_limit(cfg):
    """L for cfg's tokenizer (the tiny policy's, or model.path's); None when it cannot be had."""
    from supo_jax.agent.render import ChatFormat

    try:
        if cfg.model.path:
            from supo_jax.model.policy import load_tokenizer
            tok = load_tokenizer(cfg.model.path)
        else:
            from supo_jax.rl.runs import env_tokenizer
            tok = env_tokenizer(cfg)
        return cfg.context.limit(ChatFormat(tok))
    except Exception:   # noqa: BLE001  (no tokenizer at hand: the settings alone are printed)
        return None


def _run_config(args):
    """eval's config: the run directory's saved config.json (the settings its checkpoints were
    trained with) with this command's --set overrides on top, or the command's own config where
    the directory has none. A --config file whose settings differ from the saved ones is an
    error that lists the differences."""
    import dataclasses

    from supo_jax.config import (ConfigError, apply_overrides, config_changes, describe,
                                 from_dict, saved_config)
    from supo_jax.storage import join

    cfg = _config(args, announce=False)
    fn = join(cfg.train.run_dir, "config.json")
    saved = saved_config(cfg.train.run_dir)
    if saved is None:
        print(describe(args.config), flush=True)
        if args.print_config:
            _print_config(cfg)
        return cfg
    try:
        base = from_dict(saved)
    except (ConfigError, TypeError, AttributeError) as e:
        raise ConfigError(f"{fn} is not a readable run config ({e})") from None
    if args.config:   # the file's settings and this command's --set keys against the saved
        keys = ["train.run_dir"] + [o.split("=", 1)[0].strip() for o in args.set or []]
        keys += ["env.knobs", "env.eval_knobs"] if "env.name" in keys else []
        changes = [c for c in config_changes(saved, cfg) if not any(
            c.startswith(k + ":") or c.startswith(k + ".") or k.startswith(c.split(":")[0] + ".")
            for k in keys)]
        if changes:
            raise ConfigError(
                f"{cfg.train.run_dir} was trained with settings other than {args.config}'s:\n  "
                + "\n  ".join(changes) + "\neval uses the run's saved settings (config.json): "
                "leave out --config, and --set only what the evaluation should change")
    base = dataclasses.replace(base, train=dataclasses.replace(base.train,
                                                               run_dir=cfg.train.run_dir))
    print(f"config: {fn} (the run's settings)"
          + (f" with {', '.join(args.set)}" if args.set else ""))
    cfg = apply_overrides(base, args.set or [])
    if args.print_config:
        _print_config(cfg)
    return cfg


def _cmd_train(args) -> None:
    from supo_jax.rl.metrics import summary_table
    from supo_jax.rl.trainer import Preempted, train

    import jax

    cfg = _config(args)
    try:
        with _harness_mode(cfg):
            out = train(cfg)
    except Preempted as e:
        print(f"supo-jax train: {e}", file=sys.stderr)
        raise SystemExit(143) from None    # 128 + SIGTERM: the run did not finish
    except KeyboardInterrupt:
        from supo_jax import storage
        ck = storage.join(cfg.train.run_dir, "checkpoints")
        steps = [int(d) for d in (storage.listdir(ck) if storage.isdir(ck) else [])
                 if d.isdigit()]
        raise KeyboardInterrupt(f"checkpoint step {max(steps)} of {cfg.train.steps}" if steps
                                else "no checkpoint yet: a rerun starts the run over") from None
    if jax.process_index() > 0:   # process 0 reports and logs; the others state their losses
        print(f"process {jax.process_index()} of {jax.process_count()}: losses by step "
              f"{[h['loss'] for h in out['history']]}; logs and reports come from process 0")
        return
    print(summary_table(out["history"], out["eval"], out.get("eval_before")))
    from supo_jax.storage import join
    print(f"logs: {join(cfg.train.run_dir, 'metrics.jsonl')} and "
          f"{join(cfg.train.run_dir, 'tb')} (TensorBoard events: pip install tensorboard, "
          f"then tensorboard --logdir {cfg.train.run_dir}); "
          f"checkpoints: {join(cfg.train.run_dir, 'checkpoints')}; "
          f"HF export: {out.get('export')}"
          + (f"; PEFT adapter: {out['peft']}" if out.get("peft") else ""))


def _restore_policy(cfg, mesh=None):
    """The run's latest policy (checkpoint in run_dir) or the configured one; a
    FileNotFoundError when there is neither."""
    from supo_jax import storage
    from supo_jax.checkpoint import RunCheckpoints
    from supo_jax.rl.runs import build_policy, check_run_dir

    ck = storage.join(cfg.train.run_dir, "checkpoints")
    mgr = RunCheckpoints(ck) if storage.isdir(ck) else None
    steps = mgr.steps() if mgr else []
    if not (steps or cfg.model.path or cfg.train.init_from):
        raise FileNotFoundError(f"no checkpoint in {ck} and no model.path / train.init_from: "
                                "nothing to evaluate (point train.run_dir at a trained run)")
    policy = build_policy(cfg, cfg.train.run_dir, mesh)
    check_run_dir(cfg.train.run_dir, policy)
    if steps:
        from flax import nnx
        from supo_jax.rl.train_step import trainable
        # a checkpoint holds the trained parameters (with LoRA the adapters: the base is
        # the one build_policy made from the same settings)
        nnx.update(policy.model, mgr.restore_params(steps[-1], trainable(policy.split()[1])))
        print(f"policy: {ck} step {steps[-1]}")
    if mgr:
        mgr.close()
    return policy


def _cmd_eval(args) -> None:
    import json

    import jax

    from supo_jax import storage
    from supo_jax.agent.render import ChatFormat
    from supo_jax.rl.runs import check_prompt_fits
    from supo_jax.rl.trainer import evaluate_caps, expert_ceiling
    from supo_jax.utils import json_safe

    cfg = _run_config(args)
    policy = _restore_policy(cfg)
    fmt = ChatFormat(policy.tokenizer)
    check_prompt_fits(cfg, fmt, "eval")
    expert_ceiling(cfg, fmt)     # one line when the ideal agent solves none at these settings
    caps = args.max_summaries or [None]
    with _harness_mode(cfg):
        rows = evaluate_caps(policy, fmt, cfg, caps, seed=cfg.train.seed)
    keys = ["max_summaries", "success_rate", "summaries_mean", "tool_calls_mean",
            "working_context_mean", "effective_context_mean", "overlong_rate"]
    print(" | ".join(f"{k:>20s}" for k in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:>20.3f}" if isinstance(r[k], float) else f"{r[k]:>20}" for k in keys))
    out = storage.join(cfg.train.run_dir, "eval_scaling.json")
    if jax.process_index() == 0:   # multi-process: every process has the same rows
        storage.makedirs(cfg.train.run_dir)
        storage.write_text(out, json.dumps(json_safe(rows), indent=2, allow_nan=False))
    print(f"saved {out}")


def _cmd_sft(args) -> None:
    from supo_jax import storage
    from supo_jax.agent.render import ChatFormat
    from supo_jax.rl.runs import build_policy, check_prompt_fits, check_run_dir, save_policy
    from supo_jax.rl.trainer import warm_start

    cfg = _config(args)
    storage.makedirs(cfg.train.run_dir)
    policy = build_policy(cfg, cfg.train.run_dir)
    check_run_dir(cfg.train.run_dir, policy)
    fmt = ChatFormat(policy.tokenizer)
    check_prompt_fits(cfg, fmt)
    report = warm_start(policy, fmt, cfg)
    out = storage.join(cfg.train.run_dir, "sft")
    save_policy(policy, cfg, out, out + "_peft")
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in report.items() if v == v))   # nan: no figure (JSONL demos)
    print(f"saved {out} (use it with --set train.init_from={out})"
          + (f"; the adapters alone: {out}_peft (train.init_from={out}_peft continues them)"
             if policy.model.lora is not None else ""))


def _cmd_rollout(args) -> None:
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import summarize, write_jsonl
    from supo_jax.config import describe, load_config
    from supo_jax.envs import make_tasks
    from supo_jax.envs.experts import has_expert
    from supo_jax.rl.runs import check_prompt_fits

    # env.name first: task knobs belong to the config's own environment (apply_overrides)
    sets = [f"env.name={args.env}", f"context.manager={args.context}", *(args.set or [])]
    if args.policy != "scripted":
        sets.append(f"model.path={args.policy}")
    else:   # no warm start here (validate would ask for SFT demonstrations); same tokenizer
        sets.append("train.sft_warm_start=false")
    print(describe(args.config), flush=True)
    cfg = load_config(args.config, sets)
    _no_summarizer(cfg)
    if args.print_config:
        _print_config(cfg)
    if args.policy == "scripted" and not has_expert(cfg.env.name):
        raise ValueError(f"--policy scripted: environment {cfg.env.name!r} has no scripted expert "
                         "(register one with supo_jax.envs.experts.register_expert, or pass "
                         "--policy PATH to roll out a model)")
    tasks = make_tasks(cfg.env.name, args.split, args.num, seed=cfg.env.seed, **cfg.env.knobs)
    if args.policy == "scripted":
        from supo_jax.rl.runs import env_tokenizer
        from supo_jax.rl.trainer import scripted_rollouts
        fmt = ChatFormat(env_tokenizer(cfg))   # the tokenizer a tiny policy of this config has
        check_prompt_fits(cfg, fmt, args.split)
        ro, actor = scripted_rollouts(cfg, fmt, tasks)
        if not summarize(ro)["success_rate"]:
            from supo_jax.rl.trainer import solved_none_line
            print(solved_none_line(cfg, ro, actor, fmt) + ": change those settings (--set) or "
                  "the task's knobs (--set 'env.knobs.size=...')", flush=True)
    else:
        from supo_jax.rl.runs import build_policy
        from supo_jax.rl.trainer import rollout_batch
        policy = build_policy(cfg)
        if policy.tokenizer is None:
            raise ValueError(f"{args.policy} has no tokenizer")
        fmt = ChatFormat(policy.tokenizer)
        check_prompt_fits(cfg, fmt, args.split)
        from supo_jax.rl.trainer import expert_ceiling
        ceiling = expert_ceiling(cfg, fmt)
        with _harness_mode(cfg):
            ro = rollout_batch(policy, fmt, cfg, tasks, seed=cfg.train.seed, group_size=1)
    s = summarize(ro)
    if args.policy != "scripted" and ceiling:
        s["expert_success_rate"] = ceiling["expert_success_rate"]
    own = {"clear": ("cleared_mean", "clear_exhausted_mean", "states_mean"),
           "state": ("states_mean",), "fold": ("folds_mean",)}
    for k in ("rollouts", "success_rate", "steps_mean", "tool_calls_mean", "summaries_mean",
              *own.get(cfg.context.manager, ()), "working_context_mean", "working_context_max",
              "effective_context_mean", "summary_state_share", "observation_cut_rate", "reasons",
              *(k for k in s if k.startswith("harness_")),
              *(("expert_success_rate",) if "expert_success_rate" in s else ())):
        v = s[k]
        print(f"{k:24s} {'-' if isinstance(v, float) and math.isnan(v) else v}")
    if s["observation_cut_rate"] > 0.5:
        print(f"note: context.max_observation_tokens={cfg.context.max_observation_tokens} cut "
              f"{100 * s['observation_cut_rate']:.0f}% of the observations of {args.env}; raise "
              "it (--set context.max_observation_tokens=N) for the manager to see them whole")
    if args.out:
        write_jsonl(ro, args.out)
        print(f"wrote {args.out}")


def _is_run_dir(path: str) -> bool:
    """A supo_jax run directory (what train writes: run.json, checkpoints/), not a model."""
    from supo_jax import storage

    return storage.isdir(path) and (storage.isfile(storage.join(path, "run.json"))
                                    or storage.isdir(storage.join(path, "checkpoints")))


def _serve_policy(path: str, dtype: str):
    """The policy `path` names, as eval and rollout take one: a run directory (its latest
    checkpoint under the run's saved settings, as eval restores it), or a model (an HF
    directory, a .gguf file, a Hub id or a PEFT adapter directory: load_policy)."""
    import dataclasses

    from supo_jax.config import from_dict, load_config, saved_config
    from supo_jax.model.policy import load_policy

    if not _is_run_dir(path):
        return load_policy(path, dtype=dtype)
    saved = saved_config(path)
    cfg = from_dict(saved) if saved else load_config(None, [f"train.run_dir={path}"])
    return _restore_policy(dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, run_dir=path)))


# the context a server holds by default (a model's own limit is often 32K-128K tokens: a KV
# cache of rows x that many tokens is more than most hosts hold)
SERVE_MAX_LEN = 4096


def _cmd_serve(args) -> None:
    import os

    from supo_jax.agent.render import ChatFormat
    from supo_jax.serve.app import Server, listen, serve, url_of
    from supo_jax.serve.engine import Engine

    sock = listen(args.host, args.port)     # a port in use fails before the model loads
    if args.policy == "scripted":
        return _serve_scripted(args, sock)
    if args.env or args.tokenizer:
        raise ValueError("--env and --tokenizer go with --policy scripted (a model brings its "
                         "own tokenizer)")
    policy = _serve_policy(args.policy, args.dtype)
    if policy.tokenizer is None:
        raise ValueError(f"{args.policy} has no tokenizer files; cannot render chat prompts")
    max_len = args.max_len or min(policy.config.max_position_embeddings, SERVE_MAX_LEN)
    engine = Engine(policy, rows=args.rows, max_len=max_len, queue=args.queue)
    name = args.served_model_name or args.policy
    key = args.api_key or os.environ.get("SUPO_JAX_API_KEY", "")
    print(f"serving {name} on {url_of(sock)}/v1 ({args.rows} rows of {max_len} tokens"
          f"{', API key required' if key else ''})", flush=True)
    serve(Server(engine, ChatFormat(policy.tokenizer), name, key), sock)


def _serve_scripted(args, sock) -> None:
    """--policy scripted: the environment's scripted expert answers (serve/scripted.py)."""
    import os

    from supo_jax.agent.render import ChatFormat
    import supo_jax.envs  # noqa: F401  (registers the built-in environments and experts)
    from supo_jax.envs.experts import expert_for, has_expert
    from supo_jax.model.policy import load_tokenizer
    from supo_jax.serve.app import Server, serve, url_of
    from supo_jax.serve.scripted import ScriptedEngine

    if not args.env or not args.tokenizer:
        raise ValueError("--policy scripted needs --env NAME (whose scripted expert answers) "
                         "and --tokenizer DIR (the tokenizer clients count tokens with)")
    if not has_expert(args.env):
        raise ValueError(f"--policy scripted: environment {args.env!r} has no scripted expert")
    fmt = ChatFormat(load_tokenizer(args.tokenizer))
    max_len = args.max_len or SERVE_MAX_LEN
    engine = ScriptedEngine(expert_for(args.env), fmt, max_len, rows=args.rows,
                            queue_limit=args.queue)
    name = args.served_model_name or args.policy
    key = args.api_key or os.environ.get("SUPO_JAX_API_KEY", "")
    print(f"serving {name} on {url_of(sock)}/v1 (the scripted expert of {args.env}; prompts "
          f"of up to {max_len} tokens{', API key required' if key else ''})", flush=True)
    serve(Server(engine, fmt, name, key), sock)


def _cmd_sweep(args) -> None:
    from supo_jax import storage, sweep

    if storage.isfile(args.out):
        raise ValueError(f"--out {args.out}: is a file, not a directory")
    host, hosts = (_env_int("SUPO_JAX_SWEEP_HOST", args.host_index),
                   _env_int("SUPO_JAX_SWEEP_HOSTS", args.host_count))
    if not 0 <= host < hosts:   # said before the configs load
        raise ValueError(f"--host-index {host} is not in [0, --host-count {hosts}) (or "
                         "SUPO_JAX_SWEEP_HOST, SUPO_JAX_SWEEP_HOSTS)")
    points = sweep.points(sweep.parse_grid(args.grid or []))
    runs = sweep.plan(args.config, points, args.seeds, args.out, overrides=args.set or [])
    print(f"sweep: {len(points)} grid points x {len(args.seeds)} seeds = {len(runs)} runs in "
          f"{args.out}")
    if not args.collect_only:
        sweep.run_sweep(runs, host_index=host, host_count=hosts)
    rep = sweep.report(runs, args.out)
    if not any(r["seeds"] for r in rep["rows"]):
        print(f"no run of this sweep has finished yet in {args.out}")
    print(rep["markdown"])
    print(f"table: {storage.join(args.out, 'sweep.md')}; plot: {rep['plot']}")


def _env_int(name: str, default: int) -> int:
    """An integer environment variable that overrides a flag (default: the flag's value)."""
    import os

    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r}: expected an integer") from None


def _cmd_plan(args) -> None:
    import json

    from supo_jax.plan import COMPARISONS, format_plan, plan
    from supo_jax.utils import json_safe

    cfg = _config(args)
    rep = plan(cfg, args.topology, model_config=args.model_config, host_copy=args.host_copy,
               training_layout=args.training_layout, dump=args.dump, segments=args.segments,
               generated_tokens=args.generated_tokens)
    print(format_plan(rep))
    if args.json:
        from supo_jax.utils import provenance
        from supo_jax import storage
        storage.write_text(args.json, json.dumps(json_safe({**rep, "provenance": provenance()}),
                                                 indent=2, allow_nan=False))
        print(f"wrote {args.json}")
    bad = [n for n, p in rep["programs"].items() if not p["fits"] and n not in COMPARISONS]
    bad += [f"the {n} phase" for n, ph in rep["phases"].items() if not ph["fits"]]
    if bad:
        print(f"supo-jax plan: {', '.join(bad)} "
              f"{'does' if len(bad) == 1 else 'do'} not fit (or compile) on {args.topology}",
              file=sys.stderr)
        raise SystemExit(1)


_EXAMPLES = {
    "train": "supo-jax train                       # the CPU recipe (supo_jax/configs/cpu_recipe.py)\n"
             "supo-jax train --print-config        # its settings, departures from the paper marked\n"
             "supo-jax train --config experiments/configs/paper_fncall_supo.py "
             "--set model.path=/ckpt/Qwen2.5-7B-Instruct\n"
             "supo-jax train --set context=full --set train.run_dir=runs/full   # the GRPO baseline",
    "eval": "supo-jax eval --set train.run_dir=runs/default --max-summaries 0,2,4,8",
    "sft": "supo-jax sft --set sft.demos=demos.jsonl --set train.run_dir=runs/x",
    "sweep": "supo-jax sweep --grid context.manager=supo,full --seeds 0,1,2 --out runs/sweep",
    "rollout": "supo-jax rollout --env fncall/count --policy scripted --context full --num 64",
    "generate": "supo-jax generate --model HuggingFaceTB/SmolLM2-135M-Instruct --prompt 'Hi'",
    "export": "supo-jax export --model model.gguf --out out/model",
    "serve": "supo-jax serve --policy runs/default --port 8000\n"
             "supo-jax serve --policy /ckpt/Qwen2.5-7B-Instruct --rows 16 --max-len 8192 "
             "--served-model-name qwen",
    "plan": "supo-jax plan --topology v5litepod-4 --model-config tiny   # the CPU recipe\n"
            "supo-jax plan --config experiments/configs/paper_fncall_supo.py --topology v5p-32 "
            "--model-config /ckpt/Qwen2.5-7B-Instruct --json plan.json",
}


def _sub(sub, name: str, help_: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_, description=help_,
                          epilog="example:\n  " + _EXAMPLES[name].replace("\n", "\n  "),
                          formatter_class=_Formatter)


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line, like every other error of a command (exit status 2); --help
    has the usage argparse would print."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _count(text: str) -> int:
    """argparse type: a positive integer (a bad one names its flag before anything loads)."""
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _size(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return n


def int_list(text: str) -> list[int]:
    """argparse type: a comma list of integers >= 0 ('0,2,4'); '' is the empty list."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = None
    if out is None or any(n < 0 for n in out):
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 0 (e.g. 0,2,4), "
                                         f"got {text!r}")
    return out


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help lines (where there is one to show), examples as written."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.required:
            return action.help
        return super()._get_help_string(action)


def _config_args(c: argparse.ArgumentParser, config: str = "default: the CPU recipe",
                 sets: str = "override a config field, e.g. --set optim.lr=1e-5 (repeatable; "
                 "--print-config lists the keys)") -> None:
    c.add_argument("--config", default=None, metavar="FILE", help="a config file "
                   "(experiments/configs/NAME.py defining config()) or a run directory / its "
                   f"config.json; {config}")
    c.add_argument("--set", action="append", metavar="KEY=VALUE", help=sets)
    c.add_argument("--print-config", action="store_true",
                   help="print the resolved settings (departures from the paper's "
                   "algorithm marked) and exit")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="supo-jax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = _sub(sub, "generate", "chat-generate with a policy (HF directory, .gguf or Hub id)")
    g.add_argument("--model", required=True, metavar="PATH", help="HF directory, .gguf file "
                   "or Hub id")
    g.add_argument("--prompt", default="What is the capital of France?", help="the user turn")
    g.add_argument("--max-new-tokens", type=_count, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--dtype", default="float32", help="parameter dtype: float32 | bfloat16")
    g.set_defaults(fn=_cmd_generate)
    e = _sub(sub, "export", "load a policy (e.g. a .gguf) and write it as HF safetensors")
    e.add_argument("--model", required=True, metavar="PATH", help="HF directory, .gguf file "
                   "or Hub id")
    e.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    e.add_argument("--dtype", default="float32", help="parameter dtype: float32 | bfloat16")
    e.set_defaults(fn=_cmd_export)
    for name, fn, help_ in (("train", _cmd_train, "SUPO RL training; rerunning resumes"),
                            ("eval", _cmd_eval, "evaluate a run's policy on the held-out split"),
                            ("sft", _cmd_sft, "SFT warm start on demonstrations -> run_dir/sft")):
        c = _sub(sub, name, help_)
        if name == "eval":
            _config_args(c, "checked against the run's saved settings (a difference is an "
                         "error listing them); default: the run's saved settings "
                         "(train.run_dir's config.json)", "what the evaluation changes, e.g. "
                         "train.run_dir, env.eval_tasks (repeatable)")
        else:
            _config_args(c)
        if name == "eval":
            c.add_argument("--max-summaries", type=int_list, default="", metavar="LIST",
                           help="summary caps to evaluate, a comma list (e.g. 0,2,4,8), one "
                           "table row each; default: the run's own cap (context.max_summaries)")
        c.set_defaults(fn=fn)
    w = _sub(sub, "sweep", "train a grid of overrides x seeds; one table and plots")
    w.add_argument("--config", default=None, metavar="FILE", help="the base config file; "
                   "default: the CPU recipe")
    w.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="a key and its values "
                   "(repeatable: the grid is their product)")
    w.add_argument("--seeds", type=int_list, default="0", metavar="LIST", help="comma list of "
                   "train.seed values, e.g. 0,1,2")
    w.add_argument("--set", action="append", metavar="KEY=VALUE", help="fixed overrides for "
                   "every run (repeatable)")
    w.add_argument("--out", default="runs/sweep", metavar="DIR", help="where the runs and the "
                   "table go")
    w.add_argument("--host-index", type=int, default=0, metavar="I", help="this host's share "
                   "of the runs (or SUPO_JAX_SWEEP_HOST)")
    w.add_argument("--host-count", type=_count, default=1, metavar="N", help="hosts sharing the "
                   "sweep (or SUPO_JAX_SWEEP_HOSTS)")
    w.add_argument("--collect-only", action="store_true", help="only write the table from the "
                   "finished runs")
    w.set_defaults(fn=_cmd_sweep)
    r = _sub(sub, "rollout", "run rollouts and print their statistics (and write them as JSONL)")
    r.add_argument("--env", required=True, metavar="NAME", help="a registered environment "
                   "(env.name), e.g. fncall/count")
    r.add_argument("--policy", default="scripted", metavar="scripted|PATH", help="'scripted' "
                   "(the environment's expert) or a model: HF directory, .gguf or Hub id")
    r.add_argument("--context", default="supo", metavar="MANAGER", help="context.manager: "
                   "supo | full | truncate | window | clear | state | fold")
    _config_args(r, sets="an override (repeatable; applied after --env and --context)")
    r.add_argument("--num", type=_count, default=8, metavar="N", help="tasks to roll out (one "
                   "rollout each)")
    r.add_argument("--split", default="eval", metavar="eval|train", help="task split")
    r.add_argument("--out", default=None, metavar="FILE.jsonl", help="write the rollouts "
                   "(JSONL: transcripts, segments; usable as sft.demos) to this file")
    r.set_defaults(fn=_cmd_rollout)
    v = _sub(sub, "serve", "serve a policy behind an OpenAI-compatible HTTP API "
             "(/v1/chat/completions, /v1/completions)")
    v.add_argument("--policy", required=True, metavar="PATH", help="a run directory (its "
                   "latest checkpoint), an HF directory, .gguf file, Hub id or PEFT adapter; "
                   "'scripted': the scripted expert of --env answers (ChatML prompts)")
    v.add_argument("--env", default=None, metavar="NAME", help="with --policy scripted: the "
                   "environment whose expert answers")
    v.add_argument("--tokenizer", default=None, metavar="DIR", help="with --policy scripted: "
                   "an HF tokenizer directory (its chat template renders the chats)")
    v.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: "
                   "every interface)")
    v.add_argument("--port", type=_size, default=8000, help="the port (0: a free one)")
    v.add_argument("--api-key", default=None, metavar="KEY", help="the key clients must send "
                   "(Authorization: Bearer KEY); default: $SUPO_JAX_API_KEY, else none")
    v.add_argument("--rows", type=_count, default=8, metavar="N", help="requests (choices) "
                   "decoded at once: the sampler's rows")
    v.add_argument("--max-len", type=_count, default=None, metavar="TOKENS", help="the "
                   "context of a row (prompt + completion); default: the model's, at most "
                   f"{SERVE_MAX_LEN}")
    v.add_argument("--queue", type=_size, default=None, metavar="N", help="requests that may "
                   "wait for a row beyond that (more: 429); default: 4 x --rows")
    v.add_argument("--served-model-name", default=None, metavar="NAME", help="the model name "
                   "clients ask for; default: --policy as given")
    v.add_argument("--dtype", default="float32", help="parameter dtype: float32 | bfloat16")
    v.set_defaults(fn=_cmd_serve)
    n = _sub(sub, "plan", "compile the run's train step, prefill and decode ahead of time for a "
             "TPU slice (no TPU needed: libtpu) and report memory per chip, flops, est. time")
    _config_args(n)
    n.add_argument("--topology", required=True, metavar="NAME", help="a TPU slice as gcloud names accelerator "
                   "types, e.g. v4-8, v5litepod-16, v5p-8, v6e-8 (supo_jax.plan.TOPOLOGIES)")
    n.add_argument("--model-config", default=None, metavar="DIR", help="a directory holding the "
                   "model's HF config.json (no weights needed); default: model.path's; 'tiny': "
                   "the config's tiny test policy")
    n.add_argument("--dump", default=None, metavar="DIR", help="write each program's compiled "
                   "HLO text to DIR/NAME.hlo.txt")
    n.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    n.add_argument("--host-copy", action="store_true", help="also compile the decode as a "
                   "per-host copy of the policy would run it (one host's chips holding the whole "
                   "policy), for comparison with sampling on the serving layout; not counted in "
                   "the exit status")
    n.add_argument("--training-layout", action="store_true", help="also compile the decode on "
                   "the training layout (the parameters as training shards them), for comparison "
                   "with the serving layout; not counted in the exit status")
    n.add_argument("--segments", type=int, default=None, metavar="K", help="segments (rows) a "
                   "rollout makes, for the predicted RL step (default: S + 1, the cap)")
    n.add_argument("--generated-tokens", type=int, default=None, metavar="N", help="tokens a "
                   "rollout generates, for the predicted RL step (default: the caps: H actions "
                   "and S summaries at their budgets, at most the rows' tokens)")
    n.set_defaults(fn=_cmd_plan)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from supo_jax.utils import enable_compile_cache, maybe_init_distributed

    enable_compile_cache()
    try:
        several = args.command in ("train", "eval", "sft") and maybe_init_distributed()
    except ValueError as e:     # SUPO_JAX_HEARTBEAT_S
        print(f"supo-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    try:
        code, said = _run(args)
    except BaseException as e:   # SystemExit (143: preempted), or an error not expected
        if not several:
            raise
        code, said = (e.code, None) if isinstance(e, SystemExit) else (1, repr(e))
        if not isinstance(e, SystemExit):
            import traceback
            traceback.print_exc()
    if several:    # the other processes stop at once, naming this one's error
        _leave(code, said)
    return code


def _run(args) -> tuple[int, str | None]:
    """The command's exit status, and what its error said."""
    try:
        args.fn(args)
    except (FileNotFoundError, ValueError, KeyError, IndexError, OSError) as e:
        print(f"supo-jax {args.command}: error: {e}", file=sys.stderr)
        return 2, str(e)
    except KeyboardInterrupt as e:
        hint = ("; rerun the same command to resume from the latest checkpoint"
                if args.command in ("train", "sweep") else "") + (f" ({e})" if str(e) else "")
        print(f"supo-jax {args.command}: interrupted{hint}", file=sys.stderr)
        return 130, "interrupted"
    return 0, None


def _leave(code, said: str | None) -> None:
    """A process of a multi-process run leaves after an error: told to the others
    (utils.PeerWatch); it exits without jax.distributed's shutdown barrier (the others stop too: it would
    wait its 5 minutes and abort), once the others have read why (PeerWatch.leave)."""
    import jax

    from supo_jax.utils import PeerWatch

    if code in (0, None, 143):    # said at exit (PeerWatch.start)
        return
    print(f"supo-jax: process {jax.process_index()} of {jax.process_count()} stopped (the "
          "others stop too); once the cause is gone, rerun every process with the same "
          "command: the run resumes from its last checkpoint", file=sys.stderr)
    PeerWatch.leave(f"error: {said or f'exit status {code}'}",
                    code if isinstance(code, int) else 1)


if __name__ == "__main__":
    sys.exit(main())
