"""Recurrent, state-space and convolution layers (Mamba, Gated DeltaNet, short convolutions,
lightning attention): their per-request state in fixed-size slots, and the model's own mixers run
against those slots, request by request."""
