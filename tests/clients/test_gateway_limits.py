"""The gateway's refusals that need no scheduler, against a real gateway process (its scheduler
address answers nothing): bodies over --max-body-bytes answered 413 before they are held in
memory (the gateway's RSS measured from /proc), malformed credentials 401, caller-controlled
text quoted in log lines, routing errors typed as OpenAI types them. Raw sockets send what
http.client would refuse to (non-ASCII headers, endless chunked bodies)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from service_support.log_format import message_fields
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.process_memory import peak_rss_bytes, reset_peak, rss_bytes
from tests.helpers.service_process import free_port

MiB = 1 << 20
BODY_BYTES = 100 * MiB
# What the issue allows the gateway to grow by while a 100 MiB body is refused.
RSS_ALLOWANCE_BYTES = 50 * 1000 * 1000
SMALL_CAP = 4096
# Above the bodies the budget leaves uncounted (body_limit.SMALL_BODY_BYTES, 64 KiB).
BUDGET_CAP = 256 << 10
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 1}


@dataclass(slots=True, frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def error(self) -> dict[str, Any]:
        return self.body["error"]


def running_gateway(**flags: object) -> Iterator[GatewayProcess]:
    """A gateway with these flags, in front of a port nobody listens on."""
    process = GatewayProcess(f"127.0.0.1:{free_port()}", served_model_name="tiny", **flags)
    try:
        process.wait_ready(timeout_s=60.0)
        yield process
    finally:
        process.close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    """The default body cap and budget."""
    yield from running_gateway()


@pytest.fixture(scope="module")
def budget_gateway() -> Iterator[GatewayProcess]:
    yield from running_gateway(max_body_bytes=BUDGET_CAP, max_body_bytes_in_flight=2 * BUDGET_CAP)


@pytest.fixture(scope="module")
def impatient_gateway() -> Iterator[GatewayProcess]:
    yield from running_gateway(max_body_bytes=BUDGET_CAP, max_body_bytes_in_flight=2 * BUDGET_CAP, body_read_timeout=1)


@pytest.fixture(scope="module")
def small_cap_gateway() -> Iterator[GatewayProcess]:
    yield from running_gateway(max_body_bytes=SMALL_CAP)


def exchange(
    address: str, head: bytes, body: Iterator[bytes] | None = None, read_first: bool = False
) -> Answer:
    """Sends a raw request head, then the body from another thread while the answer is read (a
    gateway that refuses early answers before the body is through); read_first reads the answer
    before sending any of it."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(head)

        def send_body() -> None:
            try:
                for chunk in body or ():
                    connection.sendall(chunk)
            except OSError:
                pass  # The gateway closed the connection: it has read all it will.

        sender = threading.Thread(target=send_body, daemon=True)
        if not read_first:
            sender.start()
        response = http.client.HTTPResponse(connection)
        response.begin()
        answer = Answer(response.status, dict(response.getheaders()), json.loads(response.read() or b"{}"))
        if read_first:
            sender.start()
        sender.join(timeout=60)
        return answer


def head(method: str, path: str, *headers: bytes) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: gateway", *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def post_json(address: str, path: str, payload: dict[str, Any], *headers: bytes) -> Answer:
    data = json.dumps(payload).encode()
    request = head(
        "POST", path, b"Content-Type: application/json", f"Content-Length: {len(data)}".encode(), *headers
    )
    return exchange(address, request + data)


