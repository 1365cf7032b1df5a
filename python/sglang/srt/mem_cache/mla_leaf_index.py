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
classes' oldest leaves only, taking the next of a class when its head goes.

Nor does a walk need to look at every leaf to find the ones that changed. The index
stands in for the tree's set of evictable leaves (:class:`TrackedLeaves`), so it hears of
every leaf the tree adds (a new leaf, a parent whose last child went, the lower half of a
split, a leaf unlocked) and classes it at the next walk if its ``last_access_time`` moved.
A leaf accessed in place (a prefix match stamps the path without touching the set) keeps
its old entry until that entry reaches the head of its class, and is classed again there:
an access only raises a leaf's priority (younger, more hits, perhaps proven), so the old
entry comes up no later than the leaf's turn. What this rests on: the tree stamps
``last_access_time`` on every access and split and adds a split's lower half to the set
again; a leaf's price changes only with its key, its hits only with an access. The walk
takes the same victims in the same order as the full heap (leaves of exactly equal
priority aside), and the strategy's learning sees every new leaf, every oldest leaf and
every victim scored as before; :meth:`GhostLearning.start_build` tells it where a walk
begins. A walk costs the changed leaves and the classes, not the leaves.

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
    their ``last_access_time``, and such that an access (a new ``last_access_time``, more
    hits) never lowers a leaf's priority.

    The index learns of the tree's leaves through :class:`TrackedLeaves`, which stands in
    for the tree's set of evictable leaves (:meth:`track`): a leaf the tree adds is classed
    at the next walk, a leaf it discards leaves at once. A leaf accessed in place (a prefix
    match stamps it without touching the set) keeps its entry until the entry comes to the
    head of its class; there it is classed again. Since the access only raised its
    priority, the entry comes to the head no later than the leaf's turn, so no walk does
    work in proportion to the leaves that did not change.
    """

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self.live: dict = {}  # leaf -> (last_access_time, seq, class) it was classed with
        self.changed: set = set()  # leaves the tree added (again) since the last walk
        self._leaf: dict = {}  # seq of a live entry -> its leaf
        # class -> heap of (last_access_time, seq); an entry whose seq is not in _leaf is
        # stale. Entries hold no node, so a node gone from the tree is not kept alive.
        self._heaps: dict = {}
        self._entries = 0  # entries in all class heaps, stale ones included
        self._seq = itertools.count()  # ties of the heaps, never a node comparison
        self._walk: list = []  # heap of (priority, seq, leaf, its class or None)
        self._scored: dict = {}  # leaf -> priority, scored in the walk in progress
        self.walks = 0  # walks taken through the index
        sessions = getattr(strategy, "sessions", None)
        if sessions is not None:
            sessions.listeners.append(self.class_changed)

    def class_changed(self, nodes: Any) -> None:
        """The class of ``nodes`` changed without an access (a session closed): each is
        classed again at the next walk, if it is an evictable leaf then."""
        for node in nodes:
            self.forget(node)
            self.changed.add(node)

    def track(self, tree_core: Any) -> set:
        """``tree_core``'s evictable device leaves, as a :class:`TrackedLeaves` of this
        index: put in place at the first walk and again after the tree reset its set,
        when every leaf is new to the index."""
        leaves = tree_core.evictable_device_leaves
        if getattr(leaves, "index", None) is not self:
            self._clear()
            leaves = tree_core.evictable_device_leaves = TrackedLeaves(leaves, self)
            self.changed = set(leaves)
        return leaves

    def untrack(self, tree_core: Any) -> None:
        """Give ``tree_core`` a plain set again (the index is switched off) and forget."""
        leaves = tree_core.evictable_device_leaves
        if getattr(leaves, "index", None) is self:
            tree_core.evictable_device_leaves = set(leaves)
            self._clear()

    def start(self, leaves: set) -> None:
        """Begin a walk over ``leaves``, the tree's evictable leaves (:meth:`track`)."""
        self.walks += 1
        self._scored = {}
        live, changed, self.changed = self.live, self.changed, set()
        for leaf in changed:
            entry = live.get(leaf)
            if leaf in leaves and (entry is None or entry[0] != leaf.last_access_time):
                self._class_again(leaf)
        if self._entries > 2 * len(live) + 64:
            self._compact()
        for key in list(self._heaps):
            self._head(key, walking=False)  # a leaf classed again keeps every head live
        self._walk = walk = []
        for key, heap in self._heaps.items():
            seq = heap[0][1]
            leaf = self._leaf[seq]
            walk.append((self._score(leaf), seq, leaf, key))
        heapq.heapify(walk)

    def push(self, leaf: Any) -> None:
        """A leaf the walk made (its last child went), or one accessed since it was
        classed: into this walk, scored now."""
        heapq.heappush(self._walk, (self._score(leaf), next(self._seq), leaf, None))

    def pop(self) -> Optional[Any]:
        """The lowest-priority leaf left in this walk (``None`` once none is left); it
        leaves the index, and the next of its class takes its place in the walk."""
        if not self._walk:
            return None
        _, seq, leaf, key = heapq.heappop(self._walk)
        if key is not None:
            heap = self._heaps[key]
            if heap[0][1] == seq:
                heapq.heappop(heap)
                self._entries -= 1
            self.forget(leaf)
            head = self._head(key, walking=True)
            if head is not None:
                heapq.heappush(self._walk, (self._score(head), self.live[head][1], head, key))
        return leaf

    def end(self) -> None:
        self._walk, self._scored = [], {}

    def forget(self, leaf: Any) -> None:
        """``leaf`` is no longer indexed (its entry goes stale)."""
        entry = self.live.pop(leaf, None)
        if entry is not None:
            del self._leaf[entry[1]]

    def _clear(self) -> None:
        self.live, self.changed, self._leaf, self._heaps, self._entries = {}, set(), {}, {}, 0

    def _score(self, leaf: Any) -> tuple:
        # At most one score per leaf and walk, as the full heap scores it: the learning
        # takes a second score at one build for the start of the next.
        priority = self._scored.get(leaf)
        if priority is None:
            priority = self._scored[leaf] = self.strategy.get_priority(leaf)
        return priority

    def _class_again(self, leaf: Any) -> None:
        """Score ``leaf`` and file it under its class (its old entry goes stale)."""
        self._score(leaf)
        self.forget(leaf)
        t, seq, key = leaf.last_access_time, next(self._seq), self.strategy.score_class(leaf)
        self.live[leaf], self._leaf[seq] = (t, seq, key), leaf
        heap = self._heaps.get(key)
        if heap is None:
            heap = self._heaps[key] = []
        heapq.heappush(heap, (t, seq))
        self._entries += 1

    def _head(self, key: Any, walking: bool) -> Optional[Any]:
        """The oldest leaf of class ``key`` (``None`` once the class is empty, and it
        goes). Stale entries are dropped; a leaf accessed since it was classed is classed
        again, or, in a walk, goes into the walk (and is classed at the next)."""
        heap = self._heaps.get(key)
        while heap:
            t, seq = heap[0]
            leaf = self._leaf.get(seq)
            if leaf is not None and leaf.last_access_time == t:
                return leaf
            heapq.heappop(heap)
            self._entries -= 1
            if leaf is None:
                continue
            if walking:
                self.forget(leaf)
                self.changed.add(leaf)
                self.push(leaf)
            else:
                self._class_again(leaf)
        if heap is not None:
            del self._heaps[key]
        return None

    def _compact(self) -> None:
        """Rebuild the class heaps from the live entries (stale ones outnumber them)."""
        self._heaps, self._entries = {}, len(self.live)
        for t, seq, key in self.live.values():
            self._heaps.setdefault(key, []).append((t, seq))
        for heap in self._heaps.values():
            heapq.heapify(heap)


class TrackedLeaves(set):
    """A tree's set of evictable device leaves that tells a :class:`LeafIndex` of the
    leaves the tree adds (``changed``) and discards (forgotten at once). SGLang's
    tree changes the set through ``add`` and ``discard`` only."""

    __slots__ = ("index",)

    def __init__(self, leaves: set, index: LeafIndex):
        super().__init__(leaves)
        self.index = index

    def add(self, node: Any) -> None:
        set.add(self, node)
        self.index.changed.add(node)

    def discard(self, node: Any) -> None:
        if node in self:
            set.discard(self, node)
            self.index.changed.discard(node)
            self.index.forget(node)


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
        index.untrack(component.tree_core)
        return False
    component._evict_device_request_cnt = request_cnt
    component._evict_device_last_node = None
    index.start(index.track(component.tree_core))
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
