"""splitserve executor: model weights, paged KV memory, one forward pass and sampling per step plan."""
