"""The leaf index of mla_aware on SGLang's real UnifiedRadixCache: fewer scores, same victims.

Each test builds the tree over a real CPU allocator, with SGLang's ``HookRegistry``
applying the walk hooks of ``mla_leaf_index`` as a server does after loading the plugin.
That the index takes the same victims as the stock heap after long random interleavings
is tested with the accounting invariants (``test_mla_eviction_invariants.py``).
"""

import unittest
from array import array
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache import mla_leaf_index
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy
from sglang.srt.mem_cache.mla_eviction_plugin import register
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

POOL = 4096


def setUpModule():
    register()
    HookRegistry.apply_hooks()


def build(policy="mla_aware", **config):
    allocator = TokenToKVPoolAllocator(POOL, torch.bfloat16, "cpu", kvcache=None, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=1,
        eviction_policy=policy,
        eviction_policy_config={"model": "deepseek-v3", **config} if policy == "mla_aware" else None,
        tree_core_backend="python",
        tree_components=(ComponentType.FULL,),
    )
    return UnifiedRadixCache(params)


def insert(cache, tokens):
    key = RadixKey(array("q", tokens))
    m = cache.match_prefix(MatchPrefixParams(key=key))
    prefix = m.device_prefix_len
    new = cache.token_to_kv_pool_allocator.alloc(len(tokens) - prefix)
    values = torch.cat([cache.path_device_indices(m.last_device_node)[:prefix], new])
    cache.insert(InsertParams(key=key, value=values, prev_prefix_len=prefix))


def touch(cache, tokens):
    cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))


def full(cache):
    return cache.tree_core.components_by_type[ComponentType.FULL]


def prompts(n, shared=16):
    """``n`` prompts of different lengths under one shared prefix (several score classes)."""
    return [list(range(shared)) + [1000 + 100 * i + j for j in range(1 + i % 5)] for i in range(n)]


class TestScoreClass(CustomTestCase):
    """What the index rests on: leaves of one class are ordered by last access time."""

    @settings(max_examples=60, deadline=None, database=None)
    @given(
        lengths=st.lists(st.integers(1, 3), min_size=13, max_size=24),
        hits=st.lists(st.integers(0, 1), min_size=24, max_size=24),
        proven=st.lists(st.booleans(), min_size=24, max_size=24),
        log_factor=st.floats(0, 6.9),
        weight=st.floats(0.25, 3.0),
    )
    def test_one_class_is_ordered_by_age(self, lengths, hits, proven, log_factor, weight):
        # Each key element stands for 8,192 tokens, as a replay keys blocks: lengths 1-3
        # then differ in price per byte by a third (attention within the node).
        cache = build(key_unit_tokens=8192)
        for i, n in enumerate(lengths):
            insert(cache, [7, 7] + [100 * i + j for j in range(n)])
        strategy = cache.tree_core.eviction_strategy
        learning = strategy.learning
        learning.log_factor, learning.weight = log_factor, weight
        learning.factor = 2.718281828459045 ** log_factor
        leaves = sorted(cache.tree_core.evictable_device_leaves, key=lambda n: n.last_access_time)
        for leaf, h, p in zip(leaves, hits, proven):
            leaf.hit_count = h
            strategy.get_priority(leaf)
            leaf._mla_seen.probationary = not p  # as a return or a second child would prove it
        classes = {}
        for leaf in leaves:
            priority = strategy.get_priority(leaf)
            classes.setdefault(strategy.score_class(leaf), []).append(priority)
        # Thirteen leaves or more in twelve classes at most: some class has two.
        self.assertGreater(sum(len(p) > 1 for p in classes.values()), 0)
        for key, priorities in classes.items():
            self.assertEqual(priorities, sorted(priorities), key)


