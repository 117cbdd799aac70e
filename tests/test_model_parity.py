"""Logit, generation and export parity against transformers' own models."""
import numpy as np
import pytest
import torch
import transformers

import supo_jax
from supo_jax.sampling.sampler import generate
from tests.helpers import FAMILIES, hf_logits, make_hf_model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    ref = make_hf_model(request.param, path)
    return request.param, path, ref, supo_jax.load_policy(path)


def test_logits_match_transformers(pair):
    _, _, ref, pol = pair
    ids = np.random.RandomState(1).randint(0, pol.config.vocab_size, (3, 48))
    ours = np.asarray(pol.logits(ids))
    assert ours.shape == (3, 48, pol.config.vocab_size) and ours.dtype == np.float32
    assert np.abs(ours - hf_logits(ref, ids)).max() <= 1e-4


def test_greedy_generation_matches_transformers(pair):
    _, _, ref, pol = pair
    rs = np.random.RandomState(2)
    prompts = [rs.randint(0, pol.config.vocab_size, n).tolist() for n in (7, 19, 12)]
    outs = generate(pol, prompts, 32)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            full = ref.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                do_sample=False, pad_token_id=0)[0].tolist()
        expect = full[len(prompt):]
        if out.tokens != expect:  # allowed only at a near-tie of the reference's top-2 logits
            k = next(i for i, (a, b) in enumerate(zip(out.tokens, expect)) if a != b)
            top2 = np.sort(hf_logits(ref, [full[:len(prompt) + k]])[0, -1])[-2:]
            assert top2[1] - top2[0] < 1e-4, f"diverged at step {k} without a near-tie"
        assert len(out.tokens) == 32


def test_save_pretrained_roundtrip(pair, tmp_path):
    name, _, ref, pol = pair
    pol.save_pretrained(str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    ids = np.random.RandomState(3).randint(0, pol.config.vocab_size, (2, 20))
    np.testing.assert_allclose(hf_logits(back, ids), hf_logits(ref, ids), atol=1e-6)
    again = supo_jax.load_policy(str(tmp_path))
    np.testing.assert_allclose(np.asarray(again.logits(ids)), np.asarray(pol.logits(ids)), atol=1e-6)


def test_sharded_index_checkpoint(tmp_path):
    """model.safetensors.index.json with several shards loads like a single file."""
    ref = make_hf_model("qwen2_bias_gqa", str(tmp_path / "one"))
    ref.save_pretrained(str(tmp_path / "many"), max_shard_size="20KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    pol = supo_jax.load_policy(str(tmp_path / "many"))
    ids = np.arange(30)[None] % pol.config.vocab_size
    assert np.abs(np.asarray(pol.logits(ids)) - hf_logits(ref, ids)).max() <= 1e-4


def test_bfloat16_params_close(tmp_path):
    ref = make_hf_model("qwen2_bias_gqa", str(tmp_path))
    pol = supo_jax.load_policy(str(tmp_path), dtype="bfloat16", compute_dtype="float32")
    assert pol.model.embed[...].dtype == np.dtype("bfloat16")
    ids = np.arange(16)[None]
    out = np.asarray(pol.logits(ids))
    assert out.dtype == np.float32
    assert np.abs(out - hf_logits(ref, ids)).max() < 0.15 * np.abs(hf_logits(ref, ids)).max()


def test_unsupported_config_fields_named(tmp_path):
    from supo_jax.model.config import ModelConfig
    from supo_jax.model.tiny import tiny_config
    hf = tiny_config("qwen2").to_hf_dict()
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict(dict(hf, hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope_scaling type 'longrope'"):
        ModelConfig.from_hf_dict(dict(hf, rope_scaling={"rope_type": "longrope", "factor": 4.0}))
    with pytest.raises(ValueError, match="rope_scaling lacks 'low_freq_factor'"):
        ModelConfig.from_hf_dict(dict(hf, rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_dict(dict(hf, model_type="gpt2"))
    # a bias on o_proj (llama / qwen3 / smollm3 attention_bias, seed_oss attention_out_bias)
    for family in ("smollm", "qwen3", "smollm3"):
        with pytest.raises(ValueError, match="attention_bias=true.*o_proj"):
            ModelConfig.from_hf_dict(dict(tiny_config(family).to_hf_dict(), attention_bias=True))
    with pytest.raises(ValueError, match="attention_out_bias"):
        ModelConfig.from_hf_dict(dict(tiny_config("seed_oss").to_hf_dict(), attention_out_bias=True))
    mistral = tiny_config("mistral").to_hf_dict()
    with pytest.raises(ValueError, match="sliding_window=4096"):
        ModelConfig.from_hf_dict(dict(mistral, sliding_window=4096))
    with pytest.raises(ValueError, match="sliding_window=4096"):   # transformers' default
        ModelConfig.from_hf_dict({k: v for k, v in mistral.items() if k != "sliding_window"})
    with pytest.raises(ValueError, match="no_rope_layers has 3 entries"):
        ModelConfig.from_hf_dict(dict(tiny_config("smollm3").to_hf_dict(), no_rope_layers=[1, 0, 1]))
    # class defaults where config.json is silent: Seed-OSS has q/k/v bias, SmolLM3 ties
    bare = lambda family, key: {k: v for k, v in tiny_config(family).to_hf_dict().items() if k != key}
    assert ModelConfig.from_hf_dict(bare("seed_oss", "attention_bias")).qkv_bias
    assert ModelConfig.from_hf_dict(bare("smollm3", "tie_word_embeddings")).tie_embeddings


def test_unused_checkpoint_tensors_are_an_error(tmp_path):
    """Weights the configured architecture would not read (here q/k/v biases under a config
    that says llama without attention_bias) fail the load instead of being dropped."""
    import json
    from supo_jax.model.weights import CheckpointError
    make_hf_model("qwen2_bias_gqa", str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"does not use, e.g. model\.layers\.0\.self_attn\.[qkv]_proj\.bias"):
        supo_jax.load_policy(str(tmp_path))


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        supo_jax.load_policy(str(tmp_path / "nope"))
    make_hf_model("qwen2_bias_gqa", str(tmp_path / "m"))
    pol = supo_jax.load_policy(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pol.logits([[1, 2, pol.config.vocab_size]])
    # a truncated checkpoint is a clear error, not a crash deep inside numpy
    st = tmp_path / "m" / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    from supo_jax.model.weights import CheckpointError
    with pytest.raises(CheckpointError, match="truncated"):
        supo_jax.load_policy(str(tmp_path / "m"))


def test_rope_scaling_matters_at_these_lengths(tmp_path):
    """The yarn / linear parity above is a test of the scaling: the same weights without it
    give other logits at the 48 positions compared."""
    import dataclasses
    for name in ("qwen2_yarn", "qwen3_linear_rope"):
        ref = make_hf_model(name, str(tmp_path / name))
        pol = supo_jax.load_policy(str(tmp_path / name))
        ids = np.random.RandomState(1).randint(0, pol.config.vocab_size, (2, 48))
        pol.model.cfg = dataclasses.replace(pol.model.cfg, rope_scaling=None)
        assert np.abs(np.asarray(pol.logits(ids)) - hf_logits(ref, ids)).max() > 1e-2, name
