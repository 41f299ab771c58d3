"""Limits both ends of a gRPC link must agree on."""

# A plan carries every token of its new requests, so long prompts in big batches pass gRPC's
# 4 MiB default; the executor and the scheduler must raise their limits to the same size.
MAX_MESSAGE_BYTES = 64 << 20

# The token an executor answers in StepResult.decode_token_ids for a decode handle it does not
# hold (its state was dropped, say by a failed step).
UNHELD_DECODE_TOKEN = 2**32 - 1
