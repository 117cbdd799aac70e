"""Tiny random transformers models saved to disk: the reference for parity tests."""
import numpy as np
import torch
import transformers

from supo_jax.model.tiny import tiny_config

FAMILIES = {
    # name: (tiny family, overrides)
    "qwen2_bias_gqa": ("qwen2", dict(tie=False)),
    "qwen3_qknorm_tied": ("qwen3", dict(tie=True)),
    "llama3_ropescaling_tied": ("llama3", dict(tie=True)),
    "llama_mha_untied": ("smollm", dict(tie=False, kv_heads=4)),
}


def make_hf_model(name: str, out_dir: str, seed: int = 0, scale: float = 0.25, vocab: int = 528):
    """Save a random transformers model of the named family; weights scaled so logits are spread."""
    family, kw = FAMILIES[name]
    cfg = tiny_config(family, vocab_size=vocab, **kw)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, scale)
    model.save_pretrained(out_dir)
    return model


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids))).logits.float().numpy()
