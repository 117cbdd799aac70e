"""Run setup: the policy a config describes (a checkpoint, or a tiny one whose tokenizer is
trained on the environment's texts), and the checks of a run directory (same model, same
config on resume) and of the context bound (the initial prompt fits)."""
from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Sequence

import numpy as np
from jax.sharding import Mesh

from supo_jax import storage
from supo_jax.config import Config, ConfigError, ModelSection, config_changes, saved_config
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import start_state
from supo_jax.model.policy import Policy, load_policy, new_policy
from supo_jax.rl.multihost import barrier, is_main

if TYPE_CHECKING:   # transformers is slow to import; the tokenizer code imports it when used
    from transformers import PreTrainedTokenizerFast


def _sample_value(schema: dict):
    """A plausible value of a JSON-schema type (for calls the corpus shows without an expert)."""
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and schema.get("enum"):
        return schema["enum"][0]
    return {"integer": 1, "number": 1.5, "boolean": True, "array": [],
            "object": {}}.get(t, "text")


def env_corpus(cfg: Config, n: int = 24) -> list[str]:
    """Texts of the environment for a tiny policy's tokenizer: the summary and continuation
    templates, task prompts, tool schemas, and turns: the scripted expert's where the
    environment has one, else one call of each tool with schema-typed arguments and its
    observation; plus the JSONL demonstrations when sft.demos is a file."""
    from supo_jax.envs import make_env, make_tasks
    from supo_jax.envs.experts import expert_for, has_expert
    from supo_jax.text.parsing import format_tool_call

    texts = [cfg.context.summary_instruction, cfg.context.continuation] * 4
    if cfg.context.state_request:      # state, clear: the prompt asks for <state> blocks
        texts += [cfg.context.state_request] * 4
    if cfg.context.manager == "fold":   # the driver's tools and a call of each
        from supo_jax.agent.context import FOLD_TOOLS
        texts += [json.dumps(list(FOLD_TOOLS))] + [
            format_tool_call(t["function"]["name"], {k: "the state reached" for k in
                                                      t["function"]["parameters"]["properties"]})
            for t in FOLD_TOOLS] * 4
    expert = expert_for(cfg.env.name) if has_expert(cfg.env.name) else None
    for task in make_tasks(cfg.env.name, "train", n, seed=10_000 + cfg.env.seed, **cfg.env.knobs):
        try:
            env = make_env(cfg.env.name)
            rs = env.reset(task)
        except Exception:   # noqa: BLE001  (its rollouts fail the same way)
            continue
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
        prompt = rs.prompt + (f"\n\n{cfg.context.state_request}"   # as the driver asks
                              if cfg.context.state_request else "")
        msgs = [{"role": "user", "content": prompt}]
        try:   # an environment (or expert) that raises ends this task's texts, as its rollout
            for _ in range(12):
                a = expert.act(msgs, False)
                texts.append(a)
                res = env.act(a)
                if res.done:
                    break
                texts.append(res.observation)
                msgs += [{"role": "assistant", "content": a},
                         {"role": "tool", "content": res.observation}]
            texts.append(expert.act(msgs, True))
        except Exception:   # noqa: BLE001
            continue
    if cfg.sft.demos != "expert" and storage.isfile(cfg.sft.demos):
        with storage.open(cfg.sft.demos) as f:
            texts += [_demo_text(line) for _, line in zip(range(256), f)]
    return texts


def _demo_text(line: str) -> str:
    """A JSONL demonstration's messages as text (a rollout record: its transcript, not its
    token ids); the line itself when it is not one (sft reports the error)."""
    from supo_jax.rl.sft import assistant_text

    try:
        d = json.loads(line)
        msgs = d.get("messages", d.get("transcript"))
        return "\n".join([assistant_text(m) if m.get("role") == "assistant" else
                          str(m.get("content") or "") for m in msgs]
                         + [json.dumps(d.get("tools") or [])])
    except (ValueError, AttributeError, TypeError):
        return line


