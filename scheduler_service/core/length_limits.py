"""How long a prompt may be once it is tokenized: it must leave room for one generated token
under the model's maximum length, and in the KV cache that is to hold it. The engine applies the
rules against what every executor offers, each executor's scheduler against its own."""

from scheduler_service.core.errors import ErrorKind, RequestRejected


def check_room_under_model_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise RequestRejected(
            ErrorKind.INVALID,
            f"prompt of {num_prompt_tokens} tokens leaves no room to generate under "
            f"the maximum model length of {max_model_len}",
        )


def check_room_in_cache(num_prompt_tokens: int, max_seq_len: int, cache: str) -> None:
    """cache: which KV cache, for the message ("a KV cache of 2 blocks x 4 tokens")."""
    if num_prompt_tokens >= max_seq_len:
        raise RequestRejected(
            ErrorKind.TOO_LARGE, f"prompt of {num_prompt_tokens} tokens leaves no room to generate in {cache}"
        )
