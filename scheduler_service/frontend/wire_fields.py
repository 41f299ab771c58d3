"""A protobuf message's top-level fields read from its wire bytes, without parsing it: so an
oversized request can be named by its largest field at the cost of a few varints, and a large one
parsed a field at a time (frontend/request_parsing.py)."""

from __future__ import annotations

from dataclasses import dataclass

# A message of a few capped fields has far fewer; past this many the scan stops, so a message
# made of millions of tiny fields costs no more than one made of a few big ones.
MAX_FIELDS_SCANNED = 64
# Wire types.
VARINT, FIXED64, LENGTH_DELIMITED, START_GROUP, FIXED32 = 0, 1, 2, 3, 5
_FIXED_WIDTHS = {FIXED64: 8, FIXED32: 4}


@dataclass(slots=True, frozen=True)
class WireField:
    number: int
    size_bytes: int


@dataclass(slots=True, frozen=True)
class FieldSpan:
    """One top-level field of a message's wire bytes."""

    number: int
    wire_type: int
    # Where its tag starts, where its value starts (past a length prefix) and where it ends.
    start: int
    value_start: int
    end: int


def field_spans(raw: bytes | memoryview, most: int) -> list[FieldSpan]:
    """The top-level fields from the start, up to `most` of them, and up to where the bytes stop
    being well-formed protobuf framing (groups, whose end only a parse finds, included): the
    fields end before len(raw) only where the framing broke or `most` were read."""
    spans: list[FieldSpan] = []
    position = 0
    while position < len(raw) and len(spans) < most:
        start = position
        tag, position = _varint(raw, position)
        if tag is None or position is None:
            break
        number, wire_type = tag >> 3, tag & 7
        value_start = position
        if wire_type == VARINT:
            _, position = _varint(raw, position)
        elif wire_type == LENGTH_DELIMITED:
            length, position = _varint(raw, position)
            if length is None or position is None:
                break
            value_start = position
            position += length
        elif wire_type in _FIXED_WIDTHS:
            position += _FIXED_WIDTHS[wire_type]
        else:
            break
        if position is None or position > len(raw):
            break
        spans.append(FieldSpan(number, wire_type, start, value_start, position))
    return spans


def largest_field(raw: bytes) -> WireField | None:
    """The biggest top-level field among the first MAX_FIELDS_SCANNED (repeats of one field
    number add up); None when the bytes are not well-formed protobuf framing."""
    spans = field_spans(raw, MAX_FIELDS_SCANNED)
    if not spans or (len(spans) < MAX_FIELDS_SCANNED and spans[-1].end < len(raw)):
        return None
    sizes: dict[int, int] = {}
    for span in spans:
        sizes[span.number] = sizes.get(span.number, 0) + span.end - span.start
    number = max(sizes, key=sizes.__getitem__)
    return WireField(number, sizes[number])


def varint_bytes(value: int) -> bytes:
    """value as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varint(raw: bytes | memoryview, position: int) -> tuple[int | None, int | None]:
    value = 0
    for shift in range(0, 64, 7):
        if position >= len(raw):
            return None, None
        byte = raw[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
    return None, None