def env_tokenizer(cfg: Config, out_dir: str | None = None) -> PreTrainedTokenizerFast:
    """The tiny policy's tokenizer for this config (every command builds the same one)."""
    from supo_jax.model.tiny import tiny_tokenizer

    m = cfg.model
    return tiny_tokenizer(out_dir, vocab_size=m.tiny_vocab, extra_corpus=env_corpus(cfg),
                          template=m.tiny_template)


def load_configured_policy(path: str, m: ModelSection, *, mesh: Mesh | None = None,
                           seed: int = 0) -> Policy:
    """The checkpoint at `path` loaded as the model section says: parameter and compute
    dtypes, remat, attention and precision, and its LoRA adapters (model.lora_*: fresh ones;
    `path` a PEFT adapter directory: its base, model.path or the adapter's
    base_model_name_or_path, with the adapter's weights)."""
    from supo_jax.model.lora import load_peft, peft_lora, read_peft_config

    path = storage.resolve(path)     # a bucket's export: its current version
    peft = storage.isfile(storage.join(path, "adapter_config.json"))
    base = path
    if peft:
        pc = read_peft_config(path)
        base = m.path or pc.get("base_model_name_or_path") or ""
        lora = m.lora()
        want = peft_lora(pc)
        if lora is None or (lora.rank, lora.alpha, set(lora.targets)) != (
                want.rank, want.alpha, set(want.targets)):
            raise ConfigError(
                f"{path} is a PEFT adapter of rank {want.rank}, alpha {want.alpha:g} on "
                f"{','.join(want.targets)}: set model.lora_rank={want.rank} "
                f"model.lora_alpha={want.alpha:g} model.lora_targets={','.join(want.targets)}")
        if not base:
            raise ConfigError(f"{path}: the adapter names no base model; set model.path")
    policy = load_policy(base, dtype=m.dtype, mesh=mesh, compute_dtype=m.compute_dtype or None,
                         **m.decoder_options())
    add_configured_adapters(policy, m, seed=seed)
    if peft:
        load_peft(policy.model, path)
    return policy


def add_configured_adapters(policy: Policy, m: ModelSection, seed: int = 0) -> None:
    """The model section's LoRA adapters (and base storage) on `policy`, if any."""
    lora = m.lora()
    if lora is not None:
        from supo_jax.model.lora import add_adapters
        add_adapters(policy.model, lora, base_dtype=m.lora_base_dtype, seed=seed,
                     mesh=policy.mesh)


def adapter_base(cfg: Config) -> str | None:
    """The model a PEFT export of the run's adapters names as its base (base_model_name_or_path):
    model.path, or train.init_from (a PEFT adapter's own base when it is one); None for the
    tiny random policy and for a base stored in int8 or bfloat16 (model.lora_base_dtype: the
    adapters trained on that, not on the checkpoint), whose base save_adapters writes to
    run_dir/base."""
    from supo_jax.model.lora import read_peft_config

    path = cfg.train.init_from or cfg.model.path
    if not path or cfg.model.lora_base_dtype:
        return None
    export = storage.resolve(path)     # a bucket's export: its current version
    if storage.isfile(storage.join(export, "adapter_config.json")):
        return cfg.model.path or read_peft_config(export).get("base_model_name_or_path")
    return path


def save_policy(policy: Policy, cfg: Config, out: str, peft_out: str | None = None) -> None:
    """The policy as an HF directory at `out` (adapters merged in) and, when it has LoRA
    adapters and `peft_out` is given, the adapters alone as a PEFT adapter there.
    Collective in a multi-process run (every process calls it; process 0 writes)."""
    policy.save_pretrained(out)
    if policy.model.lora is not None and peft_out is not None:
        save_adapters(policy, cfg, peft_out)


def save_adapters(policy: Policy, cfg: Config, out: str) -> None:
    """The policy's LoRA adapters as a PEFT adapter at `out`, naming the base they trained on
    (adapter_base, else run_dir/base, written here: dequantized from int8). Collective."""
    from supo_jax.model.lora import save_peft

    base = adapter_base(cfg)
    if base is None:
        base = storage.join(cfg.train.run_dir, "base")
        policy.save_pretrained(base, adapters=False)
    save_peft(policy.model, out, storage.abspath(base) if storage.exists(base) else base)
    barrier("supo_jax:peft:written")


