"""Large client requests parsed on an intake thread instead of the event loop, a token-id list
counted before it is decoded.

The interceptor (message_parsing.py) parses small requests on the loop and hands larger ones to
the intake unparsed (UnparsedRequest). A thread alone would not free the loop: protobuf's C
decoder keeps the GIL for as long as one parse runs, which for a list of millions of token ids is
a stop of the loop measured in seconds (README, "Large requests are parsed off the event loop").
So a token-id list whose bytes could hold more ids than the request may carry is first counted
from its bytes (packed_varints.py, in pieces that hold the GIL for well under a millisecond,
whatever the ids' widths), and decoded only when the count is allowed. The other fields are
parsed as they come, in wire order, so a list refused for its count gets the refusal a whole
parse would have given: the first field that does not parse (protobuf itself names what is
wrong with a piece that is not well-formed), else the first cap the request breaks.

A message of more than MAX_SPANS top-level fields, or a list written in more than MAX_SPANS
records, is parsed whole: only an encoder that writes every id as a field of its own makes one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.frontend.packed_varints import count_varints, piece_end
from scheduler_service.frontend.wire_fields import (
    FIXED32,
    FIXED64,
    LENGTH_DELIMITED,
    START_GROUP,
    VARINT,
    FieldSpan,
    field_spans,
    varint_bytes,
)

logger = logging.getLogger(__name__)

# Requests up to this size are parsed on the event loop (about a millisecond); larger ones on an
# intake thread.
INLINE_PARSE_BYTES = 256 << 10
# Fields a request is split into at most; a real request has a dozen.
MAX_SPANS = 256
# The field holding a request's token-id list, in every message type that has one.
ID_LIST_FIELD = "token_ids"


@dataclass(slots=True, frozen=True)
class UnparsedRequest:
    """A request too large to parse on the event loop, as its bytes came off the wire."""

    raw: bytes
    message_class: type[Message]


@dataclass(slots=True, frozen=True)
class ParsedRequest:
    message: Message
    # How many ids the token-id list holds when it was left undecoded because that is more than
    # allowed: the message then holds every other field, and its prompt is that list. None: the
    # message is whole.
    undecoded_ids: int | None = None


def unparsable(error: DecodeError, size: int) -> str:
    """What a client is told of a request that does not parse (logged here)."""
    logger.info("event=request_unparsable bytes=%d error=%r", size, str(error))
    return f"the request message does not parse ({error}); strings must be valid UTF-8"


def parse_request(request: UnparsedRequest, most_ids: int) -> ParsedRequest:
    """The message, its token-id list left undecoded if it holds more than most_ids ids;
    RequestRejected (INVALID) when it does not parse."""
    try:
        return _parse(request, most_ids)
    except DecodeError as error:
        raise RequestRejected(ErrorKind.INVALID, unparsable(error, len(request.raw))) from None


@dataclass(slots=True, frozen=True)
class _IdList:
    """Where a message type keeps its token-id list."""

    message_class: type[Message]
    # Its top-level field.
    number: int
    # The field of the TokenIds message holding the ids, when the top-level field is such a
    # message; None when the top-level field is the repeated ids themselves.
    inner_number: int | None
    # Its oneof and the oneof's other members, as (field number, wire type): the one written
    # last is the one the message holds, the list replacing a member written before it as a
    # member replaces the list. A member's number under another wire type is an unknown field to
    # protobuf, which replaces nothing.
    oneof: str | None
    siblings: frozenset[tuple[int, int]]

    def holds(self, span: FieldSpan) -> bool:
        """Whether this top-level field adds ids to the list (a repeated id may come packed or
        alone; a TokenIds message only length-delimited, else protobuf keeps it as unknown)."""
        return span.number == self.number and (
            span.wire_type == LENGTH_DELIMITED or (self.inner_number is None and span.wire_type == 0)
        )

    def count(self, raw: memoryview, span: FieldSpan) -> int | None:
        """Ids the field adds; None when they are written in too many pieces to count."""
        if span.wire_type != LENGTH_DELIMITED:
            return self._ids(raw[span.start : span.end])
        value = raw[span.value_start : span.end]
        if self.inner_number is None:
            return self._count_packed(value)
        records = field_spans(value, MAX_SPANS + 1)
        if len(records) > MAX_SPANS:
            return None
        total = 0
        for record in records:
            if record.number == self.inner_number and record.wire_type == LENGTH_DELIMITED:
                total += self._count_packed(value[record.value_start : record.end])
            else:
                total += self._ids(self._wrap(value[record.start : record.end]))
        framed = records[-1].end if records else 0
        if framed < len(value):
            # Framing that breaks (or a group): protobuf reads the rest, and refuses it as it
            # would within the whole message.
            total += self._ids(self._wrap(value[framed:]))
        return total

    def _count_packed(self, packed: memoryview) -> int:
        total = 0
        start = 0
        while start < len(packed):
            end = piece_end(packed, start)
            piece = packed[start:end]
            counted = count_varints(piece)
            if counted is None:
                # Not well-formed: protobuf refuses it as it would the whole message.
                counted = self._ids(self._packed(piece))
            total += counted
            start = end
        return total

    def _packed(self, piece: memoryview) -> bytes:
        """An occurrence of the top-level field holding just these packed ids."""
        record = b"".join(
            (varint_bytes((self.inner_number or self.number) << 3 | LENGTH_DELIMITED), varint_bytes(len(piece)), piece)
        )
        return record if self.inner_number is None else self._wrap(record)

    def _wrap(self, inner: bytes | memoryview) -> bytes:
        """A TokenIds message's bytes as an occurrence of the top-level field."""
        return b"".join((varint_bytes(self.number << 3 | LENGTH_DELIMITED), varint_bytes(len(inner)), inner))

    def _ids(self, occurrence: bytes | memoryview) -> int:
        # Parsed as the whole message type, so what does not parse is named as a whole parse would.
        ids = getattr(self.message_class.FromString(occurrence), ID_LIST_FIELD)
        return len(ids if self.inner_number is None else ids.ids)


