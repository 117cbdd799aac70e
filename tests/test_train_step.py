"""The jitted train step: microbatch accumulation, learning, sharding."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from supo_jax.agent.context import Segment
from supo_jax.model.policy import new_policy
from supo_jax.model.sharding import make_mesh
from supo_jax.model.tiny import tiny_config
from supo_jax.rl.batch import build_batch
from supo_jax.rl.train_step import LossConfig, loss_and_grads, make_optimizer, train_step


def _segments(n=8, seed=0):
    rs = np.random.RandomState(seed)
    out = []
    for i in range(n):
        L = rs.randint(10, 30)
        toks = tuple(rs.randint(0, 97, L).tolist())
        mask = tuple(int(j >= L // 2) for j in range(L))
        out.append(Segment(toks, mask, tuple((-4.0 * np.array(mask)).tolist())))
    return out


@pytest.mark.slow
def test_microbatches_accumulate_to_the_full_batch_gradient():
    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=0)
    graphdef, params = pol.split()
    batch = build_batch(_segments(), list(np.linspace(-1, 1, 8)), max_len=32, rows_multiple=4)
    cfg = LossConfig()
    l1, m1, g1 = jax.jit(lambda p, b: loss_and_grads(graphdef, p, b, cfg, 1))(params, batch)
    l4, m4, g4 = jax.jit(lambda p, b: loss_and_grads(graphdef, p, b, cfg, 4))(params, batch)
    np.testing.assert_allclose(l1, l4, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(m1["clip_fraction"], m4["clip_fraction"], rtol=1e-5)


@pytest.mark.slow
def test_positive_advantage_raises_likelihood():
    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=1)
    graphdef, params = pol.split()
    segs = _segments(4, seed=3)
    tx = make_optimizer(3e-3)
    opt_state = tx.init(params)
    batch = build_batch(segs, [1.0] * 4, max_len=32)
    cfg = LossConfig(eps_high=10.0, eps_low=0.9)   # loose clip so several steps keep moving

    def mean_logp(p):
        from supo_jax.sampling.sampler import token_logprobs
        logits, _ = nnx.merge(graphdef, p)(batch.inputs, batch.positions, segment_ids=batch.segment_ids)
        return float((token_logprobs(logits, batch.targets) * batch.mask).sum() / batch.mask.sum())

    before = mean_logp(params)
    for _ in range(5):
        params, opt_state, m = train_step(graphdef, params, opt_state, batch, tx=tx, cfg=cfg)
    assert mean_logp(params) > before + 0.1
    assert np.isfinite(float(m["grad_norm"])) and float(m["tokens"]) == batch.mask.sum()


@pytest.mark.slow
@pytest.mark.cpu_devices   # 8 simulated CPU devices (see conftest)
def test_sharded_train_step_matches_single_device():
    cfg = tiny_config("qwen2", vocab_size=97)
    batch = build_batch(_segments(), list(np.linspace(-1, 1, 8)), max_len=32, rows_multiple=8)
    tx = make_optimizer(1e-3)
    results = []
    for mesh in (None, make_mesh(2, 2, 2)):
        pol = new_policy(cfg, seed=0, mesh=mesh)
        graphdef, params = pol.split()
        opt_state = tx.init(params)
        b = batch
        if mesh is not None:
            from supo_jax.model.sharding import batch_sharding
            b = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh, x.shape)), batch)
        params, opt_state, m = train_step(graphdef, params, opt_state, b, tx=tx, cfg=LossConfig(),
                                          micro=2)
        wq = nnx.to_pure_dict(params)["layers"]["wq"]
        if mesh is not None:
            assert wq.sharding.spec[2] == "tensor"   # still sharded after the update
            assert len({s.device for s in wq.addressable_shards}) == 8
            assert wq.addressable_shards[0].data.size < wq.size
        results.append((float(m["loss"]), np.asarray(wq)))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5)
    np.testing.assert_allclose(results[0][1], results[1][1], atol=1e-5)


def test_an_mlp_in_token_chunks_trains_as_the_whole_rows_mlp():
    """model.mlp_chunks: each layer's MLP over a row's tokens in chunks (one chunk's
    intermediates live at a time in the backward; here inside the layer's own remat,
    offload) gives the loss and the update of the unchunked MLP with the weights sharded over
    fsdp and tensor (the chunks use the layer's weights gathered once); a chunk count that
    does not divide the rows is an error naming the setting."""
    from supo_jax.model.sharding import batch_sharding, mesh_scope

    cfg = tiny_config("qwen2", vocab_size=97)
    batch = build_batch(_segments(), list(np.linspace(-1, 1, 8)), max_len=32, rows_multiple=8)
    tx = make_optimizer(1e-3)
    for mesh in (make_mesh(1, 4, 2),):
        got = []
        # and model.head_split=vocab: the LM head over its vocabulary on the 8 devices (97
        # tokens: unevenly), each chunk's rows gathered, the same loss and update
        # and remat offload_qkvo (the projections saved, not recomputed): the same again
        for chunks, split, remat in ((1, "rows", "offload"), (4, "rows", "offload"),
                                     (1, "vocab", "offload"), (1, "rows", "offload_qkvo")):
            pol = new_policy(cfg, seed=0, mesh=mesh, mlp_chunks=chunks, remat=remat,
                             head_split=split)
            graphdef, params = pol.split()
            b = batch if mesh is None else jax.tree.map(
                lambda x: jax.device_put(x, batch_sharding(mesh, x.shape)), batch)
            with mesh_scope(mesh):
                params, _, m = train_step(graphdef, params, tx.init(params), b, tx=tx,
                                          cfg=LossConfig())
            pure = nnx.to_pure_dict(params)
            got.append((float(m["loss"]), np.asarray(pure["layers"]["w_up"]),
                        np.asarray(pure["lm_head"] if "lm_head" in pure else pure["embed"])))
        # (gradients summed in another order: Adam's first step normalizes a few near-zero
        # gradients differently, by under 1% of the step, lr 1e-3)
        for other, tol in zip(got[1:], (1e-6, 1e-5, 1e-5)):
            np.testing.assert_allclose(got[0][0], other[0], rtol=1e-5)
            np.testing.assert_allclose(got[0][1], other[1], atol=tol)
            np.testing.assert_allclose(got[0][2], other[2], atol=tol)
        assert np.abs(got[0][2] - np.asarray(nnx.to_pure_dict(new_policy(
            cfg, seed=0).split()[1])["lm_head" if "lm_head" in pure else "embed"])).max() > 1e-5
    pol = new_policy(cfg, seed=0, mlp_chunks=3)
    graphdef, params = pol.split()
    with pytest.raises(ValueError, match="model.mlp_chunks=3 must divide"):
        train_step(graphdef, params, tx.init(params), batch, tx=tx, cfg=LossConfig())
    with pytest.raises(ValueError, match="model.mlp_chunks=0"):
        new_policy(cfg, mlp_chunks=0)
    # a run's settings: refused at its start, in one line
    from supo_jax.config import ConfigError, load_config
    from supo_jax.rl.runs import row_len
    with pytest.raises(ConfigError, match="model.mlp_chunks=0: at least 1"):
        load_config(None, ["model.mlp_chunks=0"])
    with pytest.raises(ConfigError, match="model.head_split='vocabulary' is not one of rows, "
                                          "vocab"):
        load_config(None, ["model.head_split=vocabulary"])
    run = load_config(None, ["model.mlp_chunks=4", "optim.max_row_len=446"])
    with pytest.raises(ConfigError, match="model.mlp_chunks=4 must divide the training row "
                                          "length, 446 tokens here"):
        row_len(run, None)
    assert row_len(load_config(None, ["model.mlp_chunks=4", "optim.max_row_len=448"]),
                   None) == 448


def test_recomputed_logprobs_equal_sampler_logprobs():
    """With unchanged weights, recomputing old logprobs gives the sampler's (PPO ratio = 1)."""
    from supo_jax.rl.train_step import LossConfig, recompute_logprobs
    from supo_jax.sampling.sampler import SamplingParams, generate

    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=2)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    outs = generate(pol, prompts, 12, sampling=SamplingParams(0.8), seed=1)
    segs = [Segment(tuple(p + o.tokens), (0,) * len(p) + (1,) * len(o.tokens),
                    (0.0,) * len(p) + tuple(o.logprobs)) for p, o in zip(prompts, outs)]
    batch = build_batch(segs, [1.0, 1.0], max_len=32)
    graphdef, params = pol.split()
    lp = np.asarray(recompute_logprobs(graphdef, params, batch, LossConfig(temperature=0.8)))
    np.testing.assert_allclose(lp * batch.mask, batch.old_logp * batch.mask, atol=1e-4)


