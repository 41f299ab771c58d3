"""The scheduler's planning core: requests, queues and policies, the step planner, stop checks,
the step records it exchanges with executors, and a simulated executor.

Pure Python: no torch, no gRPC, no protobuf (tests/scheduler/test_core_purity.py checks it), so
it can be unit-tested, fuzzed, replayed and benchmarked in microseconds.
"""
