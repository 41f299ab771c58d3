"""The fast CPU forward: weights packed once (packed_linear, packed_experts, packed_routers),
Llama layers fused (fused_layers), activations from C kernels (kernel_activations), the lean
Llama loop and its one-call decode program, and the greedy rows' int8-screened head."""