class TestLeafIndex(CustomTestCase):
    def test_taken_for_mla_aware_only(self):
        for policy, config, expected in [
            ("mla_aware", {}, True),
            ("mla_aware", {"indexed_eviction": False}, False),
            ("lru", {}, False),
        ]:
            with self.subTest(policy=policy, config=config):
                cache = build(policy, **config)
                for tokens in prompts(8):
                    insert(cache, tokens)
                cache.evict(EvictParams(num_tokens=4))
                index = full(cache).__dict__.get(mla_leaf_index._INDEX)
                self.assertEqual(bool(index and index.walks), expected)
                self.assertEqual(mla_leaf_index.indexes(full(cache)), policy == "mla_aware")

    def test_scores_new_and_touched_leaves_and_class_heads_only(self):
        cache = build(trim_victims=False)
        batch = prompts(40)
        for tokens in batch:
            insert(cache, tokens)
        strategy = cache.tree_core.eviction_strategy
        leaves = len(cache.tree_core.evictable_device_leaves)
        with mock.patch.object(MLAAwareStrategy, "get_priority", autospec=True,
                               side_effect=MLAAwareStrategy.get_priority) as score:
            cache.evict(EvictParams(num_tokens=1))
            first = score.call_count
            classes = len(full(cache).__dict__[mla_leaf_index._INDEX]._heaps)
            touch(cache, batch[-1])
            touch(cache, batch[-2])
            score.reset_mock()
            cache.evict(EvictParams(num_tokens=1))
            second = score.call_count
        self.assertEqual(first, leaves)  # every leaf is new to the index
        self.assertGreater(leaves, 3 * classes)
        # Each class's oldest, the next of the victim's class, and the two leaves accessed
        # in place if they come to the head of their old class.
        self.assertLessEqual(second, 2 + classes + 1)
        self.assertGreater(strategy.learning._build, 1)

    def test_a_walk_does_not_read_the_unchanged_leaves(self):
        cache = build(trim_victims=False)
        batch = prompts(40)
        for tokens in batch:
            insert(cache, tokens)
        cache.evict(EvictParams(num_tokens=1))
        leaves = cache.tree_core.evictable_device_leaves
        self.assertIsInstance(leaves, mla_leaf_index.TrackedLeaves)
        touch(cache, batch[-1])
        insert(cache, prompts(41)[-1])
        with mock.patch.object(mla_leaf_index.TrackedLeaves, "__iter__",
                               side_effect=AssertionError("the walk read every leaf")):
            cache.evict(EvictParams(num_tokens=1))
        index = full(cache).__dict__[mla_leaf_index._INDEX]
        self.assertEqual(index.walks, 2)
        self.assertLessEqual(set(index.live), set(leaves))
        # A leaf the tree takes out of the set (a request locks it) leaves the index at once.
        locked = max(index.live, key=lambda n: n.last_access_time)
        cache.inc_lock_ref(locked.id)
        self.assertNotIn(locked, leaves)
        self.assertNotIn(locked, index.live)

    def test_a_reset_tree_and_a_switched_off_index_get_their_sets_back(self):
        cache = build(trim_victims=False)
        for tokens in prompts(10):
            insert(cache, tokens)
        cache.evict(EvictParams(num_tokens=1))
        index = full(cache).__dict__[mla_leaf_index._INDEX]
        cache.reset()  # SGLang gives the tree a new, plain set
        self.assertNotIsInstance(cache.tree_core.evictable_device_leaves, mla_leaf_index.TrackedLeaves)
        for tokens in prompts(10):
            insert(cache, tokens)
        cache.evict(EvictParams(num_tokens=1))
        leaves = cache.tree_core.evictable_device_leaves
        self.assertIsInstance(leaves, mla_leaf_index.TrackedLeaves)
        self.assertEqual(set(index.live), set(leaves))  # every leaf but the victim, classed
        cache.tree_core.eviction_strategy.indexed_eviction = False
        cache.evict(EvictParams(num_tokens=1))
        self.assertIs(type(cache.tree_core.evictable_device_leaves), set)
        self.assertEqual(index.live, {})
        self.assertEqual(index.walks, 2)

    def test_victims_in_score_order(self):
        cache = build(trim_victims=False)
        batch = prompts(30)
        for tokens in batch:
            insert(cache, tokens)
        cache.evict(EvictParams(num_tokens=1))  # every leaf classed
        for tokens in batch[::3]:
            touch(cache, tokens)  # accessed in place: still filed under the old access time
        strategy = cache.tree_core.eviction_strategy
        leaves = cache.tree_core.evictable_device_leaves
        expected = sorted(leaves, key=strategy.get_priority)
        victims = []
        component = full(cache)
        original = mla_leaf_index.next_node

        def record(component, index, tracker):
            node_id = original(component, index, tracker)
            if node_id is not None:
                victims.append(cache.tree_core.node_by_id(node_id))
            return node_id

        with mock.patch.object(mla_leaf_index, "next_node", side_effect=record):
            cache.evict(EvictParams(num_tokens=sum(len(n.key) for n in expected[:10])))
        self.assertIsNotNone(component.__dict__.get(mla_leaf_index._INDEX))
        self.assertEqual(victims, expected[:10])

    def test_stale_entries_stay_bounded(self):
        cache = build(trim_victims=False)
        batch = prompts(20)
        for tokens in batch:
            insert(cache, tokens)
        for round_ in range(50):
            for tokens in batch[round_ % 4 :: 4]:
                touch(cache, tokens)
            cache.evict(EvictParams(num_tokens=1))
            index = full(cache).__dict__[mla_leaf_index._INDEX]
            # Indexed: leaves only (victims leave at once); stale entries: a few walks' worth.
            self.assertLessEqual(set(index.live), set(cache.tree_core.evictable_device_leaves))
            self.assertLessEqual(index._entries, 2 * len(index.live) + 64 + len(batch))
            insert(cache, prompts(20 + round_ + 1)[-1])
        self.assertEqual(index.walks, 50)


if __name__ == "__main__":
    unittest.main()
