"""LoRA adapters (supo_jax.model.lora): logits against peft's on the transformers base, the
merged export against transformers, training touches the adapters alone, an int8 base
(QLoRA), exact resume, PEFT adapters in and out of runs (alpha_pattern, refused fields, the
base an int8 adapter names), the bfloat16 sampler against the trainer, and the KL reference
after a warm start."""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import supo_jax
from supo_jax.config import ConfigError, load_config
from supo_jax.model.lora import TARGETS, LoRA, LoRAParam, add_adapters, load_peft, save_peft
from tests.helpers import flat_params, hf_logits, make_hf_model, same_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "experiments", "configs", "tiny_test.py")
ALL = tuple(TARGETS)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lora_base"))
    make_hf_model("qwen2_bias_gqa", path)
    return path


def _randomize(model, seed=0):
    """Non-zero adapters (B is zero at initialisation: the product would vanish)."""
    rng = np.random.RandomState(seed)
    for name in TARGETS.values():
        for suffix in ("lora_a", "lora_b"):
            var = getattr(model.layers, f"{name}_{suffix}", None)
            if var is not None:
                var[...] = jnp.asarray(rng.normal(0, 0.2, var.shape), jnp.float32)


def _ids(policy, seed=0):
    return np.random.RandomState(seed).randint(0, policy.config.vocab_size, (2, 17))


