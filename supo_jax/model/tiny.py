"""Tiny policies built offline: a byte-level BPE tokenizer with a Qwen-style chat
template, and small model configs of each supported family.

Used by the tests, the notebook and the default `supo-jax train` run, so nothing
is downloaded: the tokenizer is trained in about a second with `tokenizers`.
"""
from __future__ import annotations

import os

from supo_jax.model.config import ModelConfig

# Qwen2.5-style template: tools listed in the system turn, tool results as
# <tool_response> blocks inside a user-side "tool" turn, generation prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The tiny policies' own template: ChatML turns, tools as one line each (name(arg, ...): text),
# so the initial prompt of a CPU-scale run is ~100 tokens instead of ~400.
COMPACT_TEMPLATE = (
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{%- if tools %}{{- '\nTools:' }}"
    "{%- for t in tools %}{%- set f = t['function'] if 'function' in t else t %}"
    "{{- '\n' + f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + '): ' + f['description'] }}"
    "{%- endfor %}"
    "{{- '\nCall one tool per turn as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>' }}"
    "{%- endif %}{{- '<|im_end|>\n' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                "<summary>", "</summary>", "<tools>", "</tools>"]

_CORPUS = """
You are a helpful assistant. Call one tool per turn. When you know the answer call finish.
The history is too long. Summarize everything needed to continue inside <summary></summary>.
We are in the following stage of solving the problem: next compare the pair, the tallest so far,
read page, sum of values so far, lookup key value, neighbors of node, path found, answer.
{"name": "compare", "arguments": {"i": 3, "j": 7}} {"name": "finish", "arguments": {"answer": "42"}}
{"name": "read_page", "arguments": {"page": 12}} {"name": "lookup", "arguments": {"key": "k17"}}
{"name": "neighbors", "arguments": {"node": "n5"}} {"name": "search", "arguments": {"query": "x"}}
error: malformed JSON, unknown tool, missing argument, wrong type. result true false null
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 the a of to and in is it that
"""


def tiny_tokenizer(out_dir: str | None = None, vocab_size: int = 512, extra_corpus=(),
                   template: str = "qwen"):
    """A byte-level BPE PreTrainedTokenizerFast with a chat template: "qwen" (Qwen2.5-style,
    tools as JSON in the system turn) or "compact" (one line per tool).

    extra_corpus: texts (e.g. an environment's prompts and tool calls) to train the
    merges on as well, so those texts take few tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Qwen2's exact pipeline (NFC, its split regex: one digit per piece, byte-level): a saved
    # tiny qwen2/qwen3 policy is loaded by AutoTokenizer as Qwen2Tokenizer, which rebuilds
    # this pipeline from the vocab and merges and ignores the one in tokenizer.json.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4 + list(extra_corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.add_tokens(ADDED_TOKENS)
    if template not in ("qwen", "compact"):
        raise ValueError(f"tiny tokenizer template {template!r}: qwen or compact")
    fast.chat_template = CHAT_TEMPLATE if template == "qwen" else COMPACT_TEMPLATE
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        fast.save_pretrained(out_dir)
    return fast


def tiny_config(family: str = "qwen2", vocab_size: int = 528, *, hidden: int = 64,
                layers: int = 2, heads: int = 4, kv_heads: int = 2, mlp: int = 128,
                tie: bool | None = None, rope_scaling: dict | None = None) -> ModelConfig:
    """A small config of a supported family ('qwen2', 'qwen3', 'llama3', 'smollm', 'mistral',
    'seed_oss', 'smollm3': every fourth layer without rotary embedding)."""
    base = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=mlp,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
                eos_token_id=2)
    if family == "qwen2":
        hf = dict(base, model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=10000.0,
                  tie_word_embeddings=bool(tie))
    elif family == "qwen3":
        hf = dict(base, model_type="qwen3", architectures=["Qwen3ForCausalLM"], rope_theta=10000.0,
                  head_dim=hidden // heads * 2, attention_bias=False,
                  tie_word_embeddings=bool(tie))
    elif family == "llama3":
        hf = dict(base, model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  tie_word_embeddings=bool(tie))
    elif family == "smollm":
        hf = dict(base, model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=100000.0,
                  tie_word_embeddings=True if tie is None else tie)
    elif family == "mistral":
        hf = dict(base, model_type="mistral", architectures=["MistralForCausalLM"],
                  rope_theta=1000000.0, head_dim=hidden // heads * 2, sliding_window=None,
                  tie_word_embeddings=bool(tie))
    elif family == "seed_oss":
        hf = dict(base, model_type="seed_oss", architectures=["SeedOssForCausalLM"],
                  rope_theta=10000000.0, attention_bias=True, attention_out_bias=False,
                  attention_dropout=0.0, residual_dropout=0.0, tie_word_embeddings=bool(tie))
    elif family == "smollm3":
        hf = dict(base, model_type="smollm3", architectures=["SmolLM3ForCausalLM"],
                  rope_theta=5000000.0, no_rope_layer_interval=4, pad_token_id=0, bos_token_id=1,
                  no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)],
                  tie_word_embeddings=True if tie is None else tie)
    else:
        raise ValueError(f"unknown tiny family {family!r} "
                         "(qwen2, qwen3, llama3, smollm, mistral, seed_oss, smollm3)")
    if rope_scaling is not None:    # e.g. {"rope_type": "yarn", "factor": 4.0, ...}
        hf["rope_scaling"] = rope_scaling
    return ModelConfig.from_hf_dict(hf)
