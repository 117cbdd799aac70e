"""Flax NNX decoder, HF/GGUF checkpoint I/O, mesh partitioning rules."""