def zeros(total: int, piece: int = MiB) -> Iterator[bytes]:
    block = b"0" * piece
    for _ in range(total // piece):
        yield block


def chunked(pieces: Iterator[bytes]) -> Iterator[bytes]:
    for piece in pieces:
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    yield b"0\r\n\r\n"


def peak_growth_bytes(process: GatewayProcess, send: Any) -> int:
    """How far the gateway's resident memory rose above where it stood while send() ran."""
    pid = process.process.pid
    reset_peak(pid)
    start = rss_bytes(pid)
    send()
    return peak_rss_bytes(pid) - start


# --- the body cap -----------------------------------------------------------------------------


def test_a_declared_100_mib_body_is_refused_from_its_headers(gateway: GatewayProcess) -> None:
    request = head(
        "POST", "/v1/completions", b"Content-Type: application/json", f"Content-Length: {BODY_BYTES}".encode()
    )
    answers: list[Answer] = []
    growth = peak_growth_bytes(
        gateway, lambda: answers.append(exchange(gateway.address, request, zeros(BODY_BYTES), read_first=True))
    )

    assert answers[0].status == 413 and answers[0].headers.get("connection") == "close"
    assert answers[0].error["type"] == "invalid_request_error"
    assert answers[0].error["code"] == "request_too_large"
    assert f"{BODY_BYTES:,} bytes" in answers[0].error["message"]
    assert "--max-body-bytes" in answers[0].error["message"]
    assert growth < RSS_ALLOWANCE_BYTES, f"the gateway grew by {growth / MiB:.0f} MiB"


def test_a_chunked_100_mib_body_is_refused_once_past_the_cap(gateway: GatewayProcess) -> None:
    request = head("POST", "/v1/completions", b"Content-Type: application/json", b"Transfer-Encoding: chunked")
    answers: list[Answer] = []
    growth = peak_growth_bytes(
        gateway, lambda: answers.append(exchange(gateway.address, request, chunked(zeros(BODY_BYTES))))
    )

    assert answers[0].status == 413 and answers[0].error["code"] == "request_too_large"
    assert f"at most {16 * MiB:,}" in answers[0].error["message"]
    assert growth < RSS_ALLOWANCE_BYTES, f"the gateway grew by {growth / MiB:.0f} MiB"
    # And it serves on.
    assert exchange(gateway.address, head("GET", "/health")).body == {"status": "not_serving"}


def test_the_cap_is_the_flags_and_a_body_within_it_goes_through(small_cap_gateway: GatewayProcess) -> None:
    address = small_cap_gateway.address
    padded = {**COMPLETION, "user": "u" * SMALL_CAP}
    assert post_json(address, "/v1/completions", padded).status == 413
    streamed = head("POST", "/v1/completions", b"Content-Type: application/json", b"Transfer-Encoding: chunked")
    answer = exchange(address, streamed, chunked(iter([json.dumps(padded).encode()])))
    assert answer.status == 413 and f"over {SMALL_CAP:,} bytes" in answer.error["message"]

    # Within the cap the request reaches the scheduler, which is not there.
    within = post_json(address, "/v1/completions", {**COMPLETION, "user": "u" * (SMALL_CAP // 2)})
    assert (within.status, within.error["type"], within.error["code"]) == (503, "server_error", "unavailable")


# --- bodies in flight, together ---------------------------------------------------------------


def test_many_large_bodies_at_once_take_no_more_memory_than_the_budget(gateway: GatewayProcess) -> None:
    """Thirty 15 MiB bodies at once, each within the body cap: without a budget of bodies in
    flight they took the gateway from 64 MiB to 1.5 GiB resident (a Kubernetes gateway pod may
    use 512 MiB); with the default one, those past it are answered 503 gateway_busy unheld."""
    data = json.dumps({**COMPLETION, "prompt": "x" * (15 * MiB)}).encode()
    request = head("POST", "/v1/completions", b"Content-Type: application/json", f"Content-Length: {len(data)}".encode())
    answers: list[Answer] = []

    def send() -> None:
        with concurrent.futures.ThreadPoolExecutor(max_workers=30) as pool:
            answers.extend(pool.map(lambda _: exchange(gateway.address, request, iter([data])), range(30)))

    growth = peak_growth_bytes(gateway, send)
    codes = Counter(answer.error["code"] for answer in answers)
    # Those taken reach the scheduler, which is not there.
    assert codes["gateway_busy"] > 0 and set(codes) <= {"gateway_busy", "unavailable"}, codes
    busy = next(answer for answer in answers if answer.error["code"] == "gateway_busy")
    assert busy.status == 503 and busy.headers.get("retry-after") == "1"
    assert "--max-body-bytes-in-flight" in busy.error["message"]
    # Three bodies at a time grow it 250-340 MiB; thirty at once without a budget, 1.5 GiB.
    assert growth < 600 * MiB, f"the gateway grew by {growth / MiB:.0f} MiB"


def test_bodies_in_progress_hold_the_budget_until_they_end(budget_gateway: GatewayProcess) -> None:
    """Requests whose bodies are still arriving hold what has arrived of them: with two such, a
    large third one, declared or chunked, is 503 until they are gone, while a small one goes
    through. Clients that declared large bodies and sent none of them hold nothing."""
    address = budget_gateway.address
    host, port = address.rsplit(":", 1)
    declared = head("POST", "/v1/completions", b"Content-Type: application/json", f"Content-Length: {BUDGET_CAP}".encode())
    large = {**COMPLETION, "user": "u" * (BUDGET_CAP * 3 // 5)}
    connections = [socket.create_connection((host, int(port)), timeout=60) for _ in range(4)]
    liars, holders = connections[:2], connections[2:]
    try:
        # Declared bodies that never come: together as large as the whole budget.
        for liar in liars:
            liar.sendall(declared)
        # 80 % of a body each, then a stall.
        for holder in holders:
            holder.sendall(declared + b'{"model": "' + b"m" * (BUDGET_CAP * 4 // 5))
        busy = eventually(lambda: post_json(address, "/v1/completions", large), "gateway_busy")
        assert busy.status == 503 and f"({2 * BUDGET_CAP:,})" in busy.error["message"]
        assert busy.headers.get("retry-after") == "1"
        streamed = head("POST", "/v1/completions", b"Content-Type: application/json", b"Transfer-Encoding: chunked")
        assert exchange(address, streamed, chunked(iter([json.dumps(large).encode()]))).error["code"] == "gateway_busy"
        # A small request reaches the scheduler, which is not there.
        assert post_json(address, "/v1/completions", COMPLETION).error["code"] == "unavailable"
        for holder in holders:
            holder.close()
        # Gone, they hold nothing, and the liars never held any.
        eventually(lambda: post_json(address, "/v1/completions", large), "unavailable")
    finally:
        for connection in connections:
            connection.close()


def test_a_body_that_stops_arriving_is_408_and_holds_nothing_after(impatient_gateway: GatewayProcess) -> None:
    """Two clients that send most of a large body and stall hold the whole budget only until
    --body-read-timeout (1 s here): each is answered 408 request_timeout and cut off, and a
    large request goes through after them."""
    address = impatient_gateway.address
    host, port = address.rsplit(":", 1)
    declared = head("POST", "/v1/completions", b"Content-Type: application/json", f"Content-Length: {BUDGET_CAP}".encode())
    holders = [socket.create_connection((host, int(port)), timeout=30) for _ in range(2)]
    try:
        for holder in holders:
            holder.sendall(declared + b'{"model": "' + b"m" * (BUDGET_CAP * 4 // 5))
        for holder in holders:
            response = http.client.HTTPResponse(holder)
            response.begin()
            body = json.loads(response.read())
            assert response.status == 408 and body["error"]["code"] == "request_timeout"
            assert "--body-read-timeout" in body["error"]["message"]
    finally:
        for holder in holders:
            holder.close()
    large = {**COMPLETION, "user": "u" * (BUDGET_CAP * 3 // 5)}
    assert post_json(address, "/v1/completions", large).error["code"] == "unavailable"


def eventually(ask: Any, code: str) -> Answer:
    """ask()'s answer once its error code is code (the gateway takes its connections in its own
    time), within ten seconds."""
    deadline = time.monotonic() + 10
    while True:
        answer = ask()
        if answer.error["code"] == code or time.monotonic() > deadline:
            assert answer.error["code"] == code, answer
            return answer
        time.sleep(0.05)


# --- credentials ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer clé-secrète-0123456789".encode(),
        b"Bearer " + b"k" * 20_000,
        b"Bearer abc\x01def0123456789",
        b"Bearer two words0123456789",
        b"Basic dXNlcjpwYXNzd29yZA==",
        b"Token abc0123456789abcdef",
    ],
    ids=["non-ascii", "20-kB", "control-char", "space", "basic", "other-scheme"],
)
def test_a_malformed_credential_is_401(gateway: GatewayProcess, authorization: bytes) -> None:
    for answer in (
        post_json(gateway.address, "/v1/completions", COMPLETION, b"Authorization: " + authorization),
        exchange(gateway.address, head("GET", "/v1/models", b"Authorization: " + authorization)),
    ):
        assert answer.status == 401, answer
        assert (answer.error["type"], answer.error["code"]) == ("authentication_error", "invalid_api_key")


def test_an_empty_bearer_token_is_no_key_not_a_malformed_one(gateway: GatewayProcess) -> None:
    """What lm-evaluation-harness sends without OPENAI_API_KEY: it goes on keyless, and the
    scheduler (here missing) decides."""
    answer = post_json(gateway.address, "/v1/completions", COMPLETION, b"Authorization: Bearer ")
    assert (answer.status, answer.error["code"]) == (503, "unavailable")


def test_a_trace_header_grpc_cannot_carry_is_dropped_not_a_500(gateway: GatewayProcess) -> None:
    answer = post_json(
        gateway.address, "/v1/completions", COMPLETION, b"Authorization: Bearer key-0123456789abcdef",
        "traceparent: 00-caf\xe9-01".encode(),
    )
    # The request went on to the (missing) scheduler without the header.
    assert (answer.status, answer.error["code"]) == (503, "unavailable")


# --- routing errors and their log lines -------------------------------------------------------


def test_routing_errors_are_typed_as_openai_types_them(gateway: GatewayProcess) -> None:
    wrong_method = exchange(gateway.address, head("GET", "/v1/completions"))
    assert (wrong_method.status, wrong_method.error["type"]) == (405, "invalid_request_error")
    assert wrong_method.headers.get("allow") == "POST"
    assert "GET is not allowed on '/v1/completions'; use POST" in wrong_method.error["message"]

    missing = exchange(gateway.address, head("GET", "/v1/nothing"))
    assert (missing.status, missing.error["type"], missing.error["code"]) == (404, "not_found_error", "not_found")
    assert "/v1/chat/completions" in missing.error["message"]

    unreachable = exchange(gateway.address, head("GET", "/v1/models"))
    assert (unreachable.status, unreachable.error["type"]) == (503, "server_error")


def test_a_path_is_quoted_in_the_log_line(gateway: GatewayProcess) -> None:
    answer = exchange(gateway.address, head("GET", "/v1/%1b%5b31mred%20request_id=forged"))
    assert answer.status == 404

    log = gateway.log_text()
    assert "\x1b" not in log
    lines = [line for line in log.splitlines() if "status=404" in line and "red" in line]
    assert len(lines) == 1, log[-2000:]
    fields = message_fields(lines[0])
    assert fields["path"] == "/v1/\x1b[31mred request_id=forged"
    assert fields["event"] == "request_refused" and "request_id" not in fields
