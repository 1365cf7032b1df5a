"""MLAEvictionBudget: capacity figures, and the shortfall on SGLang's real allocator and tree."""

import math
import unittest
from array import array

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.allocator import (
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.mla_cost_model import KVCostModel
from sglang.srt.mem_cache.mla_eviction_budget import MLAEvictionBudget, parse_size
from sglang.srt.mem_cache.mla_eviction_plugin import register
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

GB = 10**9
V3_TP8 = KVCostModel.from_preset("deepseek-v3", tp_size=8)


def v3_budget(**kwargs):
    setup = dict(gpu_memory_bytes=80 * GB, weights_bytes=40 * GB)
    setup.update(kwargs)
    return MLAEvictionBudget(V3_TP8, **setup)


class TestParseSize(CustomTestCase):
    def test_units(self):
        cases = {
            "80GB": 80 * 10**9,
            "40GiB": 40 * 2**30,
            "512MB": 512 * 10**6,
            "512mib": 512 * 2**20,
            "1.5TB": 1_500_000_000_000,
            "64 KiB": 65_536,
            "4096": 4_096,
            "7B": 7,
            "0GB": 0,
        }
        for text, expected in cases.items():
            with self.subTest(text=text):
                self.assertEqual(parse_size(text), expected)

    def test_bad_values_are_named(self):
        for text in ("", "GB", "80GX", "-1GB", "eighty", "1e9", "80 G B", "1.2.3GB"):
            with self.subTest(text=text):
                with self.assertRaises(ValueError) as ctx:
                    parse_size(text)
                self.assertIn(repr(text), str(ctx.exception))


class TestCapacity(CustomTestCase):
    def test_deepseek_v3_80gb_40gb_tp8(self):
        budget = v3_budget()
        # 80 GB x 0.9 - 40 GB of weights
        self.assertEqual(budget.capacity_bytes, 32_000_000_000)
        # 32e9 // 70,272 B per token
        self.assertEqual(budget.capacity_tokens, 455_373)
        self.assertEqual(budget.capacity_tokens, 32_000_000_000 // 70_272)

    def test_page_rounded(self):
        budget = MLAEvictionBudget(
            V3_TP8.with_setup(page_size=64), gpu_memory_bytes=80 * GB, weights_bytes=40 * GB
        )
        # 32e9 // (64 x 70,272) = 7,115 whole pages
        self.assertEqual(budget.capacity_tokens, 7_115 * 64)

    def test_activation_and_reserved_bytes(self):
        budget = v3_budget(mem_fraction_static=0.8, activation_bytes=2 * GB, reserved_bytes=GB)
        self.assertEqual(budget.capacity_bytes, 64 * GB - 40 * GB - 3 * GB)

    def test_bad_setup_raises(self):
        cases = {
            "weights_bytes": dict(weights_bytes=-1),
            "gpu_memory_bytes": dict(gpu_memory_bytes=-5),
            "mem_fraction_static": dict(mem_fraction_static=1.5),
            "no room": dict(weights_bytes=72 * GB),
        }
        for name, kwargs in cases.items():
            with self.subTest(name=name):
                with self.assertRaises(ValueError) as ctx:
                    v3_budget(**kwargs)
                self.assertIn(name, str(ctx.exception))


class TestTokensToEvict(CustomTestCase):
    def test_exact_shortfall(self):
        budget = v3_budget()
        self.assertEqual(budget.tokens_to_evict(0, 0), 0)
        self.assertEqual(budget.tokens_to_evict(0, 100), 0)
        self.assertEqual(budget.tokens_to_evict(100, 100), 0)
        self.assertEqual(budget.tokens_to_evict(100, 40), 60)
        self.assertEqual(budget.tokens_to_evict(100, 0), 100)

    def test_negative_input_raises(self):
        budget = v3_budget()
        for args, name in (((-1, 0), "requested_tokens"), ((1, -1), "available_tokens")):
            with self.subTest(name=name):
                with self.assertRaises(ValueError) as ctx:
                    budget.tokens_to_evict(*args)
                self.assertIn(name, str(ctx.exception))

    @settings(max_examples=200, deadline=None)
    @given(
        requested=st.integers(min_value=0, max_value=10**7),
        available=st.integers(min_value=0, max_value=10**7),
        tp=st.sampled_from([1, 2, 8, 16]),
    )
    def test_never_below_shortfall(self, requested, available, tp):
        budget = MLAEvictionBudget(
            KVCostModel.from_preset("deepseek-v3", tp_size=tp),
            gpu_memory_bytes=80 * GB,
            weights_bytes=40 * GB,
        )
        shortfall = max(0, requested - available)
        evict = budget.tokens_to_evict(requested, available)
        self.assertGreaterEqual(evict, shortfall)
        self.assertEqual(evict, shortfall)


class TestOnRealAllocator(CustomTestCase):
    """A RadixCache filled to capacity over SGLang's allocators on CPU."""

    SIZE = 256
    LEAF = 8  # tokens per cached leaf

    @classmethod
    def setUpClass(cls):
        register()

    def _full_cache(self, page_size):
        kv = MLATokenToKVPool(
            size=self.SIZE, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=8,
            qk_rope_head_dim=4, layer_num=1, device="cpu", enable_memory_saver=False,
        )
        if page_size == 1:
            allocator = TokenToKVPoolAllocator(
                self.SIZE, torch.bfloat16, "cpu", kv, need_sort=False
            )
        else:
            allocator = PagedTokenToKVPoolAllocator(
                self.SIZE, page_size, torch.bfloat16, "cpu", kv, need_sort=False
            )
        cache = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=allocator,
                page_size=page_size,
                eviction_policy="mla_aware",
                eviction_policy_config={"model": "deepseek-v3", "tp_size": 8},
            )
        )
        for i in range(self.SIZE // self.LEAF):
            tokens = array("q", range(i * 1000, i * 1000 + self.LEAF))
            cache.insert(InsertParams(key=RadixKey(tokens), value=allocator.alloc(self.LEAF)))
        self.assertEqual(allocator.available_size(), 0)
        self.assertEqual(cache.evictable_size(), self.SIZE)
        return allocator, cache

    def _check_integrity(self, allocator, cache):
        self.assertEqual(allocator.available_size() + cache.evictable_size(), self.SIZE)

    def test_naive_scaled_eviction_fails_budget_succeeds(self):
        budget = v3_budget()
        ratio = V3_TP8.compression_vs_mha  # 8.89 at TP 8
        for page_size in (1, 4):
            for requested in (16, 64, 128, self.SIZE):
                with self.subTest(page_size=page_size, requested=requested):
                    # The naive design: a latent token is `ratio` times smaller, so
                    # evict `ratio` times fewer tokens. The pool counts tokens.
                    allocator, cache = self._full_cache(page_size)
                    shortfall = requested - allocator.available_size()
                    naive = math.ceil(shortfall / ratio)
                    cache.evict(EvictParams(num_tokens=naive))
                    self._check_integrity(allocator, cache)
                    self.assertLess(allocator.available_size(), requested)
                    self.assertIsNone(allocator.alloc(requested))

                    allocator, cache = self._full_cache(page_size)
                    evict = budget.tokens_to_evict(requested, allocator.available_size())
                    self.assertEqual(evict, shortfall)
                    result = cache.evict(EvictParams(num_tokens=evict))
                    self._check_integrity(allocator, cache)
                    # Whole leaves go: overshoot below one leaf.
                    self.assertLess(result.num_tokens_evicted - evict, self.LEAF)
                    self.assertIsNotNone(allocator.alloc(requested))

    def test_matches_upstream_evict_to_free_tokens(self):
        # SGLang's own allocation path evicts the same shortfall.
        budget = v3_budget()
        for requested in (1, 20, 100):
            with self.subTest(requested=requested):
                ours, our_cache = self._full_cache(1)
                evict = budget.tokens_to_evict(requested, ours.available_size())
                our_cache.evict(EvictParams(num_tokens=evict))

                theirs, their_cache = self._full_cache(1)
                theirs.evict_to_free_tokens(their_cache, requested)
                self.assertEqual(ours.available_size(), theirs.available_size())
                self.assertIsNotNone(ours.alloc(requested))

    def test_zero_when_room(self):
        allocator, cache = self._full_cache(1)
        cache.evict(EvictParams(num_tokens=64))
        available = allocator.available_size()
        self.assertEqual(v3_budget().tokens_to_evict(available, available), 0)
        self.assertIsNotNone(allocator.alloc(available))


if __name__ == "__main__":
    unittest.main()