@pytest.mark.slow
def test_adapters_start_as_the_base_and_export_to_peft_with_logit_parity(base, tmp_path):
    """Zero B: the adapted policy's logits are the base's. With random adapters: peft's
    PeftModel on the transformers base, transformers on the merged export (run_dir/hf's form)
    and this policy agree within 1e-4 (float32); the PEFT directory reads back exactly."""
    import torch
    import transformers
    from peft import PeftModel

    policy = supo_jax.load_policy(base)
    ids = _ids(policy)
    plain = np.asarray(policy.logits(ids))
    add_adapters(policy.model, LoRA(4, 8.0, ALL), seed=3)
    np.testing.assert_array_equal(np.asarray(policy.logits(ids)), plain)
    _randomize(policy.model)
    ours = np.asarray(policy.logits(ids))
    assert np.abs(ours - plain).max() > 1e-2            # the adapters do change the logits

    peft_dir, merged = str(tmp_path / "peft"), str(tmp_path / "hf")
    save_peft(policy.model, peft_dir, base)
    policy.save_pretrained(merged)
    cfg = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
    assert cfg["base_model_name_or_path"] == base and cfg["r"] == 4
    assert sorted(cfg["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    with_peft = PeftModel.from_pretrained(hf_base, peft_dir).eval()
    np.testing.assert_allclose(hf_logits(with_peft, ids), ours, atol=1e-4, rtol=0)
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(merged,
                                                                  torch_dtype=torch.float32)
    np.testing.assert_allclose(hf_logits(hf_merged.eval(), ids), ours, atol=1e-4, rtol=0)

    back = supo_jax.load_policy(base)
    add_adapters(back.model, LoRA(4, 8.0, ALL), seed=9)
    load_peft(back.model, peft_dir)
    np.testing.assert_array_equal(np.asarray(back.logits(ids)), ours)
    np.testing.assert_array_equal(np.asarray(supo_jax.load_policy(peft_dir).logits(ids)), ours)


def test_subset_of_targets_and_peft_errors(base, tmp_path):
    policy = supo_jax.load_policy(base)
    add_adapters(policy.model, LoRA(2, 4.0, ("q", "v")))
    names = set(nnx.to_pure_dict(nnx.state(policy.model, LoRAParam))["layers"])
    assert names == {"wq_lora_a", "wq_lora_b", "wv_lora_a", "wv_lora_b"}
    save_peft(policy.model, str(tmp_path / "p"), base)
    other = supo_jax.load_policy(base)
    add_adapters(other.model, LoRA(4, 4.0, ("q", "v")))
    with pytest.raises(ValueError, match="adapter of rank 2 on q,v; the model has 4"):
        load_peft(other.model, str(tmp_path / "p"))


@pytest.mark.slow
@pytest.mark.parametrize("base_dtype", ["", "int8"])
def test_decode_merges_adapters_into_its_layer_copy(base, base_dtype):
    """The unrolled decode's per-layer copy holds W + (alpha / r) A @ B and no adapters (an
    int8 base keeps them: merging would dequantize it); generation with the merged copy
    gives the product's tokens and logprobs."""
    from supo_jax.sampling.sampler import Sampler, SamplingParams

    policy = supo_jax.load_policy(base)
    add_adapters(policy.model, LoRA(4, 8.0, ("q", "up", "down")), base_dtype=base_dtype)
    _randomize(policy.model)
    layers = policy.model.layer_weights()
    merged = not base_dtype
    assert ("wq_lora_a" in layers[0]) is not merged and "wk_lora_a" not in layers[0]
    if merged:
        s = policy.model.layers
        want = np.asarray(s.wq[...][1]) + 2.0 * np.asarray(s.wq_lora_a[...][1]) @ np.asarray(
            s.wq_lora_b[...][1])
        np.testing.assert_allclose(np.asarray(layers[1]["wq"]), want, atol=1e-6)
    prompts = {i: list(p) for i, p in enumerate(_ids(policy))}
    out = []
    for merge in (True, False):
        sampler = Sampler(policy, 2, 64, unroll_layers=True, merge_adapters=merge)
        sampler.append(prompts)
        out.append(sampler.generate([0, 1], 12, set(), SamplingParams(1.0), jax.random.key(0)))
    for r in (0, 1):   # the merged copy and the product round differently in float32
        assert out[0][r].tokens == out[1][r].tokens
        np.testing.assert_allclose(out[0][r].logprobs, out[1][r].logprobs, rtol=1e-5, atol=1e-5)


def _sample_and_score(policy, prompts, seed):
    """(tokens [R, P + N], the sampler's logprobs [R, N], the trainer's recomputed ones [R, N])
    of N = 24 tokens sampled after each prompt (the unrolled decode: the per-layer copy)."""
    from supo_jax.sampling.sampler import Sampler, SamplingParams

    r, p, n = len(prompts), len(prompts[0]), 24
    sampler = Sampler(policy, r, 64, unroll_layers=True)
    sampler.append(dict(enumerate(prompts)))
    out = sampler.generate(range(r), n, set(), SamplingParams(1.0), jax.random.key(seed))
    toks = np.array([list(prompts[i]) + out[i].tokens for i in range(r)], np.int32)
    return toks, np.array([out[i].logprobs for i in range(r)]), _recomputed(policy, toks, p)


def _recomputed(policy, toks, prompt_len):
    """The trainer's logprobs of the tokens after the first `prompt_len` of each row."""
    from supo_jax.rl.train_step import recompute_logprobs

    graphdef, params = policy.split()
    batch = jax.tree.map(jnp.asarray, _batch(toks, prompt_len))
    return np.asarray(recompute_logprobs(graphdef, params, batch))[:, prompt_len - 1:]


def _batch(toks, prompt_len):
    """A train batch of whole rows `toks`, the tokens after the first `prompt_len` trained."""
    from supo_jax.rl.batch import TrainBatch

    r, t = toks.shape[0], toks.shape[1] - 1
    mask = (np.arange(t) >= prompt_len - 1)[None].repeat(r, 0).astype(np.float32)
    return TrainBatch(inputs=toks[:, :-1], targets=toks[:, 1:],
                      positions=np.tile(np.arange(t, dtype=np.int32), (r, 1)),
                      segment_ids=np.ones((r, t), np.int32), mask=mask,
                      old_logp=np.zeros((r, t), np.float32),
                      advantages=np.ones((r, t), np.float32))


@pytest.mark.slow
def test_bf16_sampler_sees_a_small_adapter_update_as_the_trainer_does(base):
    """bfloat16 compute, after a small update (every B entry +-1e-3: most of W + scale * A @ B
    rounds back to W in bfloat16): the sampler's logprobs match the trainer's recomputed ones
    as closely as at B = 0 (the full-weight path's bfloat16 tolerance), while the update moved
    the trainer's by over twice that. The decode that merged the adapters into bfloat16
    weights missed most of the update (mismatch 2.8x the tolerance's mean, 3.8x its max)."""
    policy = supo_jax.load_policy(base, compute_dtype="bfloat16")
    add_adapters(policy.model, LoRA(4, 8.0, ALL))
    prompts = np.random.RandomState(0).randint(0, policy.config.vocab_size, (4, 12)).tolist()
    toks, sampled, trained = _sample_and_score(policy, prompts, 1)
    tol = np.abs(sampled - trained)
    rng = np.random.RandomState(1)
    for t in ALL:
        b = getattr(policy.model.layers, f"{TARGETS[t]}_lora_b")
        b[...] = jnp.asarray(rng.choice([-1e-3, 1e-3], b.shape), jnp.float32)
    assert np.abs(_recomputed(policy, toks, 12) - trained).max() > 2 * tol.max()   # it matters
    _, sampled, trained = _sample_and_score(policy, prompts, 2)
    err = np.abs(sampled - trained)
    assert err.mean() <= 1.5 * tol.mean() and err.max() <= 2 * tol.max(), (err, tol)


def _step(policy, *, kl=0.0, ref_params=None):
    """One train step on a random batch; (params before, params after, metrics)."""
    from supo_jax.rl.batch import TrainBatch
    from supo_jax.rl.configs import LossConfig
    from supo_jax.rl.train_step import make_optimizer, train_step, trainable

    rng = np.random.RandomState(0)
    r, t = 4, 16
    toks = rng.randint(0, policy.config.vocab_size, (r, t)).astype(np.int32)
    batch = TrainBatch(inputs=toks, targets=np.roll(toks, -1, 1),
                       positions=np.tile(np.arange(t, dtype=np.int32), (r, 1)),
                       segment_ids=np.ones((r, t), np.int32), mask=np.ones((r, t), np.float32),
                       old_logp=np.full((r, t), -5.0, np.float32),
                       advantages=np.asarray(rng.normal(size=(r, 1)) * np.ones((1, t)), np.float32))
    tx = make_optimizer(1e-2)
    graphdef, params = policy.split()
    # uncommitted arrays, whether loaded (device_put) or not: one compiled step for these tests
    params, ref_params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), (params, ref_params))
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
    opt_state = tx.init(trainable(params))
    params, opt_state, m = train_step(graphdef, params, opt_state, jax.tree.map(jnp.asarray, batch),
                                      tx=tx, cfg=LossConfig(kl_coef=kl), ref_params=ref_params)
    return before, jax.tree.map(np.asarray, nnx.to_pure_dict(params)), opt_state, m


