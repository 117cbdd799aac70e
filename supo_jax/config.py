"""Configuration: frozen dataclasses, one experiment = one config file.

A config file (experiments/configs/NAME.py) defines `config() -> Config`.
Overrides are `section.field=value` strings (`--set` on the command line);
values are parsed as Python literals / JSON and checked against the field's
type. An unknown key or a bad value fails at start, naming the key.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import sys
import types
import typing
from typing import Any, Sequence

from supo_jax import storage

from supo_jax.agent.context import NO_ANSWER, ContextConfig
from supo_jax.rl.configs import SCHEDULES, AdvantageConfig, LossConfig
from supo_jax.text.templates import SUMMARY_INSTRUCTION


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str = ""                 # HF dir or .gguf; "" or "tiny" = a tiny random policy (tiny_*)
    pretrained: bool = False       # the config is for a pretrained model: a policy built without
                                   # model.path / train.init_from is an error (unless path="tiny")
    dtype: str = "float32"         # parameter (master) dtype
    compute_dtype: str = ""        # "" = same as dtype
    remat: str = "auto"            # auto | none | full | dots | offload | offload_qkvo (what the
                                   # backward keeps; docs/SCALING.md)
    attention: str = "auto"        # auto | xla | blockwise | cudnn | splash (model/attention.py)
    precision: str = "auto"        # auto | default | high | highest (matmuls; auto: float32 is true
                                   # float32 on accelerators)
    mlp_chunks: int = 1            # training: each layer's MLP over a row's tokens in this many
                                   # chunks (less activation memory, more weight reads)
    head_split: str = "rows"       # training's LM head on a mesh: rows (each device its rows'
                                   # logits, the head gathered whole) | vocab (each device every
                                   # row's logits over its slice of the vocabulary)
    tiny_family: str = "qwen2"
    tiny_hidden: int = 64
    tiny_layers: int = 2
    tiny_heads: int = 4
    tiny_kv_heads: int = 2
    tiny_mlp: int = 128
    tiny_vocab: int = 1024
    tiny_template: str = "compact"  # tiny tokenizer chat template: compact | qwen
    lora_rank: int = 0             # LoRA adapters' rank; 0 = off (train every parameter)
    lora_alpha: float = 16.0       # adapters' scale is lora_alpha / lora_rank
    lora_targets: str = "q,k,v,o,gate,up,down"   # projections with adapters (comma-separated)
    lora_base_dtype: str = ""      # the adapted base's storage: "" = dtype | bfloat16 | int8 (QLoRA)

    def decoder_options(self) -> dict:
        return {"remat": self.remat, "attention": self.attention, "precision": self.precision,
                "mlp_chunks": self.mlp_chunks, "head_split": self.head_split}

    def lora(self):
        """The adapters asked for (supo_jax.model.lora.LoRA), None when lora_rank = 0."""
        from supo_jax.model.lora import parse
        return parse(self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_base_dtype)


@dataclasses.dataclass(frozen=True)
class EnvSection:
    name: str = "fncall/tallest"
    imports: tuple = ()            # modules to import first (they register more environments)
    # harness mode (docs/HARNESS.md): "module:function", an agent episode(task, client, model)
    # -> reward speaking the OpenAI API, whose sessions are the run's rollouts; its tasks are
    # env.name's (that environment's task generator), its tools its own. "" = off: the
    # rollouts are env.name's own environment. "http": a harness in a process of its own
    # claims the sessions over HTTP (GET /sessions/next on 127.0.0.1:harness_port).
    # "verifiers:MODULE:FUNCTION": a verifiers environment (FUNCTION returns it), played by the
    # bridge the run starts in harness_python's venv (supo_jax/harnesses/verifiers_bridge.py).
    # "tau2:DOMAIN": tau2-bench's orchestrator and evaluator on DOMAIN (mock; env.name
    # tau2/DOMAIN), the same way (supo_jax/harnesses/tau2_bridge.py)
    harness: str = ""
    harness_port: int = 0          # the sessions server's port in harness mode; 0 = a free one
    # the python of the external harnesses' venv (verifiers, tau2); "" = the cached one of
    # supo_jax.harnesses.verifiers_venv
    harness_python: str = ""
    knobs: dict = dataclasses.field(default_factory=dict)       # task-generator knobs (train)
    eval_knobs: dict = dataclasses.field(default_factory=dict)  # overrides for eval tasks
    train_tasks: int = 4096
    eval_tasks: int = 32
    seed: int = 0
    timeout_s: float = 30.0


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    tasks_per_step: int = 8        # B prompts per RL step
    group_size: int = 8            # G samples per prompt
    rows: int = 64                 # concurrent sampler rows
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # DAPO's dynamic sampling (0 = off, the paper: every group of the step trains). k >= 1: a
    # group whose advantages are all 0 (its counted rollouts all alike) is dropped, and up to k
    # rounds of tasks_per_step tasks are sampled until tasks_per_step groups carry an advantage
    dynamic_rounds: int = 0
    # the sampler's tensor groups (supo_jax.model.serving): rollouts run on the training
    # devices as (n / tensor groups) x (tensor chips), each group holding the weights split
    # over its chips and its share of the rows; 0 = the largest group dividing the devices,
    # the heads and the kv heads (the fewest weight bytes read a chip a token)
    tensor: int = 0
    # partial rollouts (0 = off: every rollout of a step ends in it): a step's rollout phase
    # ends once its generations hold this many tokens; the rollouts not ended are suspended
    # at their last complete turn and go on first in the next step, under the new weights;
    # a group trains in the step in which its last rollout ends (docs/SUPO.md)
    budget_tokens: int = 0
    # a suspended rollout whose first tokens are more than this many updates old when it
    # would resume is restarted from its task instead (counted: rollouts_restarted)
    max_staleness: int = 4
    # each environment call's outcome joins at the decode-call boundary after the one it was
    # made at (the driver waits for it there): the rows' schedule depends on the tokens alone,
    # so a run (and a resumed one) repeats to the bit; slow tools are waited for
    reproducible: bool = False


@dataclasses.dataclass(frozen=True)
class OptimSection:
    lr: float = 1e-6
    schedule: str = "constant"     # constant | warmup_cosine (to 0 at train.steps)
    warmup_steps: int = 0          # RL steps of linear warm-up
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    minibatch_rows: int = 16       # rows per optimizer update
    micro: int = 1                 # microbatches per minibatch (gradient accumulation)
    ppo_epochs: int = 1
    max_row_len: int = 0           # 0 = the context bound (ContextConfig.cache_len)
    recompute_old_logprobs: bool = False  # default: the sampler's logprobs (same weights)
    pack: bool = False
    # trust region (0 = off): a step's minibatch updates stop at the first minibatch on which
    # the policy has moved more than this from the rollouts' policy (approx KL, mean over its
    # trained tokens of 0.5 (log p - log p_old)^2); that minibatch's update is not applied
    max_kl: float = 0.0


@dataclasses.dataclass(frozen=True)
class TrainSection:
    steps: int = 100
    seed: int = 0
    run_dir: str = "runs/default"
    save_every: int = 10
    keep: int = 3
    eval_every: int = 0            # 0 = only at the end
    eval_before: bool = True       # also evaluate the starting policy (step 0 in metrics.jsonl)
    expert_ceiling: int = 8        # a new run first rolls out the scripted expert on this many
                                   # training tasks (its ceiling, eval.json); 0: not
    eval_temperature: float = 0.0  # 0 = greedy (one rollout per task)
    eval_samples: int = 1          # rollouts per eval task when eval_temperature > 0
    eval_max_summaries: tuple = ()  # extra summary caps evaluated at the end
    init_from: str = ""            # a checkpoint / HF dir to start from ("" = model.path)
    sft_warm_start: bool = False   # tiny policies with no init: SFT on expert demos first
    progress: bool = True
    # resuming with settings other than the saved config.json (beyond RESUMABLE_KEYS) is refused
    # unless this is true; the old config is then kept as config.step<N>.json
    accept_config_change: bool = False


@dataclasses.dataclass(frozen=True)
class SFTSection:
    demos: str = "expert"          # "expert" (scripted experts' rollouts) or a JSONL path
    num_demos: int = 64
    steps: int = 200
    lr: float = 3e-3
    batch_rows: int = 8
    summary_drop: float = 0.0      # imperfect expert summaries on purpose
    # share of expert demos played under `full` with a context of W * (S + 1) (no summaries),
    # so that the warm-started policy can also act in long single-segment contexts
    full_context_demos: float = 0.0


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    # on TPU, XLA's windowed einsum ("collective matmul") for the sharded matmuls of the train
    # step: off by default, as MaxText's trillium recipes run (DISABLE_COLLECTIVE_MATMUL;
    # supo_jax.rl.train_step.step_programs)
    collective_matmul: bool = False


@dataclasses.dataclass(frozen=True)
class Config:
    """One experiment. Every default is the paper's SUPO (PAPER_SUPO below, docs/SUPO.md); the
    CPU recipe that `supo-jax train` runs without --config is supo_jax/configs/cpu_recipe.py."""
    model: ModelSection = ModelSection()
    env: EnvSection = EnvSection()
    context: ContextConfig = ContextConfig()
    rollout: RolloutSection = RolloutSection()
    advantage: AdvantageConfig = AdvantageConfig()
    loss: LossConfig = LossConfig()
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    sft: SFTSection = SFTSection()
    mesh: MeshSection = MeshSection()


# The paper's algorithm, setting by setting (docs/SUPO.md: Lu et al. 2025, sections 2 and 4;
# "(?)" marks our reading where the paper is silent). The class defaults above hold these values;
# `--print-config` marks every setting of a config that departs from them.
PAPER_SUPO = {
    "context.manager": "supo",
    "context.trigger_ratio": 0.95,                  # L = 0.95 W
    "context.trigger_rule": "paper",
    "context.summary_role": "system",               # the summary instruction is a system turn
    "context.summary_instruction": SUMMARY_INSTRUCTION,
    "context.show_dropped_to_summarizer": False,    # (?)
    "context.summary_counts_as_step": True,         # (?)
    "rollout.group_size": 8,
    "rollout.temperature": 1.0,
    "rollout.dynamic_rounds": 0,                    # every group of a step trains
    "rollout.budget_tokens": 0,                     # every rollout ends in its step
    "advantage.estimator": "rollout_group",
    "advantage.normalize_std": True,
    "advantage.negative_weight": 1.0,
    "advantage.masked_reasons": NO_ANSWER,          # overlong masking
    "advantage.masked_count_in_stats": True,        # (?)
    "advantage.rollout_weight": "tokens",
    "advantage.permute_rewards": False,
    "loss.objective": "ppo",
    "loss.eps_low": 0.2,
    "loss.eps_high": 0.28,
    "loss.aggregation": "token-mean",
    "loss.kl_coef": 0.0,
    "loss.entropy_coef": 0.0,
    "optim.lr": 1e-6,                               # for 7B-36B policies
    "optim.schedule": "constant",
    "optim.warmup_steps": 0,
    "optim.ppo_epochs": 1,
    "optim.max_kl": 0.0,
    "train.sft_warm_start": False,                  # RL from the pretrained policy
    "train.eval_temperature": 0.0,                  # (?) greedy evaluation
    "train.eval_samples": 1,
}


def get(cfg: Config, key: str):
    """The value of a dotted key (`section.field`) of cfg."""
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def departures(cfg: Config) -> dict[str, tuple]:
    """key -> (cfg's value, the paper's) for every PAPER_SUPO setting cfg departs from."""
    return {k: (get(cfg, k), v) for k, v in PAPER_SUPO.items() if get(cfg, k) != v}


class ConfigError(ValueError):
    pass


def _coerce(key: str, value: Any, tp) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} does not match {tp}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        return str(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a dict, got {value!r}")
        return value
    if tp is tuple or origin is tuple:
        if isinstance(value, (int, float, str)):
            value = (value,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if args and args[-1] is not Ellipsis and len(args) == 1:
            return tuple(_coerce(key, v, args[0]) for v in value)
        if args and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(key, v, args[0]) for v in value)
        return tuple(value)
    return value


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """Return cfg with `a.b=value` overrides applied (dict fields accept a.b.key=value), its
    env.imports imported (import_env_modules) and validated.

    Task knobs belong to the environment they were written for: overriding env.name to
    another environment clears env.knobs and env.eval_knobs unless the overrides set them too.
    """
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, text = item.split("=", 1)
        parsed.append((key.strip(), _parse_value(text.strip())))
    start = cfg.env.name if isinstance(cfg, Config) else None
    for key, value in parsed:
        cfg = _set(cfg, key.split("."), value, key)
    if start is not None and cfg.env.name != start:   # only the knobs set here stay
        cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, knobs={}, eval_knobs={}))
        for key, value in parsed:
            if key.split(".")[:2] in (["env", "knobs"], ["env", "eval_knobs"]):
                cfg = _set(cfg, key.split("."), value, key)
    import_env_modules(cfg.env)
    return validate(cfg)


def _set(obj, path, value, full):
    if not dataclasses.is_dataclass(obj):
        if isinstance(obj, dict):
            d = dict(obj)
            if len(path) == 1:
                d[path[0]] = value
            else:
                d[path[0]] = _set(d.get(path[0], {}), path[1:], value, full)
            return d
        raise ConfigError(f"unknown config key {full!r}")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    name = path[0]
    if name not in fields:
        raise ConfigError(f"unknown config key {full!r} (valid here: {', '.join(fields)})")
    hints = typing.get_type_hints(type(obj))
    cur = getattr(obj, name)
    if len(path) == 1:
        if isinstance(cur, ContextConfig) and isinstance(value, str):
            return _set(obj, [name, "manager"], value, full)   # --set context=full
        if dataclasses.is_dataclass(cur):
            raise ConfigError(f"config key {full!r} is a section; set one of its fields")
        new = _coerce(full, value, hints[name])
    else:
        new = _set(cur, path[1:], value, full)
    try:
        return dataclasses.replace(obj, **{name: new})
    except (ValueError, TypeError) as e:   # the message names the key already, or is given it
        raise ConfigError(str(e) if str(e).startswith(full) else f"{full}: {e}") from None


def import_env_modules(env: EnvSection) -> None:
    """Import the modules env.imports names (they register environments), looked up from the
    working directory (put on sys.path for them) and sys.path; a ConfigError names one that
    does not import."""
    if env.imports and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())   # env.imports finds modules in the working directory
    for mod in env.imports:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise ConfigError(f"env.imports: cannot import {mod!r} ({e}; modules are looked up "
                              "from the working directory and sys.path)") from None


def load_harness(env: EnvSection):
    """The function env.harness names ("module:function"), its module looked up as env.imports'
    are; a ConfigError names one that does not import or is not a function. None for "http"
    (an out-of-process harness: "http", or "verifiers:MODULE:FUNCTION" and "tau2:DOMAIN", whose
    bridge harness_mode starts)."""
    if env.harness == "http":
        return None
    if env.harness.startswith(("verifiers:", "tau2:")):
        verifiers_python(env)
        return None
    mod, sep, name = env.harness.partition(":")
    if not (sep and mod and name):
        raise ConfigError(f"env.harness={env.harness!r}: \"module:function\" expected (a function "
                          "episode(task, client, model) -> reward), \"http\", "
                          "\"verifiers:MODULE:FUNCTION\" or \"tau2:DOMAIN\"")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(mod), name, None)
    except ImportError as e:
        raise ConfigError(f"env.harness: cannot import {mod!r} ({e}; modules are looked up from "
                          "the working directory and sys.path)") from None
    if not callable(fn):
        raise ConfigError(f"env.harness={env.harness!r}: module {mod!r} has no function {name!r}")
    return fn


def verifiers_python(env: EnvSection) -> str:
    """The python that runs env.harness="verifiers:MODULE:FUNCTION"'s (or "tau2:DOMAIN"'s)
    bridge (env.harness_python, or the cached venv of supo_jax.harnesses.verifiers_venv); a
    ConfigError names a bad spec or a python that is not there."""
    _, mod, fn = (env.harness.split(":") + ["", ""])[:3]
    if env.harness.startswith("tau2:"):
        if env.harness.count(":") != 1 or not mod:
            raise ConfigError(f"env.harness={env.harness!r}: \"tau2:DOMAIN\" expected (a "
                              "tau2-bench domain: mock; env.name tau2/DOMAIN)")
    elif env.harness.count(":") != 2 or not mod or not fn:
        raise ConfigError(f"env.harness={env.harness!r}: \"verifiers:MODULE:FUNCTION\" expected "
                          "(FUNCTION returns a verifiers environment)")
    from supo_jax.harnesses import verifiers_venv
    python = env.harness_python or verifiers_venv.python_of(verifiers_venv.default_dir())
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ConfigError(f"env.harness_python={python!r} is not an executable python: make "
                          "the harnesses' venv with `python -m supo_jax.harnesses.verifiers_venv` "
                          "(or name one with env.harness_python)")
    return python


def _check_harness(cfg: Config) -> None:
    """Harness mode's settings (env.harness set): a harness that imports, no partial rollouts
    (a harness's episode cannot be suspended across steps and replayed). Every context
    manager runs: its edits and its own tools (fold's) are the driver's, on the server."""
    load_harness(cfg.env)
    if cfg.rollout.budget_tokens:
        raise ConfigError(f"env.harness with rollout.budget_tokens={cfg.rollout.budget_tokens}: "
                          "a harness's episode cannot be suspended and replayed in a later step; "
                          "set rollout.budget_tokens=0")


# numeric settings checked at start, naming themselves (not a division by zero, or a run that
# trains with a negative learning rate, later)
POSITIVE = ("rollout.rows", "rollout.group_size", "rollout.tasks_per_step", "optim.lr",
            "optim.clip_norm", "optim.minibatch_rows", "optim.micro", "optim.ppo_epochs",
            "train.save_every", "train.keep", "sft.lr", "sft.batch_rows", "env.train_tasks",
            "env.eval_tasks", "env.timeout_s", "model.tiny_hidden", "model.tiny_layers",
            "model.tiny_heads", "model.tiny_kv_heads", "model.tiny_mlp", "model.tiny_vocab")
AT_LEAST_0 = {"rollout.dynamic_rounds": "0 = off", "rollout.budget_tokens": "0 = off",
              "rollout.max_staleness": "", "rollout.temperature": "0 = greedy",
              "optim.warmup_steps": "", "optim.weight_decay": "",
              "env.harness_port": "0 = a free port",
              "optim.max_row_len": "0 = the context bound", "optim.max_kl": "0 = off",
              "train.steps": "", "train.eval_every": "0 = only at the end",
              "train.expert_ceiling": "0 = no expert rollouts", "sft.summary_drop": ""}


def validate(cfg: Config) -> Config:
    """Cross-field checks that single sections cannot do, and the settings whose default
    depends on others resolved (loss.behaviour_correction=auto); no side effects. An
    environment of env.imports is registered only once its module is imported:
    import_env_modules first."""
    from supo_jax.envs import list_envs
    if cfg.env.name not in list_envs():
        hint = ("" if cfg.env.imports else "; an environment of your own registers when its "
                "module is imported: --set 'env.imports=[\"my_envs.redcount\"]'")
        raise ConfigError(f"env.name={cfg.env.name!r} is not a registered environment "
                          f"({', '.join(list_envs())}){hint}")
    _check_knobs(cfg.env)
    tau2 = cfg.env.harness.startswith("tau2:")
    malformed = tau2 and (cfg.env.harness.count(":") != 1 or cfg.env.harness == "tau2:")
    if not malformed and (cfg.env.name.startswith("tau2/") or tau2) and (
            not tau2 or cfg.env.name != "tau2/" + cfg.env.harness.split(":", 1)[1]):
        raise ConfigError(f"env.name={cfg.env.name!r} with env.harness={cfg.env.harness!r}: a "
                          "tau2-bench domain is played by its bridge: env.name=tau2/DOMAIN with "
                          "env.harness=tau2:DOMAIN")
    if cfg.env.harness:     # after the pairing: a mismatch is named before a missing venv
        # (a malformed "tau2:..." spec is named here)
        _check_harness(cfg)
    if cfg.model.path == "tiny":   # the tiny policy asked for by name
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path="",
                                                                 pretrained=False))
    try:
        cfg.model.lora()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    warm = cfg.train.sft_warm_start and not (cfg.train.init_from or cfg.model.path)
    if warm and cfg.sft.demos == "expert":
        from supo_jax.envs.experts import has_expert
        if not has_expert(cfg.env.name):
            raise ConfigError(
                f"sft.demos=expert: environment {cfg.env.name!r} has no scripted expert; give "
                "demonstrations as a JSONL of chat messages (sft.demos=PATH), register an expert "
                "(supo_jax.envs.experts), or train without SFT (train.sft_warm_start=false, for "
                "a pretrained model: model.path=...)")
    elif warm and not storage.isfile(cfg.sft.demos):
        raise ConfigError(f"sft.demos={cfg.sft.demos!r}: no such file ('expert' or a JSONL path)")
    if warm and (cfg.sft.steps < 1 or (cfg.sft.demos == "expert" and cfg.sft.num_demos < 1)):
        raise ConfigError(f"sft.steps={cfg.sft.steps}, sft.num_demos={cfg.sft.num_demos}: an SFT "
                          "warm start takes at least one step and one demonstration (or "
                          "train.sft_warm_start=false)")
    for key in POSITIVE:
        if get(cfg, key) <= 0:
            raise ConfigError(f"{key}={get(cfg, key)}: must be positive")
    for key, zero in AT_LEAST_0.items():
        if get(cfg, key) < 0:
            raise ConfigError(f"{key}={get(cfg, key)}: must be >= 0"
                              + (f" ({zero})" if zero else ""))
    if (not storage.is_url(cfg.train.run_dir) and os.path.exists(cfg.train.run_dir)
            and not os.path.isdir(cfg.train.run_dir)):
        raise ConfigError(f"train.run_dir={cfg.train.run_dir!r} is a file, not a directory")
    if cfg.rollout.tensor < 0:
        raise ConfigError(f"rollout.tensor={cfg.rollout.tensor}: the sampler's tensor-group size "
                          "is a positive divisor of the device count, the heads and the kv "
                          "heads, or 0 (the largest such size)")
    if cfg.optim.minibatch_rows % cfg.optim.micro:
        raise ConfigError(f"optim.minibatch_rows={cfg.optim.minibatch_rows} is not a multiple of "
                          f"optim.micro={cfg.optim.micro}")
    if cfg.optim.pack and cfg.loss.aggregation == "sequence-mean":
        raise ConfigError("optim.pack=true needs loss.aggregation=token-mean")
    if not 0 <= cfg.sft.full_context_demos <= 1:
        raise ConfigError("sft.full_context_demos must be in [0, 1]")
    if cfg.train.eval_samples < 1 or cfg.train.eval_temperature < 0:
        raise ConfigError("train.eval_samples must be >= 1 and train.eval_temperature >= 0")
    if cfg.rollout.top_k or cfg.rollout.top_p < 1.0:
        raise ConfigError(
            f"rollout.top_k={cfg.rollout.top_k} / rollout.top_p={cfg.rollout.top_p}: RL samples "
            "from the full distribution (top_k=0, top_p=1.0); the training forward scores the "
            "untruncated distribution, so the PPO ratio would not be the behaviour policy's")
    if cfg.rollout.budget_tokens and cfg.rollout.dynamic_rounds:
        raise ConfigError("rollout.budget_tokens and rollout.dynamic_rounds: partial rollouts "
                          "carry groups across steps and dynamic sampling redraws a step's "
                          "groups; set one of them to 0")
    if cfg.loss.behaviour_correction == "auto":
        # partial rollouts: a suspended rollout's tokens were sampled by a policy up to
        # max_staleness updates old (a restarted one's, older): clipping against those
        # log-probs is not PPO; the ratio is clipped against the recomputed log-probs and
        # the tokens weighed by truncated importance sampling. The run's config.json holds
        # what was chosen, and the trainer says it at start.
        budget = bool(cfg.rollout.budget_tokens)
        cfg = dataclasses.replace(
            cfg, loss=dataclasses.replace(cfg.loss, behaviour_correction="tis" if budget
                                          else "none"),
            optim=dataclasses.replace(cfg.optim, recompute_old_logprobs=(
                cfg.optim.recompute_old_logprobs or budget)))
    if cfg.rollout.budget_tokens and (cfg.loss.behaviour_correction == "none"
                                      or not cfg.optim.recompute_old_logprobs):
        raise ConfigError("rollout.budget_tokens: resumed rollouts hold tokens of older "
                          "policies, which loss.behaviour_correction=none (or "
                          "optim.recompute_old_logprobs=false) trains as the current one's; "
                          "leave loss.behaviour_correction at auto (tis), or set tis or "
                          "decoupled with optim.recompute_old_logprobs=true")
    if cfg.loss.behaviour_correction != "none" and not cfg.optim.recompute_old_logprobs:
        raise ConfigError(f"loss.behaviour_correction={cfg.loss.behaviour_correction}: the "
                          "proximal policy is the trainer's recomputed log-probabilities; set "
                          "optim.recompute_old_logprobs=true")
    if cfg.optim.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={cfg.optim.schedule!r}: one of {', '.join(SCHEDULES)}")
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype={cfg.model.dtype!r}: float32 or bfloat16")
    from supo_jax.model.attention import IMPLS
    from supo_jax.model.decoder import HEAD_SPLITS, PRECISIONS, REMAT
    if cfg.model.mlp_chunks < 1:
        raise ConfigError(f"model.mlp_chunks={cfg.model.mlp_chunks}: at least 1 (1: the MLP "
                          "over whole rows)")
    for key, allowed in (("remat", REMAT), ("attention", IMPLS), ("precision", PRECISIONS),
                         ("head_split", HEAD_SPLITS)):
        if getattr(cfg.model, key) not in allowed:
            raise ConfigError(f"model.{key}={getattr(cfg.model, key)!r} is not one of "
                              f"{', '.join(allowed)}")
    return cfg


def _check_knobs(env: EnvSection) -> None:
    """Every knob is a parameter of the environment's task generator (named if not)."""
    import inspect

    from supo_jax.envs.base import task_generator
    gen = task_generator(env.name)
    if gen is None:
        return
    params = inspect.signature(gen).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        takes = [n for n, p in params.items() if n not in ("split", "n", "seed") and n[0] != "_"
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for field in ("knobs", "eval_knobs"):
            for k in getattr(env, field):
                if k not in takes:
                    raise ConfigError(
                        f"env.{field}.{k}: the task generator of {env.name!r} takes no knob "
                        f"{k!r} (it takes: {', '.join(takes) or 'none'})")
    # a knob of the wrong type or range fails here, not inside a run: one task of each split
    for field, split, knobs in (("knobs", "train", env.knobs),
                                ("eval_knobs", "eval", {**env.knobs, **env.eval_knobs})):
        if knobs and (field == "knobs" or env.eval_knobs):
            try:
                gen(split, 1, seed=env.seed, **knobs)
            except Exception as e:   # noqa: BLE001  (the generator is the user's code)
                raise ConfigError(f"env.{field}={knobs!r}: the task generator of {env.name!r} "
                                  f"fails with them ({type(e).__name__}: {e})") from None


def format_config(cfg: Config, limit: int | None = None) -> str:
    """Every setting of cfg as `key = value`, one a line; a setting that departs from the
    paper's algorithm (PAPER_SUPO) ends with `# paper: value`. `limit`: the resolved L (it
    needs the tokenizer), shown after the context section."""
    out = departures(cfg)
    lines = []

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            key, v = prefix + f.name, getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(v, key + ".")
                continue
            mark = f"   # paper: {out[key][1]!r}" if key in out else ""
            lines.append(f"{key} = {v!r}{mark}")
            if key == "context.summary_counts_as_step" and limit is not None:
                lines.append(f"# context: L = {limit} tokens ({cfg.context.trigger_rule} rule, "
                             f"W = {cfg.context.working_context})")
    walk(cfg, "")
    lines.append(f"# {len(out)} departure(s) from the paper's algorithm"
                 + (f": {', '.join(out)}" if out else ""))
    return "\n".join(lines)


# what `supo-jax train` runs without --config
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                              "cpu_recipe.py")


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Config from a Python file defining config(), a run directory's config.json (the
    settings a run was made with), or (path None) the CPU recipe DEFAULT_CONFIG; plus
    overrides."""
    return apply_overrides(_config_file(path or DEFAULT_CONFIG), overrides)


def describe(path: str | None) -> str:
    """How a command names the config it runs (its first line of output)."""
    if path is None:
        return ("config: the CPU recipe (supo_jax/configs/cpu_recipe.py; --config FILE runs "
                "another)")
    return f"config: {path}"


def _config_file(path: str) -> Config:
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{path!r} is a directory without a config.json (not a run directory)")
        return from_dict(saved_config(path))
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    if path.endswith(".json"):
        return from_dict(_read_json(path))
    if not path.endswith(".py"):
        raise ConfigError(f"config file {path!r}: expected a .py file defining config() "
                          "or a run's config.json")
    spec = importlib.util.spec_from_file_location("supo_jax_user_config", path)
    mod = importlib.util.module_from_spec(spec)
    here = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, here)   # a config may build on a sibling config file
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(here)
    if not hasattr(mod, "config"):
        raise ConfigError(f"{path} does not define config()")
    cfg = mod.config()
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path}: config() must return supo_jax.config.Config")
    return cfg


def saved_config(run_dir: str) -> dict | None:
    """The settings a run directory holds (its config.json as saved), None where it has none;
    an unreadable one is a ConfigError naming the file."""
    fn = storage.join(run_dir, "config.json")
    return _read_json(fn) if storage.isfile(fn) else None


def _read_json(fn: str) -> dict:
    try:
        d = json.loads(storage.read_text(fn))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{fn} is not a readable run config ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{fn} is not a readable run config (not a JSON object)")
    return d


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


# settings a resumed run may change: where it is, how long it runs, how often it saves /
# evaluates, logging
RESUMABLE_KEYS = ("train.run_dir", "train.steps", "train.save_every", "train.keep",
                  "train.eval_every",
                  "train.eval_before", "train.expert_ceiling", "train.eval_temperature",
                  "train.eval_samples",
                  "train.eval_max_summaries", "train.progress", "train.accept_config_change",
                  "env.eval_tasks", "env.eval_knobs", "env.harness_port",
                  "env.harness_python")


def config_changes(saved: dict, cfg, ignore: Sequence[str] = RESUMABLE_KEYS) -> list[str]:
    """'key: saved -> new' for every setting of cfg that differs from a saved to_dict() (JSON)
    outside `ignore` (by default the keys a resumed run may change). A setting the saved
    config lacks (added to the code since) is no change while it keeps its default, which is
    the behaviour the code had before it."""
    new = json.loads(json.dumps(to_dict(cfg), default=str))
    out = []

    def walk(a, b, prefix):
        for k in sorted(set(a) | set(b)):
            key = f"{prefix}{k}"
            if key in ignore:
                continue
            x, y = a.get(k), b.get(k)
            if k not in a and y == _field_default(prefix, k):
                continue      # a setting added since the run was saved, at its default
            if isinstance(x, dict) and isinstance(y, dict) and dataclasses.is_dataclass(
                    _section_type(key)):
                walk(x, y, key + ".")
            elif x != y:
                out.append(f"{key}: {x!r} -> {y!r}")
    walk(saved, new, "")
    return out


# settings added after runs were saved whose behaviour before them is not their class default:
# a saved config without the key ran (and is read back) with this value
BEFORE_ADDED = {"context.trigger_rule": "reserve", "context.summary_role": "user"}


def _field_default(prefix: str, name: str):
    """The JSON form of the value a saved config without field `name` (in the section at
    `prefix`) ran with: BEFORE_ADDED's, else the class default (None when there is none)."""
    if prefix + name in BEFORE_ADDED:
        return BEFORE_ADDED[prefix + name]
    tp = _section_type(prefix.rstrip(".")) if prefix else Config
    f = {f.name: f for f in dataclasses.fields(tp)}.get(name) if dataclasses.is_dataclass(tp) \
        else None
    if f is None or f.default is dataclasses.MISSING:
        return None
    return json.loads(json.dumps(f.default, default=str))


def _section_type(key: str):
    tp = Config
    for part in key.split("."):
        hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
        tp = hints.get(part)
    return tp


def from_dict(d: dict, cls=Config, prefix: str = ""):
    """Inverse of to_dict (resolved configs saved in run directories); a key the dict lacks
    takes the value runs saved without it ran with (BEFORE_ADDED, else the class default)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ConfigError(f"unknown config key {sorted(unknown)[0]!r} in {cls.__name__}")
    kwargs = {k: BEFORE_ADDED[prefix + k] for k in names - set(d) if prefix + k in BEFORE_ADDED}
    for k, v in d.items():
        tp = hints[k]
        kwargs[k] = (from_dict(v, tp, f"{prefix}{k}.") if dataclasses.is_dataclass(tp)
                     else _coerce(k, v, tp))
    return cls(**kwargs)