def build_policy(cfg: Config, run_dir: str | None = None, mesh: Mesh | None = None) -> Policy:
    """The configured policy: a checkpoint (model.path / train.init_from) or a tiny random one
    whose tokenizer is trained on the environment's texts (saved in the run directory), with
    the configured LoRA adapters."""
    m = cfg.model
    path = cfg.train.init_from or m.path
    if path:
        return load_configured_policy(path, m, mesh=mesh, seed=cfg.train.seed)
    if m.pretrained:
        raise ConfigError("model.path: this config trains a pretrained model and names none; "
                          "--set model.path=DIR (an HF checkpoint or a .gguf), or "
                          "model.path=tiny for the 2-layer random test policy")
    from supo_jax.model.policy import load_tokenizer
    from supo_jax.model.tiny import tiny_config

    tok_dir = storage.join(run_dir, "tokenizer") if run_dir else None
    fresh = not (tok_dir and storage.isdir(tok_dir))
    barrier("supo_jax:tokenizer:looked")   # every process looked before process 0 writes
    tok = None
    if fresh and (is_main() or not tok_dir):
        if tok_dir is None:
            tok = env_tokenizer(cfg)
        else:
            with storage.staged_dir(tok_dir) as d:
                tok = env_tokenizer(cfg, d)
    barrier("supo_jax:tokenizer:written")  # the others load process 0's tokenizer
    if tok is None:
        with storage.local_copy(storage.resolve(tok_dir)) as d:
            tok = load_tokenizer(d)
    vocab = int(math.ceil(len(tok) / 8) * 8)
    mc = tiny_config(m.tiny_family, vocab_size=vocab, hidden=m.tiny_hidden, layers=m.tiny_layers,
                     heads=m.tiny_heads, kv_heads=m.tiny_kv_heads, mlp=m.tiny_mlp)
    policy = new_policy(mc, dtype=m.dtype, compute_dtype=m.compute_dtype or None, mesh=mesh,
                        seed=cfg.train.seed, tokenizer=tok, **m.decoder_options())
    add_configured_adapters(policy, m, seed=cfg.train.seed)
    return policy


def model_signature(policy: Policy) -> dict:
    """The architecture fields a checkpoint must match (saved in the run directory)."""
    d = policy.config.to_hf_dict()
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim")
    return {k: d.get(k) for k in keys}


def model_fingerprint(policy: Policy) -> str:
    sig = model_signature(policy)
    return hashlib.sha1(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:16]


PROMPT_SAMPLE = 16    # tasks whose initial prompts check_prompt_fits renders


def check_prompt_fits(cfg: Config, fmt: ChatFormat, split: str = "train") -> None:
    """Fail at start (a ValueError naming context.working_context) when the first task's
    initial prompt, rendered with the policy's tokenizer, does not fit the working context;
    say in one line how many of the first PROMPT_SAMPLE tasks (their sizes vary with the
    knobs) do not fit (each such rollout ends at once, counted as context_limit); say so when
    the chat template leaves the environment's tools out of the prompt."""
    from supo_jax.envs import make_env, make_tasks

    knobs = {**cfg.env.knobs, **(cfg.env.eval_knobs if split == "eval" else {})}
    env = make_env(cfg.env.name)
    if getattr(env, "harness_only", False):   # its prompts are its harness's (tau2/mock)
        return
    tasks = make_tasks(cfg.env.name, split, PROMPT_SAMPLE, seed=cfg.env.seed, **knobs)
    rs = env.reset(tasks[0])
    start_state(fmt, cfg.context, rs)
    over = []
    for task in tasks[1:]:
        try:
            start_state(fmt, cfg.context, env.reset(task))
        except ValueError as e:
            over.append(str(e))
    if over:
        print(f"note: {len(over)} of the first {len(tasks)} {split} tasks do not fit (their "
              f"rollouts end at once, as context_limit): {over[0]}")
    if rs.tools and not fmt.renders_tools:
        print("note: the model's chat template does not render the tools, so the policy is not "
              "told their names, arguments or call format beyond what the task prompt says; "
              "warm-start it on demonstrations (sft) or describe the tools in the environment's "
              "system message")


