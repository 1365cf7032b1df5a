"""Namespace isolation with the mla_aware policy on SGLang's real prefix caches.

Requests whose keys carry different namespaces (``RadixKey(tokens, extra_key=...,
cache_salt=...)``: LoRA ids, tenants, cache salts) must never match each other's
prefixes, whatever the eviction policy does. Checked on ``UnifiedRadixCache`` (built
as a server builds it for mla_aware: the plugin's ``prepare_params``, so the Python
tree core and the eviction callback) and the legacy ``RadixCache``, unpaged and with
page size 4, over a real CPU allocator: fixed cases first, then a seeded random
interleaving of inserts, matches and evictions where every match is bounded by what
that namespace itself inserted. Seed: ``MLA_INVARIANT_SEED`` (printed).
"""

import os
import random
import sys
import unittest
from array import array

import torch

from sglang.srt.mem_cache.allocator import (
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy
from sglang.srt.mem_cache.mla_cost_model import KVCostModel
from sglang.srt.mem_cache.mla_eviction_plugin import (
    EvictionCallbackFullComponent,
    prepare_params,
    register,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

SEED = int(os.environ.get("MLA_INVARIANT_SEED", random.SystemRandom().randrange(2**32)))
print(f"[mla isolation] MLA_INVARIANT_SEED={SEED}", file=sys.stderr)
POOL = 512
# (extra_key, cache_salt): no namespace, tenants, a LoRA id, a salt, both.
NAMESPACES = (
    (None, None),
    ("tenant-a", None),
    ("tenant-b", None),
    ("lora-7", None),
    (None, "salt-1"),
    ("tenant-a", "salt-1"),
)
SETUPS = [(kind, page) for kind in ("unified", "radix") for page in (1, 4)]


def setUpModule():
    register()


class Tree:
    def __init__(self, kind, page):
        self.kind, self.page = kind, page
        if page == 1:
            self.allocator = TokenToKVPoolAllocator(
                POOL, torch.bfloat16, "cpu", None, need_sort=False
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                POOL, page, torch.bfloat16, "cpu", None, need_sort=False
            )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page,
            eviction_policy="mla_aware",
        )
        prepare_params(params, KVCostModel.from_preset("deepseek-v3", page_size=page))
        if kind == "radix":
            self.cache = RadixCache(params)
            strategy = self.cache.eviction_strategy
        else:
            params.tree_components = (ComponentType.FULL,)
            self.cache = UnifiedRadixCache(params)
            strategy = self.cache.tree_core.eviction_strategy
            full = self.cache.tree_core.components_by_type[ComponentType.FULL]
            assert isinstance(full, EvictionCallbackFullComponent)
        assert isinstance(strategy, MLAAwareStrategy)

    @staticmethod
    def key(tokens, namespace):
        extra_key, salt = namespace
        return RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=salt)

    def match(self, tokens, namespace):
        key = self.key(tokens, namespace)
        return self.cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len

    def insert(self, tokens, namespace):
        """Insert as a finished request would: match, lock, allocate the rest
        (evicting the shortfall first), insert, free duplicates, unlock."""
        key = self.key(tokens, namespace)
        m = self.cache.match_prefix(MatchPrefixParams(key=key))
        lock = self.cache.lock(m.last_device_node)
        prefix = m.device_prefix_len
        need = len(tokens) - prefix
        self.allocator.evict_to_free_tokens(self.cache, need)
        new = self.allocator.alloc(need)
        if new is None:
            self.cache.unlock(lock)
            return False
        head = self.cache.path_device_indices(m.last_device_node)[:prefix]
        values = torch.cat([head, new])
        res = self.cache.insert(
            InsertParams(key=key, value=values, prev_prefix_len=prefix)
        )
        if self.kind == "radix":  # the unified tree frees its duplicates itself
            self.allocator.free(values[prefix : res.prefix_len])
        self.cache.unlock(lock)
        return True

    def accounted(self):
        free = self.allocator.available_size()
        return free + self.cache.evictable_size() + self.cache.protected_size()


def _lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TestNamespaceIsolation(CustomTestCase):
    def test_same_tokens_other_namespace_match_nothing(self):
        tokens = list(range(100, 164))
        a, b = ("tenant-a", None), ("tenant-b", None)
        for kind, page in SETUPS:
            with self.subTest(kind=kind, page=page):
                t = Tree(kind, page)
                self.assertTrue(t.insert(tokens, a))
                self.assertEqual(t.match(tokens, a), 64)
                self.assertEqual(t.match(tokens[:40], a), 40)
                for other in NAMESPACES[:1] + NAMESPACES[2:] + (("tenant-a ", None),):
                    self.assertEqual(t.match(tokens, other), 0, other)
                # Once the other namespace inserts the same tokens, both match fully.
                self.assertTrue(t.insert(tokens, b))
                self.assertEqual((t.match(tokens, b), t.match(tokens, a)), (64, 64))
                self.assertEqual(t.match(tokens, (None, None)), 0)
                self.assertEqual(t.accounted(), POOL)

    def test_random_interleaving_with_evictions(self):
        rng = random.Random(SEED)
        checks = evictions = 0
        for kind, page in SETUPS:
            with self.subTest(kind=kind, page=page, seed=SEED):
                t = Tree(kind, page)
                inserted = {ns: [] for ns in NAMESPACES}
                for step in range(1000):
                    # Shared documents, so namespaces' token sequences collide often.
                    doc = rng.randrange(3)
                    n = rng.randrange(1, 17) * page
                    tokens = [doc * 1000 + i for i in range(n)]
                    tokens += [rng.randrange(9000, 9004) for _ in range(4 * page)]
                    namespace = rng.choice(NAMESPACES)
                    r = rng.random()
                    if r < 0.45:
                        if t.insert(tokens, namespace):
                            inserted[namespace].append(tokens)
                            self.assertEqual(
                                t.match(tokens, namespace),
                                len(tokens),
                                f"step {step}: own insert not matched",
                            )
                    elif r < 0.55:
                        n = rng.choice([1, 16, 64, 256])
                        freed = t.cache.evict(EvictParams(num_tokens=n))
                        evictions += freed.num_tokens_evicted > 0
                    else:
                        got = t.match(tokens, namespace)
                        bound = max(
                            (_lcp(tokens, s) for s in inserted[namespace]), default=0
                        )
                        bound -= bound % page
                        self.assertLessEqual(
                            got,
                            bound,
                            f"step {step}: {namespace} matched {got} tokens, but "
                            f"it only ever inserted a {bound}-token common prefix "
                            f"(seed {SEED})",
                        )
                        checks += 1
                    self.assertEqual(t.accounted(), POOL, f"step {step}")
        self.assertGreater(checks, 1000)
        self.assertGreater(evictions, 100)


if __name__ == "__main__":
    unittest.main()
