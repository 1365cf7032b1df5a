"""Tests for benchmark/mla_eviction/peers.py: GDSF, S3-FIFO, LHD on hand-built trees."""

import heapq
import itertools
import math
import sys
import unittest
from pathlib import Path

from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.mla_cost_model import KVCostModel
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

sys.path.insert(
    0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction")
)

from peers import PEERS, GDSFStrategy, LHDStrategy, S3FIFOStrategy  # noqa: E402

_ids = itertools.count(1)


class Node:
    """The fields a strategy may read, as the radix trees have them."""

    def __init__(self, name, parent, key, created=0.0, accessed=None, hits=0):
        self.name = name
        self.id = next(_ids)
        self.parent = parent
        self.key = tuple(key)
        self.children = {}
        self.creation_time = created
        self.last_access_time = created if accessed is None else accessed
        self.hit_count = hits
        if parent is not None:
            parent.children[self.id] = self


def make_root(now):
    return Node("root", None, (), created=0.0, accessed=now)


def leaf(name, parent, length=1, created=0.0, accessed=None, hits=0, first=None):
    first = next(_ids) * 1000 if first is None else first
    key = range(first, first + length)
    return Node(name, parent, key, created, accessed, hits)


def leaves(root):
    out, stack = [], list(root.children.values())
    while stack:
        n = stack.pop(0)
        if n.children:
            stack.extend(n.children.values())
        else:
            out.append(n)
    return out


def evict(strategy, root, count=None):
    """The Full component's walk: heap of priorities, pop, on_evict, detach."""
    seq = itertools.count()
    heap = [(strategy.get_priority(n), next(seq), n) for n in leaves(root)]
    heapq.heapify(heap)
    order = []
    while heap and (count is None or len(order) < count):
        _, _, x = heapq.heappop(heap)
        strategy.on_evict(x)
        parent = x.parent
        del parent.children[x.id]
        order.append(x.name)
        if parent is not root and not parent.children:
            heapq.heappush(heap, (strategy.get_priority(parent), next(seq), parent))
    return order


class PageCost:
    """Hand-checkable cost: 1 s per token to prefill, 1 byte a token, 4-token pages."""

    def prefill_seconds(self, start, end):
        return float(end - start)

    def bytes_for_tokens(self, n):
        return 4 * math.ceil(n / 4)

    def seconds_per_byte(self, n):  # KVCostModel's contract, on these figures
        return n / self.bytes_for_tokens(n) if n > 0 else 0.0


