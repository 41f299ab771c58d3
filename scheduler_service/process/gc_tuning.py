"""Garbage-collector settings for the scheduler process.

Each step allocates small records for every running request; with thousands of requests queued,
CPython's default thresholds run full collections every few steps, each scanning every request: a
pause in every few steps that grows with the running count (README, "Tests and benchmarks", has
the figure). Objects made at start-up (tokenizer, model info) never die, so they are frozen out of the scans,
and young collections run less often.

So an object that lives through a few young collections ends in the oldest generation, which is
collected only once it has grown by a quarter: rarely. A stream lives that long, and ends in
reference cycles (grpc's call state holds the done-callbacks that hold the stream; a request and
its stream name each other), so whatever it still held would wait for such a collection: a
stream drops its unread output when its call ends (OutputStream.discard) instead.
"""

import gc

YOUNG_THRESHOLD = 50_000


def tune_gc() -> None:
    """Call once start-up is done: freezes what exists and makes young collections rarer."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
