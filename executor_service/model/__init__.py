"""A model as the executor serves it: the checkpoint loaded with our attention plugged in, the
K/V geometry its layers really use, rotary tables per sequence, and the refusals of what cannot
be served."""