class TestGDSF(CustomTestCase):
    def test_eviction_order_differs_from_lru(self):
        root = make_root(now=10)
        # cost / size = n / (4 * ceil(n / 4)): 1 for 4 tokens, 0.5 for 2, 0.25 for 1.
        leaf("A", root, length=4, accessed=1)  # H = 0 + 1 * 1    = 1
        leaf("B", root, length=1, accessed=2, hits=2)  # 3 * 0.25 = 0.75
        leaf("C", root, length=2, accessed=3)  # H = 1 * 0.5      = 0.5
        e = leaf("E", root, length=4, accessed=5)  # inner until F goes
        leaf("F", e, length=2, accessed=6, hits=1)  # H = 2 * 0.5 = 1 (lat 6)
        leaf("D", root, length=4, accessed=9, hits=1)  # H = 2 * 1  = 2
        # C (L=0.5), B (L=0.75), A (1, lat 1; L=1), F (1, lat 6); E becomes a leaf:
        # accessed at 5, before the evictions at clock 10, so H = 0 + 1 = 1 < D's 2.
        # LRU would go A, B, C, F, E, D.
        self.assertEqual(evict(GDSFStrategy(PageCost()), root), list("CBAFED"))

    def test_inflation_rises_to_victim_and_later_access_scores_higher(self):
        s = GDSFStrategy(PageCost())
        root = make_root(now=10)
        v = leaf("V", root, length=4, accessed=2, hits=1)  # H = 2
        s.on_evict(v)
        self.assertEqual(s.inflation, 2.0)
        s.on_evict(leaf("W", root, length=1, accessed=3))  # H = 0.25: L stays 2
        self.assertEqual(s.inflation, 2.0)
        later = leaf("P", root, length=4, accessed=12)  # after the eviction: 2 + 1
        earlier = leaf("Q", root, length=4, accessed=8)  # before it: 0 + 1
        self.assertEqual(s.get_priority(later), (3.0, 12))
        self.assertEqual(s.get_priority(earlier), (1.0, 8))

    def test_uses_the_inflation_in_effect_at_the_last_access(self):
        s = GDSFStrategy(PageCost())
        root = make_root(now=10)
        s.on_evict(leaf("V1", root, length=4, accessed=1))  # H = 1 -> L = 1 at 10
        root.last_access_time = 20
        s.on_evict(leaf("V2", root, length=4, accessed=15, hits=1))  # 1 + 2 -> L = 3
        for accessed, h in ((5, 1.0), (10, 2.0), (15, 2.0), (20, 4.0), (25, 4.0)):
            node = leaf("N", root, length=4, accessed=accessed)
            self.assertEqual(s.get_priority(node), (h, accessed))

    def test_history_is_bounded(self):
        s = GDSFStrategy(PageCost(), max_history=4)
        root = make_root(now=0)
        for t in range(1, 11):
            root.last_access_time = t
            s.on_evict(leaf("V", root, length=4, accessed=t, hits=t))
            self.assertLessEqual(s.state_size()["history"], 4)
        levels = [s.inflation_at(t) for t in range(0, 12)]
        self.assertEqual(levels, sorted(levels))
        self.assertEqual(levels[-1], s.inflation)

    def test_real_cost_model_pays_for_the_rounded_page(self):
        cost = KVCostModel.from_preset("deepseek-v3", page_size=64)
        s = GDSFStrategy(cost)
        root = make_root(now=10)
        one = leaf("one", root, length=1, accessed=5)
        page = leaf("page", root, length=64, accessed=1)
        # Both occupy one 64-token page; one token costs less to recompute than 64.
        self.assertLess(s.get_priority(one), s.get_priority(page))