def row_len(cfg: Config, fmt: ChatFormat) -> int:
    """A training row's tokens: optim.max_row_len, else the context's row bound; a
    model.mlp_chunks that does not divide it is a config error (at the run's start, not in
    its first update)."""
    t = cfg.optim.max_row_len or cfg.context.row_bound(fmt)
    n = cfg.model.mlp_chunks
    if n > 1 and t % n:
        raise ConfigError(f"model.mlp_chunks={n} must divide the training row length, {t} "
                          f"tokens here: set optim.max_row_len to a multiple of {n}")
    return t


def check_run_dir(run_dir: str, policy: Policy, *, record: bool = False) -> None:
    """Refuse a run directory whose run.json names a different model, naming the directory
    and the architecture fields that differ; record=True writes run.json if absent."""
    meta = storage.join(run_dir, "run.json")
    fp, sig = model_fingerprint(policy), model_signature(policy)
    old = None
    if storage.exists(meta):
        old = json.loads(storage.read_text(meta))
    barrier("supo_jax:run.json:read")   # every process read it before process 0 writes
    if old is not None and old.get("model_fingerprint") != fp:
        was = old.get("model") or {}
        diff = "; ".join(f"{k} {was[k]} there, {sig[k]} here" for k in sig
                         if k in was and was[k] != sig[k])
        raise ValueError(f"run directory {run_dir} holds a checkpoint of a different model "
                         f"({diff or 'model fingerprint ' + str(old.get('model_fingerprint'))}); "
                         "use another train.run_dir or that run's model settings")
    if old is None and record and is_main():
        storage.write_text(meta, json.dumps({"model_fingerprint": fp, "model": sig}, indent=2))


def check_resume_config(run_dir: str, cfg: Config, steps: Sequence[int]) -> None:
    """A run directory holding checkpoints resumes only with the settings that produced them
    (supo_jax.config.RESUMABLE_KEYS may change): otherwise a ConfigError lists the differences
    and the two ways on. With train.accept_config_change the saved config is kept as
    config.step<N>.json."""
    saved = saved_config(run_dir) if steps else None
    if saved is None:
        return
    changes = config_changes(saved, cfg)
    if not changes:
        return
    if not cfg.train.accept_config_change:
        raise ConfigError(
            f"{run_dir} holds a run (checkpoint step {max(steps)}) made with other settings:\n  "
            + "\n  ".join(changes) + "\nstart a new run with another train.run_dir, or continue "
            "this one with the new settings: --set train.accept_config_change=true")
    if is_main():
        storage.replace(storage.join(run_dir, "config.json"),
                        storage.join(run_dir, f"config.step{max(steps)}.json"))
        print(f"resuming {run_dir} with changed settings ({'; '.join(changes)}); the old "
              f"config is kept as config.step{max(steps)}.json")


def serving_policy(cfg: Config, policy: Policy) -> Policy:
    """The policy on its serving layout for one rollout phase (supo_jax.model.serving):
    tensor groups of rollout.tensor chips, or (0) the largest group that divides the
    devices, the heads and the kv heads. One line (ConfigError) for a size the devices or
    the model cannot take."""
    from supo_jax.model.serving import auto_tensor, check_tensor, to_serving

    if policy.mesh is None:
        return policy
    mc, n = policy.config, policy.mesh.devices.size
    tensor = cfg.rollout.tensor or auto_tensor(mc, n)
    try:
        check_tensor(tensor, mc, n)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return to_serving(policy, tensor)


def sampler_rows(cfg: Config, rollouts: int, mesh) -> int:
    """The sampler's rows for `rollouts` rollouts: rollout.rows at most, rounded up to a
    multiple of the mesh's batch axes (data x fsdp) so that the KV cache's rows shard
    over them (the extra rows stay idle)."""
    n = min(cfg.rollout.rows, rollouts)
    if mesh is None:
        return n
    k = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    return -(-n // k) * k
