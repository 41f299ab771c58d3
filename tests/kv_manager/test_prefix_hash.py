"""Block hashes name a block's whole prefix and its cache salt: blake2b (16 bytes) of the parent's
hash, the salt's length (4 bytes, little-endian), the salt and the tokens as uint32."""

import hashlib
import struct

from kv_manager.prefix_hash import ROOT_HASH, chain_hashes, hash_block_tokens


def test_a_block_hash_is_blake2b_of_parent_salt_and_tokens() -> None:
    tokens = [0, 1, 49_151, 2**32 - 1]
    expected = hashlib.blake2b(b"p" * 16 + struct.pack("<I", 4) + b"salt" + struct.pack("<4I", *tokens), digest_size=16)
    assert hash_block_tokens(b"p" * 16, tokens, b"salt") == expected.digest()


def test_chains_differ_by_salt_and_by_any_earlier_token() -> None:
    tokens = list(range(64))
    plain = chain_hashes(tokens, 16)
    assert len(plain) == 4 and plain[0] == hash_block_tokens(ROOT_HASH, tokens[:16])
    assert set(plain).isdisjoint(chain_hashes(tokens, 16, b"tenant-a"))
    changed = chain_hashes([99, *tokens[1:]], 16)
    # One token of the first block differs: every later block's hash differs too.
    assert all(a != b for a, b in zip(plain, changed, strict=True))