@pytest.mark.slow
def test_only_the_adapters_train_and_carry_optimizer_state(base):
    """The optimizer's moments are the adapters' shapes, nothing else; an update changes
    every adapter B (A's gradient is zero while B is) and leaves the base bitwise as it was;
    the KL reference, the adapters as they start, is the policy (zero KL)."""
    from supo_jax.rl.train_step import trainable

    policy = supo_jax.load_policy(base)
    add_adapters(policy.model, LoRA(4, 8.0, ALL))
    ref = jax.tree.map(jnp.copy, trainable(policy.split()[1]))
    before, after, opt_state, m = _step(policy, kl=0.1, ref_params=ref)
    adapters = {k for k in flat_params(before) if "_lora_" in k}
    moments = [x.shape for x in jax.tree.leaves(opt_state) if getattr(x, "ndim", 0) > 1]
    assert sorted(moments) == sorted(2 * [flat_params(before)[k].shape for k in adapters])
    b, a = flat_params(before), flat_params(after)
    for k in b:
        if "_lora_b" in k:
            assert not np.array_equal(a[k], b[k]), k
        elif "_lora_" not in k:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert float(m["kl_ref"]) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_int8_base_qlora_trains_a_step(base):
    """model.lora_base_dtype=int8: every target's base is int8 with a scale per output
    channel, within half a step of the float weight; the forward dequantizes it (logits
    equal a float policy holding the dequantized weights); a train step updates the
    adapters only."""
    policy = supo_jax.load_policy(base)
    ref = supo_jax.load_policy(base)
    ids = _ids(policy)
    add_adapters(policy.model, LoRA(4, 8.0, ALL), base_dtype="int8")
    for name in TARGETS.values():
        q = np.asarray(getattr(policy.model.layers, name)[...])
        scale = np.asarray(getattr(policy.model.layers, f"{name}_scale")[...])
        assert q.dtype == np.int8 and scale.shape == (q.shape[0], 1, q.shape[2])
        w = np.asarray(getattr(ref.model.layers, name)[...])
        deq = q.astype(np.float32) * scale
        assert np.all(np.abs(deq - w) <= scale / 2 + 1e-6)
        getattr(ref.model.layers, name)[...] = jnp.asarray(deq)
    np.testing.assert_allclose(np.asarray(policy.logits(ids)), np.asarray(ref.logits(ids)),
                               atol=1e-5)
    before, after, _, m = _step(policy)
    assert np.isfinite(float(m["loss"]))
    b, a = flat_params(before), flat_params(after)
    assert any(not np.array_equal(a[k], b[k]) for k in b if "_lora_b" in k)
    assert all(np.array_equal(a[k], b[k]) for k in b if "_lora_" not in k)


