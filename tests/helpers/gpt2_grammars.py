"""GPT-2's vocabulary as the planner's structured-output tests use it (their fixtures, the
tokenizer and its grammars, are in tests/scheduler/conftest.py), and a bitmask's tokens."""

from __future__ import annotations

import numpy as np

VOCAB_SIZE = 50_257
EOS = 50_256


def allowed(bitmask: bytes) -> set[int]:
    """The tokens a bitmask allows (bit t % 32 of little-endian 32-bit word t / 32)."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB_SIZE]).tolist())
