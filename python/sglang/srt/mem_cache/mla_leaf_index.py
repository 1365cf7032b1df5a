"""Score each value class's oldest leaf, not every leaf: an eviction walk for ``mla_aware``
that costs what the classes and the changed leaves cost.

SGLang's Full component begins every eviction walk by scoring every evictable leaf and
heapifying them (``FullComponent._evict_device_start``). A Python score that keeps state
per node costs ten times LRU's attribute read, and where nearly every prompt hits, the
prefill left to save is a few milliseconds a request: scoring hundreds of leaves at every
eviction was most of the policy's added CPU (docs/advanced_features/mla_aware_eviction.md,
the cpu rows of the bar check).

The scores do not need it. ``mla_aware`` scores a node ``-age * factor / value ** weight``
(ties by ``last_access_time``), with ``factor`` and ``weight`` the same for every node of
a probation state: two leaves of one *class* (:meth:`MLAAwareStrategy.score_class`: the
probation state and the unweighted value) are ordered by ``last_access_time`` at every
clock reading, factor and weight. So :class:`LeafIndex` keeps the evictable leaves
grouped by class, each class a heap by ``last_access_time``, and a walk heaps the
classes' oldest leaves only, taking the next of a class when its head goes. A leaf is
scored again only when it is new to the index or its ``last_access_time`` moved, which the
tree stamps on every access, hit and split of a node (the contract this rests on; a
leaf's price changes only with its key, its hits with an access). The walk takes the same
victims in the same order as the full heap (leaves of exactly equal priority aside), and
the strategy's learning sees every new leaf, every oldest leaf and every victim scored as
before; :meth:`GhostLearning.start_build` tells it where a walk begins.

Used for a strategy with a true ``indexed_eviction`` attribute (``mla_aware`` by default)
on the trees where victims can be trimmed (:func:`mla_victim_trim.supports`: the unified
tree, Full component alone, no host memory, no session radix); elsewhere the stock walk
runs. The plugin wraps the three walk methods through SGLang's ``HookRegistry``
(:func:`register_hooks`).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Optional

from sglang.srt.mem_cache import mla_victim_trim

_INDEX = "_mla_leaf_index"  # FullComponent attribute: its LeafIndex, made at the first walk


class LeafIndex:
    """The evictable leaves of one tree by score class, and the walk in progress.

    ``strategy`` must score with ``get_priority`` and class with ``score_class`` (read
    after a score of the node) such that leaves of one class have priorities ordered as
    their ``last_access_time``.
    """

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self._stamp: dict = {}  # leaf -> last_access_time when it was classed
        self._class: dict = {}  # leaf -> its class
        self._heaps: dict = {}  # class -> heap of (last_access_time, seq, leaf), stale entries lazily dropped
        self._entries = 0  # entries in all class heaps, stale ones included
        self._seq = itertools.count()  # ties of the heaps, never a node comparison
        self._walk: list = []  # heap of (priority, seq, leaf, its class or None)
        self._scored: dict = {}  # leaf -> priority, scored in the walk in progress
        self.walks = 0  # walks taken through the index

    def start(self, leaves: set) -> None:
        """Begin a walk over ``leaves``, the tree's evictable leaves."""
        strategy = self.strategy
        self.walks += 1
        stamp, klass = self._stamp, self._class
        for leaf in stamp.keys() - leaves:
            del stamp[leaf], klass[leaf]
        get = stamp.get
        self._scored = scored = {}
        for leaf in [n for n in leaves if get(n) != n.last_access_time]:
            scored[leaf] = strategy.get_priority(leaf)
            self._add(leaf, strategy.score_class(leaf))
        if self._entries > 2 * len(stamp) + 64:
            self._compact()
        self._walk = walk = []
        for key in list(self._heaps):
            leaf = self._head(key)
            if leaf is not None:
                walk.append((self._score(leaf), next(self._seq), leaf, key))
        heapq.heapify(walk)

    def push(self, leaf: Any) -> None:
        """A leaf the walk made (its last child went): into this walk, scored now."""
        heapq.heappush(self._walk, (self._score(leaf), next(self._seq), leaf, None))

    def pop(self) -> Optional[Any]:
        """The lowest-priority leaf left in this walk (``None`` once none is left); it
        leaves the index, and the next of its class takes its place in the walk."""
        if not self._walk:
            return None
        _, _, leaf, key = heapq.heappop(self._walk)
        if key is not None:
            heapq.heappop(self._heaps[key])
            self._entries -= 1
            del self._stamp[leaf], self._class[leaf]
            head = self._head(key)
            if head is not None:
                heapq.heappush(self._walk, (self._score(head), next(self._seq), head, key))
        return leaf

    def end(self) -> None:
        self._walk, self._scored = [], {}

    def _score(self, leaf: Any) -> tuple:
        # At most one score per leaf and walk, as the full heap scores it: the learning
        # takes a second score at one build for the start of the next.
        priority = self._scored.get(leaf)
        if priority is None:
            priority = self._scored[leaf] = self.strategy.get_priority(leaf)
        return priority

    def _add(self, leaf: Any, key: Any) -> None:
        t = leaf.last_access_time
        self._stamp[leaf], self._class[leaf] = t, key
        heap = self._heaps.get(key)
        if heap is None:
            heap = self._heaps[key] = []
        heapq.heappush(heap, (t, next(self._seq), leaf))
        self._entries += 1

    def _head(self, key: Any) -> Optional[Any]:
        """The oldest leaf of class ``key`` (stale entries dropped; an empty class goes)."""
        heap, stamp, klass = self._heaps[key], self._stamp, self._class
        while heap:
            t, _, leaf = heap[0]
            if stamp.get(leaf) == t and klass[leaf] == key:
                return leaf
            heapq.heappop(heap)
            self._entries -= 1
        del self._heaps[key]
        return None

    def _compact(self) -> None:
        """Rebuild the class heaps from the live leaves (stale entries outnumber them)."""
        self._heaps, self._entries = {}, 0
        for leaf, key in self._class.items():
            heap = self._heaps.setdefault(key, [])
            heap.append((self._stamp[leaf], next(self._seq), leaf))
            self._entries += 1
        for heap in self._heaps.values():
            heapq.heapify(heap)


