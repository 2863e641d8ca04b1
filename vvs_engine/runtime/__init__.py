"""Decoding runtime: the target session, static KV cache, local masks, CUDA-graph runner, profiling ranges."""
