"""Plan a TPU run without a TPU: compile the run's programs ahead of time for a TPU slice.

    plan(cfg, "v5litepod-16", model_config="/ckpt/Qwen2.5-7B-Instruct") -> dict

libtpu (pip install "jax[tpu]") describes a slice (jax.experimental.topologies) and XLA
compiles for its chips on this machine, CPU only: nothing runs and no weight is made (every
input is a jax.ShapeDtypeStruct carrying its sharding). The programs are the run's own,
traced as a run on that slice traces them (supo_jax.model.platform: splash attention, matmul
precision, remat by the chip's memory, the sampler's layer scan):

  train_step   supo_jax.rl.train_step.train_step on one minibatch: optim.minibatch_rows rows
               of the longest training row (optim.max_row_len, else the row bound: W, or
               more under the paper's trigger rule, plan.row_bound),
               the policy's parameters and the trainer's optimizer state sharded by
               supo_jax.model.sharding's rules over the mesh (mesh.data x mesh.fsdp x
               mesh.tensor; fsdp -1 spans the chips), the batch over (data, fsdp)
  prefill      supo_jax.sampling.sampler.prefill: the longest prefill call, min(W, 4096) tokens
               (Sampler.append runs longer appends as calls of PREFILL_CHUNK tokens) for every
               sampler row
               (supo_jax.rl.runs.sampler_rows: min(rollout.rows, tasks_per_step x group_size)
               rounded up to the serving layout's groups) into a cache of row-bound slots, on the
               serving layout (supo_jax.model.serving: tensor groups of rollout.tensor chips,
               or the fewest whose weights fit beside the training state)
  decode       supo_jax.sampling.sampler.decode: one chunk of decode steps over those rows,
               attending over all those slots, on the serving layout
  to_serving   the one jitted call that makes the serving copy of the trained parameters
  recompute_logprobs   (only with optim.recompute_old_logprobs)
  decode_host_copy     (host_copy=True / --host-copy) the decode of one host's share of the
               rows on that host's chips alone, as a per-process copy of the policy would
               run it: for comparison

For each program, from the compiled HLO walked with every loop's trip count
(supo_jax.hlo_cost; XLA's cost_analysis counts a loop body once): FLOPs, HBM bytes and
interconnect bytes a chip, and its time: the bound max(FLOPs / peak of the compute dtype, HBM
bytes / HBM bandwidth, ICI time: each collective's bytes at the rate of the links its group
spans, collective_rate) naming what bounds it, the no-overlap sum of the three, and for the
train step and the decode a calibrated time: the no-overlap time times how much slower
MaxText's published train steps and JetStream's published decode run than the planner's
no-overlap time for them (TRAIN_CALIBRATION, DECODE_CALIBRATION; benchmarks/calibration.py),
from each chip generation's published figures (CHIPS). XLA's
per-chip memory (arguments, outputs, temporaries, aliased = donated buffers reused by outputs)
against the chip's HBM, and by phase: what is resident during rollouts (the training state
beside the sampler's largest program) and during the update; a predicted RL step (rl_step).
Estimates from compiled programs, not measurements.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time


GiB = 1 << 30

# gcloud accelerator type -> (topology name, chip config, chips per host bounds)
TOPOLOGIES: dict[str, tuple[str, str, tuple[int, int, int]]] = {
    "v4-8": ("v4:2x2x1", "megacore", (2, 2, 1)),
    "v4-16": ("v4:2x2x2", "megacore", (2, 2, 1)),
    "v4-32": ("v4:2x2x4", "megacore", (2, 2, 1)),
    "v5litepod-1": ("v5e:1x1", "default", (1, 1, 1)),
    "v5litepod-4": ("v5e:2x2", "default", (2, 2, 1)),
    "v5litepod-8": ("v5e:2x4", "default", (2, 4, 1)),
    "v5litepod-16": ("v5e:4x4", "default", (2, 2, 1)),
    "v5litepod-32": ("v5e:4x8", "default", (2, 2, 1)),
    "v5litepod-64": ("v5e:8x8", "default", (2, 2, 1)),
    "v5litepod-128": ("v5e:8x16", "default", (2, 2, 1)),
    "v5litepod-256": ("v5e:16x16", "default", (2, 2, 1)),
    "v5p-8": ("v5p:2x2x1", "megacore", (2, 2, 1)),
    "v5p-16": ("v5p:2x2x2", "megacore", (2, 2, 1)),
    "v5p-32": ("v5p:2x2x4", "megacore", (2, 2, 1)),
    "v5p-64": ("v5p:2x4x4", "megacore", (2, 2, 1)),
    "v5p-128": ("v5p:4x4x4", "megacore", (2, 2, 1)),
    "v5p-256": ("v5p:4x4x8", "megacore", (2, 2, 1)),
    "v6e-1": ("v6e:1x1", "default", (1, 1, 1)),
    "v6e-4": ("v6e:2x2", "default", (2, 2, 1)),
    "v6e-8": ("v6e:2x4", "default", (2, 4, 1)),
    "v6e-16": ("v6e:4x4", "default", (2, 2, 1)),
    "v6e-32": ("v6e:4x8", "default", (2, 2, 1)),
    "v6e-64": ("v6e:8x8", "default", (2, 2, 1)),
    "v6e-128": ("v6e:8x16", "default", (2, 2, 1)),
    "v6e-256": ("v6e:16x16", "default", (2, 2, 1)),
    # Ironwood: the name counts TensorCores (two a chip, each a JAX device), four chips a host
    # (Google's XPK, src/xpk/core/system_characteristics.py: tpu7x-{chips x 2})
    "tpu7x-8": ("tpu7x:2x2x1", "default", (2, 2, 1)),
    "tpu7x-16": ("tpu7x:2x2x2", "default", (2, 2, 1)),
    "tpu7x-32": ("tpu7x:2x2x4", "default", (2, 2, 1)),
    "tpu7x-64": ("tpu7x:2x4x4", "default", (2, 2, 1)),
    "tpu7x-128": ("tpu7x:4x4x4", "default", (2, 2, 1)),
    "tpu7x-256": ("tpu7x:4x4x8", "default", (2, 2, 1)),
    "tpu7x-512": ("tpu7x:4x8x8", "default", (2, 2, 1)),
}

# generation -> per chip: HBM bytes, peak dense FLOP/s by matmul input dtype, HBM bytes/s, and
# bidirectional inter-chip interconnect (ICI) bytes/s over all its ports (2 per torus
# dimension: v5e and v6e are 2-D tori, v4 and v5p 3-D), from each generation's system
# architecture page: https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e.
# The v4 page publishes no per-chip ICI bandwidth: its collectives get no time (said so).
CHIPS: dict[str, dict] = {
    "v4": {"torus_dims": 3, "hbm_bytes": 32 * GiB,
           "peak_flops": {"bfloat16": 275e12, "int8": 275e12},
           "hbm_bandwidth": 1.2e12, "ici_bandwidth": None,
           "source": "https://cloud.google.com/tpu/docs/v4"},
    "v5e": {"torus_dims": 2, "hbm_bytes": 16 * GiB,
            "peak_flops": {"bfloat16": 197e12, "int8": 393e12},
            "hbm_bandwidth": 819e9, "ici_bandwidth": 400e9,
            "source": "https://cloud.google.com/tpu/docs/v5e"},
    "v5p": {"torus_dims": 3, "hbm_bytes": 95 * GiB,
            "peak_flops": {"bfloat16": 459e12, "int8": 918e12},
            "hbm_bandwidth": 2.765e12, "ici_bandwidth": 1200e9,
            "source": "https://cloud.google.com/tpu/docs/v5p"},
    "v6e": {"torus_dims": 2, "hbm_bytes": 32 * GiB,
            "peak_flops": {"bfloat16": 918e12, "int8": 1836e12},
            "hbm_bandwidth": 1.638e12, "ici_bandwidth": 800e9,
            "source": "https://cloud.google.com/tpu/docs/v6e"},
    # two TensorCores a chip, which JAX sees as two devices: the figures are the chip's, and
    # a device has half of each (device_figures)
    "tpu7x": {"torus_dims": 3, "hbm_bytes": 192 * GiB, "cores_per_chip": 2,
              "peak_flops": {"bfloat16": 2307e12, "float8_e4m3fn": 4614e12},
              "hbm_bandwidth": 7.38e12, "ici_bandwidth": 1200e9,
              "source": "https://docs.cloud.google.com/tpu/docs/tpu7x"},
}


def device_figures(chip: dict) -> dict:
    """A chip's figures for one of its JAX devices: the whole chip's, except on a chip of
    several TensorCores that are devices of their own (Ironwood: two), where each device
    has its share of the HBM, the peak, the HBM bandwidth and the ICI links."""
    k = chip.get("cores_per_chip", 1)
    if k == 1:
        return chip
    return {**chip, "hbm_bytes": chip["hbm_bytes"] // k,
            "peak_flops": {d: f / k for d, f in chip["peak_flops"].items()},
            "hbm_bandwidth": chip["hbm_bandwidth"] / k,
            "ici_bandwidth": chip["ici_bandwidth"] and chip["ici_bandwidth"] / k}


def peak_flops(chip: dict, compute_dtype: str, precision: str = "default") -> float:
    """The matmul peak for a compute dtype: bfloat16's for bfloat16, and for float32 at the
    default precision (one bf16 pass on the MXU); a sixth of it for float32 at "highest"
    (XLA's six bf16 passes), which the model uses for float32 compute on an accelerator."""
    bf16 = chip["peak_flops"]["bfloat16"]
    if compute_dtype == "float32" and precision in ("auto", "highest"):
        return bf16 / 6
    return chip["peak_flops"].get(compute_dtype, bf16)


def generation(topology: str) -> str:
    """The chip generation of a slice name ('v5litepod-16' -> 'v5e')."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown TPU topology {topology!r}; one of {', '.join(TOPOLOGIES)}")
    return TOPOLOGIES[topology][0].split(":")[0]


def tpu_devices(topology: str) -> list:
    """The compile-only devices of a slice (libtpu's description of its chips)."""
    return _describe(*(TOPOLOGIES[topology] if topology in TOPOLOGIES else (
        generation(topology), None, None)), topology)


def host_devices(topology: str) -> list:
    """The compile-only devices of one host of a slice (its chips alone, as a slice of
    their own: XLA compiles for a whole topology, not for a subset of one)."""
    name, chip_config, per_host = TOPOLOGIES[topology]
    dims = per_host if name.startswith(("v4", "v5p", "tpu7x")) else per_host[:2]
    return _describe(name.split(":")[0] + ":" + "x".join(map(str, dims)), chip_config, per_host,
                     topology)


def _describe(name: str, chip_config, per_host, topology: str) -> list:
    # libtpu looks for the host's TPU at start-up; there is none here: say what it would ask
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # compile-only: no chip to guard, so several processes (pytest workers) may load libtpu
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                            chip_config_name=chip_config,
                                            chips_per_host_bounds=per_host, num_slices=1)
    except RuntimeError as e:
        raise ValueError(f"cannot describe TPU slice {topology}: {str(e).splitlines()[0]} "
                         "(pip install \"jax[tpu]\" brings libtpu)") from None
    return list(topo.devices)


TINY = "tiny"     # --model-config tiny: the config's tiny model, asked for by name


def row_bound(cfg) -> int:
    """context.row_bound for the run's tokenizer where model.path / train.init_from has one,
    else its upper bound without a tokenizer (W; under the paper's rule the summary's own
    budget beyond L, the instruction counted as a token a byte)."""
    from supo_jax.agent.render import ChatFormat
    from supo_jax.model.policy import load_tokenizer

    path = cfg.train.init_from or cfg.model.path
    try:
        fmt = ChatFormat(load_tokenizer(path)) if path else None
    except Exception:  # noqa: BLE001 - no tokenizer there: the bound without one
        fmt = None
    return cfg.context.row_bound(fmt)


def resolve_model_config(cfg, model_config_dir: str | None):
    """The architecture: a directory's config.json (--model-config DIR), else model.path /
    train.init_from's config.json; the config's tiny model (with the vocabulary of its
    tokenizer, trained on the environment's texts as a run trains it) only when asked for
    by name (--model-config tiny). No model at all is a one-line ValueError: a plan of the
    0.2M-parameter tiny policy under a paper config says nothing of the paper's run."""
    from supo_jax.model.config import ModelConfig

    if model_config_dir != TINY:
        path = model_config_dir or cfg.train.init_from or cfg.model.path
        if not path:
            raise ValueError("no model to plan: the config sets no model.path (or "
                             "train.init_from); pass --model-config DIR (a directory holding "
                             "the model's HF config.json), or --model-config tiny for the "
                             "config's tiny test policy")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"no config.json in {path!r} (pass --model-config DIR: a directory "
                             "holding the model's HF config.json)")
        try:
            return ModelConfig.from_pretrained(path)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    from supo_jax.model.tiny import tiny_config
    from supo_jax.rl.runs import env_tokenizer

    m = cfg.model
    vocab = int(math.ceil(len(env_tokenizer(cfg)) / 8) * 8)    # as rl.runs.build_policy
    return tiny_config(m.tiny_family, vocab_size=vocab, hidden=m.tiny_hidden, layers=m.tiny_layers,
                       heads=m.tiny_heads, kv_heads=m.tiny_kv_heads, mlp=m.tiny_mlp)


