"""splitserve executor: model weights, paged KV memory, a forward pass and sampling per plan.

Its code lies in rooms, each importing only the rooms listed before it (lowest first;
tests/executor/test_executor_rooms.py keeps it so):

- kernels: the C kernels (kernels/*.c), their build and cache, and the ctypes wrappers of those
  that are not attention's;
- attention: the paged KV cache, each step's attention metadata, and our attention function
  with its C decode and prefill kernels;
- recurrent: recurrent, state-space and convolution layers' per-request state in slots, and the
  model's own mixers run against those slots, split by sequence;
- cpu_forward: the fast CPU forward: packed GEMMs, fused layers, packed experts and routers,
  the lean Llama loop, the one-call decode program and the greedy head's int8 screen;
- model: loading a checkpoint with our attention plugged in, what its layers keep, per-sequence
  RoPE, and why a model cannot be served;
- sampling: the sampler and the sampling settings it reads from a plan;
- runner: request state, plan validation, step inputs, the forward, CUDA graphs of decode steps
  and the ModelRunner that runs one plan;
- parallel: tensor parallelism's rank group and how ranks run each step together;
- serving: the Executor gRPC service, its settings, access policy and metrics;
- startup: a ready executor built from settings (KV budget, self-check) and served on one rank
  or several.

At the top: __main__ (python -m executor_service) and prepare_model (python -m
executor_service.prepare_model).
"""
