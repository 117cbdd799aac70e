"""The jitted SUPO train step and its optimizer.

    train_step(graphdef, params, opt_state, batch) -> params, opt_state, metrics

is a pure function: params are the policy's nnx.Param state (float32 master
weights; the decoder casts to its compute dtype), optimizer state is optax's over the
trainable part of params (`split_trainable`: every parameter, or with LoRA adapters the
adapters alone, the base frozen and passed through),
the batch is split into `micro` microbatches whose gradients are accumulated
with lax.scan. Parameters keep their mesh shardings (jit propagates them;
optimizer state is created from the sharded parameters), the batch is sharded
over (data, fsdp).
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from supo_jax.model.sharding import put, replicated
from supo_jax.rl.algo import aggregation_norm, policy_loss
from supo_jax.rl.batch import TrainBatch
from supo_jax.rl.configs import SCHEDULES, LossConfig

_global_norm = optax.tree.norm if hasattr(getattr(optax, "tree", None), "norm") else optax.global_norm



def make_optimizer(lr=1e-6, *, weight_decay: float = 0.0, clip_norm: float = 1.0,
                   b1: float = 0.9, b2: float = 0.999) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW whose learning rate lives in the optimizer state
    (optax.inject_hyperparams). `lr` is a float or an optax schedule of the update count;
    `train_step(..., lr=...)` sets a float one for that update, so that a schedule can
    follow what the caller counts (RL steps, not the minibatch updates within them, whose
    number varies with the rollouts' segments: `learning_rate`)."""
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.inject_hyperparams(optax.adamw)(
                           learning_rate=lr, b1=b1, b2=b2, weight_decay=weight_decay))


def learning_rate(step: int, lr: float, *, schedule: str = "constant", warmup_steps: int = 0,
                  total_steps: int = 1000) -> float:
    """The learning rate at `step` (0-based) of `total_steps`: `constant` (after a linear
    warm-up from 0 over `warmup_steps`, if any) or `warmup_cosine` (that warm-up, then a
    cosine decay to 0 at `total_steps`)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={schedule!r}: one of {', '.join(SCHEDULES)}")
    if step < warmup_steps:   # the first step already learns: lr / warmup_steps
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    frac = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * 0.5 * (1.0 + math.cos(math.pi * frac))


def _with_learning_rate(opt_state, lr):
    """`opt_state` of make_optimizer with the AdamW learning rate replaced by `lr`."""
    def put(s):
        if hasattr(s, "hyperparams") and "learning_rate" in s.hyperparams:
            old = s.hyperparams["learning_rate"]
            return s._replace(hyperparams={**s.hyperparams,
                                           "learning_rate": jnp.asarray(lr, old.dtype)})
        return s
    return tuple(put(s) for s in opt_state)


def init_opt_state(tx: optax.GradientTransformation, params: nnx.State,
                   mesh: jax.sharding.Mesh | None) -> optax.OptState:
    """Optimizer state with every leaf placed: moments follow their parameters' shardings,
    scalars (step counts) are replicated over the mesh (restores then match exactly)."""
    opt_state = tx.init(trainable(params))
    if mesh is None:
        return opt_state
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
                        else put(x, replicated(mesh)), opt_state)


def split_trainable(params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
    """(trainable, frozen): with LoRA adapters (supo_jax.model.lora.LoRAParam) the adapters
    and the rest of the parameters; else every parameter and None."""
    from supo_jax.model.lora import LoRAParam

    adapters, base = nnx.split_state(params, LoRAParam, ...)
    if not jax.tree.leaves(adapters):
        return params, None
    return adapters, base


def trainable(params: nnx.State) -> nnx.State:
    """The parameters the optimizer updates (and holds state for): split_trainable's first."""
    return split_trainable(params)[0]


def join_trainable(trainable_: nnx.State, frozen: nnx.State | None) -> nnx.State:
    """The whole parameters again from split_trainable's (trainable, frozen)."""
    return trainable_ if frozen is None else nnx.merge_state(trainable_, frozen)


def _score(graphdef, params, mb: TrainBatch, cfg: LossConfig, entropy_grad: bool = False):
    """(log p(targets), entropy) [R, T] of the microbatch under `params` (Decoder.score)."""
    return nnx.merge(graphdef, params).score(
        mb.inputs, mb.positions, mb.targets, segment_ids=mb.segment_ids,
        temperature=cfg.temperature, chunk=cfg.logit_chunk, entropy_grad=entropy_grad)


def _loss(graphdef, train, mb: TrainBatch, norm, cfg: LossConfig, ref_params=None, frozen=None):
    params = join_trainable(train, frozen)
    logp, entropy = _score(graphdef, params, mb, cfg, entropy_grad=bool(cfg.entropy_coef))
    if cfg.objective == "sft":
        mask = mb.mask.astype(jnp.float32)
        n = jnp.maximum(mask.sum(), 1.0)
        return -jnp.sum(logp * mask) / norm, {"entropy": jnp.sum(entropy * mask) / n}
    ref = None
    if cfg.kl_coef:
        if frozen is not None:   # LoRA: the reference adapters (None: zero) on the frozen base
            ref_params = join_trainable(
                jax.tree.map(jnp.zeros_like, train) if ref_params is None else ref_params, frozen)
        ref = jax.lax.stop_gradient(_score(graphdef, ref_params, mb, cfg)[0])
    return policy_loss(logp, mb.old_logp, mb.advantages, mb.mask, eps_low=cfg.eps_low,
                       eps_high=cfg.eps_high, aggregation=cfg.aggregation, ref_logp=ref,
                       kl_coef=cfg.kl_coef, entropy=entropy, entropy_coef=cfg.entropy_coef,
                       norm=norm)