class TestS3FIFO(CustomTestCase):
    def test_eviction_order_differs_from_lru(self):
        s = S3FIFOStrategy(small_ratio=0.4)
        root = make_root(now=20)
        # hit_count 1 = only the insert that created it; above that = reused.
        leaf("A", root, created=1, hits=1)  # not reused: S at 1
        e = leaf("E", root, created=2, accessed=12, hits=3)  # reused: M at 20
        leaf("B", root, created=3, accessed=8, hits=2)  # reused: M at 20
        leaf("C", root, created=4, hits=1)  # S at 4
        leaf("D", root, created=5, hits=1)  # S at 5
        for n in leaves(root):  # an earlier walk saw them all
            s.get_priority(n)
        self.assertEqual([s.queue(n) for n in leaves(root)], list("SMMSS"))
        root.last_access_time = e.last_access_time = 21  # a hit while in M: freq 1
        # |S| = 3 of 5 entries, share 0.4 * 5 = 2: the oldest 3 - 2 = 1 S entry (A)
        # ranks below M; M by (freq, position): B (0, 20), E (1, 20); then C, D.
        # LRU would go A (1), C (4), D (5), B (8), E (21).
        self.assertEqual(evict(s, root), list("ABECD"))

    def test_one_hit_new_leaf_goes_before_older_leaf_accessed_twice(self):
        root = make_root(now=10)
        leaf("old", root, created=1, accessed=4, hits=3)  # inserted, hit at 3 and 4
        leaf("new", root, created=5, accessed=6, hits=1)  # its own inserts only
        # old moves to M; new (touched again by its own finish-insert at 6, no reuse)
        # is S's only entry, over its 10 % share. LRU: old (4) before new (6).
        self.assertEqual(evict(S3FIFOStrategy(), root), ["new", "old"])

    def test_first_sight_counts_reuse_above_the_insert_baseline(self):
        root = make_root(now=10)
        fresh = leaf("fresh", root, created=1, accessed=5, hits=1)
        reused = leaf("reused", root, created=1, accessed=5, hits=2)
        s = S3FIFOStrategy()
        self.assertEqual([s.get_priority(n)[0] for n in (fresh, reused)], [0, 1])
        self.assertEqual((s.queue(fresh), s.queue(reused)), ("S", "M"))
        s = S3FIFOStrategy(insert_hits=0)  # a tree that does not count the insert
        s.get_priority(fresh)
        self.assertEqual(s.queue(fresh), "M")

    def test_ghost_hit_is_admitted_to_main(self):
        s = S3FIFOStrategy()
        root = make_root(now=10)
        x = leaf("X", root, length=12, created=1, hits=1, first=100)
        s.get_priority(x)
        self.assertEqual(evict(s, root), ["X"])
        self.assertEqual(s.state_size()["ghost"], 1)
        root.last_access_time = 11
        again = leaf("X2", root, length=9, created=11, hits=1, first=100)  # same 8
        other = leaf("Y", root, length=12, created=11, hits=1, first=500)
        deeper = leaf("Z", other, length=12, created=11, hits=1, first=100)  # at 12
        self.assertEqual(s.get_priority(again)[0], 1)
        self.assertEqual(s.queue(again), "M")
        self.assertEqual(s.state_size()["ghost"], 0)
        self.assertEqual(s.queue(deeper), None)
        s.get_priority(deeper)
        self.assertEqual(s.queue(deeper), "S")

    def test_main_is_clock_with_reinsertion(self):
        s = S3FIFOStrategy()
        root = make_root(now=10)
        x = leaf("X", root, created=1, hits=2)
        y = leaf("Y", root, created=2, hits=2)
        self.assertEqual(s.get_priority(x), (1, 0, 10, x.id))  # promoted at 10
        self.assertEqual(s.get_priority(y), (1, 0, 10, y.id))
        root.last_access_time = x.last_access_time = 11  # X hit in M: freq 1
        # Both at position 10, X first in FIFO order, but CLOCK passes over X.
        self.assertEqual(evict(s, root, count=1), ["Y"])
        # The hand passed X: re-inserted at the hand's clock 11 with freq 0.
        self.assertEqual(s.get_priority(x), (1, 0, 11, x.id))

    def test_state_is_bounded(self):
        s = S3FIFOStrategy(ghost_ratio=0.5)
        root = make_root(now=100)
        for i in range(40):
            leaf(f"L{i}", root, created=i)
        self.assertEqual(len(evict(s, root)), 40)
        # Peak 40 entries: ghost capped at int(0.5 * 40) + 1; memo and S emptied.
        self.assertEqual(s.state_size(), {"tracked": 0, "small": 0, "ghost": 21})
        s = S3FIFOStrategy(max_tracked=8)
        for i in range(20):
            s.get_priority(leaf(f"M{i}", root, created=100 + i))
        self.assertEqual(s.state_size(), {"tracked": 8, "small": 8, "ghost": 0})


