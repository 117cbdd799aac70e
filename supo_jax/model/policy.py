"""The policy: one Decoder (optionally sharded over a mesh) plus its tokenizer.

The same object samples (supo_jax.sampling) and trains (supo_jax.rl); there is
no second inference engine and no weight sync.
"""
from __future__ import annotations

import json
import logging
import os
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from supo_jax import storage
from supo_jax.model.config import ModelConfig
from supo_jax.model.decoder import Decoder
from supo_jax.model.gguf_io import gguf_tokenizer, open_gguf
from supo_jax.model.sharding import batch_sharding, param_sharding, put
from supo_jax.model.weights import build_params, hf_tensors, safetensors_source, write_safetensors

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _dtype(name):
    if name is None:
        return None
    if isinstance(name, str):
        if name not in _DTYPES:
            raise ValueError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}")
        return _DTYPES[name]
    return jnp.dtype(name).type


@partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return model(tokens, positions)[0]


class Policy:
    """A causal LM policy. `model` is the NNX Decoder; `tokenizer` may be None."""

    def __init__(self, model: Decoder, tokenizer=None, mesh=None):
        self.model = model
        self.tokenizer = tokenizer
        self.mesh = mesh

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def eos_ids(self) -> set[int]:
        """End-of-sequence ids: the config's eos_token_id and the tokenizer's eos token."""
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def split(self):
        """(graphdef, params state) for pure jitted functions."""
        return nnx.split(self.model)

    def logits(self, input_ids) -> jax.Array:
        """input_ids int [B, T] -> float32 logits [B, T, vocab] (causal, no cache)."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a non-empty [batch, time] array, got shape {ids.shape}")
        check_token_ids(ids, self.config.vocab_size)
        ids = jnp.asarray(ids, jnp.int32)
        sh = batch_sharding(self.mesh, ids.shape)
        if sh is not None:
            ids = put(ids, sh)
        graphdef, params = self.split()
        return _logits(graphdef, params, ids)

    def save_pretrained(self, out_dir: str, *, adapters: bool = True) -> None:
        """Write config.json + model.safetensors (+ tokenizer files) loadable by transformers.
        With LoRA adapters (supo_jax.model.lora), the adapters merged into the weights (an
        int8 base dequantized); adapters=False writes the base alone. `out_dir` may be a
        bucket's URL (supo_jax.storage): written locally, then uploaded by process 0."""
        if jax.process_index() != 0:   # it only joins the collective gathers
            return self._save_pretrained(out_dir, adapters)
        with storage.staged_dir(out_dir) as local:
            self._save_pretrained(local, adapters)

    def _save_pretrained(self, out_dir: str, adapters: bool) -> None:
        cfg = self.config
        params = nnx.to_pure_dict(nnx.state(self.model, nnx.Param))
        if any(k.endswith(("_lora_a", "_lora_b", "_scale")) for k in params["layers"]):
            from supo_jax.model.lora import merged_layers
            from supo_jax.model.weights import host_array

            params["layers"] = merged_layers({k: host_array(v) for k, v in params["layers"].items()},
                                             self.model.lora if adapters else None)
        if jax.process_index() == 0:
            hf = cfg.to_hf_dict()
            dt = str(jnp.dtype(self.model.embed[...].dtype))   # (the adapters' dtype is float32)
            hf["torch_dtype"] = dt
            with open(os.path.join(out_dir, "config.json"), "w") as f:
                json.dump(hf, f, indent=2)
        tensors = list(hf_tensors(cfg, params))
        if jax.process_index() == 0:
            write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
            index = os.path.join(out_dir, "model.safetensors.index.json")
            if os.path.exists(index):
                os.remove(index)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(out_dir)
        else:  # every process joins the collective gathers
            for _, _, _, get in tensors:
                get()