def _sds(x, sharding=None):
    import jax
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def abstract_policy(mc, m, mesh):
    """(graphdef, params): the Decoder built abstractly (nnx.eval_shape), each parameter a
    ShapeDtypeStruct with the sharding supo_jax.model.sharding gives it on `mesh`."""
    import jax
    from flax import nnx

    from supo_jax.model.decoder import Decoder
    from supo_jax.model.policy import _dtype
    from supo_jax.model.sharding import param_sharding

    pdt = _dtype(m.dtype)
    cdt = _dtype(m.compute_dtype or None) or pdt
    lora = m.lora()

    def build():
        model = Decoder(mc, param_dtype=pdt, dtype=cdt, rngs=nnx.Rngs(0), **m.decoder_options())
        if lora is not None:
            from supo_jax.model.lora import add_adapters
            add_adapters(model, lora, base_dtype=m.lora_base_dtype)
        return model

    graphdef, state = nnx.split(nnx.eval_shape(build))
    pure = nnx.to_pure_dict(state)
    pure = jax.tree_util.tree_map_with_path(
        lambda path, x: _sds(x, param_sharding(".".join(str(getattr(k, "key", k)) for k in path),
                                               x.shape, mesh)), pure)
    nnx.replace_by_pure_dict(state, pure)
    return graphdef, state, cdt


def abstract_opt_state(tx, params, mesh):
    """tx's state of `params`, abstract: the moments with their parameters' shardings, the
    scalars replicated (as train_step.init_opt_state places them)."""
    import jax

    from supo_jax.model.sharding import replicated
    from supo_jax.rl.train_step import trainable

    by_path = {tuple(p): x.sharding for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    shapes = jax.eval_shape(tx.init, trainable(params))

    def place(path, x):
        for i in range(len(path)):
            sh = by_path.get(tuple(path[i:]))
            if sh is not None:
                return _sds(x, sh)
        return _sds(x, replicated(mesh))

    return jax.tree_util.tree_map_with_path(place, shapes)


def serving_params(params, mesh, compute_dtype):
    """The serving copy of abstract training `params` on the serving `mesh`: each parameter
    with its sharding there, floating ones in the compute dtype (supo_jax.model.serving)."""
    import jax
    from flax import nnx

    from supo_jax.model.serving import _casts, _name
    from supo_jax.model.sharding import param_sharding

    pure = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(
            x.shape, compute_dtype if _casts(_name(path), x.dtype, compute_dtype) else x.dtype,
            sharding=param_sharding(_name(path), x.shape, mesh)), nnx.to_pure_dict(params))
    out = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(out, pure)
    return out


def _shard_bytes(tree) -> int:
    """Bytes a chip holds of an abstract tree (each leaf's shard under its sharding)."""
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def _train_programs(cfg, mc, mesh):
    """{name: (jitted, args, kwargs)} of the update on the training mesh, its shapes, and the
    abstract parameters and optimizer state."""
    import jax
    import jax.numpy as jnp

    from supo_jax.model.sharding import batch_sharding
    from supo_jax.rl.batch import TrainBatch
    from supo_jax.rl.train_step import make_optimizer, step_programs, trainable

    # as a run on TPU compiles them (mesh.collective_matmul)
    train_step, recompute_logprobs = step_programs("tpu", cfg.mesh.collective_matmul)
    o, r, ctx = cfg.optim, cfg.rollout, cfg.context
    graphdef, params, cdt = abstract_policy(mc, cfg.model, mesh)
    # the train step: one minibatch of the longest rows (rl.runs.row_len: the row bound)
    T = o.max_row_len or row_bound(cfg)
    rows = o.minibatch_rows
    if rows % o.micro:
        raise ValueError(f"optim.minibatch_rows={rows} does not split into optim.micro={o.micro} "
                         "microbatches")
    tx = make_optimizer(o.lr, weight_decay=o.weight_decay, clip_norm=o.clip_norm)
    opt_state = abstract_opt_state(tx, params, mesh)
    shape = (rows, T)
    sh = batch_sharding(mesh, shape)
    ints, floats = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh), \
        jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh)
    batch = TrainBatch(inputs=ints, targets=ints, positions=ints, segment_ids=ints, mask=floats,
                       old_logp=floats, advantages=floats)
    loss_cfg = dataclasses.replace(cfg.loss, temperature=r.temperature or 1.0)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    out = {"train_step": (train_step, (graphdef, params, opt_state, batch), dict(
        tx=tx, cfg=loss_cfg, micro=o.micro,
        ref_params=trainable(params) if cfg.loss.kl_coef else None,
        lr=scalar, max_kl=scalar if o.max_kl > 0 else None))}
    if o.recompute_old_logprobs:
        out["recompute_logprobs"] = (recompute_logprobs, (graphdef, params, batch, loss_cfg), {})
    return out, {"minibatch_rows": rows, "row_len": T}, graphdef, params, opt_state, cdt


