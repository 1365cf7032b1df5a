"""Tenant isolation with the mla_aware policy on SGLang's real prefix caches.

Requests carrying different ``extra_key`` values (``RadixKey(tokens, extra_key=...)``:
LoRA ids, cache salts, tenants) must never match each other's prefixes, whatever the
eviction policy does. Checked on ``UnifiedRadixCache`` (Python tree core) and the
legacy ``RadixCache``, unpaged and with page size 4, over a real CPU allocator:
fixed cases first, then a seeded random interleaving of inserts, matches and
evictions where every match is bounded by what that tenant itself inserted.
Seed: ``MLA_INVARIANT_SEED`` (printed).
"""

import os
import random
import sys
import unittest
from array import array

import torch

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy
from sglang.srt.mem_cache.mla_eviction_plugin import register
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

SEED = int(os.environ.get("MLA_INVARIANT_SEED", random.SystemRandom().randrange(2**32)))
print(f"[mla isolation] MLA_INVARIANT_SEED={SEED}", file=sys.stderr)
POOL = 512
TENANTS = (None, "tenant-a", "tenant-b", "lora-7")
SETUPS = [(kind, page) for kind in ("unified", "radix") for page in (1, 4)]


class Tree:
    def __init__(self, kind, page):
        self.kind, self.page = kind, page
        if page == 1:
            self.allocator = TokenToKVPoolAllocator(POOL, torch.bfloat16, "cpu", None, need_sort=False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                POOL, page, torch.bfloat16, "cpu", None, need_sort=False
            )
        params = CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator,
            page_size=page, eviction_policy="mla_aware",
            eviction_policy_config={"model": "deepseek-v3", "page_size": page},
            tree_core_backend="python",
        )
        if kind == "radix":
            self.cache = RadixCache(params)
            strategy = self.cache.eviction_strategy
        else:
            params.tree_components = (ComponentType.FULL,)
            self.cache = UnifiedRadixCache(params)
            strategy = self.cache.tree_core.eviction_strategy
        assert isinstance(strategy, MLAAwareStrategy)

    def match(self, tokens, extra_key):
        key = RadixKey(array("q", tokens), extra_key=extra_key)
        return self.cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len

    def insert(self, tokens, extra_key):
        """Insert as a finished request would: match, allocate the rest, insert."""
        key = RadixKey(array("q", tokens), extra_key=extra_key)
        m = self.cache.match_prefix(MatchPrefixParams(key=key))
        lock = self.cache.lock(m.last_device_node)
        prefix = m.device_prefix_len
        need = len(tokens) - prefix
        new = self.allocator.alloc(need)
        if new is None:
            self.cache.evict(EvictParams(num_tokens=need - self.allocator.available_size()))
            new = self.allocator.alloc(need)
        if new is None:
            self.cache.unlock(lock)
            return False
        values = torch.cat([self.cache.path_device_indices(m.last_device_node)[:prefix], new])
        res = self.cache.insert(InsertParams(key=key, value=values, prev_prefix_len=prefix))
        if self.kind == "radix":
            self.allocator.free(values[prefix : res.prefix_len])
        self.cache.unlock(lock)
        return True


def _lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TestTenantIsolation(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        register()

    def test_same_tokens_other_key_match_nothing(self):
        tokens = list(range(100, 164))
        for kind, page in SETUPS:
            with self.subTest(kind=kind, page=page):
                t = Tree(kind, page)
                self.assertTrue(t.insert(tokens, "tenant-a"))
                self.assertEqual(t.match(tokens, "tenant-a"), 64)
                self.assertEqual(t.match(tokens[:40], "tenant-a"), 40)
                for other in ("tenant-b", None, "lora-7", "tenant-a "):
                    self.assertEqual(t.match(tokens, other), 0, other)
                # Once the other tenant inserts the same tokens, both match fully.
                self.assertTrue(t.insert(tokens, "tenant-b"))
                self.assertEqual(t.match(tokens, "tenant-b"), 64)
                self.assertEqual(t.match(tokens, "tenant-a"), 64)
                self.assertEqual(t.match(tokens, None), 0)

    def test_random_interleaving_with_evictions(self):
        rng = random.Random(SEED)
        checks = 0
        for kind, page in SETUPS:
            with self.subTest(kind=kind, page=page, seed=SEED):
                t = Tree(kind, page)
                inserted = {k: [] for k in TENANTS}
                for step in range(1500):
                    # Shared documents so tenants' token sequences collide often.
                    doc = rng.randrange(3)
                    tokens = [doc * 1000 + i for i in range(rng.randrange(1, 17) * page)]
                    tokens += [rng.randrange(9000, 9004) for _ in range(rng.randrange(0, 5) * page)]
                    tenant = rng.choice(TENANTS)
                    r = rng.random()
                    if r < 0.45:
                        if t.insert(tokens, tenant):
                            inserted[tenant].append(tokens)
                            self.assertEqual(t.match(tokens, tenant), len(tokens),
                                             f"step {step}: own insert not matched")
                    elif r < 0.55:
                        t.cache.evict(EvictParams(num_tokens=rng.choice([1, 16, 64, 256])))
                    else:
                        got = t.match(tokens, tenant)
                        bound = max((_lcp(tokens, s) for s in inserted[tenant]), default=0)
                        bound -= bound % page
                        self.assertLessEqual(
                            got, bound,
                            f"step {step}: tenant {tenant!r} matched {got} tokens, but it "
                            f"only ever inserted a {bound}-token common prefix (seed {SEED})",
                        )
                        checks += 1
                    free = t.allocator.available_size()
                    cached = t.cache.evictable_size() + t.cache.protected_size()
                    self.assertEqual(free + cached, POOL, f"step {step}")
        self.assertGreater(checks, 1000)


if __name__ == "__main__":
    unittest.main()