def check_token_ids(ids: np.ndarray, vocab_size: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise ValueError(f"token id {int(bad)} is outside the vocabulary [0, {vocab_size})")


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def load_tokenizer(path: str):
    """A transformers tokenizer from an HF model directory or from a .gguf file's metadata."""
    from transformers import AutoTokenizer

    if storage.is_url(path):
        with storage.local_copy(storage.resolve(path)) as local:
            return load_tokenizer(local)
    if str(path).endswith(".gguf"):
        return gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer path {path!r} is neither a directory nor a .gguf file")
    if not _has_tokenizer(path):
        raise FileNotFoundError(f"no tokenizer files in {path!r}")
    tok = AutoTokenizer.from_pretrained(path)
    file = os.path.join(path, "tokenizer.json")
    if os.path.isfile(file):
        # transformers 5 builds some classes (e.g. Qwen2Tokenizer) from vocab + merges with
        # their own pre-tokenizer, ignoring tokenizer.json's: if that changes the ids, the
        # file (what the model was trained with) wins
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        raw = Tokenizer.from_file(file)
        if raw.encode(_PROBE, add_special_tokens=False).ids != tok.encode(
                _PROBE, add_special_tokens=False):
            logging.getLogger(__name__).warning(
                "%s: %s tokenizes differently from tokenizer.json; using tokenizer.json",
                path, type(tok).__name__)
            tok = PreTrainedTokenizerFast.from_pretrained(path)
    return tok


_PROBE = ("Person 12 is taller than person 3.\n\n<tool_call>{\"i\": 2048}</tool_call> "
          "Ünïcode café, tabs\tand   spaces; 'quotes' it's 1,234.5 ...")


def new_policy(cfg: ModelConfig, *, dtype="float32", compute_dtype=None, mesh=None, seed=0,
               tokenizer=None, **options) -> Policy:
    """A randomly initialised policy (tests, benchmarks), sharded over `mesh` if given.
    options: the Decoder's remat / attention / precision (all "auto" by default)."""
    pdt = _dtype(dtype)
    cdt = _dtype(compute_dtype) or pdt
    model = Decoder(cfg, param_dtype=pdt, dtype=cdt, rngs=nnx.Rngs(seed), **options)
    if mesh is not None:
        shard_model(model, mesh)
    return Policy(model, tokenizer, mesh)


def shard_model(model: Decoder, mesh) -> None:
    """Place every parameter of `model` on `mesh` according to the partition rules."""
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)

    def place(path, x):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        return put(x, param_sharding(name, x.shape, mesh))

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(place, pure))
    nnx.update(model, state)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def resolve_model_path(path: str) -> str:
    """A local model directory or .gguf file as given; a Hugging Face Hub id ("org/name" or
    "org/name@revision") as its snapshot directory in the huggingface_hub cache: downloaded
    when online, read from the cache when offline (HF_HUB_OFFLINE=1). A missing model is one
    FileNotFoundError saying where it looked."""
    path = os.fspath(path)
    if (storage.is_url(path) or os.path.exists(path) or not _HUB_ID.fullmatch(path)
            or path.endswith(".gguf")):
        return path
    from huggingface_hub import constants, snapshot_download

    repo, _, revision = path.partition("@")
    try:
        return snapshot_download(repo, revision=revision or None,
                                 local_files_only=bool(constants.HF_HUB_OFFLINE))
    except Exception as e:   # noqa: BLE001  (offline, not cached, no such repo, no network)
        how = ("offline (HF_HUB_OFFLINE=1) and not in the cache" if constants.HF_HUB_OFFLINE
               else f"not in the cache and not downloadable ({type(e).__name__})")
        raise FileNotFoundError(
            f"model {path!r}: no such local path, and as a Hugging Face Hub id it is {how}; "
            f"looked in {os.path.join(constants.HF_HUB_CACHE, 'models--' + repo.replace('/', '--'))}"
        ) from None


def load_policy(path: str, dtype="float32", mesh=None, *, compute_dtype=None,
                tokenizer=True, **options) -> Policy:
    """Load an HF model directory (safetensors, single or sharded), a .gguf file, a Hugging
    Face Hub id (resolve_model_path), or a PEFT LoRA adapter directory (its base, named by
    its adapter_config.json, with the adapters: supo_jax.model.lora).

    dtype: parameter dtype ("float32" | "bfloat16"); compute_dtype defaults to it.
    mesh: a jax.sharding.Mesh (see supo_jax.make_mesh); parameters are created
    directly on their shards.
    options: the Decoder's remat / attention / precision (supo_jax.model.decoder.Decoder).
    """
    path = resolve_model_path(path)
    if storage.is_url(path):   # a bucket's: read from a local copy (of its current export)
        if not storage.exists(path):
            raise FileNotFoundError(f"model path {path!r} does not exist")
        with storage.local_copy(storage.resolve(path)) as local:
            return load_policy(local, dtype, mesh, compute_dtype=compute_dtype,
                               tokenizer=tokenizer, **options)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):   # a PEFT LoRA adapter
        from supo_jax.model.lora import add_adapters, load_peft, peft_lora, read_peft_config

        pc = read_peft_config(path)
        if not pc.get("base_model_name_or_path"):
            raise FileNotFoundError(f"{path}: a PEFT adapter that names no base model")
        policy = load_policy(pc["base_model_name_or_path"], dtype, mesh,
                             compute_dtype=compute_dtype, tokenizer=tokenizer, **options)
        add_adapters(policy.model, peft_lora(pc), mesh=mesh)
        load_peft(policy.model, path)
        return policy
    pdt = _dtype(dtype)
    cdt = _dtype(compute_dtype) or pdt
    if path.endswith(".gguf"):
        hf, source = open_gguf(path)
        cfg = ModelConfig.from_hf_dict(hf)
        tok = gguf_tokenizer(path) if tokenizer else None
    elif os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "run.json")):   # what supo_jax runs write
            have = [d for d in ("hf", "sft") if os.path.isdir(os.path.join(path, d))]
            raise FileNotFoundError(
                f"{path!r} is a supo_jax run directory, not a model: pass its hf/ (the policy "
                "a run exports when it ends) or sft/ (the SFT warm start); it has "
                + (" and ".join(f"{os.path.join(path, d)}/" for d in have) or "neither yet"))
        cfg = ModelConfig.from_pretrained(path)
        source = safetensors_source(path)
        tok = load_tokenizer(path) if tokenizer and _has_tokenizer(path) else None
    else:
        what = "is not a directory or a .gguf file" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"model path {path!r} {what} (a model is an HF directory, a "
                                ".gguf file or a Hugging Face Hub id)")
    abstract = nnx.eval_shape(lambda: Decoder(cfg, param_dtype=pdt, dtype=cdt, rngs=nnx.Rngs(0),
                                              **options))
    graphdef, state = nnx.split(abstract)
    state = build_params(cfg, state, source, pdt, mesh)
    return Policy(nnx.merge(graphdef, state), tok, mesh)

