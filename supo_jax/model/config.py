"""Decoder architecture read from a Hugging Face config.json.

One frozen dataclass covers the families supo_jax supports: Qwen2/Qwen2.5
(q/k/v bias), Qwen3 (q/k RMSNorm, explicit head_dim), Llama 3.x (rope scaling
"llama3"), Llama-architecture small models (SmolLM2, tied embeddings), Mistral
(without a sliding window), Seed-OSS (the paper's BrowseComp-Plus model: q/k/v
bias, none on o_proj) and SmolLM3 (no rotary embedding in every fourth layer).
Fields the decoder does not implement fail loudly, naming the field. Dropout
fields (attention_dropout, residual_dropout) are ignored: supo_jax never drops.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "seed_oss", "smollm3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "seed_oss": "SeedOssForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
# transformers' class defaults where a config.json leaves the field out
_DEFAULT_BIAS = {"seed_oss": True}       # q/k/v bias (attention_bias; qwen2 always has it)
_DEFAULT_TIED = {"smollm3": True}                         # tie_word_embeddings


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling, as transformers' rope_scaling / rope_parameters name it:
    "llama3" (Llama 3.1+), "yarn" (Qwen2.5 / Qwen3 beyond 32K; cos and sin scaled by
    attention_factor) or "linear" (positions divided by factor)."""
    kind: str
    factor: float
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0      # llama3
    high_freq_factor: float = 4.0     # llama3
    beta_fast: float = 32.0           # yarn
    beta_slow: float = 1.0            # yarn
    attention_factor: float = 1.0     # yarn
    truncate: bool = True             # yarn

    @classmethod
    def from_hf(cls, rope: dict, max_positions: int) -> "RopeScaling":
        kind = rope.get("rope_type", rope.get("type"))
        orig = int(rope.get("original_max_position_embeddings") or max_positions)
        if kind == "llama3":
            return cls("llama3", float(rope["factor"]), orig, float(rope["low_freq_factor"]),
                       float(rope["high_freq_factor"]))
        if kind == "linear":
            return cls("linear", float(rope["factor"]))
        if kind == "yarn":
            factor = float(rope.get("factor") or max_positions / orig)
            att = rope.get("attention_factor")
            if att is None:   # YaRN's 0.1 ln(s) + 1, or the ratio of two such with mscale(s)
                ms = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
                m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
                att = ms(m) / ms(m_all) if m and m_all else ms(1.0)
            return cls("yarn", factor, orig, beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1), attention_factor=float(att),
                       truncate=bool(rope.get("truncate", True)))
        raise ValueError(f"config.json rope_scaling type {kind!r} is not supported "
                         "(supported: default, llama3, yarn, linear)")

    def to_hf(self) -> dict:
        out = {"rope_type": self.kind, "factor": self.factor}
        if self.kind == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        elif self.kind == "yarn":
            out.update(original_max_position_embeddings=self.original_max_position_embeddings,
                       beta_fast=self.beta_fast, beta_slow=self.beta_slow,
                       attention_factor=self.attention_factor, truncate=self.truncate)
        return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    # per layer: 1 = rotary embedding, 0 = none (SmolLM3's NoPE layers); None = every layer
    rope_layers: tuple[int, ...] | None = None
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The source config.json (dict), re-written by save_pretrained.
    hf_config: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be positive, got {getattr(self, name)}")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_layers:
            raise ValueError(f"no_rope_layers has {len(self.rope_layers)} entries for "
                             f"num_hidden_layers={self.num_layers}")

    @property
    def num_params(self) -> int:
        e, d = self.hidden_size, self.head_dim
        attn = e * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * e * self.intermediate_size + 2 * e + (2 * d if self.qk_norm else 0)
        emb = self.vocab_size * e * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + e

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        mt = hf.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type={mt!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        _check_unsupported(mt, hf)
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // heads
        rope = hf.get("rope_scaling") or None
        rope_params = hf.get("rope_parameters") or {}
        theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if rope is None and rope_params.get("rope_type", "default") not in ("default", None):
            rope = rope_params
        scaling = None
        max_positions = int(hf.get("max_position_embeddings", 32768))
        if rope is not None and rope.get("rope_type", rope.get("type")) not in ("default", None):
            try:
                scaling = RopeScaling.from_hf(rope, max_positions)
            except KeyError as e:
                raise ValueError(f"config.json rope_scaling lacks {e.args[0]!r}") from None
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        if mt == "qwen2":
            bias = True
        elif mt == "mistral":
            bias = False
        else:
            bias = bool(hf.get("attention_bias", _DEFAULT_BIAS.get(mt, False)))
        rope_layers = None
        if mt == "smollm3":
            layers = int(hf["num_hidden_layers"])
            every = int(hf.get("no_rope_layer_interval", 4))
            rope_layers = tuple(int(x) for x in (hf.get("no_rope_layers") or
                                [int((i + 1) % every != 0) for i in range(layers)]))
            rope_layers = None if all(rope_layers) else rope_layers
        return cls(
            model_type=mt,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            qkv_bias=bias,
            qk_norm=(mt == "qwen3"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", _DEFAULT_TIED.get(mt, False))),
            rope_layers=rope_layers,
            max_position_embeddings=max_positions,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            hf_config=dict(hf),
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        fn = os.path.join(path, "config.json")
        if not os.path.isfile(fn):
            raise FileNotFoundError(f"no config.json in model directory {path!r}")
        with open(fn) as f:
            try:
                hf = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{fn} is not valid JSON ({e})") from None
        try:
            return cls.from_hf_dict(hf)
        except KeyError as e:
            raise ValueError(f"{fn} lacks the field {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict:
        """config.json content for this architecture (the source dict when there is one)."""
        if self.hf_config:
            out = dict(self.hf_config)
        else:
            out = {"architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
                   "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True}
            if self.rope_scaling:
                out["rope_scaling"] = self.rope_scaling.to_hf()
        out.update({
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        })
        if "rope_parameters" not in out:
            out["rope_theta"] = self.rope_theta
        if self.model_type in ("llama", "seed_oss", "smollm3"):
            out["attention_bias"] = self.qkv_bias
            out.setdefault("mlp_bias", False)
        if self.model_type == "mistral":
            out["sliding_window"] = None
        if self.model_type == "smollm3":
            out["tie_word_embeddings"] = self.tie_embeddings
            out["no_rope_layers"] = list(self.rope_layers or (1,) * self.num_layers)
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                                   else list(self.eos_token_ids))
        out.pop("torch_dtype", None)
        out.pop("dtype", None)
        return out


def _check_unsupported(mt: str, hf: dict) -> None:
    """Fail on config fields that would change the math in ways the decoder ignores."""
    if mt in ("llama", "qwen3", "smollm3") and hf.get("attention_bias"):
        raise ValueError(f"config.json attention_bias=true is not supported for {mt} "
                         "(it puts a bias on o_proj too; only q/k/v biases are implemented)")
    if mt == "seed_oss" and hf.get("attention_out_bias"):
        raise ValueError("config.json attention_out_bias=true is not supported (no o_proj bias)")
    if mt == "mistral" and hf.get("sliding_window", 4096) is not None:
        raise ValueError(f"config.json sliding_window={hf.get('sliding_window', 4096)} is not "
                         "supported: the decoder attends to the whole context (a model whose "
                         "rows never exceed the window computes the same with sliding_window "
                         "null)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported")
    if hf.get("use_sliding_window") and hf.get("sliding_window") not in (None, 0):
        raise ValueError("config.json use_sliding_window=true is not supported")
    pt = hf.get("pretraining_tp", 1)
    if pt not in (None, 1):
        raise ValueError(f"config.json pretraining_tp={pt} is not supported (only 1)")
    lt = hf.get("layer_types")
    if lt and any(t != "full_attention" for t in lt):
        raise ValueError("config.json layer_types other than full_attention are not supported")
