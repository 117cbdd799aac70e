"""A saved policy's tokenizer loads back with the ids the model was trained with."""
import json
import os

from supo_jax.model.policy import load_policy, load_tokenizer, new_policy
from supo_jax.model.tiny import tiny_config, tiny_tokenizer

TEXT = ('Best so far: person 2.\n<tool_call>\n{"name": "compare", "arguments": {"i": 12, '
        '"j": 345}}\n</tool_call> Café über 3.14')


def test_tiny_policy_tokenizer_round_trip(tmp_path):
    tok = tiny_tokenizer(vocab_size=400, extra_corpus=[TEXT] * 3)
    for family in ("qwen2", "llama3"):
        pol = new_policy(tiny_config(family, vocab_size=len(tok) + 8), tokenizer=tok)
        out = str(tmp_path / family)
        pol.save_pretrained(out)
        back = load_policy(out).tokenizer
        assert back.encode(TEXT, add_special_tokens=False) == tok.encode(TEXT, add_special_tokens=False)
        assert back.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False) == \
            tok.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False)


def test_tokenizer_json_wins_over_a_class_that_rebuilds_its_pipeline(tmp_path):
    """A qwen2 config makes AutoTokenizer build Qwen2Tokenizer (its own pre-tokenizer); a
    tokenizer.json with a different pre-tokenizer must still give the file's ids."""
    from tokenizers import Tokenizer, pre_tokenizers

    tok = tiny_tokenizer(str(tmp_path), vocab_size=400, extra_corpus=[TEXT] * 3)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2 style: " 12"
    raw.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(tiny_config("qwen2", vocab_size=len(tok) + 8).to_hf_dict(), f)
    want = raw.encode(TEXT, add_special_tokens=False).ids
    assert want != tok.encode(TEXT, add_special_tokens=False)  # the pipelines do differ
    assert load_tokenizer(str(tmp_path)).encode(TEXT, add_special_tokens=False) == want
    assert os.path.isfile(tmp_path / "tokenizer_config.json")