def _sampler_programs(cfg, mc, graphdef, params, mesh, rows: int):
    """{name: (jitted, args, kwargs)}: the longest prefill call and one decode chunk over
    `rows` sampler rows with `params` (as placed on `mesh`), and their shapes."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from supo_jax.model.decoder import KVCache
    from supo_jax.model.sharding import spec_for
    from supo_jax.sampling.sampler import (PREFILL_CHUNK, STOP_WIDTH, SamplingParams, bucket,
                                           cache_length, decode, prefill)

    r, ctx = cfg.rollout, cfg.context
    cdt = _compute_dtype(cfg.model)
    W, B = cache_length(row_bound(cfg)), rows
    # the sampler's cache of W slots (the row bound, rounded up as Sampler rounds it) in the
    # compute dtype, sharded as Sampler shards it
    cache_shape = (mc.num_layers, B, mc.num_kv_heads, W, mc.head_dim)
    kv_sh = NamedSharding(mesh, spec_for(("layers", "batch", "kv_heads", "cache_len", "head_dim"),
                                         cache_shape, mesh))
    len_sh = NamedSharding(mesh, spec_for(("batch",), (B,), mesh))
    cache = KVCache(jax.ShapeDtypeStruct(cache_shape, cdt, sharding=kv_sh),
                    jax.ShapeDtypeStruct(cache_shape, cdt, sharding=kv_sh),
                    jax.ShapeDtypeStruct((B,), jnp.int32, sharding=len_sh))
    vec = lambda dt: jax.ShapeDtypeStruct((B,), dt, sharding=len_sh)
    t = bucket(min(W, PREFILL_CHUNK), 16, W)    # Sampler.append's longest call (chunked)
    out = {"prefill": (prefill, (graphdef, params, cache, jax.ShapeDtypeStruct(
        (B, t), jnp.int32, sharding=NamedSharding(mesh, spec_for(("batch", None), (B, t), mesh))),
        vec(jnp.int32)), dict(attend_len=W))}
    steps = bucket(max(ctx.action_tokens, ctx.max_summary_tokens), 8)
    steps = min(steps, 64)                                 # Sampler's decode_chunk
    sp = SamplingParams(r.temperature, r.top_k, r.top_p)
    logits_sh = NamedSharding(mesh, spec_for(("batch", None), (B, mc.vocab_size), mesh))
    out["decode"] = (decode, (graphdef, params, cache, jax.ShapeDtypeStruct(
        (B, mc.vocab_size), jnp.float32, sharding=logits_sh),
        jax.eval_shape(lambda: jax.random.key(0)),
        vec(jnp.bool_), vec(jnp.int32), jax.ShapeDtypeStruct((B, STOP_WIDTH), jnp.int32),
        jax.ShapeDtypeStruct((B, 2), jnp.int32, sharding=NamedSharding(
            mesh, spec_for(("batch", None), (B, 2), mesh))), vec(jnp.int32), None),
        dict(steps=steps, attend_len=W, sp=sp, unroll_layers=False))   # TPU: the layer scan
    cache_bytes = 2 * math.prod(cache_shape) * jnp.dtype(cdt).itemsize
    return out, {"sampler_rows": B, "cache_len": W, "decode_steps": steps, "prefill_len": t,
                 "cache_bytes": cache_bytes}


def _compute_dtype(m):
    from supo_jax.model.policy import _dtype
    return _dtype(m.compute_dtype or None) or _dtype(m.dtype)


def _to_serving(train_mesh, params, mesh, compute_dtype, chip, peak, dump) -> dict:
    """The serving copy's calls (supo_jax.model.serving.reshard_one, one a parameter, run one
    after another) compiled, as one program's figures: arguments (the training parameters)
    and outputs (the serving weights) summed, temporaries the largest call's (a call's are
    freed when it returns); FLOPs, bytes and times summed."""
    from flax import nnx

    from supo_jax.model.serving import reshard_calls, reshard_one

    calls = reshard_calls(nnx.to_pure_dict(params), train_mesh, mesh, compute_dtype)
    seen, parts = {}, []
    for path, x, kw in calls:
        key = (x.shape, str(x.dtype), x.sharding, tuple(sorted(kw.items(), key=str)))
        if key not in seen:
            compiled = _compile("to_serving." + ".".join(str(getattr(k, "key", k)) for k in path),
                                reshard_one, (x,), kw, mesh, dump)
            seen[key] = (_memory(compiled), _figures(compiled, chip, peak, mesh=mesh))
        parts.append(seen[key])
    mem = {k: sum(m[k] for m, _ in parts) for k in ("argument", "output", "alias", "host_temp")}
    mem.update(temp=max(m["temp"] for m, _ in parts), code=max(m["code"] for m, _ in parts))
    mem["total"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["code"]
    sec = {k: sum(f["seconds"][k] for _, f in parts) for k in ("compute", "hbm", "ici")}
    return {"bytes_per_chip": mem, "fits": mem["total"] <= chip["hbm_bytes"], "calls": len(parts),
            "flops_per_chip": sum(f["flops_per_chip"] for _, f in parts),
            "hbm_bytes_per_chip": sum(f["hbm_bytes_per_chip"] for _, f in parts),
            "collective_bytes_per_chip": sum(f["collective_bytes_per_chip"] for _, f in parts),
            "seconds": sec, "estimated_seconds": sum(f["estimated_seconds"] for _, f in parts),
            "no_overlap_seconds": sum(f["no_overlap_seconds"] for _, f in parts),
            "bound": max(sec, key=sec.get), "model_flops_per_chip": 0.0, "loops": [],
            "largest_collectives": [], "kernels": [],
            "xla_cost_analysis": {k: sum(f["xla_cost_analysis"][k] for _, f in parts)
                                  for k in ("flops", "bytes_accessed")}}


def _trainable_figures(params, opt_state) -> dict:
    """What the optimizer trains and holds state for: every parameter, or the LoRA adapters
    alone (their count, the bytes of all parameters, and of the optimizer state)."""
    import jax

    from supo_jax.rl.train_step import split_trainable

    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    train, frozen = split_trainable(params)
    return {"trainable_params": sum(x.size for x in jax.tree.leaves(train)),
            "adapters": frozen is not None, "param_bytes": nbytes(params),
            "trainable_bytes": nbytes(train), "opt_state_bytes": nbytes(opt_state)}


def _memory(compiled) -> dict:
    """XLA's per-chip memory of a compiled program (donated arguments, reused by outputs,
    counted once); host_temp: pinned host memory it keeps (remat "offload")."""
    mem = compiled.memory_analysis()
    b = {"argument": int(mem.argument_size_in_bytes), "output": int(mem.output_size_in_bytes),
         "temp": int(mem.temp_size_in_bytes), "alias": int(mem.alias_size_in_bytes),
         "code": int(mem.generated_code_size_in_bytes),
         "host_temp": int(getattr(mem, "host_temp_size_in_bytes", 0) or 0)}
    b["total"] = b["argument"] + b["output"] - b["alias"] + b["temp"] + b["code"]
    return b


# custom calls that compute (Mosaic kernels: splash attention); the others are plumbing
KERNELS = ("tpu_custom_call",)


def _links(dims: list[int]) -> list[int]:
    """ICI links a chip has along each torus dimension of a slice: none along a dimension of
    1 chip, one along a dimension of 2 (one neighbour), two along a longer one (a neighbour
    each way; a slice short of a full pod has no wraparound, and a bidirectional ring along
    a line is taken to reach the same rate)."""
    return [0 if d == 1 else 1 if d == 2 else 2 for d in dims]


def collective_rate(op: str, group, coords, dims: list[int], ici: float, ports: int) -> float:
    """Bytes a second one chip sends in a collective over the links it can use, not over
    every port: a chip has `ports` ports (4 on a 2-D torus, 6 on a 3-D one) sharing its
    published bidirectional ICI bandwidth `ici`, so a port sends at ici / 2 / ports. A
    collective among chips that differ along some torus dimensions runs as rings along
    those, over the links of those dimensions (_links); a collective-permute sends to one
    neighbour, over one link. `group`: the collective's first replica group (the program's
    logical device ids, hlo_cost), `coords`: each logical id's chip coordinates; without
    them (a form hlo_cost does not read) every port counts, as for a whole-slice collective.
    dims: the slice's extent along each coordinate."""
    port = ici / 2 / ports
    if op == "collective-permute":
        return port
    if not group or coords is None or len(group) < 2:
        return ici / 2
    spanned = [k for k in range(len(dims)) if len({tuple(coords[i])[k] for i in group}) > 1]
    links = sum(_links(dims)[k] for k in spanned)
    return port * links if links else ici / 2


