"""The engine's options (--max-waiting, --prefill-min-tokens and the rest, with each executor's
lane options) and their defaults.

Apart from engine.py so that the engine's parts, mixins in files of their own (intake.py,
delivery.py, lane_events.py), read them without importing the engine that is made of them.
"""

from dataclasses import dataclass

from scheduler_service.core.router import DEFAULT_TOKENS_PER_REQUEST
from scheduler_service.frontend.stream_backlog import BacklogLimits
from scheduler_service.planner.lane import LaneOptions

# A request waits this long while no executor can take it (all down, drained or refused) before
# it fails with UNAVAILABLE naming why: long enough for a killed executor to be restarted and
# reload a small model, short enough that a client of a drained fleet is not left hanging.
DEFAULT_NO_EXECUTOR_TIMEOUT_S = 30.0
# With prefill executors: prompts with fewer uncached tokens than this skip them and are computed
# where they will decode (a short prompt costs less to compute than to move).
DEFAULT_PREFILL_MIN_TOKENS = 64
# A running request moves to an idle executor only with this many tokens left to generate: the
# move costs about one step of the idle executor (it fetches while it steps), and a request that
# ends sooner would not repay it.
DEFAULT_REBALANCE_MIN_TOKENS_LEFT = 128


@dataclass(slots=True, frozen=True)
class EngineOptions:
    lane: LaneOptions = LaneOptions()
    # Requests allowed to wait before new ones are refused with RESOURCE_EXHAUSTED.
    max_waiting: int = 10_000
    # Routing: cached prompt tokens worth one more queued request (core/router.py).
    route_tokens_per_request: int = DEFAULT_TOKENS_PER_REQUEST
    # Tokens a stream gathers before sending them (frontend/output_stream.py).
    stream_interval: int = 1
    # How far a stream's reader may fall behind before its request is ended
    # (frontend/stream_backlog.py).
    stream_backlog: BacklogLimits = BacklogLimits()
    # Seconds a request may wait with no executor able to take it (see Engine.run).
    no_executor_timeout_s: float = DEFAULT_NO_EXECUTOR_TIMEOUT_S
    # Uncached prompt tokens from which a request goes to a prefill executor (--prefill-min-tokens).
    prefill_min_tokens: int = DEFAULT_PREFILL_MIN_TOKENS
    # An idle executor takes running requests with at least this many tokens left to generate
    # from a busier one, with their K/V (kv_moves.rebalance); 0: never.
    rebalance_min_tokens_left: int = DEFAULT_REBALANCE_MIN_TOKENS_LEFT
