"""Exact eviction orders of the mla_aware policy on SGLang's real trees, on CPU.

Every tree below is hand-built on a real ``RadixCache`` or ``UnifiedRadixCache``
(Python tree core) over a real ``TokenToKVPoolAllocator``. Nodes are named by their
first token; ``evict(1)`` drops exactly one leaf, so repeating it gives the order.
Access times are set by hand relative to each tree's clock (seconds for
RadixCache, logical ticks for the unified tree).
"""

import itertools
import math
import time
import unittest
from array import array
from types import SimpleNamespace

import torch

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.mla_aware_policy import (
    GhostLearning,
    MLAAwareStrategy,
    PolicyConfigError,
    create_mla_aware_strategy,
    parse_policy_config,
    prefix_end,
)
from sglang.srt.mem_cache.mla_cost_model import KVCostModel
from sglang.srt.mem_cache.mla_eviction_plugin import register
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components import base as unified_base
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import get_eviction_strategy
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

SIZE = 4096
POLICY_CONFIG = {"model": "deepseek-v3"}
DEPTH_CONFIG = {**POLICY_CONFIG, "depth_aware": True}


class TreeHarness:
    """One real cache over a real CPU allocator, with a few test helpers."""

    def __init__(self, kind, policy, config=None):
        kv = MLATokenToKVPool(
            size=SIZE, page_size=1, dtype=torch.bfloat16, kv_lora_rank=8,
            qk_rope_head_dim=4, layer_num=1, device="cpu", enable_memory_saver=False,
        )
        self.allocator = TokenToKVPoolAllocator(SIZE, torch.bfloat16, "cpu", kv, need_sort=False)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToTokenPool(
                size=4, max_context_len=SIZE, device="cpu", enable_memory_saver=False
            ),
            token_to_kv_pool_allocator=self.allocator,
            page_size=1,
            eviction_policy=policy,
            eviction_policy_config=config,
        )
        if kind == "radix":
            self.cache = RadixCache(params)
            self.strategy = self.cache.eviction_strategy
            self.now = time.monotonic
            self.tick = 1.0  # seconds
        else:
            params.tree_components = (ComponentType.FULL,)
            params.tree_core_backend = "python"
            self.cache = UnifiedRadixCache(params)
            self.strategy = self.cache.tree_core.eviction_strategy
            self.now = lambda: unified_base._LAST_ACCESS_TIME_COUNTER_FLOAT
            self.tick = 100.0  # logical ticks; eviction itself may advance a few

    def insert(self, tokens):
        value = self.allocator.alloc(len(tokens))
        result = self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value))
        if isinstance(self.cache, RadixCache):
            # The legacy tree leaves the duplicated prefix to the caller.
            self.allocator.free(value[: result.prefix_len])
        self.check_integrity()

    def check_integrity(self):
        free, cached = self.allocator.available_size(), self.cache.evictable_size()
        assert free + cached == SIZE, f"free {free} + cached {cached} != pool {SIZE}"

    def nodes(self):
        out, stack = {}, list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            out[node.key.token_ids[0]] = node
            stack.extend(node.children.values())
        return out

    def node(self, first_token):
        return self.nodes()[first_token]

    def set_age(self, first_token, age_ticks, hit_count=None):
        node = self.node(first_token)
        node.last_access_time = self.now() - age_ticks * self.tick
        if hit_count is not None:
            node.hit_count = hit_count

    def eviction_order(self):
        """First tokens of the nodes in the order the policy evicts them, whole: victim
        trimming (tested in test_mla_victim_trim.py) is off for this."""
        self.strategy.trim_victims = False
        order = []
        while self.cache.evictable_size() > 0:
            before = set(self.nodes())
            self.cache.evict(EvictParams(num_tokens=1))
            gone = before - set(self.nodes())
            assert len(gone) == 1, gone
            order.append(gone.pop())
            self.check_integrity()
        return order


KINDS = ("radix", "unified")


def span(start, length):
    return list(range(start, start + length))


