"""An oversized request is named by its largest field, read from the wire without parsing."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.frontend.wire_fields import MAX_FIELDS_SCANNED, largest_field

_requests = st.builds(
    pb.GenerateRequest,
    request_id=st.text(max_size=300),
    text=st.text(max_size=300),
    sampling=st.builds(pb.SamplingParams, stop=st.lists(st.text(max_size=50), max_size=4), seed=st.integers(0, 2**63 - 1)),
    priority=st.integers(-(2**31), 2**31 - 1),
    cache_salt=st.text(max_size=300),
)


def _field_sizes(message: pb.GenerateRequest) -> dict[int, int]:
    sizes = {}
    for descriptor, _ in message.ListFields():
        alone = pb.GenerateRequest()
        field = getattr(message, descriptor.name)
        if descriptor.message_type is not None:
            getattr(alone, descriptor.name).CopyFrom(field)
        else:
            setattr(alone, descriptor.name, field)
        sizes[descriptor.number] = alone.ByteSize()
    return sizes


@given(_requests)
def test_the_largest_field_and_its_size_match_what_protobuf_wrote(message: pb.GenerateRequest) -> None:
    sizes = _field_sizes(message)
    found = largest_field(message.SerializeToString())
    if not sizes:
        assert found is None
        return
    assert found is not None
    assert found.size_bytes == max(sizes.values())
    assert sizes[found.number] == found.size_bytes


def test_a_huge_token_id_prompt_is_named_token_ids() -> None:
    raw = pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=[70_000] * 100_000), cache_salt="s" * 1000).SerializeToString()
    found = largest_field(raw)
    assert found is not None and found.number == pb.GenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number
    assert found.size_bytes > 300_000


def test_truncated_or_corrupt_framing_names_nothing() -> None:
    raw = pb.GenerateRequest(text="x" * 500).SerializeToString()
    assert largest_field(raw[:-1]) is None
    assert largest_field(b"\xff" * 11) is None
    assert largest_field(bytes([3 << 3 | 7])) is None


def test_the_scan_stops_after_its_field_budget() -> None:
    many = b"".join(pb.GenerateRequest(priority=1).SerializeToString() for _ in range(MAX_FIELDS_SCANNED * 10))
    tail = pb.GenerateRequest(cache_salt="z" * 5000).SerializeToString()
    found = largest_field(many + tail)
    assert found is not None and found.number == pb.GenerateRequest.DESCRIPTOR.fields_by_name["priority"].number
    assert found.size_bytes == MAX_FIELDS_SCANNED * 2
