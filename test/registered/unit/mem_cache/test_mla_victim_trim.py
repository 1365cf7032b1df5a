"""Victim trimming on SGLang's real UnifiedRadixCache: an eviction frees what it is asked for.

Each test builds the tree over a real CPU allocator, with SGLang's ``HookRegistry`` applying
the two hooks of ``mla_victim_trim`` as a server does after loading the plugin.
"""

import unittest
from array import array
from types import SimpleNamespace

import torch

from sglang.srt.mem_cache import mla_victim_trim
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.mla_aware_policy import create_mla_aware_strategy
from sglang.srt.mem_cache.mla_eviction_plugin import register
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

POOL = 64


def setUpModule():
    register()
    HookRegistry.apply_hooks()


def build(policy="lru", page_size=1, trim=True, kind="unified", pool=POOL):
    """A real cache of ``pool`` token slots whose strategy asks for trimming when ``trim``."""
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(pool, torch.bfloat16, "cpu", kvcache=None, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(
            pool, page_size, torch.bfloat16, "cpu", kvcache=None, need_sort=False
        )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        eviction_policy=policy,
        eviction_policy_config={"model": "deepseek-v3"} if policy == "mla_aware" else None,
        tree_core_backend="python",
    )
    if kind == "radix":
        return RadixCache(params)
    params.tree_components = (ComponentType.FULL,)
    cache = UnifiedRadixCache(params)
    cache.tree_core.eviction_strategy.trim_victims = trim  # what mla_aware's config sets
    return cache


def insert(cache, tokens):
    """Cache ``tokens`` as a finished request would (its slots go to the tree)."""
    key = RadixKey(array("q", tokens))
    m = cache.match_prefix(MatchPrefixParams(key=key))
    prefix = m.device_prefix_len
    new = cache.token_to_kv_pool_allocator.alloc(len(tokens) - prefix)
    assert new is not None
    values = torch.cat([cache.path_device_indices(m.last_device_node)[:prefix], new])
    cache.insert(InsertParams(key=key, value=values, prev_prefix_len=prefix))


def cached(cache, tokens):
    """Leading tokens of ``tokens`` the cache still holds on device."""
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len


def first_node(cache, tokens):
    """The root's child ``tokens`` begin with (found without a match, which would touch it)."""
    return cache.tree_core.root_node.children[RadixKey(array("q", tokens)).child_key(cache.page_size)]


A = list(range(1, 11))  # ten tokens
B = list(range(101, 111))


class TestFreesWhatIsAsked(CustomTestCase):
    def test_evict_and_evict_for_alloc(self):
        for call in ("evict", "evict_for_alloc"):
            for trim, freed, left in ((False, 10, 0), (True, 3, 7)):
                with self.subTest(call=call, trim=trim):
                    cache = build(trim=trim)
                    insert(cache, A)
                    got = getattr(cache, call)(EvictParams(num_tokens=3)).num_tokens_evicted
                    self.assertEqual(got, freed)
                    self.assertEqual(cache.evictable_size(), 10 - freed)
                    self.assertEqual(cache.token_to_kv_pool_allocator.available_size(), POOL - 10 + freed)
                    self.assertEqual(cached(cache, A), left)

    def test_whole_victims_before_the_last(self):
        cache = build()
        insert(cache, A)
        insert(cache, B)
        # A is older: it goes whole, then B loses the two tokens still missing.
        self.assertEqual(cache.evict(EvictParams(num_tokens=12)).num_tokens_evicted, 12)
        self.assertEqual((cached(cache, A), cached(cache, B)), (0, 8))

    def test_a_surplus_below_a_hundredth_of_the_pool_stays_free(self):
        # 7 tokens over the request: trimmed in a pool of 700 slots, not in one of 701 or more.
        for pool, freed in ((700, 3), (701, 10), (2000, 10)):
            with self.subTest(pool=pool):
                cache = build(pool=pool)
                insert(cache, A)
                self.assertEqual(cache.evict(EvictParams(num_tokens=3)).num_tokens_evicted, freed)

    def test_rounds_up_to_a_page(self):
        cache = build(page_size=4)
        insert(cache, A[:8])
        self.assertEqual(cache.evict(EvictParams(num_tokens=3)).num_tokens_evicted, 4)
        self.assertEqual(cached(cache, A[:8]), 4)

    def test_the_head_keeps_the_victims_age(self):
        """Trimmed, A is still older than B: the next eviction trims A again (a head
        stamped as new would send B first)."""
        cache = build()
        insert(cache, A)
        insert(cache, B)
        age = first_node(cache, A).last_access_time
        cache.evict(EvictParams(num_tokens=2))
        head = first_node(cache, A)
        self.assertEqual(len(head.key), 8)
        self.assertEqual(head.last_access_time, age)
        cache.evict(EvictParams(num_tokens=2))
        self.assertEqual((cached(cache, A), cached(cache, B)), (6, 10))


class TestScope(CustomTestCase):
    def test_unsupported_trees_keep_whole_victims(self):
        legacy = build(kind="radix")
        legacy.eviction_strategy.trim_victims = True
        self.assertFalse(mla_victim_trim.supports(legacy))
        self.assertFalse(mla_victim_trim.trims(legacy))
        insert(legacy, A)
        self.assertEqual(legacy.evict(EvictParams(num_tokens=3)).num_tokens_evicted, 10)
        with_host = build()
        self.assertTrue(mla_victim_trim.trims(with_host))
        with_host.cache_controller = object()  # what HiCache attaches
        self.assertFalse(mla_victim_trim.trims(with_host))

    def test_mla_aware_asks_unless_configured_off(self):
        for config, asks in (({}, True), ({"trim_victims": False}, False)):
            with self.subTest(config=config):
                strategy = create_mla_aware_strategy(model="deepseek-v3", **config)
                self.assertIs(strategy.trim_victims, asks)

    def test_no_victim_longer_than_missing_is_split(self):
        cache = build()
        insert(cache, A)
        victim = first_node(cache, A)
        self.assertIsNone(mla_victim_trim.trim(cache.tree_core, victim, 10))
        self.assertIs(victim.parent, cache.tree_core.root_node)


class TestMLAAwareState(CustomTestCase):
    def test_head_stays_proven_and_the_tail_is_known_when_it_returns(self):
        cache = build(policy="mla_aware")
        learning = cache.tree_core.eviction_strategy.learning
        insert(cache, A)
        cache.evict(EvictParams(num_tokens=10))  # A scored (probationary) and evicted
        insert(cache, A)
        cache.evict(EvictParams(num_tokens=2))  # A comes back (proven), loses its tail
        self.assertEqual(learning.returns, [0, 1])
        head = first_node(cache, A)
        self.assertEqual(len(head.key), 8)
        self.assertFalse(head._mla_seen.probationary)  # without on_split: probationary
        # priced per byte as the ten-token node was, not as a node of eight
        strategy = cache.tree_core.eviction_strategy
        whole = strategy._restore_seconds_per_byte(SimpleNamespace(key=A), backed=False)
        self.assertEqual(head._mla_seen.density, whole)
        self.assertGreater(whole, strategy.restore_seconds_per_byte(head))
        insert(cache, A)  # the tail returns ...
        cache.evict(EvictParams(num_tokens=1))  # ... and its next score says so
        self.assertEqual(learning.returns, [1, 1])


if __name__ == "__main__":
    unittest.main()