def _figures(compiled, chip: dict, peak: float, model_flops: float = 0.0, mesh=None) -> dict:
    """Per chip, from the compiled HLO walked with every loop's trip count (supo_jax.hlo_cost):
    FLOPs, HBM bytes, bytes over the interconnect; each's time at the chip's published rate
    and the estimate, their maximum (a bound: it assumes every transfer overlaps the
    compute), naming its bound, and their sum (no overlap at all). A collective's bytes go
    at the rate of the links along the torus dimensions its group spans (collective_rate;
    `mesh`: the program's mesh, whose devices in order are its logical ids; without it every
    port counts). The FLOPs of Mosaic kernels (splash attention) are not in the HLO: the
    compute time is at least the program's model FLOPs (`model_flops` a chip) at the peak."""
    from supo_jax.hlo_cost import hlo_cost

    c = hlo_cost(compiled.as_text())
    xla = compiled.cost_analysis()
    xla = (xla[0] if xla else {}) if isinstance(xla, (list, tuple)) else (xla or {})
    ici = chip["ici_bandwidth"]
    hbm = c.hbm_bytes - c.alt_memory_bytes        # not what stays in on-chip memory (VMEM)
    coords = dims = None
    if mesh is not None and getattr(mesh.devices.flat[0], "coords", None) is not None:
        coords = [tuple(d.coords) for d in mesh.devices.flat]
        dims = [len({c_[k] for c_ in coords}) for k in range(len(coords[0]))]
    ici_seconds = 0.0
    for col in c.collectives:
        rate = collective_rate(col["op"], col.get("group"), coords, dims or [1],
                               ici, 2 * chip["torus_dims"]) if ici else 0.0
        col["gb_per_second"] = rate / 1e9
        ici_seconds += col["bytes"] * col["executions"] / rate if rate else 0.0
    seconds = {"compute": max(c.flops, model_flops) / peak, "hbm": hbm / chip["hbm_bandwidth"],
               "ici": ici_seconds}
    bound = max(seconds, key=seconds.get)
    top = sorted(c.collectives, key=lambda x: -x["bytes"] * x["executions"])[:6]
    top = [{k: v for k, v in x.items() if k != "group"} for x in top]
    mem = sorted(c.memory_ops, key=lambda x: -x["bytes"] * x["executions"])[:8]
    return {"flops_per_chip": c.flops, "hbm_bytes_per_chip": hbm,
            "vmem_bytes_per_chip": c.alt_memory_bytes, "largest_memory_ops": mem,
            "collective_bytes_per_chip": c.collective_bytes, "seconds": seconds,
            "estimated_seconds": seconds[bound], "bound": bound,
            "no_overlap_seconds": sum(seconds.values()),
            "model_flops_per_chip": model_flops, "loops": c.loops, "largest_collectives": top,
            "kernels": sorted({k["target"] for k in c.custom_calls if k["target"] in KERNELS}),
            "xla_cost_analysis": {"flops": float(xla.get("flops", 0.0) or 0.0),
                                  "bytes_accessed": float(xla.get("bytes accessed", 0.0) or 0.0)}}


def matmul_params(mc) -> int:
    """Parameters a token's forward multiplies by: every layer weight and the LM head (the
    input embedding is a lookup, unless tied to the head)."""
    embed = 0 if mc.tie_embeddings else mc.vocab_size * mc.hidden_size
    return mc.num_params - embed


def train_model_flops(mc, rows: int, T: int, adapters: bool = False) -> float:
    """The update's useful FLOPs for rows x T tokens: 6 N per token (forward and backward
    over the matmul parameters) plus causal attention, 6 L H D T per token (QK^T and AV over
    on average T / 2 earlier positions, 4 L H D T/2 forward, x3 with the backward). With
    LoRA adapters the frozen base gets no weight gradient: 4 N per token (the adapters'
    own FLOPs, rank r << hidden, are left out)."""
    attn = 6 * mc.num_layers * mc.num_heads * mc.head_dim * T
    return rows * T * ((4 if adapters else 6) * matmul_params(mc) + attn)


def decode_model_flops(mc, span: int) -> float:
    """A decode step's FLOPs a row: 2 N plus attention over `span` slots (4 L H D span)."""
    return 2 * matmul_params(mc) + 4 * mc.num_layers * mc.num_heads * mc.head_dim * span


def _compile(name, fn, args, kwargs, mesh, dump):
    from supo_jax.model.sharding import mesh_scope

    with mesh_scope(mesh):
        compiled = fn.lower(*args, **kwargs).compile()
    if dump:
        from supo_jax import storage
        storage.makedirs(dump)
        storage.write_text(storage.join(dump, f"{name}.hlo.txt"), compiled.as_text())
    return compiled


def hlo_cost_of(fn, args, kwargs, mesh):
    """supo_jax.hlo_cost of a jitted function compiled for `mesh`'s devices."""
    from supo_jax.hlo_cost import hlo_cost
    return hlo_cost(_compile("", fn, args, kwargs, mesh, None).as_text())


