"""compile_point.py with the LM head's logits chunks not cut to bytes (chunked_logprobs'
chunk_bytes, 256 MiB since ffadd05) or cut to CHUNK_BYTES:
    python compile_point_no_chunk_cap.py [--chunk-bytes N] POINT [SETTING ...]"""
import os
import sys

from supo_jax.model import decoder

cap = 1 << 40
if sys.argv[1] == "--chunk-bytes":
    cap = int(sys.argv[2])
    del sys.argv[1:3]
decoder.chunked_logprobs.__kwdefaults__["chunk_bytes"] = cap
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_point.py")) as f:
    exec(f.read())
