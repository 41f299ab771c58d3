"""A large request parsed field by field, its token-id list counted instead of decoded, comes out
as protobuf's own parse of the whole: the same message, or the same refusal."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import RequestRejected
from scheduler_service.frontend import packed_varints
from scheduler_service.frontend.packed_varints import count_varints
from scheduler_service.frontend.request_parsing import (
    UnparsedRequest,
    parse_request,
    unparsable,
)
from scheduler_service.frontend.wire_fields import varint_bytes

TOKEN_IDS = pb.GenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number


def record(number: int, payload: bytes) -> bytes:
    return varint_bytes(number << 3 | 2) + varint_bytes(len(payload)) + payload


_ids = st.lists(st.integers(0, 2**32 - 1), max_size=40)
# A TokenIds payload as any encoder may write it: packed runs, lone ids, unknown fields.
_token_id_records = st.lists(
    st.one_of(
        _ids.map(lambda ids: record(1, b"".join(map(varint_bytes, ids)))),
        st.integers(0, 2**32 - 1).map(lambda value: b"\x08" + varint_bytes(value)),
        st.binary(max_size=6).map(lambda payload: record(9, payload)),
    ),
    max_size=4,
).map(b"".join)
_other_fields = st.one_of(
    st.builds(pb.GenerateRequest, request_id=st.text(max_size=8)),
    st.builds(pb.GenerateRequest, text=st.text(max_size=8)),
    st.builds(pb.GenerateRequest, chat=st.builds(pb.Chat, messages=st.lists(st.builds(pb.ChatMessage, role=st.text(max_size=4), content=st.text(max_size=8)), max_size=2))),
    st.builds(pb.GenerateRequest, sampling=st.builds(pb.SamplingParams, max_tokens=st.integers(0, 9), stop=st.lists(st.text(max_size=4), max_size=2))),
    st.builds(pb.GenerateRequest, priority=st.integers(-5, 5), cache_salt=st.text(max_size=4)),
).map(lambda message: message.SerializeToString())
_generate_bytes = st.lists(
    st.one_of(_token_id_records.map(lambda payload: record(TOKEN_IDS, payload)), _other_fields), max_size=6
).map(b"".join)


def _damaged(draw: st.DrawFn, raw: bytes) -> bytes:
    if not raw or not draw(st.booleans()):
        return raw
    at = draw(st.integers(0, len(raw) - 1))
    return raw[:at] + draw(st.binary(min_size=0, max_size=3)) + raw[at + draw(st.integers(0, 3)) :]


@st.composite
def generate_requests(draw: st.DrawFn) -> bytes:
    return _damaged(draw, draw(_generate_bytes))


@st.composite
def detokenize_requests(draw: st.DrawFn) -> bytes:
    parts = draw(
        st.lists(
            st.one_of(
                _ids.map(lambda ids: record(1, b"".join(map(varint_bytes, ids)))),
                st.integers(0, 2**32 - 1).map(lambda value: b"\x08" + varint_bytes(value)),
                st.just(b"\x10\x01"),
            ),
            max_size=5,
        )
    )
    return _damaged(draw, b"".join(parts))


def _without_prompt(message: Message) -> Message:
    copy = type(message)()
    copy.CopyFrom(message)
    if "prompt" in type(message).DESCRIPTOR.oneofs_by_name:
        for name in ("text", "token_ids", "chat"):
            copy.ClearField(name)
    else:
        copy.ClearField("token_ids")
    return copy


def _ids_of(message: Message) -> int:
    ids = message.token_ids
    return len(ids.ids) if isinstance(message, pb.GenerateRequest) else len(ids)


def check_same_as_protobuf(raw: bytes, message_class: type[Message], most_ids: int) -> None:
    try:
        whole: Message | None = message_class.FromString(raw)
    except DecodeError as error:
        refusal = unparsable(error, len(raw))
        whole = None
    try:
        parsed = parse_request(UnparsedRequest(raw, message_class), most_ids)
    except RequestRejected as rejected:
        assert whole is None and str(rejected) == refusal
        return
    assert whole is not None, refusal
    if parsed.undecoded_ids is None:
        assert parsed.message == whole
        return
    assert parsed.undecoded_ids > most_ids
    if isinstance(whole, pb.GenerateRequest):
        assert whole.WhichOneof("prompt") == "token_ids"
    assert _ids_of(whole) == parsed.undecoded_ids
    assert _without_prompt(parsed.message) == _without_prompt(whole)


@pytest.fixture
def tiny_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of a few bytes, so short lists are cut as a 64 MB one is."""
    monkeypatch.setattr(packed_varints, "PIECE_BYTES", 5)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=generate_requests(), most_ids=st.integers(0, 12))
@example(raw=record(TOKEN_IDS, record(1, b"\x80" * 11 + b"\x01")), most_ids=0)
@example(raw=record(TOKEN_IDS, record(1, b"\x05\x80")), most_ids=0)
@example(raw=record(TOKEN_IDS, record(1, b"\x05" * 30)) + record(2, b"\xc3("), most_ids=3)
# A prompt member's number under another wire type (text as a varint) is an unknown field, which
# leaves the token-id list the prompt.
@example(raw=record(TOKEN_IDS, record(1, b"\x80\x01" * 3)) + b"\x10\x00", most_ids=0)
def test_a_generate_request_parses_as_protobuf_parses_it(tiny_pieces: None, raw: bytes, most_ids: int) -> None:
    check_same_as_protobuf(raw, pb.GenerateRequest, most_ids)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=detokenize_requests(), most_ids=st.integers(0, 12))
def test_a_detokenize_request_parses_as_protobuf_parses_it(tiny_pieces: None, raw: bytes, most_ids: int) -> None:
    check_same_as_protobuf(raw, pb.DetokenizeRequest, most_ids)


@given(st.binary(max_size=40).map(lambda raw: bytes(byte | 0x80 if byte % 3 else byte for byte in raw)))
@example(b"\x80" * 9 + b"\x01")
@example(b"\x80" * 10 + b"\x01")
def test_varints_are_counted_where_protobuf_decodes_them(piece: bytes) -> None:
    try:
        decoded: int | None = len(pb.TokenIds.FromString(record(1, piece)).ids)
    except DecodeError:
        decoded = None
    assert count_varints(memoryview(piece)) == decoded


def test_a_list_too_long_is_counted_not_decoded() -> None:
    ids = record(1, b"\x80\x80\x80\x01" * 100_000)
    raw = pb.GenerateRequest(request_id="r").SerializeToString() + record(TOKEN_IDS, ids)
    parsed = parse_request(UnparsedRequest(raw, pb.GenerateRequest), 512)
    assert parsed.undecoded_ids == 100_000
    assert parsed.message == pb.GenerateRequest(request_id="r")