def plan(cfg, topology: str, *, model_config: str | None = None,
         programs: tuple[str, ...] | None = None, host_copy: bool = False,
         training_layout: bool = False, dump: str | None = None,
         segments: int | None = None, generated_tokens: int | None = None,
         search_rows: bool = True) -> dict:
    """Compile the run's programs ahead of time for the TPU slice `topology` (a gcloud
    accelerator type, e.g. v5litepod-16) and report, for each, XLA's bytes per chip, the
    HLO-counted FLOPs, HBM and interconnect bytes a chip, the estimated time and its bound;
    for the run, the memory resident in each phase (rollouts; the update) against the
    chip's HBM, the train step's MFU and the rollouts' tokens a second a chip (bounds).
    ValueError (one line) for an unknown topology, a mesh the chips do not divide, no
    model or a missing config.json, a bad rollout.tensor. `programs`: compile only these;
    default all. host_copy: also compile `decode_host_copy` (the decode over one host's
    chips alone, as a per-process copy of the policy would need), not counted in `fits`.
    training_layout: also compile `decode_training_layout`, the decode on the training
    mesh with the parameters as training shards them (how rollouts sampled before the
    serving layout), not counted in `fits`.
    dump: write each program's compiled HLO text to DIR/NAME.hlo.txt. segments /
    generated_tokens: a rollout's work for the predicted RL step (rl_step; default the caps).
    search_rows: where the rollout phase does not fit (or XLA refuses a sampler program),
    find the most sampler rows that fit (_pick_rows) and show their programs."""
    from supo_jax.model import platform
    from supo_jax.model.serving import auto_tensor, check_tensor, serving_mesh
    from supo_jax.model.sharding import make_mesh
    from supo_jax.rl.runs import sampler_rows

    gen = generation(topology)
    chip = device_figures(CHIPS[gen])
    mc = resolve_model_config(cfg, model_config)
    devices = tpu_devices(topology)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    cdt_name = cfg.model.compute_dtype or cfg.model.dtype
    peak = peak_flops(chip, cdt_name, cfg.model.precision)
    report = {"topology": topology, "tpu_topology": TOPOLOGIES[topology][0],
              "device_kind": devices[0].device_kind, "chips": len(devices),
              # JAX devices a chip (Ironwood: 2); every "_per_chip" figure is a device's
              "devices_per_chip": CHIPS[gen].get("cores_per_chip", 1),
              "mesh": dict(mesh.shape), "hbm_bytes_per_chip": chip["hbm_bytes"],
              "peak_flops_per_chip": peak, "hbm_bandwidth_per_chip": chip["hbm_bandwidth"],
              "ici_bandwidth_per_chip": chip["ici_bandwidth"], "chip_source": chip["source"],
              "model": {"layers": mc.num_layers, "hidden": mc.hidden_size,
                        "heads": mc.num_heads, "kv_heads": mc.num_kv_heads,
                        "vocab": mc.vocab_size, "params": mc.num_params,
                        "dtype": cfg.model.dtype, "compute_dtype": cdt_name,
                        "attention": cfg.model.attention},
              "programs": {}, "versions": _versions()}
    with platform.compiling_for("tpu", chip["hbm_bytes"]):
        built, shapes, graphdef, params, opt_state, cdt = _train_programs(cfg, mc, mesh)
        report["training"] = tr = _trainable_figures(params, opt_state)
        state_bytes = _shard_bytes(params) + _shard_bytes(opt_state) + (
            _shard_bytes(params) if cfg.loss.kl_coef else 0)
        # the serving layout: rollout.tensor, else the largest valid group (as a run)
        n = len(devices)
        tensor = cfg.rollout.tensor or auto_tensor(mc, n)
        try:
            check_tensor(tensor, mc, n)
        except ValueError as e:
            raise ValueError(str(e)) from None
        smesh = serving_mesh(mesh, tensor)
        sparams = serving_params(params, smesh, cdt)
        rows = sampler_rows(cfg, cfg.rollout.tasks_per_step * cfg.rollout.group_size, smesh)
        sampler, sshapes = _sampler_programs(cfg, mc, graphdef, sparams, smesh, rows)
        built.update(sampler)
        built["to_serving"] = None      # compiled call by call (_to_serving)
        shapes.update(sshapes)
        report["serving"] = {"tensor": tensor, "mesh": dict(smesh.shape),
                             "weight_bytes_per_chip": _shard_bytes(sparams),
                             # what a decode step reads of them: not the input embedding's
                             # table (a lookup of a row a token) unless it is the LM head too
                             "decode_read_bytes_per_chip": _shard_bytes(sparams) - (
                                 0 if mc.tie_embeddings else _shard_bytes(sparams["embed"]))}
        report["training_state_bytes_per_chip"] = state_bytes
        unknown = set(programs or ()) - set(built)
        if unknown:
            raise ValueError(f"unknown program(s) {', '.join(sorted(unknown))}; this config "
                             f"has {', '.join(built)}")
        report["shapes"] = shapes
        meshes = {"train_step": mesh, "recompute_logprobs": mesh, "to_serving": smesh}
        todo = [(name, meshes.get(name, smesh), prog) for name, prog in built.items()
                if programs is None or name in programs]

        def program(name, m, prog, dump_as=None, s=None):
            fn, args, kwargs = prog or (None, None, None)
            t0 = time.perf_counter()
            try:
                if name == "to_serving":
                    return {**_to_serving(mesh, params, smesh, cdt, chip, peak, dump),
                            "compile_seconds": time.perf_counter() - t0}
                compiled = _compile(dump_as or name, fn, args, kwargs, m, dump)
            except Exception as e:   # noqa: BLE001  (XLA / Mosaic refusing the program is the finding)
                return {"fits": False, "error": f"{type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0][:400]}",
                        "compile_seconds": time.perf_counter() - t0}
            b = _memory(compiled)
            return {"bytes_per_chip": b, "fits": b["total"] <= chip["hbm_bytes"],
                    **_figures(compiled, chip, peak,
                               _model_flops(name, mc, s or shapes, tr["adapters"]) / m.size, m),
                    "compile_seconds": time.perf_counter() - t0}

        for name, m, prog in todo:
            report["programs"][name] = program(name, m, prog)
        ts = report["programs"].get("train_step")
        if ts is not None and not ts["fits"]:
            report["remat"] = _pick_remat(cfg, mc, mesh, ts, program, chip["hbm_bytes"])
            if report["remat"]["picked"]:
                report["programs"]["train_step"] = report["remat"].pop("program")
        ro = _rollout_phase(report["programs"], state_bytes, chip["hbm_bytes"])
        if search_rows and ro is not None and not ro["fits"]:
            report["rows"] = _pick_rows(cfg, mc, graphdef, sparams, smesh, shapes,
                                        report["programs"], program, state_bytes,
                                        chip["hbm_bytes"])
            if report["rows"]["picked"]:
                report["programs"].update(report["rows"].pop("programs"))
                shapes.update(report["rows"].pop("shapes"))
        # the comparisons, at the rows the plan shows (the configured ones, or the search's)
        if host_copy:
            host = host_devices(topology)
            hmesh = make_mesh(1, -1, 1, devices=host)
            # one host's share of the sampler rows, on its own chips with the whole policy
            hrows = -(-shapes["sampler_rows"] * len(host) // len(devices))
            hg, hp, _ = abstract_policy(mc, cfg.model, hmesh)
            report.update(host_chips=len(host), host_sampler_rows=hrows)
            report["programs"]["decode_host_copy"] = program(
                "decode_host_copy", hmesh, _sampler_programs(
                    cfg, mc, hg, serving_params(hp, hmesh, cdt), hmesh, hrows)[0]["decode"])
        if training_layout:
            rcfg = dataclasses.replace(cfg, rollout=dataclasses.replace(
                cfg.rollout, rows=shapes["sampler_rows"]))
            trows = sampler_rows(rcfg, cfg.rollout.tasks_per_step * cfg.rollout.group_size,
                                 mesh)
            report["programs"]["decode_training_layout"] = program(
                "decode_training_layout", mesh, _sampler_programs(
                    cfg, mc, graphdef, params, mesh, trows)[0]["decode"],
                s={**shapes, "sampler_rows": trows})
    report["phases"] = _phases(report)
    calibrate(report)
    report["estimates"] = _estimates(report, mc)
    report["rl_step"] = rl_step(report, cfg, segments, generated_tokens)
    progs = {k: p for k, p in report["programs"].items() if k not in COMPARISONS}
    report["fits"] = all(p["fits"] for p in progs.values()) and all(
        ph["fits"] for ph in report["phases"].values())
    return report


# remat policies from the most memory a chip to the least (supo_jax.model.decoder.REMAT; "auto"
# resolves to one of them by the chip's memory and is taken as full here)
REMAT_BY_MEMORY = ("none", "dots", "full", "offload_qkvo", "offload")


# the remat search (_pick_remat) stops at the first program within this share of the chip's
# HBM (XLA's total leaves out the runtime's own allocations and fragmentation); where none is,
# it picks the first that fits at all
HEADROOM = 0.95


def _pick_remat(cfg, mc, mesh, first: dict, program, hbm: float = float("inf")) -> dict:
    """The update does not fit (or XLA refused it) at the config's model.remat: compile the
    train step under each policy that keeps less, in order (REMAT_BY_MEMORY), until one fits;
    when none does, at the last policy the program changes that keep less again: the LM head
    split over the vocabulary, then the MLP in token chunks (MLP_CHUNKS) that divide the row.
    It stops at the first within HEADROOM of `hbm`, else picks the first that fits.
    {configured, picked (the remat policy, None: nothing fits), sets (every setting the
    picked program differs by, as --set arguments), tried: [{remat, sets, bytes or error}],
    program: the picked one's figures}."""
    configured = cfg.model.remat
    # auto resolves by the model's size and the chip's memory (Decoder.remat_mode) to none,
    # dots, full or offload: every policy that keeps less than none is tried
    start = REMAT_BY_MEMORY.index(configured if configured in REMAT_BY_MEMORY else "none")

    def tried(sets, p):
        return {"remat": sets.get("remat", configured), "sets": _as_sets(sets),
                "bytes": p.get("bytes_per_chip", {}).get("total"), "error": p.get("error")}
    out = {"configured": configured, "picked": None, "sets": [],
           "tried": [tried({}, first)]}
    T = cfg.optim.max_row_len or row_bound(cfg)
    tries = [{"remat": r} for r in REMAT_BY_MEMORY[start + 1:]]
    last = {"remat": (tries[-1]["remat"] if tries else configured)}
    if cfg.model.head_split != "vocab":
        last = {**last, "head_split": "vocab"}
        tries.append(last)
    tries += [{**last, "mlp_chunks": n} for n in MLP_CHUNKS
              if n > cfg.model.mlp_chunks and T % n == 0]
    fitting = None
    for sets in tries:
        c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **sets))
        name = "train_step." + ".".join(f"{k.replace('_', '-')}-{v}" for k, v in sets.items())
        p = program("train_step", mesh, _train_programs(c, mc, mesh)[0]["train_step"], name)
        out["tried"].append(tried(sets, p))
        if p["fits"] and fitting is None:
            fitting = (c.model.remat, sets, p)
        if p["fits"] and p["bytes_per_chip"]["total"] <= HEADROOM * hbm:
            fitting = (c.model.remat, sets, p)
            break
    if fitting:
        remat, sets, p = fitting
        out.update(picked=remat, sets=_as_sets(sets),
                   program={**p, "remat": remat, "sets": _as_sets(sets)})
    return out


# what the remat search tries beyond the policies (_pick_remat), in order: the LM head split
# over the vocabulary (model.head_split=vocab: no head gathered whole), then the MLP in token
# chunks (model.mlp_chunks: one chunk's intermediates at a time, more weight reads)
MLP_CHUNKS = (2, 4, 8)


def _as_sets(sets: dict) -> list[str]:
    return [f"model.{k}={v}" for k, v in sets.items()]


def _model_flops(name: str, mc, s: dict, adapters: bool = False) -> float:
    """A program's model FLOPs on the whole slice (train step, prefill, decode; else 0)."""
    if name == "train_step":
        return train_model_flops(mc, s["minibatch_rows"], s["row_len"], adapters)
    if name in ("decode", "decode_training_layout"):
        return s["sampler_rows"] * s["decode_steps"] * decode_model_flops(mc, s["cache_len"])
    if name == "prefill":       # the LM head at each row's last new token only
        head = 2 * mc.vocab_size * mc.hidden_size
        return s["sampler_rows"] * (s["prefill_len"] * (decode_model_flops(mc, s["cache_len"])
                                                        - head) + head)
    return 0.0


COMPARISONS = ("decode_host_copy", "decode_training_layout")   # reported, not in `fits`


def _phases(rep: dict) -> dict:
    """Bytes a chip resident in each phase of a step, against the chip's HBM.
    rollouts: the training state (parameters, optimizer state, a KL reference) stays
    resident while the sampler's programs run; the largest of them (each holds the serving
    weights, the KV cache and its temporaries; to_serving the copy being made) on top.
    update: the train step (its arguments are the training state and the batch); the
    serving copy and the cache are freed before it."""
    p, hbm = rep["programs"], rep["hbm_bytes_per_chip"]
    out = {}
    ro = _rollout_phase(p, rep["training_state_bytes_per_chip"], hbm)
    if ro is not None:
        out["rollout"] = ro
    if "bytes_per_chip" in p.get("train_step", {}):
        b = p["train_step"]["bytes_per_chip"]["total"]
        out["update"] = {"bytes": b, "largest": "train_step", "fits": b <= hbm}
    return out


SAMPLER_PROGRAMS = ("prefill", "decode")


def _rollout_phase(progs: dict, state: int, hbm: float) -> dict | None:
    """The rollout phase's bytes a chip: the training state beside the largest sampler
    program (prefill, decode; to_serving less its argument, the state). A sampler program
    XLA refused (over HBM at compile time) makes the phase not fit: `refused` names it, and
    `bytes` counts the programs that compiled. None without a sampler program."""
    sampler = [(n, progs[n]["bytes_per_chip"]) for n in SAMPLER_PROGRAMS
               if "bytes_per_chip" in progs.get(n, {})]
    refused = [n for n in SAMPLER_PROGRAMS if "error" in progs.get(n, {})]
    if "bytes_per_chip" in progs.get("to_serving", {}):
        b = progs["to_serving"]["bytes_per_chip"]        # its argument is the training state
        sampler.append(("to_serving", {"total": b["total"] - b["argument"]}))
    if not sampler and not refused:
        return None
    name, b = max(sampler, key=lambda x: x[1]["total"]) if sampler else (None, {"total": 0})
    out = {"bytes": state + b["total"], "largest": name or refused[0],
           "fits": not refused and state + b["total"] <= hbm}
    if refused:
        out["refused"] = refused
    return out