@pytest.mark.slow
def test_kl_reference_is_the_warm_started_policy(base, tmp_path):
    """train.init_from a PEFT adapter (as after an SFT warm start through the adapters): the
    KL reference holds those adapters, not zeros. Its logits equal the policy's and the KL
    of RL step 0 is zero; a resumed run reads the same reference from run_dir/reference."""
    from types import SimpleNamespace

    from supo_jax.model.policy import _logits
    from supo_jax.rl.runs import build_policy
    from supo_jax.rl.train_step import join_trainable, split_trainable
    from supo_jax.rl.trainer import reference_params

    warm = supo_jax.load_policy(base)
    add_adapters(warm.model, LoRA(4, 8.0, ALL))
    _randomize(warm.model)
    save_peft(warm.model, str(tmp_path / "warm"), base)
    cfg = load_config(TINY, TRAIN + ["loss.kl_coef=0.1", f"train.init_from={tmp_path / 'warm'}",
                                     f"train.run_dir={tmp_path / 'run'}"])
    policy = build_policy(cfg)
    ids = jnp.asarray(_ids(policy), jnp.int32)
    graphdef, params = policy.split()
    want = np.asarray(_logits(graphdef, params, ids))
    for start in (0, 1):           # a new run writes run_dir/reference, a resumed one reads it
        ref = reference_params(SimpleNamespace(cfg=cfg, policy=policy, params=params,
                                               start=start, mesh=None))
        joined = join_trainable(ref, split_trainable(params)[1])
        np.testing.assert_array_equal(np.asarray(_logits(graphdef, joined, ids)), want)
    assert (tmp_path / "run" / "reference" / "adapter_config.json").is_file()
    assert float(_step(policy, kl=0.1, ref_params=ref)[3]["kl_ref"]) == pytest.approx(0, abs=1e-6)


def test_peft_alpha_pattern_loads_as_peft_computes_it(base, tmp_path):
    """A PEFT adapter with alpha_pattern (a module name for every layer, a layer's module):
    this policy's logits equal PeftModel's within 1e-4 (float32)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    pc = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                    alpha_pattern={"q_proj": 32, "layers.1.mlp.down_proj": 2},
                    init_lora_weights=False)     # random B: the product is not zero
    peft_model = get_peft_model(hf, pc).eval()
    peft_model.save_pretrained(str(tmp_path / "a"))
    policy = supo_jax.load_policy(str(tmp_path / "a"))
    ids = _ids(policy)
    np.testing.assert_allclose(np.asarray(policy.logits(ids)), hf_logits(peft_model, ids),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("field,value", [
    ("modules_to_save", ["lm_head"]), ("lora_bias", True), ("bias", "lora_only"),
    ("rank_pattern", {"q_proj": 8}), ("layers_to_transform", 0)])
def test_peft_fields_these_adapters_cannot_hold_are_refused(base, tmp_path, field, value):
    policy = supo_jax.load_policy(base)
    add_adapters(policy.model, LoRA(4, 8.0, ("q",)))
    save_peft(policy.model, str(tmp_path), base)
    fn = tmp_path / "adapter_config.json"
    fn.write_text(json.dumps(dict(json.loads(fn.read_text()), **{field: value})))
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} is not supported")):
        supo_jax.load_policy(str(tmp_path))


def test_int8_adapter_export_names_the_base_it_trained_on(base, tmp_path):
    """model.lora_base_dtype=int8: the PEFT export names run_dir/base (the dequantized int8
    base), not model.path; loaded from it, the adapter gives the trained policy's logits."""
    from supo_jax.rl.runs import save_policy

    cfg = load_config(TINY, TRAIN + [f"model.path={base}", "model.lora_base_dtype=int8",
                                     f"train.run_dir={tmp_path}"])
    policy = supo_jax.load_policy(base)
    add_adapters(policy.model, LoRA(4, 8.0, ALL), base_dtype="int8")
    _randomize(policy.model)
    save_policy(policy, cfg, str(tmp_path / "hf"), str(tmp_path / "peft"))
    named = json.load(open(tmp_path / "peft" / "adapter_config.json"))["base_model_name_or_path"]
    assert named == str(tmp_path / "base")
    ids = _ids(policy)
    np.testing.assert_allclose(np.asarray(supo_jax.load_policy(str(tmp_path / "peft")).logits(ids)),
                               np.asarray(policy.logits(ids)), atol=1e-5)