class TestEvictionOrder(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        register()

    def test_shallow_leaf_goes_before_deep_one(self):
        # root -+- P [0, 1000) -- D [9000, 9064)     (deep: positions 1000..1063)
        #       +- S [5000, 5064)                    (shallow: positions 0..63)
        # D and P are a little older than S: LRU drops D, then P. Restoring D costs
        # more prefill (its tokens attend to 1000 more positions), so mla_aware with
        # depth pricing drops S first.
        for kind in KINDS:
            for policy, expected in (("lru", [9000, 0, 5000]), ("mla_aware", [5000, 9000, 0])):
                with self.subTest(kind=kind, policy=policy):
                    t = TreeHarness(kind, policy, DEPTH_CONFIG if policy == "mla_aware" else None)
                    t.insert(span(0, 1000))
                    t.insert(span(0, 1000) + span(9000, 64))
                    t.insert(span(5000, 64))
                    t.set_age(0, 10.0)
                    t.set_age(9000, 10.0)
                    t.set_age(5000, 9.99)
                    self.assertEqual(t.eviction_order(), expected)

    def test_same_recency_shallow_first_when_depth_aware(self):
        for kind in KINDS:
            for config, expected in ((DEPTH_CONFIG, [5000, 9000, 0]), (POLICY_CONFIG, None)):
                with self.subTest(kind=kind, depth_aware=config.get("depth_aware", False)):
                    t = TreeHarness(kind, "mla_aware", config)
                    t.insert(span(0, 64))
                    t.insert(span(0, 64) + span(9000, 64))
                    t.insert(span(5000, 64))
                    for first in (0, 9000, 5000):
                        t.set_age(first, 10.0)
                    deep, shallow = t.node(9000), t.node(5000)
                    if expected:
                        self.assertEqual(t.eviction_order(), expected)
                    else:  # by default, position does not price a node: equal leaves tie
                        self.assertAlmostEqual(t.strategy.value(deep), t.strategy.value(shallow))

    def test_leaf_with_more_hits_outlives_an_older_equal_one(self):
        # Two equal leaves; A is older but was hit 3 times, B is newer and never hit.
        for kind in KINDS:
            for policy, expected in (("lru", [100, 200]), ("mla_aware", [200, 100])):
                with self.subTest(kind=kind, policy=policy):
                    t = TreeHarness(kind, policy, POLICY_CONFIG if policy == "mla_aware" else None)
                    t.insert(span(100, 32))
                    t.insert(span(200, 32))
                    t.set_age(100, 30.0, hit_count=3)
                    t.set_age(200, 10.0, hit_count=0)
                    self.assertEqual(t.eviction_order(), expected)

    def test_host_backed_leaf_goes_first(self):
        # The legacy tree has no HiCache; `backuped` is the flag HiCache nodes carry.
        # H is newer but backed up on host (a reload, ~66x cheaper than recompute
        # for DeepSeek-V3); U is older and would have to be recomputed.
        for policy, expected in (("lru", [100, 200]), ("mla_aware", [200, 100])):
            with self.subTest(policy=policy):
                t = TreeHarness("radix", policy, POLICY_CONFIG if policy == "mla_aware" else None)
                t.insert(span(100, 32))
                t.insert(span(200, 32))
                t.set_age(100, 30.0)
                t.set_age(200, 1.0)
                t.node(200).backuped = True
                self.assertEqual(t.eviction_order(), expected)

    def test_host_backed_unified_node_scores_lower(self):
        # On the unified tree `backuped` means a Full host value is present;
        # score real nodes (evicting would demote through a host pool).
        t = TreeHarness("unified", "mla_aware", POLICY_CONFIG)
        t.insert(span(100, 32))
        t.insert(span(200, 32))
        t.set_age(100, 30.0)
        t.set_age(200, 1.0)
        backed = t.node(200)
        unbacked = t.node(100)
        self.assertGreater(t.strategy.get_priority(backed), t.strategy.get_priority(unbacked))
        backed.component(ComponentType.FULL).host_value = torch.arange(32)
        try:
            self.assertTrue(backed.backuped)
            self.assertLess(t.strategy.get_priority(backed), t.strategy.get_priority(unbacked))
        finally:
            backed.component(ComponentType.FULL).host_value = None

    def test_lru_flag_off_is_upstream_order(self):
        # A tree where mla_aware would reorder: depth, hits and size all differ.
        # Under "lru" the order is exactly oldest access first, as upstream.
        for kind in KINDS:
            with self.subTest(kind=kind):
                t = TreeHarness(kind, "lru")
                self.assertIs(type(t.strategy), type(get_eviction_strategy("lru")))
                t.insert(span(0, 512))
                t.insert(span(0, 512) + span(1000, 8))
                t.insert(span(0, 512) + span(2000, 64))
                t.insert(span(3000, 16))
                t.insert(span(4000, 128))
                ages = {0: 1.0, 1000: 5.0, 2000: 2.0, 3000: 4.0, 4000: 3.0}
                for first, age in ages.items():
                    t.set_age(first, age, hit_count=first // 1000)
                self.assertEqual(t.eviction_order(), [1000, 3000, 4000, 2000, 0])

    def test_mla_aware_equals_lru_when_nodes_are_alike(self):
        # Same depth, size and hits: only recency is left.
        for kind in KINDS:
            with self.subTest(kind=kind):
                orders = []
                for policy in ("lru", "mla_aware"):
                    t = TreeHarness(kind, policy, POLICY_CONFIG if policy == "mla_aware" else None)
                    for first, age in ((100, 3.0), (200, 7.0), (300, 1.0), (400, 5.0)):
                        t.insert(span(first, 16))
                        t.set_age(first, age)
                    orders.append(t.eviction_order())
                self.assertEqual(orders[0], [200, 400, 100, 300])
                self.assertEqual(orders[0], orders[1])

    def test_prefix_end_survives_split(self):
        t = TreeHarness("radix", "mla_aware", POLICY_CONFIG)
        t.insert(span(0, 100))
        leaf = t.node(0)
        self.assertEqual(prefix_end(leaf), 100)
        t.insert(span(0, 40) + span(7000, 10))  # splits [0, 100) at 40
        nodes = t.nodes()
        self.assertEqual(prefix_end(nodes[0]), 40)
        self.assertEqual(prefix_end(nodes[40]), 100)
        self.assertEqual(prefix_end(nodes[7000]), 50)


class MockNodes:
    """Tree nodes as plain namespaces, with what the strategy reads."""

    def setUp(self):
        self.created = itertools.count()
        self.root = self.node(None, 0)
        self.now = time.monotonic()

    def node(self, parent, length, first=0, **fields):
        fields.setdefault("creation_time", float(next(self.created)))
        return SimpleNamespace(parent=parent, key=[first] * length, **fields)

    def leaf(self, length, *, depth=0, age=10.0, hits=0, backuped=False, parent=None, first=0):
        if parent is None:
            parent = self.node(self.root, depth) if depth else self.root
        return self.node(parent, length, first, hit_count=hits,
                         last_access_time=self.now - age, backuped=backuped)

    def strategy(self, **kwargs):
        return MLAAwareStrategy(KVCostModel.from_preset("deepseek-v3"), **kwargs)


class TestStrategyWithMockNodes(MockNodes, CustomTestCase):
    """The scoring rules in isolation, as upstream's test_evict_policy.py does."""

    def test_depth_and_host_switches(self):
        on = self.strategy(depth_aware=True)
        deep, shallow = self.leaf(64, depth=8000), self.leaf(64)
        self.assertLess(on.get_priority(shallow), on.get_priority(deep))
        off = self.strategy()  # the default; ages differ by the clock's drift only
        ratio = off.get_priority(shallow)[0] / off.get_priority(deep)[0]
        self.assertAlmostEqual(ratio, 1.0, places=5)

        backed, unbacked = self.leaf(64, age=1.0, backuped=True), self.leaf(64, age=30.0)
        self.assertLess(on.get_priority(backed), on.get_priority(unbacked))
        host_off = self.strategy(host_aware=False)
        self.assertGreater(host_off.get_priority(backed), host_off.get_priority(unbacked))

    def test_hit_exponent(self):
        hot, cold = self.leaf(32, age=30.0, hits=3), self.leaf(32, age=10.0)
        self.assertLess(self.strategy().get_priority(cold), self.strategy().get_priority(hot))
        flat = self.strategy(hit_exponent=0)
        self.assertLess(flat.get_priority(hot), flat.get_priority(cold))

    def test_hits_count_up_to_children_plus_one_on_a_node_with_children(self):
        # A session's history: 6 hits, all walking on into its one child. A shared prefix:
        # 3 hits, one per child branching below it (and its own insert). A repeated leaf.
        strategy = self.strategy()
        history = self.node(self.root, 32, hit_count=6)
        shared = self.node(self.root, 32, 1, hit_count=3)
        repeated = self.leaf(32, hits=6, first=2)
        for child in (self.leaf(16, parent=history, first=3),
                      self.leaf(16, parent=shared, first=4), self.leaf(16, parent=shared, first=5)):
            strategy.get_priority(child)  # scoring a child is how its parent's children count
        nodes = (history, shared, repeated)
        self.assertEqual([GhostLearning.children(n) for n in nodes], [1, 2, 0])
        self.assertEqual([strategy.reuse_hits(n) for n in nodes], [2, 3, 6])
        uncapped = self.strategy(hit_cap=False)
        self.assertEqual([uncapped.reuse_hits(n) for n in nodes], [6, 3, 6])
        history.last_access_time = repeated.last_access_time = self.now - 10.0
        for n in (history, repeated):
            ratio = strategy.get_priority(n)[0] / (-10.0 / strategy.value(n))
            self.assertAlmostEqual(ratio, 1.0, places=3)  # the score uses the capped hits
        self.assertLess(strategy.get_priority(history), strategy.get_priority(repeated))
        # A second child (no new hit on the node): the memoised value follows the cap.
        strategy.get_priority(self.leaf(16, parent=history, first=6))
        self.assertEqual(strategy.reuse_hits(history), 3)
        ratio = strategy.get_priority(history)[0] / (-10.0 / strategy.value(history))
        self.assertAlmostEqual(ratio, 1.0, places=3)

    def test_key_unit_tokens_scales_depth_and_bytes(self):
        per_element = self.strategy(key_unit_tokens=64, depth_aware=True)
        per_token = self.strategy(depth_aware=True)
        a = self.leaf(2, depth=10)  # 2 pages at pages 10..12
        b = self.leaf(128, depth=640)  # the same 128 tokens at 640..768
        self.assertAlmostEqual(
            per_element.restore_seconds_per_byte(a) / per_token.restore_seconds_per_byte(b), 1.0
        )

    def test_memoised_cost_follows_splits_host_copies_and_hits(self):
        strategy = self.strategy(depth_aware=True)
        node = self.leaf(64, depth=64)
        fresh = lambda: self.strategy(depth_aware=True)  # noqa: E731
        strategy.get_priority(node)
        memo = node._mla_seen
        self.assertEqual(memo.density, fresh().restore_seconds_per_byte(node))
        # A split: a new parent above, a shorter key (where the node ends stays).
        upper = self.node(node.parent, 48, creation_time=node.creation_time)
        node.parent, node.key = upper, node.key[48:]
        strategy.get_priority(node)
        self.assertEqual(memo.density, fresh().restore_seconds_per_byte(node))
        node.backuped = True  # HiCache wrote it through: now cheap to lose
        strategy.get_priority(node)
        self.assertEqual((memo.backed, memo.density),
                         (True, fresh().restore_seconds_per_byte(node)))
        for hits in (3, 4):
            node.hit_count = hits
            age = time.monotonic() - node.last_access_time
            ratio = strategy.get_priority(node)[0] / (-age / strategy.value(node))
            self.assertAlmostEqual(ratio, 1.0, places=5)
        self.assertIs(node._mla_seen, memo)

    def test_one_strategy_prices_each_length_position_and_host_copy_on_its_own(self):
        # The strategy keeps prices by (start, end, host copy): a price seen before for
        # another node is reused only where all three match.
        cost = KVCostModel.from_preset("deepseek-v3")
        for depth_aware in (False, True):
            strategy = self.strategy(depth_aware=depth_aware)
            for length, depth, backuped in itertools.product(
                (1, 63, 64, 65, 500), (0, 64, 8000), (False, True)
            ):
                with self.subTest(depth_aware=depth_aware, length=length, depth=depth,
                                  backuped=backuped):
                    start = depth if depth_aware else 0
                    expected = (cost.restore_seconds(start, start + length, backed_up=backuped)
                                / cost.bytes_for_tokens(length))
                    node = self.leaf(length, depth=depth, backuped=backuped)
                    self.assertEqual(strategy.restore_seconds_per_byte(node), expected)

    def test_empty_node_goes_first(self):
        empty = self.leaf(0)
        self.assertEqual(self.strategy().get_priority(empty)[0], float("-inf"))

    def test_bytes_are_page_rounded(self):
        cm = KVCostModel.from_preset("deepseek-v3", page_size=64)
        strategy = MLAAwareStrategy(cm)
        one = self.leaf(1)
        expected = cm.restore_seconds(0, 1) / (64 * 70_272)
        self.assertAlmostEqual(strategy.restore_seconds_per_byte(one) / expected, 1.0)


class TestGhostLearning(MockNodes, CustomTestCase):
    """Which nodes are probationary, and how returning victims move factor and weight."""

    @classmethod
    def setUpClass(cls):
        register()  # the real-tree test builds caches by policy name

    def comeback(self, victim):
        """A node with ``victim``'s signature but a new creation time: it came back."""
        return self.node(victim.parent, len(victim.key), victim.key[0])

    def factor(self, learning, node, now, age=0.0):
        """What ``node``'s age is multiplied by when scored at ``now``."""
        return learning.factor if learning.see(node, now, age).probationary else 1.0

    def proven_prefix(self, learning, first, now=0.0):
        """A node with two different children scored under it (a shared prefix)."""
        prefix = self.leaf(64, first=first)
        learning.see(prefix, now, 0.0)
        for child in (1, 2):
            learning.see(self.leaf(8, parent=prefix, first=child), now, 0.0)
        return prefix

    def proven_and_probationary(self, learning, proven_age, probationary_age):
        """A proven prefix and a probationary leaf, scored in one build at these ages."""
        proven = self.proven_prefix(learning, first=1)
        probationary = self.leaf(64, first=2)
        learning.see(proven, 0.0, proven_age)
        learning.see(probationary, 0.0, probationary_age)
        return proven, probationary

    def test_starts_as_cost_weighted_lru(self):
        leaf = self.leaf(64, age=10.0, hits=2)
        on, off = self.strategy(), self.strategy(probation=False, value_weight=False)
        self.assertFalse(off.learning.learns_factor or off.learning.learns_weight)
        self.assertEqual((on.learning.factor, on.learning.weight), (1.0, 1.0))
        # Ages differ by the clock's drift between the two calls only.
        self.assertAlmostEqual(on.get_priority(leaf)[0] / off.get_priority(leaf)[0], 1.0, places=3)

    def test_proven_victim_coming_back_raises_the_factor_at_the_next_reading(self):
        learning = GhostLearning()
        prefix = self.proven_prefix(learning, first=5)
        tail = self.leaf(64, first=9)
        self.assertEqual(self.factor(learning, tail, 0.0), 1.0)
        back = self.comeback(prefix)
        self.assertEqual(self.factor(learning, back, 1.0), 1.0)  # came back: proven
        self.assertEqual(learning.returns, [1, 0])
        self.assertEqual(self.factor(learning, tail, 1.0), 1.0)  # same reading: not yet
        self.assertAlmostEqual(self.factor(learning, tail, 2.0), math.exp(GhostLearning.STEP))

    def test_probationary_node_ages_factor_times_faster(self):
        strategy = self.strategy(value_weight=False)
        for first in range(5):
            prefix = self.proven_prefix(strategy.learning, first=100 + first)
            strategy.learning.see(self.comeback(prefix), 1.0, 0.0)
        tail = self.leaf(64, first=9)
        off = self.strategy(probation=False, value_weight=False)
        ratio = strategy.get_priority(tail)[0] / off.get_priority(tail)[0]
        self.assertAlmostEqual(ratio, math.exp(5 * GhostLearning.STEP), places=3)

    def test_probationary_victim_coming_back_lowers_the_factor_never_below_one(self):
        learning = GhostLearning()
        prefix = self.proven_prefix(learning, first=5)
        learning.see(self.comeback(prefix), 1.0, 0.0)
        tail = self.leaf(64, first=9)
        learning.see(tail, 1.0, 0.0)
        learning.see(self.comeback(tail), 2.0, 0.0)
        self.assertEqual(learning.returns, [1, 1])
        other = self.leaf(64, first=11)
        learning.see(other, 3.0, 0.0)
        self.assertAlmostEqual(learning.log_factor, 0.0)
        learning.see(self.comeback(other), 4.0, 0.0)
        learning.see(other, 5.0, 0.0)
        self.assertEqual(learning.log_factor, 0.0)

    def test_a_batch_applies_its_net_step_whatever_the_order(self):
        # Three proven and two probationary victims come back at one clock reading.
        learnt = []
        for order in (range(5), reversed(range(5))):
            learning = GhostLearning()
            victims = [self.proven_prefix(learning, first=50 + i) for i in range(3)]
            victims += [self.leaf(64, first=60 + i) for i in range(2)]
            for age, v in enumerate(victims):
                learning.see(v, 0.0, 10.0 * age)
            for i in order:
                learning.see(self.comeback(victims[i]), 1.0, 0.0)
            learning.see(victims[0], 2.0, 0.0)
            learnt.append((learning.log_factor, learning.weight))
        self.assertAlmostEqual(learnt[0][0], GhostLearning.STEP)
        # Ages 0..40 in one build: 20, 30 and 40 were old (>= half of 40), 0 and 10 young.
        # Only the proven one of age 20 is unambiguous (old and proven): one step up.
        w = GhostLearning.WEIGHT_STEP
        self.assertAlmostEqual(learnt[0][1], 1 + w * (1 - GhostLearning.RHO))
        self.assertEqual(learnt[0], learnt[1])

    def test_old_proven_victim_raises_the_weight_young_probationary_one_lowers_it(self):
        learning = GhostLearning()
        old, young = self.proven_and_probationary(learning, 100.0, 10.0)
        learning.see(self.comeback(old), 1.0, 0.0)
        bystander = self.leaf(4, first=77)
        learning.see(bystander, 2.0, 0.0)  # the clock moved: applied
        up = 1 + GhostLearning.WEIGHT_STEP * (1 - GhostLearning.RHO)
        self.assertAlmostEqual(learning.weight, up)
        learning.see(self.comeback(young), 3.0, 0.0)
        learning.see(bystander, 4.0, 0.0)
        self.assertAlmostEqual(learning.weight, up - GhostLearning.WEIGHT_STEP * GhostLearning.RHO)
        self.assertEqual(learning.returns_by_age, [1, 1])

    def test_mixed_victims_leave_the_weight(self):
        learning = GhostLearning()
        young, old = self.proven_and_probationary(learning, 10.0, 100.0)
        learning.see(self.comeback(young), 1.0, 0.0)  # young but proven
        learning.see(self.comeback(old), 1.0, 0.0)  # old but probationary
        learning.see(self.leaf(4, first=77), 2.0, 0.0)  # the clock moved: applied
        self.assertEqual(learning.weight, 1.0)
        self.assertEqual((learning.returns, learning.returns_by_age), ([1, 1], [1, 1]))

    def test_victim_is_judged_against_its_own_heap_build(self):
        # A wall clock: every score reads a new time. Scoring `keeper` again starts the
        # second build, whose oldest age (1000) must not make the first build's victim young.
        learning = GhostLearning()
        keeper, victim = self.leaf(64, first=1), self.leaf(64, first=2)
        learning.see(keeper, 1.0, 100.0)
        learning.see(victim, 2.0, 60.0)  # 60 >= half of 100: old in build 0
        learning.see(keeper, 3.0, 1000.0)  # build 1
        learning.see(self.comeback(victim), 4.0, 0.0)
        self.assertEqual(learning.returns_by_age, [0, 1])

    def test_on_a_tick_clock_a_build_starts_when_the_clock_moves(self):
        # Build 0 at tick 0 (its oldest, `gone`, is evicted there). At tick 1 the set's
        # order puts a new node first, ahead of the first repeat: it still belongs to
        # build 1, whose oldest is its own age, so it was old when it went.
        learning = GhostLearning()
        gone, keeper = self.leaf(64, first=1), self.leaf(64, first=2)
        learning.see(gone, 0.0, 100.0)
        learning.see(keeper, 0.0, 10.0)
        new = self.leaf(64, first=3)
        learning.see(new, 1.0, 30.0)
        learning.see(keeper, 1.0, 11.0)
        learning.see(self.comeback(new), 2.0, 0.0)
        self.assertEqual(learning.returns_by_age, [0, 1])

    def test_factor_and_weight_are_bounded(self):
        learning = GhostLearning()
        for first in range(200):
            prefix = self.proven_prefix(learning, first=1000 + first, now=2.0 * first)
            learning.see(prefix, 2.0 * first, 1.0)  # the oldest leaf: an old victim
            learning.see(self.comeback(prefix), 2.0 * first + 1, 0.0)
        learning.see(prefix, 1e9, 0.0)
        self.assertAlmostEqual(learning.factor, GhostLearning.MAX_FACTOR)
        self.assertEqual(learning.weight, GhostLearning.WEIGHT_BOUNDS[1])

    def test_a_part_switched_off_stays_neutral(self):
        for probation, value_weight in ((False, True), (True, False)):
            with self.subTest(probation=probation, value_weight=value_weight):
                learning = GhostLearning(probation=probation, value_weight=value_weight)
                prefix = self.proven_prefix(learning, first=5)
                learning.see(prefix, 0.0, 5.0)  # a new heap build, where it is the oldest
                learning.see(self.comeback(prefix), 1.0, 0.0)
                learning.see(self.leaf(4, first=77), 2.0, 0.0)  # the clock moved: applied
                self.assertEqual((learning.returns, learning.returns_by_age), ([1, 0], [0, 1]))
                self.assertEqual(learning.log_factor > 0, probation)
                self.assertEqual(learning.weight > 1, value_weight)

    def test_priority_divides_by_value_to_the_weight(self):
        leaf = self.leaf(64, age=10.0, hits=1)
        strategy = self.strategy(probation=False)
        strategy.learning.weight = 2.0
        value = strategy.value(leaf)
        self.assertAlmostEqual(strategy.get_priority(leaf)[0] * value ** 2 / -10.0, 1.0, places=3)

    def test_split_and_rescoring_are_not_ghost_hits(self):
        learning = GhostLearning()
        node = self.leaf(64, first=5)
        learning.see(node, 0.0, 0.0)
        learning.see(node, 1.0, 0.0)
        upper = self.node(node.parent, 16, 5, creation_time=node.creation_time)
        node.parent, node.key = upper, node.key[16:]  # what a split does
        learning.see(upper, 2.0, 0.0)
        learning.see(node, 2.0, 0.0)
        self.assertEqual(learning.returns, [0, 0])
        self.assertEqual(upper._mla_children, 1)

    def test_upper_half_of_a_split_is_no_second_child(self):
        # Whichever half is scored first after the split, the grandparent keeps one child.
        for lower_first in (True, False):
            with self.subTest(lower_first=lower_first):
                learning = GhostLearning()
                prefix = self.leaf(64, first=1)
                node = self.leaf(16, parent=prefix, first=2)
                learning.see(prefix, 0.0, 0.0)
                learning.see(node, 0.0, 0.0)
                upper = self.node(prefix, 8, 2, children={0: node})
                node.parent, node.key = upper, node.key[8:]  # what a split does
                halves = (node, upper) if lower_first else (upper, node)
                for half in halves:
                    learning.see(half, 1.0, 0.0)
                self.assertEqual((prefix._mla_children, upper._mla_children), (1, 1))
                self.assertTrue(prefix._mla_seen.probationary)
                learning.see(self.leaf(8, parent=prefix, first=3), 2.0, 0.0)
                self.assertFalse(prefix._mla_seen.probationary)  # a second child proves it

    def superseded_pair(self, strategy, first):
        """A leaf whose one child was scored and is gone, and a leaf never continued,
        alike otherwise (scored by ``strategy``)."""
        continued = self.leaf(64, first=first)
        strategy.get_priority(continued)
        strategy.get_priority(self.leaf(8, parent=continued, first=first + 1))  # then evicted
        strategy.get_priority(continued)  # a leaf again
        fresh = self.leaf(64, first=first + 2)
        return continued, fresh

    def test_superseded_leaf_ages_superseded_factor_times_faster(self):
        strategy = self.strategy(value_weight=False, hit_cap=False)
        continued, fresh = self.superseded_pair(strategy, first=10)
        strategy.learning.superseded_factor = 4.0
        ratio = strategy.get_priority(continued)[0] / strategy.get_priority(fresh)[0]
        self.assertAlmostEqual(ratio, 4.0, places=3)
        self.assertTrue(continued._mla_seen.superseded())
        self.assertFalse(fresh._mla_seen.superseded())
        self.assertNotEqual(strategy.score_class(continued), strategy.score_class(fresh))
        # Proven (a second child) or a trimmed head: no longer, or never, superseded.
        strategy.get_priority(self.leaf(8, parent=continued, first=99))
        self.assertFalse(continued._mla_seen.superseded())
        lower = self.leaf(64, first=30)
        strategy.get_priority(lower)
        upper = self.node(lower.parent, 16, 30, hit_count=0, creation_time=lower.creation_time,
                          last_access_time=lower.last_access_time)
        lower.parent, lower.key = upper, lower.key[16:]  # a trim: only the tail goes
        strategy.on_split(upper, lower)
        self.assertEqual(upper._mla_children, 1)
        self.assertTrue(upper._mla_seen.probationary)
        self.assertFalse(upper._mla_seen.superseded())

    def test_trimmed_head_keeps_the_nodes_hit_cap(self):
        """A node with three children counted (all gone), trimmed: its head's hits are
        capped at four as the node's were, not at two as one child (its tail) would cap
        them; a node that had no more than its tail counts the tail as its one child."""
        strategy = self.strategy(value_weight=False)
        for grandchildren, cap in ((3, 4), (0, 2)):
            with self.subTest(children=grandchildren):
                lower = self.leaf(64, first=50 + grandchildren, hits=9)
                strategy.get_priority(lower)
                for child in range(grandchildren):
                    strategy.get_priority(self.leaf(8, parent=lower, first=child))  # then evicted
                before = strategy.get_priority(lower)[0]
                upper = self.node(lower.parent, 16, lower.key[0], hit_count=9,
                                  creation_time=lower.creation_time,
                                  last_access_time=lower.last_access_time)
                lower.parent, lower.key = upper, lower.key[16:]  # a trim: only the tail goes
                strategy.on_split(upper, lower)
                self.assertEqual(upper._mla_children, max(grandchildren, 1))
                self.assertEqual(strategy.reuse_hits(upper), cap)
                # value before / after: the node's hits (all 9 while it had no child) over the head's
                ratio = (1 + (cap if grandchildren else 9)) / (1 + cap)
                after = strategy.get_priority(upper)[0]
                self.assertAlmostEqual(after / before, ratio ** strategy.hit_exponent, places=3)

    def test_superseded_victims_lower_the_factor_never_continued_ones_raise_it(self):
        strategy = self.strategy()
        learning = strategy.learning
        continued, fresh = self.superseded_pair(strategy, first=40)
        strategy.get_priority(fresh)
        learning.see(self.comeback(fresh), 1.0, 0.0)  # never continued: S up
        learning.see(self.leaf(4, first=90), 2.0, 0.0)  # the clock moved: applied
        self.assertAlmostEqual(learning.log_superseded, GhostLearning.STEP)
        learning.see(self.comeback(continued), 3.0, 0.0)  # superseded: S down
        prefix = self.proven_prefix(learning, first=60, now=3.0)
        learning.see(self.comeback(prefix), 3.0, 0.0)  # proven: S stays
        learning.see(self.leaf(4, first=91), 4.0, 0.0)
        self.assertAlmostEqual(learning.log_superseded, 0.0)
        self.assertEqual(learning.superseded_factor, 1.0)
        self.assertEqual(learning.returns, [1, 2])
        learning.see(self.comeback(self.superseded_pair(strategy, first=70)[0]), 5.0, 0.0)
        learning.see(self.leaf(4, first=92), 6.0, 0.0)
        self.assertEqual(learning.log_superseded, 0.0)  # never below 1

    def test_supersession_switched_off_stays_neutral(self):
        strategy = self.strategy(superseded=False)
        continued, fresh = self.superseded_pair(strategy, first=20)
        strategy.get_priority(fresh)
        strategy.learning.see(self.comeback(fresh), 1.0, 0.0)
        strategy.learning.see(self.leaf(4, first=93), 2.0, 0.0)
        self.assertFalse(strategy.learning.learns_superseded)
        self.assertEqual(strategy.learning.superseded_factor, 1.0)
        self.assertTrue(strategy.learning.log_factor == 0.0)

    def test_memory_is_bounded(self):
        learning = GhostLearning()
        learning.MAX_GHOSTS, learning.MAX_BUILDS = 8, 4
        for first in range(50):
            learning.see(self.leaf(4, first=first), 0.0, 0.0)
        keeper = self.leaf(4, first=99)
        for build in range(10):
            learning.see(keeper, 1.0, 0.0)
        # Builds remembered: the earlier ones by number, the current one apart.
        self.assertEqual((len(learning._ghosts), len(learning._oldest) + 1), (8, 4))

    def test_ghost_hits_on_real_trees(self):
        # Content evicted and inserted again is recognised on both trees' real nodes,
        # and judged old or young against the heap build that evicted it.
        for kind in KINDS:
            with self.subTest(kind=kind):
                t = TreeHarness(kind, "mla_aware", POLICY_CONFIG)
                t.insert(span(0, 64))
                t.insert(span(500, 64))
                self.assertEqual(len(t.eviction_order()), 2)
                t.insert(span(0, 64))
                t.eviction_order()
                self.assertEqual(t.strategy.learning.returns, [0, 1])
                self.assertEqual(sum(t.strategy.learning.returns_by_age), 1)


class TestPolicyConfig(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        register()

    def test_defaults(self):
        cfg = parse_policy_config(None)
        self.assertEqual(cfg["model"], "deepseek-v3")
        self.assertEqual(cfg["hit_exponent"], 1.0)
        self.assertTrue(cfg["hit_cap"])
        self.assertTrue(cfg["probation"])
        self.assertTrue(cfg["value_weight"])
        self.assertTrue(cfg["superseded"])
        strategy = create_mla_aware_strategy()
        self.assertTrue(strategy.learning.learns_superseded)
        self.assertFalse(create_mla_aware_strategy(superseded=False).learning.learns_superseded)
        self.assertEqual(strategy.cost_model.bytes_per_token, 70_272)

    def test_setup_keys_reach_the_cost_model(self):
        strategy = create_mla_aware_strategy(
            model="llama-3-70b", tp_size=8, page_size=16, gpu_tflops=100, h2d_gbps=50
        )
        cm = strategy.cost_model
        self.assertEqual((cm.bytes_per_token, cm.page_size), (40_960, 16))
        self.assertEqual(cm.gpu_flops_per_s, 100e12)
        self.assertEqual(cm.host_to_device_bytes_per_s, 50e9)

    def test_unknown_key_is_named(self):
        with self.assertRaises(PolicyConfigError) as ctx:
            create_mla_aware_strategy(hit_exponnent=2)
        self.assertIn("'hit_exponnent'", str(ctx.exception))

    def test_bad_values_are_named(self):
        cases = {
            "hit_exponent": {"hit_exponent": "high"},
            "depth_aware": {"depth_aware": 1},
            "probation": {"probation": "on"},
            "value_weight": {"value_weight": 1},
            "tp_size": {"tp_size": 0},
            "page_size": {"page_size": True},
            "gpu_tflops": {"gpu_tflops": -1.0},
            "model": {"model": "deepseek-v9"},
        }
        for key, config in cases.items():
            with self.subTest(key=key):
                with self.assertRaises(PolicyConfigError) as ctx:
                    create_mla_aware_strategy(**config)
                self.assertIn(f"'{key}'", str(ctx.exception))

    def test_bad_config_fails_when_the_tree_is_built(self):
        with self.assertRaises(ValueError) as ctx:
            TreeHarness("radix", "mla_aware", {"bogus": 1})
        self.assertIn("'bogus'", str(ctx.exception))
        with self.assertRaises(ValueError) as ctx:
            TreeHarness("unified", "mla_aware", {"hit_exponent": -1})
        self.assertIn("'hit_exponent'", str(ctx.exception))

    def test_registered_under_its_name(self):
        self.assertIsInstance(get_eviction_strategy("mla_aware", POLICY_CONFIG), MLAAwareStrategy)
        self.assertIsInstance(get_eviction_strategy("MLA_AWARE"), MLAAwareStrategy)


if __name__ == "__main__":
    unittest.main()