def _pick_rows(cfg, mc, graphdef, sparams, smesh, shapes: dict, progs: dict, program,
               state: int, hbm: float) -> dict:
    """The rollout phase does not fit at the configured sampler rows: the most rows, a
    multiple of the serving layout's batch ways (data x fsdp: the cache's rows shard over
    them) below them, whose prefill and decode compile and leave the phase within HEADROOM of
    `hbm` beside the training state, by bisection (each try compiles the sampler programs the
    plan compiles; the phase's bytes grow with the rows); where no try is within HEADROOM,
    the most rows that fit at all. None tried where the rows cannot help: the training state
    beside the serving copy (`fixed`) over HEADROOM. {configured (sampler rows), picked (rows,
    None: none fits), within (HEADROOM), sets (--set arguments), tried: [{rows, bytes,
    refused}], programs and shapes of the picked}."""
    k = smesh.shape.get("data", 1) * smesh.shape.get("fsdp", 1)
    first = shapes["sampler_rows"]
    names = [n for n in SAMPLER_PROGRAMS if n in progs]       # those the plan compiles
    ro = _rollout_phase(progs, state, hbm)
    out = {"configured": first, "picked": None, "sets": [],
           "tried": [{"rows": first, "bytes": ro["bytes"], "refused": ro.get("refused", [])}]}
    b = progs.get("to_serving", {}).get("bytes_per_chip")
    fixed = state + (b["total"] - b["argument"] if b else 0)  # what no row count changes
    if fixed > HEADROOM * hbm or not names:
        out["fixed"] = fixed
        return out
    lo, hi, best, fitting = 0, first // k, None, None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        built, sh = _sampler_programs(cfg, mc, graphdef, sparams, smesh, mid * k)
        s = {**shapes, **sh}
        tried = {n: program(n, smesh, built[n], f"{n}.rows-{mid * k}", s) for n in names}
        ro = _rollout_phase({**progs, **tried}, state, hbm)
        out["tried"].append({"rows": mid * k, "bytes": ro["bytes"],
                             "refused": ro.get("refused", [])})
        if ro["fits"] and (fitting is None or mid > fitting[0]):
            fitting = (mid, tried, sh)        # the most rows that fit at all, the fallback
        if ro["fits"] and ro["bytes"] <= HEADROOM * hbm:
            lo, best = mid, (mid, tried, sh)
        else:
            hi = mid
    best = best or fitting
    if best:
        n = best[0] * k
        out.update(picked=n, sets=[f"rollout.rows={n}"], shapes=best[2],
                   within=next(t["bytes"] for t in out["tried"] if t["rows"] == n)
                   <= HEADROOM * hbm,
                   programs={p: {**f, "rows": n} for p, f in best[1].items()})
    return out


def format_rows(rw: dict, hbm: float) -> str:
    """The rows search's line (_pick_rows's report)."""
    def at(t):
        return (f"{', '.join(t['refused'])} over HBM" if t["refused"]
                else f"{t['bytes'] / GiB:.1f} GiB a chip ({100 * t['bytes'] / hbm:.0f}%)")
    first, rest = rw["tried"][0], rw["tried"][1:]
    head = f"rollouts at {first['rows']} sampler rows do not fit ({at(first)})"
    if "fixed" in rw:
        return (head + f": the training state beside the serving copy alone needs "
                f"{rw['fixed'] / GiB:.1f} GiB a chip, over {100 * HEADROOM:.0f}% of HBM at any "
                "rows (a larger slice, or LoRA)")
    return (head + "".join(f"; {t['rows']} rows: {at(t)}" for t in rest)
            + (f": the plan picked {rw['sets'][0]} (--set {rw['sets'][0]}), whose sampler "
               f"programs are shown (dumped as NAME.rows-{rw['picked']})"
               + ("" if rw["within"] else f"; no try is within {100 * HEADROOM:.0f}% of HBM")
               if rw["picked"] else
               ": no fewer rows fit beside the training state (a larger slice, "
               "rollout.tensor, or LoRA)"))


# How much slower than the planner's no-overlap time (compute, HBM and ICI one after another,
# each at the chip's published rate) published measurements of the same shapes on the same
# slices run: the calibrated time of a program is its no-overlap time times the factor.
# Fitted by benchmarks/calibration.py (benchmarks/results/calibration.json, fit_calibration; a
# test checks these values against that file). Train: MaxText's train steps (tpu-recipes,
# trillium: Llama-3.1-8B on v6e-8, v6e-16 and v6e-256, Mistral-7B on v6e-8, Llama-3.1-70B on
# v6e-32, each at the recipe's remat and collective-matmul settings, the last two with the
# MLP in 4 token chunks, the 70B's LM head split over the vocabulary, without which our
# programs do not fit the chip), 1.23-1.31x each, each point within 4.6% of its time when left
# out of the fit (a program that does not fit is left out of it). Ironwood has a fit of its
# own (TRAIN_CALIBRATIONS; ironwood: Llama-3.1-70B on tpu7x-128 and tpu7x-512): its measured
# steps run nearer the planner's no-overlap time (1.07x; the SparseCores run the collectives
# beside the TensorCores' compute), which one shared factor would miss by 18%. Decode: JetStream's serving
# throughput (jetstream-pytorch benchmarks/summary.md: Llama-3-8B at 128 rows, Llama-2-7B at
# 96, 2048 cache slots, v5e-8, model parallel), 1.60x and 1.36x (a serving loop adds the
# prompts' prefills between steps, idle rows, the host), each within 18% left out. Every
# published point lies beyond the planner's band: a factor on its slow end, not a fraction of
# it. (The decode points fit a constant 8 ms a step beyond the bound as well, but carried to a
# small model's 0.01 ms step a constant would make it 800x slower; a factor does not.)
TRAIN_CALIBRATION = 1.273
TRAIN_CALIBRATIONS = {"tpu7x": 1.075}     # generations with a train fit of their own
DECODE_CALIBRATION = 1.479


def fit_calibration(points: list[dict]) -> dict:
    """A calibration of published points, each {point, seconds (measured), no_overlap_seconds
    (the planner's for the same program)}: r_k = seconds / no_overlap a point, `factor` their
    mean (`factors`: each point's); `leave_one_out`: each point predicted from the mean of the
    others' (no_overlap x r) and its miss, predicted / measured - 1."""
    rs = [p["seconds"] / p["no_overlap_seconds"] for p in points]
    out = {"factor": sum(rs) / len(rs) if rs else None,
           "factors": {p["point"]: r for p, r in zip(points, rs)}, "leave_one_out": []}
    for k, p in enumerate(points):
        rest = rs[:k] + rs[k + 1:]
        if not rest:
            continue
        r = sum(rest) / len(rest)
        t = p["no_overlap_seconds"] * r
        out["leave_one_out"].append({"point": p["point"], "factor": r, "predicted_seconds": t,
                                     "miss": t / p["seconds"] - 1})
    return out


def calibrated_seconds(prog: dict, factor: float | None) -> float | None:
    """A program's calibrated time: its no-overlap time x `factor` (None: no calibration)."""
    return None if factor is None else prog["no_overlap_seconds"] * factor


# the programs whose calibrated time is the decode's (a chunk of decode steps), and those that
# are forward passes over long rows like the train step (no published point of their own: the
# train step's factor); the serving copy, a collective alone, is at no overlap
DECODES = ("decode", "decode_training_layout", "decode_host_copy")
FORWARDS = ("train_step", "recompute_logprobs", "prefill")


def train_calibration(topology: str | None) -> tuple[float, str]:
    """(factor, its name) for the forward passes on a slice: its generation's own fit where it
    has one (TRAIN_CALIBRATIONS), else the shared TRAIN_CALIBRATION."""
    gen = TOPOLOGIES[topology][0].split(":")[0] if topology in TOPOLOGIES else None
    if gen in TRAIN_CALIBRATIONS:
        return TRAIN_CALIBRATIONS[gen], f"TRAIN_CALIBRATIONS['{gen}']"
    return TRAIN_CALIBRATION, "TRAIN_CALIBRATION"


def calibrate(rep: dict) -> None:
    """Each compiled program's calibrated time in place: `calibrated_seconds` and
    `calibrated_by` (what it was calibrated on)."""
    train, train_name = train_calibration(rep.get("topology"))
    for name, p in rep["programs"].items():
        if "estimated_seconds" not in p:
            continue
        t = None
        if name in DECODES:
            t = calibrated_seconds(p, DECODE_CALIBRATION)
            by = "JetStream's decode: the no-overlap time x DECODE_CALIBRATION"
        elif name in FORWARDS:
            t = calibrated_seconds(p, train)
            by = (f"MaxText's train steps: the no-overlap time x {train_name}"
                  + ("" if name == "train_step" else " (no published point of its own: the "
                     "train step's)"))
        if t is None:
            t, by = p["no_overlap_seconds"], "no published point: at no overlap"
        p["calibrated_seconds"], p["calibrated_by"] = t, by