def _id_list(message_class: type[Message]) -> _IdList | None:
    descriptor: Descriptor = message_class.DESCRIPTOR
    field = descriptor.fields_by_name.get(ID_LIST_FIELD)
    if field is None:
        return None
    oneof = field.containing_oneof
    siblings = (
        frozenset((member.number, _wire_type(member)) for member in oneof.fields if member is not field)
        if oneof
        else frozenset()
    )
    inner = field.message_type.fields_by_name["ids"].number if field.message_type is not None else None
    return _IdList(message_class, field.number, inner, oneof.name if oneof else None, siblings)


def _parse(request: UnparsedRequest, most_ids: int) -> ParsedRequest:
    message_class = request.message_class
    id_list = _id_list(message_class)
    raw = memoryview(request.raw)
    spans = field_spans(raw, MAX_SPANS + 1) if id_list is not None else []
    if (
        id_list is None
        or len(spans) > MAX_SPANS
        # Every id takes a byte at least: this many bytes cannot hold too many.
        or sum(span.end - span.value_start for span in spans if id_list.holds(span)) <= most_ids
    ):
        return ParsedRequest(message_class.FromString(request.raw))
    framed = spans[-1].end if spans else 0
    if framed < len(raw):
        # Framing that breaks (or a group): protobuf reads the rest after the fields before it.
        spans.append(FieldSpan(number=0, wire_type=-1, start=framed, value_start=framed, end=len(raw)))
    message = message_class()
    others: list[FieldSpan] = []
    # Ids of the list while it is the message's prompt (None while a sibling is).
    ids: int | None = None
    for span in spans:
        if not id_list.holds(span):
            others.append(span)
            if (span.number, span.wire_type) in id_list.siblings:
                ids = None
            continue
        # The fields before it first: what does not parse there is what a whole parse reports.
        _merge(message, raw, others)
        others.clear()
        if id_list.oneof is not None:
            message.ClearField(id_list.oneof)
        counted = id_list.count(raw, span)
        if counted is None:
            return ParsedRequest(message_class.FromString(request.raw))
        ids = (ids or 0) + counted
    _merge(message, raw, others)
    if ids is None:
        # A sibling written after the list replaced it: the message is whole without it.
        return ParsedRequest(message)
    if ids <= most_ids:
        return ParsedRequest(message_class.FromString(request.raw))
    return ParsedRequest(message, undecoded_ids=ids)


def _wire_type(field: FieldDescriptor) -> int:
    """The wire type protobuf reads a singular field of this type from."""
    if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE):
        return LENGTH_DELIMITED
    if field.type == FieldDescriptor.TYPE_GROUP:
        return START_GROUP
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64):
        return FIXED64
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32):
        return FIXED32
    return VARINT


def _merge(message: Message, raw: memoryview, spans: Sequence[FieldSpan]) -> None:
    if spans:
        message.MergeFromString(b"".join(raw[span.start : span.end] for span in spans))
