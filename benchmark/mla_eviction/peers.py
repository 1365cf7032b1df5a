"""Published eviction policies as radix-tree strategies, for the trace-replay benchmark.

Benchmark-only peers of SGLang's built-in policies and ``mla_aware``; each one only
scores nodes (``get_priority``, lowest evicted first) and learns from ``on_evict``.

* GDSF, GreedyDual-Size-Frequency (L. Cherkasova, "Improving WWW Proxies Performance
  with Greedy-Dual-Size-Frequency Caching Policy", HP Labs HPL-98-69, 1998):
  H = L + frequency * cost / size, L the inflation value (the H of the last victim).
* S3-FIFO (J. Yang et al., "FIFO Queues are All You Need for Cache Eviction",
  SOSP 2023): a small FIFO S, a main FIFO M with 2-bit CLOCK re-insertion, and a
  ghost FIFO G of keys recently evicted from S.
* LHD, Least Hit Density (N. Beckmann et al., "LHD: Improving Cache Hit Rate by
  Maximizing Hit Density", NSDI 2018): rank by learnt expected hits per unit of
  expected remaining lifetime (and per byte), by class and age.

Mapping onto a prefix tree. The tree asks for ``get_priority`` of every evictable
leaf when an eviction walk starts, keeps that heap fixed for the walk, and scores a
parent when it becomes an evictable leaf; only leaves can be evicted, so an inner
node is a cache entry that cannot be chosen yet. There is no access callback: a
node was accessed since its memo if its ``last_access_time`` (or ``hit_count``)
changed, so several accesses between two looks count as one (more if ``hit_count``
rose by more). A node is first seen when it is first scored as a leaf. Both trees
count the creating insert in ``hit_count`` (a new node has 1), and the creating
request re-touches its nodes while they are locked, so only ``hit_count`` above
that (``insert_hits``) tells that another request used a node before first sight.
The clock is ``root.last_access_time`` (the tree stamps the root on every match
and insert); the root is found by walking ``parent`` up at a node's first sight
(GDSF, which keeps no per-node memo, walks up at each eviction). Per-node state
lives in dicts keyed by ``node.id``, dropped in ``on_evict`` and capped at
``max_tracked`` entries (oldest first-seen dropped), so one strategy instance
serves one tree.

GDSF: cost / size = the cost model's ``seconds_per_byte(n)`` (``prefill_seconds(0, n)``
over the page-rounded ``bytes_for_tokens(n)``) for the node's n = len(key) *
key_unit_tokens tokens, frequency = 1 + hit_count (2 for a fresh node). H is fixed at
the node's last access: L is the value in effect at ``last_access_time``, read from a
monotone (clock, L) history appended in ``on_evict`` (evictions stamped at or before an
access count as before it); the history keeps ``max_history`` entries, older accesses
get the L of the newest dropped entry. Ties: (H, last_access_time).

S3-FIFO, with entries = the nodes seen (leaves and inner nodes):
  * a new entry joins S at position creation_time, or M (same position) if its
    signature is in G; signature = (start position = sum of the ancestors' key
    lengths, key.extra_key, first 8 key elements);
  * freq counts accesses, capped at 3, from hit_count - insert_hits at first
    sight and each change seen later. Lazy promotion at scoring: an S entry
    with freq >= 1 moves to M at position now with freq 0 (it would move there,
    not leave, when S's tail reached it);
  * M is CLOCK: the hand is the (position, id) of the newest M victim; an M entry
    with freq > 0 behind the hand is re-inserted at the hand's clock with freq - 1
    when next scored. Within M, leaves rank by (freq, position, id): for a fixed
    set this is the order CLOCK evicts them in;
  * S over its share (paper, Algorithm 1: evict from S while |S| >= 10 % of the
    cache): with N entries, the ceil(|S| - small_ratio * N) oldest S entries
    rank below every M leaf (band 0), the rest of S above M (band 2; evicted only
    when no M leaf is left). Shares are counted when a leaf is scored, so a first
    sight in the same heap build shifts the cut for leaves scored after it;
  * a victim from S goes to G (G holds ghost_ratio * the peak entry count); M
    victims move the hand. Priority: (band, freq, position, id).

LHD: class = min(hit_count, num_classes - 1) at the node's last look; age =
(now - last_access_time) * age_scale, bucket 0 for age < 1, else bit_length
(log2-coarsened, last bucket open). A hit at age new - old is recorded for the old
class when a node's last_access_time changed; an eviction at the current age in
``on_evict``. Every ``recompute_every`` evictions each class's density by bucket is
recomputed as hits at or beyond that age / expected remaining lifetime (events at
or beyond it weighted by bucket widths), and all counts are multiplied by
``decay`` (EWMA). A class without events uses the pooled curve. Priority:
(density / size, last_access_time), size = bytes (or len(key) without a cost
model); before the first recompute every density is 0, i.e. LRU.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

_MAX_FREQ = 3
_SMALL, _MAIN = 0, 1


def _key_len(node) -> int:
    return 0 if node.key is None else len(node.key)


class _PeerStrategy(EvictionStrategy):
    """Shared plumbing: the tree clock and a bounded per-node memo keyed by id."""

    def __init__(self, max_tracked: int = 1 << 20):
        self.max_tracked = max(1, max_tracked)
        self._memo: Dict[int, Any] = {}
        self._root = None

    def _locate(self, node) -> None:
        root = node
        while root.parent is not None:
            root = root.parent
        self._root = root

    def _now(self) -> float:
        return self._root.last_access_time

    def _remember(self, node_id: int, value: Any) -> None:
        self._memo[node_id] = value
        while len(self._memo) > self.max_tracked:
            self._forget(next(iter(self._memo)))

    def _forget(self, node_id: int) -> None:
        self._memo.pop(node_id, None)

    def on_evict(self, node) -> None:
        self._forget(node.id)

    def state_size(self) -> Dict[str, int]:
        return {"tracked": len(self._memo)}


class GDSFStrategy(_PeerStrategy):
    def __init__(self, cost_model, key_unit_tokens: int = 1, max_history: int = 4096):
        super().__init__()
        self.cost_model = cost_model
        self.key_unit_tokens = key_unit_tokens
        self.max_history = max(2, max_history)
        self.inflation = 0.0  # L, never decreasing
        self._clocks: List[float] = []
        self._levels: List[float] = []
        self._floor = 0.0  # L in effect before the oldest kept history entry
        self._ratios: Dict[int, float] = {}

    def _ratio(self, node) -> float:
        n = _key_len(node) * self.key_unit_tokens
        r = self._ratios.get(n)
        if r is None:
            r = self.cost_model.seconds_per_byte(n)
            if len(self._ratios) < 65536:
                self._ratios[n] = r
        return r

    def inflation_at(self, clock: float) -> float:
        i = bisect.bisect_right(self._clocks, clock)
        return self._levels[i - 1] if i else self._floor

    def value(self, node) -> float:
        """H = L(at the last access) + (1 + hit_count) * cost / size."""
        freq = 1 + node.hit_count
        return self.inflation_at(node.last_access_time) + freq * self._ratio(node)

    def get_priority(self, node) -> Tuple[float, float]:
        return (self.value(node), node.last_access_time)

    def on_evict(self, node) -> None:
        h = self.value(node)
        if h <= self.inflation:
            return
        self.inflation = h
        self._locate(node)
        now = self._now()
        if self._clocks and now <= self._clocks[-1]:
            self._levels[-1] = h  # same tick (or a clock gone back): keep monotone
        else:
            self._clocks.append(now)
            self._levels.append(h)
        if len(self._clocks) > self.max_history:
            drop = len(self._clocks) - self.max_history // 2
            self._floor = self._levels[drop - 1]
            del self._clocks[:drop], self._levels[:drop]

    def state_size(self) -> Dict[str, int]:
        return {"tracked": 0, "history": len(self._clocks), "ratios": len(self._ratios)}


class S3FIFOStrategy(_PeerStrategy):
    def __init__(
        self,
        small_ratio: float = 0.1,
        ghost_ratio: float = 0.9,
        insert_hits: int = 1,
        max_tracked: int = 1 << 20,
    ):
        super().__init__(max_tracked)
        self.small_ratio = small_ratio
        self.ghost_ratio = ghost_ratio
        self.insert_hits = insert_hits  # hit_count a node has from its own insert
        # memo: id -> [queue, freq, position, last_access_time, hit_count]
        self._small: List[Tuple[float, int]] = []  # S in FIFO order: (position, id)
        self._ghost: OrderedDict = OrderedDict()
        self._peak = 0
        self._hand: Tuple[float, int] = (float("-inf"), -1)
        self._hand_clock = 0.0

    def _signature(self, node) -> tuple:
        start, a = 0, node.parent
        while a is not None:
            start += _key_len(a)
            self._root = a
            a = a.parent
        head = tuple(itertools.islice(iter(node.key), 8))
        return (start, getattr(node.key, "extra_key", None), head)

    def _drop_small(self, position: float, node_id: int) -> None:
        i = bisect.bisect_left(self._small, (position, node_id))
        if i < len(self._small) and self._small[i] == (position, node_id):
            del self._small[i]

    def _forget(self, node_id: int) -> None:
        e = self._memo.pop(node_id, None)
        if e is not None and e[0] == _SMALL:
            self._drop_small(e[2], node_id)

    def _entry(self, node) -> list:
        e = self._memo.get(node.id)
        lat, hits = node.last_access_time, node.hit_count
        if e is None:
            sig = self._signature(node)
            seen = max(hits - self.insert_hits, 0)
            queue = _MAIN if sig in self._ghost else _SMALL
            self._ghost.pop(sig, None)
            e = [queue, min(seen, _MAX_FREQ), node.creation_time, lat, hits]
            if queue == _SMALL:
                bisect.insort(self._small, (e[2], node.id))
            self._remember(node.id, e)
            self._peak = max(self._peak, len(self._memo))
        elif lat != e[3] or hits != e[4]:
            e[1] = min(e[1] + max(hits - e[4], 1), _MAX_FREQ)
            e[3], e[4] = lat, hits
        if e[0] == _SMALL and e[1] > 0:  # accessed while in S: on to M
            self._drop_small(e[2], node.id)
            e[0], e[1], e[2] = _MAIN, 0, self._now()
        elif e[0] == _MAIN and e[1] > 0 and (e[2], node.id) < self._hand:
            e[1], e[2] = e[1] - 1, self._hand_clock  # CLOCK passed it: re-insert
        return e

    def get_priority(self, node) -> Tuple[int, int, float, int]:
        e = self._entry(node)
        if e[0] == _MAIN:
            return (1, e[1], e[2], node.id)
        excess = len(self._small) - self.small_ratio * len(self._memo)
        rank = bisect.bisect_left(self._small, (e[2], node.id))
        return (0 if rank < excess else 2, 0, e[2], node.id)

    def on_evict(self, node) -> None:
        e = self._memo.get(node.id) or self._entry(node)
        if e[0] == _SMALL:
            sig = self._signature(node)
            self._ghost[sig] = None
            self._ghost.move_to_end(sig)
            cap = int(self.ghost_ratio * self._peak) + 1
            while len(self._ghost) > cap:
                self._ghost.popitem(last=False)
        else:
            self._hand = max(self._hand, (e[2], node.id))
            self._hand_clock = self._now()
        self._forget(node.id)

    def queue(self, node) -> Optional[str]:
        """Queue "S" or "M" as last scored; None if untracked (tests, reports)."""
        e = self._memo.get(node.id)
        return None if e is None else ("S" if e[0] == _SMALL else "M")

    def state_size(self) -> Dict[str, int]:
        return {
            "tracked": len(self._memo),
            "small": len(self._small),
            "ghost": len(self._ghost),
        }


class LHDStrategy(_PeerStrategy):
    def __init__(
        self,
        cost_model=None,
        key_unit_tokens: int = 1,
        num_classes: int = 4,
        num_buckets: int = 40,
        recompute_every: int = 128,
        decay: float = 0.9,
        age_scale: float = 1.0,
        max_tracked: int = 1 << 20,
    ):
        super().__init__(max_tracked)
        self.cost_model = cost_model
        self.key_unit_tokens = key_unit_tokens
        self.num_classes = num_classes
        self.num_buckets = num_buckets
        self.recompute_every = recompute_every
        self.decay = decay
        self.age_scale = age_scale
        self._widths = [1.0] + [2.0 ** (b - 1) for b in range(1, num_buckets)]
        self._hits = [[0.0] * num_buckets for _ in range(num_classes)]
        self._evictions = [[0.0] * num_buckets for _ in range(num_classes)]
        self._density: Optional[List[List[float]]] = None
        self._since = 0

    def _bucket(self, age: float) -> int:
        return min(max(int(age * self.age_scale), 0).bit_length(), self.num_buckets - 1)

    def _size(self, node) -> float:
        if self.cost_model is None:
            return max(_key_len(node), 1)
        n = _key_len(node) * self.key_unit_tokens
        return max(self.cost_model.bytes_for_tokens(n), 1)

    def _observe(self, node) -> Tuple[float, int]:
        m = self._memo.get(node.id)
        lat = node.last_access_time
        if m is None:
            self._locate(node)
        elif lat != m[0]:
            self._hits[m[1]][self._bucket(lat - m[0])] += 1.0
        else:
            return m
        m = (lat, min(node.hit_count, self.num_classes - 1))
        self._remember(node.id, m)
        return m

    def get_priority(self, node) -> Tuple[float, float]:
        lat, cls = self._observe(node)
        if self._density is None:
            return (0.0, lat)
        density = self._density[cls][self._bucket(max(self._now() - lat, 0.0))]
        return (density / self._size(node), lat)

    def on_evict(self, node) -> None:
        lat, cls = self._observe(node)
        self._evictions[cls][self._bucket(max(self._now() - lat, 0.0))] += 1.0
        self._forget(node.id)
        self._since += 1
        if self._since >= self.recompute_every:
            self.recompute()

    def _curve(self, hits: List[float], evictions: List[float]) -> List[float]:
        out = [0.0] * self.num_buckets
        total_hits = total_events = lifetime = 0.0
        for b in reversed(range(self.num_buckets)):
            total_hits += hits[b]
            total_events += hits[b] + evictions[b]
            lifetime += total_events * self._widths[b]
            out[b] = total_hits / lifetime if lifetime > 0 else 0.0
        return out

    def recompute(self) -> None:
        """Hit density by class and age bucket from the counts, then decay them."""
        self._since = 0
        pooled = self._curve(
            [sum(col) for col in zip(*self._hits)],
            [sum(col) for col in zip(*self._evictions)],
        )
        self._density = [
            self._curve(h, e) if sum(h) + sum(e) > 0 else pooled
            for h, e in zip(self._hits, self._evictions)
        ]
        for row in itertools.chain(self._hits, self._evictions):
            row[:] = [x * self.decay for x in row]


PEERS: Dict[str, Callable[..., EvictionStrategy]] = {
    "gdsf": lambda cost_model, key_unit_tokens=1: GDSFStrategy(
        cost_model, key_unit_tokens
    ),
    "s3fifo": lambda cost_model=None, key_unit_tokens=1: S3FIFOStrategy(),
    "lhd": lambda cost_model=None, key_unit_tokens=1: LHDStrategy(
        cost_model, key_unit_tokens
    ),
}
