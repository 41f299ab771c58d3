"""Logical KV-cache bookkeeping: which blocks a request holds, which blocks hold a cached prefix,
and for a hybrid model which recurrent-state slot a request holds and which slots keep the
recurrent state of a cached prefix (checkpoints).

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
from kv_manager.state_checkpoints import StateCheckpoints
from kv_manager.state_slots import SlotsExhausted, StateSlotPool

__all__ = [
    "BlockCopy",
    "BlockHash",
    "BlockPool",
    "CacheStats",
    "KVBlock",
    "KVCacheManager",
    "PoolExhausted",
    "PrefixHit",
    "SlotsExhausted",
    "StateCheckpoints",
    "StateSlotPool",
    "hash_block_tokens",
]