def _estimates(rep: dict, mc) -> dict:
    """The train step's MFU (model FLOPs, 6 N tokens + attention, a chip over its time at the
    peak) and tokens a second a chip, the rollouts' decode tokens a second a chip, each twice:
    `_bound` from the program's time under perfect overlap of compute, HBM and ICI (the
    largest of the three: an upper bound on speed), `_no_overlap` from their sum; and the
    decode chunk's bound against its HBM roofline (every chip reading its serving weights,
    less the input embedding's table, and its share of the cache once a step)."""
    p, s, chips = rep["programs"], rep["shapes"], rep["chips"]
    out = {}

    def both(prog, name, work, calibrated=False):  # work / time: bound, no overlap, calibrated
        out_ = {f"{name}_bound": work / prog["estimated_seconds"],
                f"{name}_no_overlap": work / prog["no_overlap_seconds"]}
        if calibrated and "calibrated_seconds" in prog:
            out_[f"{name}_calibrated"] = work / prog["calibrated_seconds"]
        return out_

    ts = p.get("train_step", {})
    if "estimated_seconds" in ts:
        model = train_model_flops(mc, s["minibatch_rows"], s["row_len"],
                                  rep["training"]["adapters"]) / chips
        out.update(train_model_flops_per_chip=model,
                   **both(ts, "train_mfu", model / rep["peak_flops_per_chip"], True),
                   **both(ts, "train_tokens_per_second_per_chip",
                          s["minibatch_rows"] * s["row_len"] / chips, True))
        if "calibrated_seconds" in ts:
            out["train_step_seconds"] = {"bound": ts["estimated_seconds"],
                                         "calibrated": ts["calibrated_seconds"],
                                         "no_overlap": ts["no_overlap_seconds"]}
    t = p.get("decode_training_layout", {})
    if "estimated_seconds" in t:
        out.update(**both(t, "training_layout_rollout_tokens_per_second_per_chip",
                          s["sampler_rows"] * s["decode_steps"] / chips),
                   training_layout_collective_bytes_per_step=t["collective_bytes_per_chip"]
                   / s["decode_steps"])
    d = p.get("decode", {})
    if "estimated_seconds" in d:
        steps = s["decode_steps"]
        roof = steps * (rep["serving"]["decode_read_bytes_per_chip"] + s["cache_bytes"] / chips) \
            / rep["hbm_bandwidth_per_chip"]
        work = s["sampler_rows"] * steps / chips
        out.update(**both(d, "rollout_tokens_per_second_per_chip", work),
                   decode_hbm_roofline_seconds=roof,
                   decode_over_roofline=d["estimated_seconds"] / roof,
                   # what the roofline reads from HBM every step and the program keeps in
                   # on-chip memory (TPU VMEM, layout S(1)) across its steps instead
                   decode_roofline_bytes_per_chip=roof * rep["hbm_bandwidth_per_chip"],
                   decode_vmem_bytes_per_chip=d.get("vmem_bytes_per_chip", 0.0),
                   decode_collective_bytes_per_step=d["collective_bytes_per_chip"] / steps)
        cal = d.get("calibrated_seconds")
        if cal is not None:
            out["rollout_tokens_per_second_per_chip_calibrated"] = work / cal
            out["decode_step_seconds"] = {"bound": d["estimated_seconds"] / steps,
                                          "calibrated": cal / steps,
                                          "no_overlap": d["no_overlap_seconds"] / steps}
    return out


