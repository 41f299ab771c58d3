"""Sizes of a protobuf message's top-level fields read from its wire bytes, without parsing it,
so an oversized request can be named by its largest field at the cost of a few varints."""

from __future__ import annotations

from dataclasses import dataclass

# A message of a few capped fields has far fewer; past this many the scan stops, so a message
# made of millions of tiny fields costs no more than one made of a few big ones.
MAX_FIELDS_SCANNED = 64
_LENGTH_DELIMITED = 2
_FIXED_WIDTHS = {1: 8, 5: 4}


@dataclass(slots=True, frozen=True)
class WireField:
    number: int
    size_bytes: int


def largest_field(raw: bytes) -> WireField | None:
    """The biggest top-level field among the first MAX_FIELDS_SCANNED (repeats of one field
    number add up); None when the bytes are not well-formed protobuf framing."""
    sizes: dict[int, int] = {}
    position = 0
    for _ in range(MAX_FIELDS_SCANNED):
        if position >= len(raw):
            break
        start = position
        tag, position = _varint(raw, position)
        if tag is None:
            return None
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, position = _varint(raw, position)
        elif wire_type == _LENGTH_DELIMITED:
            length, position = _varint(raw, position)
            if length is None:
                return None
            position += length
        elif wire_type in _FIXED_WIDTHS:
            position += _FIXED_WIDTHS[wire_type]
        else:
            return None
        if position is None or position > len(raw):
            return None
        sizes[number] = sizes.get(number, 0) + position - start
    if not sizes:
        return None
    number = max(sizes, key=sizes.__getitem__)
    return WireField(number, sizes[number])


def _varint(raw: bytes, position: int) -> tuple[int | None, int | None]:
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
