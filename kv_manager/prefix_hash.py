"""Content hashes of full KV blocks, chained so a block's hash names its whole prefix."""

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

ROOT_HASH: BlockHash = b""


# How a block's tokens are laid out in what is hashed: C unsigned ints (4 bytes), as array's
# typecode; numpy's dtype of the same name is the same layout, for callers holding tokens in
# arrays (DecodeSet).
TOKEN_FORMAT = "I"


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    return array(TOKEN_FORMAT, token_ids).tobytes()


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_key: bytes = b""
) -> BlockHash:
    """Hash of one full block given its parent's hash (ROOT_HASH for the first block).

    A cryptographic digest rather than Python's hash(): two prompts that collide would silently
    share KV and produce wrong text, and 64-bit tuple hashes collide often enough at scale. The
    extra key (a cache salt, say) keeps tenants from sharing blocks.
    """
    return hash_packed_block(parent, pack_tokens(token_ids), extra_key)


def hash_packed_block(parent: BlockHash, packed_tokens: bytes, extra_key: bytes = b"") -> BlockHash:
    """hash_block_tokens of a block whose tokens are already packed (pack_tokens)."""
    # One buffer hashed in one call: a third less time than an update() per part, the same bytes.
    message = parent + len(extra_key).to_bytes(4, "little") + extra_key + packed_tokens
    return hashlib.blake2b(message, digest_size=16).digest()


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a sequence of num_tokens a prefix hit may cover: every
    full block but one that would hold the last token, whose logits must be computed to sample
    the next."""
    return (num_tokens - 1) // block_size


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: bytes = b"", known: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """The hashes of token_ids' cacheable blocks (cacheable_blocks), reusing the already computed
    leading ones in known."""
    count = cacheable_blocks(len(token_ids), block_size)
    if len(known) >= count:
        return list(known[:count])
    return chain_hashes(token_ids[: count * block_size], block_size, extra_key, known)


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: bytes = b"",
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of token_ids, reusing the already computed leading ones."""
    hashes = list(known)
    extend_chain(hashes, token_ids, block_size, len(token_ids) // block_size, extra_key)
    return hashes


def extend_chain(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_blocks: int, extra_key: bytes = b""
) -> None:
    """Appends to hashes (the chain of token_ids' leading blocks) the hashes of the blocks after
    them, up to num_blocks in all: in place, reading only those blocks' tokens, because a
    request's chain grows by one block at a time through its whole decode."""
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, num_blocks * block_size, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_key)
        hashes.append(parent)
