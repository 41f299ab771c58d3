"""What a stream holds for a client that has not read it yet, and how much it may hold.

A client that reads slower than its request generates leaves tokens waiting in the scheduler.
They are folded into one pending message as they arrive, so falling behind costs about the bytes
the tokens take on the wire (a few per token, a few hundred with 20 logprobs) instead of a
protobuf message per step (about 1.6 KB each, measured with upb). The limits say how far behind
a reader may fall before its request is ended (output_stream.py).
"""

from dataclasses import dataclass

from protos.splitserve.v1 import generation_pb2 as pb

# A legitimate reader that stalls for a minute or two while a fast decode runs at ~100 tokens/s,
# or that reads a long answer in bursts, stays well inside these; a reader that never reads
# costs at most this much, and no more than one stream's worth per open stream.
DEFAULT_MAX_BACKLOG_TOKENS = 16_384
# ~7,000 tokens with 20 logprobs and a tokenizer (about 300 bytes each); without logprobs the
# token limit binds first.
DEFAULT_MAX_BACKLOG_BYTES = 2 << 20


@dataclass(slots=True, frozen=True)
class BacklogLimits:
    """How far a stream's reader may fall behind: tokens and bytes released to it and not yet
    taken (the scheduler's --max-stream-backlog-tokens and --max-stream-backlog-bytes)."""

    max_tokens: int = DEFAULT_MAX_BACKLOG_TOKENS
    max_bytes: int = DEFAULT_MAX_BACKLOG_BYTES

    def exceeded_by(self, pending: "PendingMessage") -> str | None:
        """The flag whose limit pending is over, if any."""
        if pending.tokens > self.max_tokens:
            return f"--max-stream-backlog-tokens {self.max_tokens}"
        if pending.size > self.max_bytes:
            return f"--max-stream-backlog-bytes {self.max_bytes}"
        return None


class PendingMessage:
    """Token messages not yet taken, as one message: the first as it came, the later ones as
    their wire bytes, which merge as repeated fields append. Their text is kept apart, as UTF-8,
    since a string field's last value wins on the wire rather than adding up."""

    __slots__ = ("_first", "_wire", "_text", "tokens", "size")

    def __init__(self, message: pb.GenerateResponse) -> None:
        self._first = message
        self._wire = bytearray()
        self._text = bytearray()
        self.tokens = len(message.token_ids)
        # Bytes on the wire, about: the limit's measure.
        self.size = message.ByteSize()

    def fold(self, message: pb.GenerateResponse) -> None:
        """Adds a later message (which is cleared of its text and request id on the way)."""
        self.tokens += len(message.token_ids)
        text = message.text.encode()
        self._text += text
        message.ClearField("text")
        message.ClearField("request_id")
        wire = message.SerializeToString()
        self._wire += wire
        self.size += len(wire) + len(text)

    def take(self) -> pb.GenerateResponse:
        """The folded message; the pending message is spent."""
        message = self._first
        if self._wire:
            message.MergeFromString(self._wire)
        if self._text:
            message.text += self._text.decode()
        return message