def loss_and_grads(graphdef, params, batch: TrainBatch, cfg: LossConfig, micro: int = 1,
                   ref_params=None):
    """Loss and gradient of the batch with respect to the trainable parameters
    (split_trainable), accumulated over `micro` microbatches. ref_params: the KL reference's
    parameters; with LoRA adapters its adapters alone (trainable(...): the base is the
    frozen one), None meaning the bare base (the adapters' product off)."""
    params, frozen = split_trainable(params)
    norm = aggregation_norm(batch.mask, cfg.aggregation)
    mbs = jax.tree.map(lambda x: x.reshape(micro, x.shape[0] // micro, *x.shape[1:]), batch)
    grad_fn = jax.value_and_grad(partial(_loss, graphdef), has_aux=True)

    def body(acc, mb):
        (loss, metrics), g = grad_fn(params, mb, norm, cfg, ref_params, frozen)
        n = jnp.sum(mb.mask)
        metrics = {k: v * n for k, v in metrics.items()}  # re-weighted to batch token means
        acc = jax.tree.map(jnp.add, acc, (loss, metrics, g))
        return acc, None

    zeros_g = jax.tree.map(jnp.zeros_like, params)
    _, m0 = jax.eval_shape(lambda: _loss(graphdef, params, jax.tree.map(lambda x: x[0], mbs),
                                         norm, cfg, ref_params, frozen))
    init = (jnp.zeros((), jnp.float32), {k: jnp.zeros((), jnp.float32) for k in m0}, zeros_g)
    (loss, metrics, grads), _ = jax.lax.scan(body, init, mbs)
    tokens = jnp.maximum(jnp.sum(batch.mask), 1.0)
    metrics = {k: v / tokens for k, v in metrics.items()}
    return loss, metrics, grads


@partial(jax.jit, static_argnames=("graphdef", "cfg"))
def recompute_logprobs(graphdef, params, batch: TrainBatch, cfg: LossConfig = LossConfig()):
    """Logprobs of the batch's targets under `params` (old logprobs recomputed by the trainer
    instead of taken from the sampler), at cfg.temperature."""
    return _score(graphdef, params, batch, cfg)[0] * (batch.mask > 0)


@partial(jax.jit, static_argnames=("graphdef", "tx", "cfg", "micro"), donate_argnums=(1, 2))
def train_step(graphdef, params, opt_state, batch: TrainBatch, *, tx, cfg: LossConfig,
               micro: int = 1, ref_params=None, lr=None, max_kl=None):
    """One optimizer update on `batch` (opt_state: over trainable(params); the frozen base of
    LoRA adapters comes back as it went in). max_kl (None: off): when the batch's approx_kl (the
    policy's distance from the one that sampled the batch, measured in this step's forward
    pass) exceeds it, the update is not applied (params and optimizer state come back
    unchanged, metrics["skipped"] = 1)."""
    if lr is not None:
        opt_state = _with_learning_rate(opt_state, lr)
    loss, metrics, grads = loss_and_grads(graphdef, params, batch, cfg, micro, ref_params)
    train, frozen = split_trainable(params)
    updates, new_opt_state = tx.update(grads, opt_state, train)
    new_params = join_trainable(optax.apply_updates(train, updates), frozen)
    metrics = dict(metrics, loss=loss, grad_norm=_global_norm(grads),
                   tokens=jnp.sum(batch.mask))
    if max_kl is None or cfg.objective != "ppo":
        return new_params, new_opt_state, metrics
    skip = metrics["approx_kl"] > max_kl
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(skip, b, a), new, old)
    return (keep(new_params, params), keep(new_opt_state, opt_state),
            dict(metrics, skipped=skip.astype(jnp.float32)))


# XLA:TPU without its windowed einsum ("collective matmul": a sharded matmul computed shard
# by shard while the next shard arrives, partial sums accumulated in HBM), as MaxText's
# trillium recipes compile (its xla_flags_library.DISABLE_COLLECTIVE_MATMUL): compiled with
# it, the 8B train step on v6e-8 read and wrote twice the HBM bytes (experiments/LOG.md,
# 2026-12-02)
NO_COLLECTIVE_MATMUL = {"xla_jf_spmd_threshold_for_windowed_einsum_mib": 1000000}
_TPU_STEPS = (
    jax.jit(train_step.__wrapped__, static_argnames=("graphdef", "tx", "cfg", "micro"),
            donate_argnums=(1, 2), compiler_options=NO_COLLECTIVE_MATMUL),
    jax.jit(recompute_logprobs.__wrapped__, static_argnames=("graphdef", "cfg"),
            compiler_options=NO_COLLECTIVE_MATMUL))


def step_programs(platform: str, collective_matmul: bool = False):
    """(train_step, recompute_logprobs) as a run on `platform` ("tpu", "gpu", "cpu") compiles
    them: on TPU without XLA's windowed einsum unless collective_matmul
    (mesh.collective_matmul); elsewhere with XLA's defaults (the option is XLA:TPU's)."""
    if platform == "tpu" and not collective_matmul:
        return _TPU_STEPS
    return train_step, recompute_logprobs
