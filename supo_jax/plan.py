"""Plan a TPU run without a TPU: compile the run's programs ahead of time for a TPU slice.

    plan(cfg, "v5litepod-16", model_config="/ckpt/Qwen2.5-7B-Instruct") -> dict

libtpu (pip install "jax[tpu]") describes a slice (jax.experimental.topologies) and XLA
compiles for its chips on this machine, CPU only: nothing runs and no weight is made (every
input is a jax.ShapeDtypeStruct carrying its sharding). The programs are the run's own,
traced as a run on that slice traces them (supo_jax.model.platform: splash attention, matmul
precision, remat by the chip's memory, the sampler's layer scan):

  train_step   supo_jax.rl.train_step.train_step on one minibatch: optim.minibatch_rows rows
               of the longest training row (optim.max_row_len, else W = context.working_context),
               the policy's parameters and the trainer's optimizer state sharded by
               supo_jax.model.sharding's rules over the mesh (mesh.data x mesh.fsdp x
               mesh.tensor; fsdp -1 spans the chips), the batch over (data, fsdp)
  prefill      supo_jax.sampling.sampler.prefill: the longest prefill call, min(W, 4096) tokens
               (Sampler.append runs longer appends as calls of PREFILL_CHUNK tokens) for every
               sampler row
               (supo_jax.rl.runs.sampler_rows: min(rollout.rows, tasks_per_step x group_size)
               rounded up to the mesh's batch axes) into a cache of W slots, on the training
               mesh (every process samples with the parameters as training shards them)
  decode       supo_jax.sampling.sampler.decode: one chunk of decode steps over those rows,
               attending over all W slots
  recompute_logprobs   (only with optim.recompute_old_logprobs)
  decode_host_copy     (host_copy=True / --host-copy) the decode of one host's share of the
               rows on that host's chips alone, as a per-process copy of the policy would
               run it: for comparison

For each: XLA's per-chip memory (arguments, outputs, temporaries, aliased = donated buffers
reused by outputs) against the chip's HBM, its flops per chip, and a roofline estimate of its
time, max(flops / peak flops, bytes accessed / HBM bandwidth), from the tables below.
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
}

# generation -> per chip: HBM bytes, peak bf16 flop/s, HBM bytes/s (published figures)
CHIPS: dict[str, dict] = {
    "v4": {"hbm_bytes": 32 * GiB, "peak_flops": 275e12, "hbm_bandwidth": 1.2e12},
    "v5e": {"hbm_bytes": 16 * GiB, "peak_flops": 197e12, "hbm_bandwidth": 819e9},
    "v5p": {"hbm_bytes": 95 * GiB, "peak_flops": 459e12, "hbm_bandwidth": 2.76e12},
    "v6e": {"hbm_bytes": 32 * GiB, "peak_flops": 918e12, "hbm_bandwidth": 1.64e12},
}


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
    dims = per_host if name.startswith(("v4", "v5p")) else per_host[:2]
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


def resolve_model_config(cfg, model_config_dir: str | None):
    """The architecture: a directory's config.json (--model-config), else model.path /
    train.init_from's config.json, else the config's tiny model with the vocabulary of its
    tokenizer (trained on the environment's texts, as a run trains it)."""
    from supo_jax.model.config import ModelConfig

    path = model_config_dir or cfg.train.init_from or cfg.model.path
    if path:
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
    scalars replicated (as trainer.init_opt_state places them)."""
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


def _programs(cfg, mc, mesh, sampler_rows_: int | None = None):
    """{name: (jitted function, args, kwargs)}: the run's programs with abstract inputs."""
    import jax
    import jax.numpy as jnp

    from supo_jax.model.decoder import KVCache
    from supo_jax.model.sharding import batch_sharding, spec_for
    from supo_jax.rl.batch import TrainBatch
    from supo_jax.rl.runs import sampler_rows
    from supo_jax.rl.train_step import make_optimizer, recompute_logprobs, train_step
    from supo_jax.sampling.sampler import PREFILL_CHUNK, SamplingParams, bucket, decode, prefill
    from jax.sharding import NamedSharding

    o, r, ctx = cfg.optim, cfg.rollout, cfg.context
    graphdef, params, cdt = abstract_policy(mc, cfg.model, mesh)
    W = ctx.working_context
    out = {}

    # the train step: one minibatch of the longest rows (rl.runs.row_len: W is the bound)
    T = o.max_row_len or W
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
    out["train_step"] = (train_step, (graphdef, params, opt_state, batch), dict(
        tx=tx, cfg=loss_cfg, micro=o.micro, ref_params=params if cfg.loss.kl_coef else None,
        lr=scalar, max_kl=scalar if o.max_kl > 0 else None))
    if o.recompute_old_logprobs:
        out["recompute_logprobs"] = (recompute_logprobs, (graphdef, params, batch, loss_cfg), {})

    # the sampler (trainer.rollout_batch's rows; Sampler's cache of W slots in the compute
    # dtype, sharded as Sampler shards it); the longest prefill call, one decode chunk over W slots
    B = sampler_rows_ or sampler_rows(cfg, r.tasks_per_step * r.group_size, mesh)
    cache_shape = (mc.num_layers, B, mc.num_kv_heads, W, mc.head_dim)
    kv_sh = NamedSharding(mesh, spec_for(("layers", "batch", "kv_heads", "cache_len", "head_dim"),
                                         cache_shape, mesh))
    len_sh = NamedSharding(mesh, spec_for(("batch",), (B,), mesh))
    cache = KVCache(jax.ShapeDtypeStruct(cache_shape, cdt, sharding=kv_sh),
                    jax.ShapeDtypeStruct(cache_shape, cdt, sharding=kv_sh),
                    jax.ShapeDtypeStruct((B,), jnp.int32, sharding=len_sh))
    vec = lambda dt: jax.ShapeDtypeStruct((B,), dt)
    t = bucket(min(W, PREFILL_CHUNK), 16, W)    # Sampler.append's longest call (chunked)
    out["prefill"] = (prefill, (graphdef, params, cache, jax.ShapeDtypeStruct((B, t), jnp.int32),
                                vec(jnp.int32)), dict(attend_len=W))
    steps = bucket(max(ctx.max_action_tokens, ctx.max_summary_tokens), 8)
    steps = min(steps, 64)                                 # Sampler's decode_chunk
    sp = SamplingParams(r.temperature, r.top_k, r.top_p)
    out["decode"] = (decode, (graphdef, params, cache, jax.ShapeDtypeStruct(
        (B, mc.vocab_size), jnp.float32), jax.eval_shape(lambda: jax.random.key(0)),
        vec(jnp.bool_), vec(jnp.int32), jax.ShapeDtypeStruct((B, 2), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32), None),
        dict(steps=steps, attend_len=W, sp=sp, unroll_layers=False))   # TPU: the layer scan
    return out, {"minibatch_rows": rows, "row_len": T, "sampler_rows": B, "cache_len": W,
                 "decode_steps": steps, "prefill_len": t}, _trainable_figures(params, opt_state)


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


def _figures(compiled, chip: dict) -> dict:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    b = {"argument": int(mem.argument_size_in_bytes), "output": int(mem.output_size_in_bytes),
         "temp": int(mem.temp_size_in_bytes), "alias": int(mem.alias_size_in_bytes),
         "code": int(mem.generated_code_size_in_bytes),
         # host memory (pinned_host) the program keeps per chip: remat "offload"'s layer inputs
         "host_temp": int(getattr(mem, "host_temp_size_in_bytes", 0) or 0)}
    # donated arguments (alias) are reused by outputs: counted once
    b["total"] = b["argument"] + b["output"] - b["alias"] + b["temp"] + b["code"]
    flops = float(cost.get("flops", 0.0) or 0.0)
    accessed = float(cost.get("bytes accessed", 0.0) or 0.0)
    moved = accessed if accessed > 0 else float(b["total"])
    return {"bytes_per_chip": b, "fits": b["total"] <= chip["hbm_bytes"],
            "flops_per_chip": flops, "bytes_accessed_per_chip": accessed,
            "estimated_seconds": max(flops / chip["peak_flops"], moved / chip["hbm_bandwidth"])}


def plan(cfg, topology: str, *, model_config: str | None = None,
         programs: tuple[str, ...] | None = None, host_copy: bool = False) -> dict:
    """Compile the run's programs (train_step, prefill, decode) ahead of time for the TPU
    slice `topology` (a gcloud accelerator type, e.g. v5litepod-16) and report, for each, its
    bytes per chip against the chip's HBM, whether it fits, its flops per chip and an estimated
    time. ValueError (one line) for an unknown topology, a mesh the chips do not divide, or a
    missing config.json. `programs`: compile only these (names as above); default all.
    host_copy: also compile `decode_host_copy`, the decode over one host's chips alone (the
    whole policy sharded over them: what a per-process copy of the policy would need),
    reported beside the others and not counted in `fits`."""
    from supo_jax.model import platform
    from supo_jax.model.sharding import make_mesh, mesh_scope

    gen = generation(topology)
    chip = CHIPS[gen]
    mc = resolve_model_config(cfg, model_config)
    devices = tpu_devices(topology)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    report = {"topology": topology, "tpu_topology": TOPOLOGIES[topology][0],
              "device_kind": devices[0].device_kind, "chips": len(devices),
              "mesh": dict(mesh.shape), "hbm_bytes_per_chip": chip["hbm_bytes"],
              "peak_flops_per_chip": chip["peak_flops"],
              "hbm_bandwidth_per_chip": chip["hbm_bandwidth"],
              "model": {"layers": mc.num_layers, "hidden": mc.hidden_size,
                        "heads": mc.num_heads, "kv_heads": mc.num_kv_heads,
                        "vocab": mc.vocab_size, "params": mc.num_params,
                        "dtype": cfg.model.dtype, "compute_dtype": cfg.model.compute_dtype
                        or cfg.model.dtype, "attention": cfg.model.attention},
              "programs": {}, "versions": _versions()}
    with platform.compiling_for("tpu", chip["hbm_bytes"]):
        built, shapes, report["training"] = _programs(cfg, mc, mesh)
        unknown = set(programs or ()) - set(built)
        if unknown:
            raise ValueError(f"unknown program(s) {', '.join(sorted(unknown))}; this config "
                             f"has {', '.join(built)}")
        report["shapes"] = shapes
        todo = [(name, mesh, prog) for name, prog in built.items()
                if programs is None or name in programs]
        if host_copy:
            host = host_devices(topology)
            hmesh = make_mesh(1, -1, 1, devices=host)
            # one host's share of the sampler rows, on its own chips with the whole policy
            rows = -(-shapes["sampler_rows"] * len(host) // len(devices))
            todo.append(("decode_host_copy", hmesh,
                         _programs(cfg, mc, hmesh, sampler_rows_=rows)[0]["decode"]))
            report.update(host_chips=len(host), host_sampler_rows=rows)
        for name, m, (fn, args, kwargs) in todo:
            t0 = time.perf_counter()
            try:
                with mesh_scope(m):
                    compiled = fn.lower(*args, **kwargs).compile()
            except Exception as e:   # noqa: BLE001  (XLA / Mosaic refusing the program is the finding)
                report["programs"][name] = {"fits": False, "error": f"{type(e).__name__}: "
                                            f"{str(e).strip().splitlines()[0][:400]}",
                                            "compile_seconds": time.perf_counter() - t0}
                continue
            report["programs"][name] = {**_figures(compiled, chip),
                                        "compile_seconds": time.perf_counter() - t0}
    report["fits"] = all(p["fits"] for n, p in report["programs"].items()
                         if n != "decode_host_copy")
    return report


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


def format_plan(rep: dict) -> str:
    """The plan as text: the slice, then a table per program."""
    m = rep["model"]
    lines = [f"{rep['topology']} ({rep['tpu_topology']}, {rep['device_kind']}): {rep['chips']} "
             f"chips, {_gib(rep['hbm_bytes_per_chip'])} HBM each; mesh {rep['mesh']}",
             f"model: {m['layers']} layers, hidden {m['hidden']}, heads {m['heads']}/"
             f"{m['kv_heads']}, vocab {m['vocab']}, {m['params'] / 1e6:.1f}M parameters "
             f"({m['dtype']}, compute {m['compute_dtype']}, attention {m['attention']})",
             "shapes: " + ", ".join(f"{k} {v}" for k, v in rep["shapes"].items())]
    tr = rep.get("training")
    if tr:
        lines.append(f"trained: {'LoRA adapters, ' if tr['adapters'] else 'every parameter, '}"
                     f"{tr['trainable_params'] / 1e6:.2f}M parameters ({_gib(tr['trainable_bytes'])}"
                     f"); optimizer state {_gib(tr['opt_state_bytes'])}; all parameters "
                     f"{_gib(tr['param_bytes'])} (whole slice, before sharding)")
    for name, p in rep["programs"].items():
        lines.append("")
        if name == "decode_host_copy":
            lines.append(f"decode_host_copy: the decode of one host's share of the rows "
                         f"({rep['host_sampler_rows']}) on its {rep['host_chips']} chips alone, "
                         "as a per-host copy of the policy would run it (not counted in the "
                         "exit status)")
        if "error" in p:
            lines.append(f"{name}: DOES NOT COMPILE ({p['error']})")
            continue
        b = p["bytes_per_chip"]
        lines.append(f"{name}: {'fits' if p['fits'] else 'DOES NOT FIT'} "
                     f"(compiled in {p['compile_seconds']:.1f} s)")
        for k in ("argument", "output", "alias", "temp", "code", "total"):
            lines.append(f"  {k + ' bytes/chip':24s} {_gib(b[k]):>14s}"
                         + (f"   ({100 * b[k] / rep['hbm_bytes_per_chip']:.1f}% of HBM)"
                            if k == "total" else ""))
        if b.get("host_temp"):
            lines.append(f"  {'host memory/chip':24s} {_gib(b['host_temp']):>14s}"
                         "   (offloaded to the host: not in HBM)")
        lines.append(f"  {'flops/chip':24s} {p['flops_per_chip']:>14.4g}")
        lines.append(f"  {'bytes accessed/chip':24s} {_gib(p['bytes_accessed_per_chip']):>14s}")
        lines.append(f"  {'estimated time':24s} {p['estimated_seconds'] * 1e3:>11.3f} ms"
                     "   (roofline: max(flops/peak, bytes/bandwidth))")
    return "\n".join(lines)
