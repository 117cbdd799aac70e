"""`supo-jax` command line. Every command fails fast with one clear line on bad input."""
from __future__ import annotations

import argparse
import sys


def _cmd_generate(args) -> None:
    import jax

    from supo_jax.model.policy import load_policy
    from supo_jax.sampling.sampler import Sampler, SamplingParams

    policy = load_policy(args.model, dtype=args.dtype)
    tok = policy.tokenizer
    if tok is None:
        raise ValueError(f"{args.model} has no tokenizer files; cannot render a prompt")
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    stops = set(policy.config.eos_token_ids) | {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>",)
                                               if t in tok.get_vocab()}
    sampler = Sampler(policy, batch=1, max_len=len(ids) + args.max_new_tokens)
    sampler.append({0: ids})
    out = sampler.generate([0], args.max_new_tokens, stops,
                           SamplingParams(temperature=args.temperature), jax.random.key(args.seed))
    print(tok.decode(out[0].tokens, skip_special_tokens=True))


def _cmd_export(args) -> None:
    from supo_jax.model.policy import load_policy

    policy = load_policy(args.model, dtype=args.dtype)
    policy.save_pretrained(args.out)
    print(f"wrote {args.out} ({policy.config.num_params / 1e6:.1f}M parameters)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="supo-jax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="chat-generate with a policy (HF directory or .gguf)")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt", default="What is the capital of France?")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="float32")
    g.set_defaults(fn=_cmd_generate)
    e = sub.add_parser("export", help="load a policy (e.g. a .gguf) and write it as HF safetensors")
    e.add_argument("--model", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--dtype", default="float32")
    e.set_defaults(fn=_cmd_export)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (FileNotFoundError, ValueError, KeyError, IndexError) as e:
        print(f"supo-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
