"""bench.grpc_stream_cost measures a real grpc.aio server: each stream gets one message a tick,
and the server's CPU per message comes from its own process."""

import math

from bench.grpc_stream_cost import measure


def test_every_stream_gets_one_message_a_tick_and_the_server_cost_is_counted() -> None:
    cost = measure(streams=8, tick_s=0.01, warmup_s=0.5, measure_s=1.0)
    # At most one message per stream per tick: the server sends no more than a front-end would.
    assert 0 < cost.messages_per_s <= 8 / 0.01 * 1.1
    assert cost.server_cores > 0 and math.isfinite(cost.server_us_per_message) and cost.server_us_per_message > 0
