"""splitserve executor: model weights, paged KV memory, a forward pass and sampling per plan."""