class TestLHD(CustomTestCase):
    def test_no_data_orders_as_lru(self):
        root = make_root(now=10)
        leaf("A", root, length=8, accessed=3, hits=3)
        b = leaf("B", root, length=1, accessed=4)
        leaf("C", b, length=2, accessed=1)
        leaf("D", root, length=5, accessed=2, hits=1)
        self.assertEqual(evict(LHDStrategy(), root), list("CDAB"))

    def train(self, s, root):
        """Class 1: 2 hits at age 1, evicted at age 5; class 0: 2 unhit, gone at 3."""
        h = leaf("h", root, created=0, hits=1)
        s.get_priority(h)
        for t in (1, 2):
            root.last_access_time = h.last_access_time = t
            s.get_priority(h)
        unhit = [leaf("u", root, created=4) for _ in range(2)]
        for u in unhit:
            s.get_priority(u)
        root.last_access_time = 7
        for n in [h, *unhit]:
            s.on_evict(n)
            del root.children[n.id]

    def test_eviction_order_after_training(self):
        s = LHDStrategy(num_buckets=4, recompute_every=1000)
        root = make_root(now=0)
        self.train(s, root)
        s.recompute()
        # Buckets b0..b3 = [0,1) [1,2) [2,4) [4,inf), widths 1 1 2 4. From b3 down:
        # density = hits at or beyond / lifetime; lifetime += events at or beyond
        # * width.
        #   class 1: hits b1 = 2, evictions b3 = 1
        #     b3: 0/4, b2: 0/(4+1*2), b1: 2/(6+3*1) = 2/9, b0: 2/(9+3*1) = 1/6
        #   class 0: no hits, density 0 everywhere
        #   class 3: no events, pooled (hits b1 2; evictions b2 2, b3 1):
        #     b3: 0/4, b2: 0/(4+3*2), b1: 2/(10+5) = 2/15, b0: 2/(15+5) = 1/10
        root.last_access_time = 10
        leaf("P", root, accessed=9.5)  # class 0, age 0.5: 0
        leaf("Q", root, accessed=7, hits=1)  # class 1, age 3 (b2): 0
        leaf("R", root, length=2, accessed=8.5, hits=1)  # b1: 2/9 / 2 = 0.111
        leaf("S", root, accessed=9.25, hits=1)  # b0: 1/6 = 0.167
        leaf("T", root, accessed=9, hits=5)  # class 3, b1: 2/15 = 0.133
        # Ties at 0 by last access. LRU would go Q (7), R, T, S, P (9.5).
        self.assertEqual(evict(s, root), list("QPRTS"))

    def test_hit_class_ranks_above_unhit_class(self):
        s = LHDStrategy(recompute_every=6)
        root = make_root(now=0)
        self.train(s, root)
        self.train(s, root)  # the sixth eviction recomputes
        root.last_access_time = 20
        young_unhit = leaf("young", root, accessed=19.5)  # class 0
        older_hit = leaf("older", root, accessed=19, hits=1)  # class 1, age 1
        # LRU would evict "older" first; LHD evicts the class that never gets hit.
        self.assertEqual(evict(s, root, count=1), ["young"])
        self.assertLess(s.get_priority(young_unhit), s.get_priority(older_hit))
        # EWMA: the counts were decayed once by 0.9 at the recompute.
        self.assertAlmostEqual(s._hits[1][1], 4 * 0.9)

    def test_state_is_bounded(self):
        s = LHDStrategy(max_tracked=5)
        root = make_root(now=10)
        for i in range(12):
            leaf(f"L{i}", root, accessed=i)
        self.assertEqual(len(evict(s, root, count=3)), 3)
        self.assertLessEqual(s.state_size()["tracked"], 5)
        evict(s, root)
        self.assertEqual(s.state_size()["tracked"], 0)


class TestRegistry(CustomTestCase):
    def test_factories_build_working_strategies(self):
        cost = KVCostModel.from_preset("deepseek-v3", page_size=64)
        self.assertEqual(set(PEERS), {"gdsf", "s3fifo", "lhd"})
        for name, factory in PEERS.items():
            with self.subTest(name):
                s = factory(cost, 1)
                self.assertIsInstance(s, EvictionStrategy)
                root = make_root(now=10)
                a = leaf("a", root, length=70, accessed=2, hits=1)
                leaf("b", a, length=3, accessed=3)
                leaf("c", root, length=64, accessed=4)
                self.assertEqual(sorted(evict(s, root)), ["a", "b", "c"])
                self.assertEqual(s.state_size()["tracked"], 0)


if __name__ == "__main__":
    unittest.main()
