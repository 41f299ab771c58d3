"""Paged attention: the KV cache, each step's attention metadata, our attention function
registered with transformers, the written-out attention for soft-capping and sinks, and the C
decode and prefill kernels it calls."""