def rl_step(rep: dict, cfg, segments: int | None = None,
            generated_tokens: int | None = None) -> dict | None:
    """A predicted RL step of the run from its compiled programs' times: the rollout phase
    (the serving copy once; each wave of sampler rows prefilling its context and decoding its
    generated tokens) plus the update phase (ppo_epochs passes over every segment's row, a
    train step a minibatch, after one forward pass over them when
    optim.recompute_old_logprobs), each as bound, no overlap and calibrated (each program's
    calibrated time, `calibrate`), and the whole run (train.steps steps) in chip-hours.

    The work a rollout does is an assumption, said in the result's `work`: by default the
    caps (an upper bound): `segments` = S + 1 rows (S = context.max_summaries; 1 under a
    manager without summaries), each prefilling up to the row length, and `generated_tokens`
    = H actions of max_action_tokens plus S summaries of max_summary_tokens, at most the
    rows' tokens. Pass a run's measured means (metrics.jsonl: tokens generated, segments a
    rollout) to predict that run instead. Rows advance independently in a run; here the
    rollouts run in waves of the sampler's rows, each as long as one rollout. None when a
    program it needs did not compile."""
    for name, v in (("segments", segments), ("generated_tokens", generated_tokens)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be at least 1 (got {v})")
    p, s = rep["programs"], rep["shapes"]
    ctx, r, o = cfg.context, cfg.rollout, cfg.optim
    # optim.recompute_old_logprobs (rollout.budget_tokens sets it): one forward pass over
    # every row before the update's epochs
    need = ("train_step", "prefill", "decode", "to_serving") + (
        ("recompute_logprobs",) if o.recompute_old_logprobs else ())
    if any("estimated_seconds" not in p.get(n, {}) for n in need):
        return None
    summaries = ctx.max_summaries if ctx.manager == "supo" else 0
    cap = (summaries + 1) * s["row_len"]
    segments = segments or summaries + 1
    generated = generated_tokens or min(ctx.max_steps * ctx.action_tokens
                                        + summaries * ctx.max_summary_tokens, cap)
    rollouts = r.tasks_per_step * r.group_size
    waves = -(-rollouts // s["sampler_rows"])
    prefills = -(-segments * s["row_len"] // s["prefill_len"])   # calls a rollout, at most
    decodes = generated / s["decode_steps"]
    minibatches = -(-rollouts * segments // s["minibatch_rows"])
    updates = o.ppo_epochs * minibatches
    forwards = minibatches if o.recompute_old_logprobs else 0   # (in minibatch-row programs)

    def phase(kind: str) -> dict:
        # calibrated: the decode's and the update's; resharding and prefill (no published
        # point) at no overlap
        key = {"bound": "estimated_seconds", "no_overlap": "no_overlap_seconds",
               "calibrated": "calibrated_seconds"}[kind]
        rollout = p["to_serving"][key] + waves * (prefills * p["prefill"][key]
                                                  + decodes * p["decode"][key])
        update = updates * p["train_step"][key] + (
            forwards * p["recompute_logprobs"][key] if forwards else 0.0)
        return {"rollout": rollout, "update": update, "step": rollout + update}

    kinds = ["bound", "no_overlap"] + (["calibrated"] if all(
        "calibrated_seconds" in p[n] for n in need) else [])
    given = bool(generated_tokens) or segments != summaries + 1
    out = {"work": {"rollouts": rollouts, "segments": segments, "generated_tokens": generated,
                    "prefill_tokens": segments * s["row_len"], "waves": waves,
                    "prefill_calls": prefills, "decode_chunks": decodes,
                    "train_steps": updates, "recompute_passes": forwards,
                    "assumed": "given" if given else "caps"},
           **{k: phase(k) for k in kinds}}
    steps = cfg.train.steps
    chips = rep["chips"] / rep.get("devices_per_chip", 1)     # chips, not devices, are billed
    out["run_chip_hours"] = {k: out[k]["step"] * steps * chips / 3600 for k in kinds}
    out["run_steps"] = steps
    return out


def format_rl_step(st: dict | None) -> list[str]:
    """The predicted RL step as lines of text (none without one)."""
    if not st:
        return []
    w = st["work"]
    kinds = [k for k in ("bound", "no_overlap", "calibrated") if k in st]

    def band(key):
        return " / ".join(f"{st[k][key]:.3g}" for k in kinds) + " s"
    return [f"RL step ({' / '.join(kinds)}): rollouts {band('rollout')}, update "
            f"{band('update')}, step {band('step')}; {w['rollouts']} rollouts in {w['waves']} "
            f"wave(s), each {w['segments']} segment(s), {w['generated_tokens']} generated tokens"
            + (" (the caps: an upper bound on the work; --segments / --generated-tokens set a "
               "run's means)" if w["assumed"] == "caps" else " (as given)")
            + ("; calibrated: each program's (the serving copy at no overlap)" if "calibrated"
               in st else ""),
            f"whole run ({st['run_steps']} steps): "
            + " / ".join(f"{st['run_chip_hours'][k]:.3g}" for k in kinds) + " chip-hours"]


def _versions() -> dict:
    import importlib.metadata

    import jax

    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = None
    return {"jax": jax.__version__, "libtpu": libtpu}


def _gib(n: float) -> str:
    return f"{n / GiB:.3f} GiB" if n >= GiB / 100 else f"{n / (1 << 20):.2f} MiB"


def format_remat(rm: dict, picked: dict, hbm: float) -> str:
    """The remat search's line (_pick_remat's report `rm`; `picked`: the train step shown)."""
    def at(t):
        return (f"{t['bytes'] / GiB:.1f} GiB a chip" if t["bytes"] is not None
                else (t["error"] or "")[:80])
    return (f"update at model.remat={rm['configured']} does not fit ({at(rm['tried'][0])})"
            + "".join(f"; {' '.join(t['sets'])}: {at(t)}" for t in rm["tried"][1:])
            + (f": the plan picked {', '.join(rm['sets'])}, whose figures are shown "
               f"({' '.join('--set ' + x for x in rm['sets'])})"
               + ("" if picked["bytes_per_chip"]["total"] <= HEADROOM * hbm else
                  f"; no try is within {100 * HEADROOM:.0f}% of HBM")
               if rm["picked"]
               else ": nothing tried fits (remat policies, the head split over the "
               "vocabulary, the MLP in token chunks)"))


def format_plan(rep: dict) -> str:
    """The plan as text: the slice, the model, the serving layout, each program's figures,
    the memory of each phase and the run's estimates."""
    m = rep["model"]
    ici = rep["ici_bandwidth_per_chip"]
    k = rep.get("devices_per_chip", 1)
    unit = "chip" if k == 1 else "device"
    lines = [f"{rep['topology']} ({rep['tpu_topology']}, {rep['device_kind']}): {rep['chips']} "
             + ("chips" if k == 1 else f"devices ({rep['chips'] // k} chips of {k} TensorCores, "
                "each a device with its share of the chip's figures)")
             + f", {_gib(rep['hbm_bytes_per_chip'])} HBM each; training mesh {rep['mesh']}",
             f"{unit}: {rep['peak_flops_per_chip'] / 1e12:.0f} TFLOP/s ({m['compute_dtype']} "
             f"matmuls), HBM {rep['hbm_bandwidth_per_chip'] / 1e9:.0f} GB/s, ICI "
             + (f"{ici / 1e9:.0f} GB/s bidirectional" if ici else "not published (no time "
                "counted for collectives)") + f" ({rep['chip_source']})",
             f"model: {m['layers']} layers, hidden {m['hidden']}, heads {m['heads']}/"
             f"{m['kv_heads']}, vocab {m['vocab']}, {m['params'] / 1e6:.1f}M parameters "
             f"({m['dtype']}, compute {m['compute_dtype']}, attention {m['attention']})",
             "shapes: " + ", ".join(f"{k} {v}" for k, v in rep["shapes"].items())]
    sv = rep.get("serving")
    if sv:
        lines.append(f"rollouts: serving layout {sv['mesh']} (rollout.tensor={sv['tensor']}): "
                     f"{_gib(sv['weight_bytes_per_chip'])} of weights a chip")
    tr = rep.get("training")
    if tr:
        lines.append(f"trained: {'LoRA adapters, ' if tr['adapters'] else 'every parameter, '}"
                     f"{tr['trainable_params'] / 1e6:.2f}M parameters ({_gib(tr['trainable_bytes'])}"
                     f"); optimizer state {_gib(tr['opt_state_bytes'])}; all parameters "
                     f"{_gib(tr['param_bytes'])} (whole slice, before sharding); training "
                     f"state {_gib(rep['training_state_bytes_per_chip'])} a chip")
    for name, p in rep["programs"].items():
        lines.append("")
        if name == "decode_training_layout":
            lines.append("decode_training_layout: the same decode on the training mesh with the "
                         "parameters as training shards them (before the serving layout; not "
                         "counted in the exit status)")
        if name == "decode_host_copy":
            lines.append(f"decode_host_copy: the decode of one host's share of the rows "
                         f"({rep['host_sampler_rows']}) on its {rep['host_chips']} chips alone, "
                         "as a per-host copy of the policy would run it (not counted in the "
                         "exit status)")
        if "error" in p:
            lines.append(f"{name}: DOES NOT COMPILE ({p['error']})")
            continue
        b = p["bytes_per_chip"]
        picked = (f" at {', '.join(p['sets'])}, not the configured model.remat="
                  f"{rep['remat']['configured']}, which does not fit" if "remat" in p else
                  f" at rollout.rows={p['rows']}, not the configured "
                  f"{rep['rows']['configured']} sampler rows, which do not fit" if "rows" in p
                  else "")
        lines.append(f"{name}: {'fits' if p['fits'] else 'DOES NOT FIT'}{picked} "
                     f"(compiled in {p['compile_seconds']:.1f} s)")
        for k in ("argument", "output", "alias", "temp", "code", "total"):
            lines.append(f"  {k + ' bytes/chip':24s} {_gib(b[k]):>14s}"
                         + (f"   ({100 * b[k] / rep['hbm_bytes_per_chip']:.1f}% of HBM)"
                            if k == "total" else ""))
        if b.get("host_temp"):
            lines.append(f"  {'host memory/chip':24s} {_gib(b['host_temp']):>14s}"
                         "   (offloaded to the host: not in HBM)")
        sec = p["seconds"]
        lines.append(f"  {'flops/chip':24s} {p['flops_per_chip']:>14.4g}   "
                     f"{sec['compute'] * 1e3:10.3f} ms at peak")
        lines.append(f"  {'HBM bytes/chip':24s} {_gib(p['hbm_bytes_per_chip']):>14s}   "
                     f"{sec['hbm'] * 1e3:10.3f} ms")
        lines.append(f"  {'ICI bytes/chip':24s} {_gib(p['collective_bytes_per_chip']):>14s}   "
                     f"{sec['ici'] * 1e3:10.3f} ms")
        lines.append(f"  {'estimated time':24s} {p['estimated_seconds'] * 1e3:>11.3f} ms"
                     f"   ({p['bound']}-bound: perfect overlap)")
        lines.append(f"  {'no overlap':24s} {p['no_overlap_seconds'] * 1e3:>11.3f} ms")
        if "calibrated_seconds" in p:
            lines.append(f"  {'calibrated':24s} {p['calibrated_seconds'] * 1e3:>11.3f} ms   "
                         f"({p['calibrated_by']})")
        loops = ", ".join(f"{lp['trip_count']}x ({lp['source']})" for lp in p["loops"])
        if loops:
            lines.append(f"  {'loops':24s} {loops}")
        if p["kernels"]:
            lines.append(f"  {'kernels':24s} {', '.join(p['kernels'])} (FLOPs not in the HLO: "
                         f"compute time at least the model's {p['model_flops_per_chip']:.4g} "
                         "FLOPs a chip)")
    for name, ph in rep.get("phases", {}).items():
        lines.append(f"{'' if name != 'rollout' else chr(10)}phase {name}: "
                     + (f"{', '.join(ph['refused'])} refused by XLA (over HBM); the programs "
                        "that compiled: " if ph.get("refused") else "")
                     + f"{_gib(ph['bytes'])} a chip resident "
                     f"({100 * ph['bytes'] / rep['hbm_bytes_per_chip']:.0f}% of HBM; largest "
                     f"program {ph['largest']}): {'fits' if ph['fits'] else 'DOES NOT FIT'}")
    e = rep.get("estimates", {})
    if "train_mfu_bound" in e:
        lines.append(f"train step: MFU at most {100 * e['train_mfu_bound']:.0f}% (compute, HBM "
                     f"and ICI overlapping perfectly), {100 * e['train_mfu_no_overlap']:.0f}% "
                     "with no overlap ("
                     f"{e['train_tokens_per_second_per_chip_no_overlap']:.0f} to "
                     f"{e['train_tokens_per_second_per_chip_bound']:.0f} tokens/s a chip)")
        if "train_mfu_calibrated" in e:
            lines.append(f"train step calibrated: MFU {100 * e['train_mfu_calibrated']:.0f}%, "
                         f"{e['train_tokens_per_second_per_chip_calibrated']:.0f} tokens/s a "
                         f"chip, {e['train_step_seconds']['calibrated']:.3g} s a step (the no-overlap "
                         "time x how much slower MaxText's published steps are than theirs: an "
                         "assumption, not a measurement; BENCHMARKS.md)")
    if "rollout_tokens_per_second_per_chip_bound" in e:
        lines.append(f"rollouts: {e['rollout_tokens_per_second_per_chip_no_overlap']:.0f} to "
                     f"{e['rollout_tokens_per_second_per_chip_bound']:.0f} decode tokens/s "
                     f"a chip (no overlap to perfect overlap); decode at "
                     f"{e['decode_over_roofline']:.2f}x its HBM roofline"
                     + (f" (below 1: of the {_gib(e['decode_roofline_bytes_per_chip'])} of "
                        "weights and KV cache the roofline reads from HBM, the program moves "
                        f"{_gib(e['decode_vmem_bytes_per_chip'])} in on-chip memory, VMEM, "
                        "where they stay across its steps)"
                        if e["decode_over_roofline"] < 0.9
                        and "decode_vmem_bytes_per_chip" in e else "")
                     + f"; {_gib(e['decode_collective_bytes_per_step'])} over ICI a chip a step")
        if "rollout_tokens_per_second_per_chip_calibrated" in e:
            lines.append(f"rollouts calibrated: "
                         f"{e['rollout_tokens_per_second_per_chip_calibrated']:.0f} decode "
                         f"tokens/s a chip, {1e3 * e['decode_step_seconds']['calibrated']:.3g} ms "
                         "a step (the no-overlap time x how much slower JetStream's published "
                         "decode steps are than theirs: an assumption, not a measurement; "
                         "BENCHMARKS.md)")
    if rep.get("remat"):
        lines.append(format_remat(rep["remat"], rep["programs"]["train_step"],
                                  rep["hbm_bytes_per_chip"]))
    if rep.get("rows"):
        lines.append(format_rows(rep["rows"], rep["hbm_bytes_per_chip"]))
    lines += format_rl_step(rep.get("rl_step"))
    lines.append("(bounds from the compiled programs, not measurements: a chip reaches neither "
                 "perfect overlap nor none)")
    return "\n".join(lines)