@pytest.mark.slow
def test_the_update_corrects_for_the_behaviour_policy_against_the_recomputed_one():
    """optim.recompute_old_logprobs with loss.behaviour_correction: the update clips against
    the trainer's recomputed log-probabilities and weighs each token by p_prox / p_behav
    (tis: truncated at the cap): the same update as ppo_update given the proximal
    log-probabilities and the hand-weighted advantages; correction none is that update with
    weight 1."""
    from supo_jax.config import Config
    from supo_jax.rl.train_step import recompute_logprobs
    from supo_jax.rl.trainer import ppo_update

    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=1)
    graphdef, params = pol.split()
    batch = build_batch(_segments(8, seed=2), list(np.linspace(-1, 1, 8)), max_len=32,
                        rows_multiple=4)
    prox = np.asarray(recompute_logprobs(graphdef, params, batch, LossConfig()))
    rs = np.random.RandomState(0)
    behav = (prox + rs.uniform(-1.5, 0.5, prox.shape)).astype(np.float32)  # some w > 2
    batch = batch.__class__(**{**vars(batch), "old_logp": behav})
    optim = Config().optim.__class__(minibatch_rows=4, recompute_old_logprobs=True)

    def update(b, loss_cfg, o=optim):
        pol_ = new_policy(tiny_config("qwen2", vocab_size=97), seed=1)
        gd, ps = pol_.split()
        tx = make_optimizer(1e-2)
        ps, _, upd = ppo_update(pol_, gd, ps, tx.init(ps), b, tx=tx, loss_cfg=loss_cfg,
                                optim=o, mesh=None, seed=0)
        return jax.tree.map(np.asarray, ps), upd

    got, upd = update(batch, LossConfig(behaviour_correction="tis", behaviour_cap=2.0))
    w = np.minimum(np.exp(prox.astype(np.float64) - behav), 2.0) * (batch.mask > 0)
    trained = batch.mask > 0
    assert upd["behaviour_weight"] == pytest.approx(np.exp(prox - behav)[trained].mean(), rel=1e-4)
    assert 0 < upd["behaviour_over_cap"] < 1
    by_hand = batch.__class__(**{**vars(batch), "old_logp": prox,
                                 "advantages": (batch.advantages * w).astype(np.float32)})
    want, _ = update(by_hand, LossConfig(), Config().optim.__class__(minibatch_rows=4))
    none, _ = update(batch, LossConfig())
    # Adam turns float rounding in near-zero gradients into visible steps: compare the
    # distances (a wrong weighting moves the parameters as far as no correction does)
    dist = lambda x, y: max(float(np.abs(a - b).max())
                            for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
    assert dist(got, want) < 0.01 * dist(got, none)


@pytest.mark.slow
def test_learning_rate_schedules_count_rl_steps_and_every_update_of_a_step_uses_one_rate():
    from supo_jax.rl.train_step import learning_rate
    assert learning_rate(0, 1.0) == learning_rate(99, 1.0) == 1.0
    assert [learning_rate(s, 1.0, warmup_steps=4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = [learning_rate(s, 2.0, schedule="warmup_cosine", warmup_steps=2, total_steps=6)
           for s in range(7)]
    np.testing.assert_allclose(cos, [1.0, 2.0, 2.0, 1.0 + 2 ** -0.5, 1.0, 1.0 - 2 ** -0.5, 0.0])
    with pytest.raises(ValueError, match="warmup_cosine"):
        learning_rate(0, 1.0, schedule="linear")
    from supo_jax.config import Config, ConfigError, apply_overrides
    with pytest.raises(ConfigError, match=r"optim\.schedule='linear'"):   # at start, named
        apply_overrides(Config(), ["optim.schedule=linear"])

    # ppo_update: several minibatch updates in one RL step, all at the step's rate
    from supo_jax.rl.trainer import ppo_update
    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=1)
    graphdef, params = pol.split()
    tx = make_optimizer(1.0)
    opt_state = tx.init(params)
    batch = build_batch(_segments(8, seed=2), list(np.linspace(-1, 1, 8)), max_len=32,
                        rows_multiple=4)
    optim = Config().optim.__class__(minibatch_rows=4)
    p0 = jax.tree.map(np.asarray, params)
    params, opt_state, upd = ppo_update(pol, graphdef, params, opt_state, batch, tx=tx,
                                        loss_cfg=LossConfig(), optim=optim, mesh=None, seed=0,
                                        lr=0.0)
    assert upd["updates"] == 2
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)   # lr 0 in both updates: nothing moved
    params, opt_state, _ = ppo_update(pol, graphdef, params, opt_state, batch, tx=tx,
                                      loss_cfg=LossConfig(), optim=optim, mesh=None, seed=0,
                                      lr=1e-3)
    assert float(opt_state[1].hyperparams["learning_rate"]) == pytest.approx(1e-3)
    assert int(opt_state[1].count) == 4
    moved = max(float(np.abs(a - b).max())
                for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(params)))
    assert 0 < moved <= 2.2e-3   # two Adam updates of at most ~lr each, not of lr 1.0


