"""Running one step plan: request state from the plan's diffs, checks of each entry, the
flattened step's inputs, the forward (or a CUDA graph of a decode step), sampling and the
result (model_runner)."""