def indexes(component: Any) -> bool:
    """Whether ``component`` gets a :class:`LeafIndex`: its strategy classes its scores
    (``score_class``) and its tree :func:`mla_victim_trim.supports` it. Its walks go
    through the index while the strategy's ``indexed_eviction`` is true."""
    strategy = getattr(component.tree_core, "eviction_strategy", None)
    return hasattr(strategy, "score_class") and mla_victim_trim.supports(component.cache)


def _index(component: Any) -> Optional[LeafIndex]:
    """``component``'s index, decided at its first walk (``False`` where it has none:
    asked once, so the stock walks of other policies pay nothing)."""
    index = component.__dict__.get(_INDEX)
    if index is None:
        index = LeafIndex(component.tree_core.eviction_strategy) if indexes(component) else False
        setattr(component, _INDEX, index)
    return index or None


def start_walk(component: Any, request_cnt: int) -> bool:
    """A walk of ``component`` (a ``FullComponent``) begins: tell the learning (indexed or
    not, so both see the same heap builds) and, where the index takes the walk, set it up.
    Whether it did; if not, the stock heap is to be built."""
    index = _index(component)
    if index is None:
        return False
    from sglang.srt.mem_cache.unified_cache.components import base

    index.strategy.learning.start_build(base._LAST_ACCESS_TIME_COUNTER_FLOAT)
    if not index.strategy.indexed_eviction:
        return False
    component._evict_device_request_cnt = request_cnt
    component._evict_device_last_node = None
    index.start(component.tree_core.evictable_device_leaves)
    return True


def walking(component: Any) -> Optional[LeafIndex]:
    """``component``'s index if the walk in progress goes through it."""
    index = component.__dict__.get(_INDEX)
    return index if index and index.strategy.indexed_eviction else None


def next_node(component: Any, index: LeafIndex, tracker: dict) -> Any:
    """As ``FullComponent._evict_device_next_node``, the heap replaced by ``index``: the
    next victim's id, or ``None`` when the walk has freed its request or has none left."""
    leaves = component.tree_core.evictable_device_leaves
    last = component._evict_device_last_node
    if last is not None and last.parent is not None and last.parent in leaves:
        index.push(last.parent)
    component._evict_device_last_node = None
    ct = component.component_type
    while tracker[ct] < component._evict_device_request_cnt:
        leaf = index.pop()
        if leaf is None:
            return None
        if leaf in leaves:
            component._evict_device_last_node = leaf
            return leaf.id
    return None


def end_walk(component: Any) -> None:
    index = walking(component)
    if index is not None:
        index.end()


def _around_start(original: Callable, component: Any, request_cnt: int) -> None:
    if not start_walk(component, request_cnt):
        original(component, request_cnt)


def _around_next_node(
    original: Callable, component: Any, tracker: dict, *args: Any, **kwargs: Any
) -> Any:
    index = walking(component)
    if index is None:
        return original(component, tracker, *args, **kwargs)
    return next_node(component, index, tracker)


def _around_end(original: Callable, component: Any) -> None:
    end_walk(component)
    original(component)


def register_hooks() -> None:
    """Wrap the three walk methods through SGLang's ``HookRegistry`` (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in HOOKS.items():
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType.AROUND)


_FULL = "sglang.srt.mem_cache.unified_cache.components.full.FullComponent."
# SGLang method -> the AROUND hook the plugin wraps it with.
HOOKS = {
    _FULL + "_evict_device_start": _around_start,
    _FULL + "_evict_device_next_node": _around_next_node,
    _FULL + "_evict_device_end": _around_end,
}