@pytest.mark.slow
def test_max_kl_skips_the_update_once_the_policy_has_left_the_trust_region():
    """train_step(max_kl=...): applied while the batch's approx KL (policy vs the batch's old
    logprobs) is within max_kl; beyond it, params and optimizer state come back unchanged."""
    from supo_jax.rl.train_step import recompute_logprobs

    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=1)
    graphdef, params = pol.split()
    batch = build_batch(_segments(4, seed=3), [1.0, -1.0, 0.5, -0.5], max_len=32)
    batch = batch.__class__(**{**batch.__dict__, "old_logp": np.asarray(
        recompute_logprobs(graphdef, params, batch))})   # the batch's own policy: KL 0
    tx = make_optimizer(3e-2)
    opt_state = tx.init(params)
    cfg = LossConfig(eps_high=10.0, eps_low=0.9)
    kls, skipped = [], []
    for _ in range(6):
        before = jax.tree.map(np.asarray, (params, opt_state))
        params, opt_state, m = train_step(graphdef, params, opt_state, batch, tx=tx, cfg=cfg,
                                          max_kl=np.float32(1e-3))
        kls.append(float(m["approx_kl"]))
        skipped.append(float(m["skipped"]))
        same = all(np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, (params, opt_state)))))
        assert same == (kls[-1] > 1e-3) == bool(skipped[-1])
    assert skipped[0] == 0.0 and kls[0] < 1e-8   # the first update is always applied
    assert skipped[-1] == 1.0                   # at lr 3e-2 the policy leaves a 1e-3 region

    # ppo_update with optim.max_kl: the step's updates stop at the first one outside the region,
    # and the policy keeps working on the returned parameters (the skipped step's were donated)
    from supo_jax.config import Config
    from supo_jax.rl.trainer import ppo_update
    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=1)
    graphdef, params = pol.split()
    batch = build_batch(_segments(8, seed=3), list(np.linspace(-1, 1, 8)), max_len=32,
                        rows_multiple=2)
    batch = batch.__class__(**{**batch.__dict__, "old_logp": np.asarray(
        recompute_logprobs(graphdef, params, batch))})
    opt_state = tx.init(params)
    optim = Config().optim.__class__(minibatch_rows=2, max_kl=1e-3)
    params, opt_state, upd = ppo_update(pol, graphdef, params, opt_state, batch, tx=tx,
                                        loss_cfg=cfg, optim=optim, mesh=None, seed=0)
    assert upd["kl_stopped"] == 1.0 and upd["updates"] == 1 and int(opt_state[1].count) == 1
    lp = recompute_logprobs(graphdef, pol.split()[1], batch)   # the policy's own params
    np.testing.assert_array_equal(lp, recompute_logprobs(graphdef, params, batch))
