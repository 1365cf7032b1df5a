"""EvictionStrategy.on_evict: the trees tell the strategy of each device victim.

A recording strategy, registered for the test, must see every victim of both the
legacy RadixCache and the UnifiedRadixCache (Python TreeCore), once, in the order
they leave the tree, while each is still attached to it. The default is a no-op.
"""

import unittest
from array import array
from unittest import mock
from unittest.mock import MagicMock

import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.evict_policy import EvictionStrategy, LRUStrategy
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES, get_eviction_strategy
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

SIZE = 64


class RecordingStrategy(LRUStrategy):
    """LRU that records the first token of each victim, checking it is attached."""

    def __init__(self):
        self.victims = []

    def on_evict(self, node):
        assert node.parent is not None and node in node.parent.children.values()
        self.victims.append(node.key.token_ids[0])


def _make_cache(unified):
    kv_pool = MLATokenToKVPool(
        size=SIZE,
        page_size=1,
        dtype=torch.bfloat16,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(
        SIZE, torch.bfloat16, "cpu", kv_pool, need_sort=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=SIZE, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=allocator,
        page_size=1,
        eviction_policy="recording",
    )
    with mock.patch.dict(_EVICTION_POLICY_FACTORIES, {"recording": RecordingStrategy}):
        if not unified:
            cache = RadixCache(params)
            return cache, allocator, cache.eviction_strategy
        params.tree_components = (ComponentType.FULL,)
        params.tree_core_backend = "python"
        cache = UnifiedRadixCache(params)
        return cache, allocator, cache.tree_core.eviction_strategy


def _first_tokens(cache):
    return {node.key.token_ids[0] for node in cache.root_node.children.values()}


class TestOnEvict(CustomTestCase):
    def check_victims_in_eviction_order(self, unified):
        cache, allocator, strategy = _make_cache(unified)
        self.assertIsInstance(strategy, RecordingStrategy)
        for first in (1, 3, 5):  # three disjoint leaves, oldest first
            tokens = [first, first + 100]
            value = allocator.alloc(len(tokens))
            cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value))
        gone = []
        while cache.evictable_size() > 0:
            before = _first_tokens(cache)
            cache.evict(EvictParams(num_tokens=1))
            gone += sorted(before - _first_tokens(cache))
        self.assertEqual(gone, [1, 3, 5])  # LRU order, one leaf per call
        self.assertEqual(strategy.victims, gone)
        self.assertEqual(allocator.available_size(), SIZE)

    def test_radix_cache_reports_each_victim(self):
        self.check_victims_in_eviction_order(unified=False)

    def test_unified_radix_cache_reports_each_victim(self):
        self.check_victims_in_eviction_order(unified=True)

    def test_default_is_a_no_op(self):
        node = MagicMock()
        for policy in ("lru", "lfu", "slru", "priority", "tlru"):
            strategy = get_eviction_strategy(policy)
            self.assertIs(type(strategy).on_evict, EvictionStrategy.on_evict)
            self.assertIsNone(strategy.on_evict(node))
        self.assertEqual(node.mock_calls, [])


if __name__ == "__main__":
    unittest.main()
