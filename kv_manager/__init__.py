"""Logical KV-cache bookkeeping: which blocks a request holds, which blocks hold a cached prefix.

Pure Python (no torch, no gRPC): the scheduler owns one KVCacheManager per executor, and the
executor owns the memory the block ids point into.
"""

from kv_manager.block_pool import BlockPool, KVBlock
from kv_manager.kv_cache_manager import (
    BlockCopy,
    CacheStats,
    KVCacheManager,
    PoolExhausted,
    PrefixHit,
)
from kv_manager.prefix_hash import BlockHash, hash_block_tokens

__all__ = [
    "BlockCopy",
    "BlockHash",
    "BlockPool",
    "CacheStats",
    "KVBlock",
    "KVCacheManager",
    "PoolExhausted",
    "PrefixHit",
    "hash_block_tokens",
]