@pytest.mark.parametrize("sets,match", [
    (["model.lora_rank=4", "model.lora_targets=q,x"], "'x' is not one of q, k, v"),
    (["model.lora_base_dtype=int8"], "needs adapters: set model.lora_rank"),
    (["model.lora_rank=4", "model.lora_base_dtype=nf8"], "lora_base_dtype='nf8'"),
    (["model.lora_rank=-1"], "lora_rank must be >= 0"),
])
def test_bad_lora_settings_are_config_errors(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, sets)


# unmasked rows with an entropy bonus: every step trains (as tests/test_multihost.py)
TRAIN = ["train.sft_warm_start=false", "advantage.masked_reasons=[]", "loss.entropy_coef=0.05",
         "context.max_steps=8", "env.eval_tasks=1", "train.eval_before=false",
         "model.lora_rank=4", "model.lora_alpha=8"]


def _train(run_dir, *sets):
    from supo_jax import cli
    args = ["train", "--config", TINY, "--set", f"train.run_dir={run_dir}"]
    for s in TRAIN + list(sets):
        args += ["--set", s]
    assert cli.main(args) in (0, None)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


@pytest.mark.slow
def test_lora_run_resumes_exactly_and_continues_from_its_peft_adapter(tmp_path):
    """A LoRA run (SFT warm start, then RL) of 2 steps equals one of 1 step resumed to 2
    (metrics and adapters); the warm start wrote sft/ and sft_peft/; the run's run_dir/peft
    adapter (on run_dir/base) restarts training with the same logits."""
    # with the SFT warm start (3 steps through the adapters, checkpointed as step 0)
    sft = ("train.sft_warm_start=true", "context.max_steps=16")   # room for the expert
    whole = _train(str(tmp_path / "a"), "train.steps=2", *sft)
    _train(str(tmp_path / "b"), "train.steps=1", *sft)
    resumed = _train(str(tmp_path / "b"), "train.steps=2", *sft)
    # the train steps' rows and the final eval (the 1-step run also wrote an eval at step 1)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("seconds")}
                          for r in rows if "loss" in r] + [rows[-1]]
    same_run(strip(resumed), strip(whole))
    assert [r["step"] for r in whole if "loss" in r] == [1, 2]
    assert all(r["updates"] > 0 for r in whole if "loss" in r)
    assert (tmp_path / "a" / "sft_peft" / "adapter_config.json").is_file()
    # the checkpoints hold the adapters (and their optimizer state), not the frozen base
    meta = json.load(open(tmp_path / "a" / "checkpoints" / "2" / "params" / "_METADATA"))
    saved = list(meta["tree_metadata"])                  # "('layers', 'wq_lora_a', 'value')"
    assert len(saved) == 2 * len(ALL) and all("_lora_" in k for k in saved), saved
    from safetensors.numpy import load_file
    a = load_file(str(tmp_path / "a" / "peft" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "peft" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:          # to rounding (tests/helpers.same_run: rows advance independently)
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)

    from supo_jax.config import load_config as lc
    from supo_jax.rl.runs import build_policy

    peft = str(tmp_path / "a" / "peft")
    cfg = lc(TINY, TRAIN + [f"train.init_from={peft}"])
    cont = build_policy(cfg)
    merged = supo_jax.load_policy(str(tmp_path / "a" / "hf"))
    ids = _ids(merged)
    np.testing.assert_allclose(np.asarray(cont.logits(ids)), np.asarray(merged.logits(ids)),
                               atol=1e-5)
    # `supo-jax eval`'s policy: the base rebuilt, the adapters from the last checkpoint
    from supo_jax.cli import _restore_policy
    back = _restore_policy(lc(TINY, TRAIN + list(sft) + [f"train.run_dir={tmp_path / 'a'}"]))
    np.testing.assert_allclose(np.asarray(back.logits(ids)), np.asarray(merged.logits(ids)),
                               atol=1e-5)
    with pytest.raises(ConfigError, match="set model.lora_rank=4 model.lora_alpha=8"):
        build_policy(lc(TINY, TRAIN[:-2] + ["model.lora_rank=2", f"train.init_from={peft}"]))
