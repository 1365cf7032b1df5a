"""The ``mla_aware`` radix eviction policy: evict what is cheapest to lose.

A node's priority (lowest is evicted first) is its idle time over the restore work its
bytes would save::

    value(node)    = restore_seconds(node) / bytes(node) * reuse(node)
    priority(node) = (-age(node) * factor(node) / value(node) ** weight, last_access_time)

``restore_seconds`` comes from :class:`KVCostModel`: recompute the node's tokens, or
reload them from host memory when HiCache holds a copy (``node.backuped``), whichever is
cheaper. Recompute is priced as if the node began a prompt (its tokens attend to each
other: a long node is worth more per byte than a short one); with ``depth_aware`` at its
true positions ``[start, end)``, where prefill work grows with depth. Depth pricing is off
by default: on every trace measured, the deep tails it would keep are the least reused
(docs/advanced_features/mla_aware_eviction.md, ablations).
``reuse`` is ``(1 + hits) ** hit_exponent``. A tree counts a hit on every node a
request's prefix walks over, so ``hits`` is ``hit_count``, except that with ``hit_cap`` a
node that has had children counts at most ``children + 1``: a prefix shared by many
requests gains a child for each request that branches below it (its ``hit_count`` is about
``children + 1``), while a session's later turns walk through every node of its history
without branching, and those extra hits say nothing of reuse once the session has ended
(measured in docs/advanced_features/mla_aware_eviction.md). A leaf's hits (a repeated
prompt) all count. Dividing the node's age by its value makes this a cost- and
frequency-weighted LRU: a node twice as valuable may sit idle twice as long. Ages are
ratios of one clock, so the order does not depend on whether the tree counts time in
seconds (``RadixCache``) or in logical ticks (``UnifiedRadixCache``).

``factor``, ``S`` and ``weight`` are learnt online from victims that come back
(:class:`GhostLearning`). ``factor`` is 1 for a *proven* node (two different children
have hung under it, or it came back after being evicted) and ``B >= 1`` for a
*probationary* one; as ARC sizes its recency and frequency lists, a probationary victim
returning lowers ``B`` (toward cost-weighted LRU), a proven one raises it (toward SLRU's
strict protection). A probationary leaf that has lost its only child (a later request, or
its own request's output, continued it and that continuation went first; a trimmed
head's tail is no continuation) is *superseded*: its age is multiplied by ``S >= 1`` as
well, learnt the same way between the two kinds of probationary victim (a superseded one
coming back lowers ``S``, one never continued raises it). ``weight`` says how much value
counts against recency: a proven victim that was among the oldest leaves when it went
raises it (LRU would have lost it too, and its sharing should have kept it), a young
probationary one lowers it (its low value evicted it early); the mixed cases leave it.
All three start at 1.

A leaf that only a session the client has closed used scores ``(-inf, last_access_time)``:
such leaves go first, oldest first (:mod:`mla_sessions`; ``sessions``, on by default).

The strategy only scores; the cache decides how much to free. With ``trim_victims`` (on by
default) the strategy asks the tree to free what an eviction is asked for rather than
whole leaves: the last victim is split and only the tail still missing goes
(:mod:`mla_victim_trim`, on trees that support it, where that saves more than 1 % of the
pool); :meth:`MLAAwareStrategy.on_split` keeps the head's state. With ``indexed_eviction``
(on by default) an eviction scores only the leaves that changed and the oldest of each
:meth:`MLAAwareStrategy.score_class`, with the same victims (:mod:`mla_leaf_index`).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.mla_cost_model import (
    KV_DTYPE_BYTES,
    Calibration,
    KVCostModel,
    ModelConfigError,
)
from sglang.srt.mem_cache.mla_sessions import CLOSED_HITS, SessionBook

POLICY_NAME = "mla_aware"
_CLOSED = ("closed",)  # the score class of leaves only closed sessions used
_CHILDREN = "_mla_children"  # the node attribute GhostLearning counts scored children in

# Keys of --radix-eviction-policy-config, with their types and defaults.
_SETUP_KEYS = {
    "model": ((str, dict), "deepseek-v3"),
    "kv_cache_dtype": (str, "auto"),
    "tp_size": (int, 1),
    "page_size": (int, 1),
    "gpu_tflops": ((int, float), 400.0),
    "h2d_gbps": ((int, float), 25.0),
    "calibration": (str, None),
    # Tokens one radix-key element stands for: 1 in a server (keys are token ids);
    # trace replays key one element per page or block.
    "key_unit_tokens": (int, 1),
}
_TUNABLE_KEYS = {
    "hit_exponent": ((int, float), 1.0),
    "hit_cap": (bool, True),
    "depth_aware": (bool, False),
    "host_aware": (bool, True),
    "probation": (bool, True),
    "value_weight": (bool, True),
    "superseded": (bool, True),
    "sessions": (bool, True),
    "trim_victims": (bool, True),
    "indexed_eviction": (bool, True),
}


class PolicyConfigError(ValueError):
    """A bad --radix-eviction-policy-config for mla_aware; names the key."""


class MLAAwareStrategy(EvictionStrategy):
    """Cost-, frequency- and recency-weighted priority; see the module docstring."""

    def __init__(
        self,
        cost_model: KVCostModel,
        *,
        hit_exponent: float = 1.0,
        hit_cap: bool = True,
        depth_aware: bool = False,
        host_aware: bool = True,
        probation: bool = True,
        value_weight: bool = True,
        superseded: bool = True,
        sessions: bool = True,
        trim_victims: bool = True,
        indexed_eviction: bool = True,
        key_unit_tokens: int = 1,
    ):
        self.cost_model = cost_model
        # Read by the integration, not here: evict only the needed tail of the last victim
        # where the tree supports it (mla_victim_trim).
        self.trim_victims = trim_victims
        # Also read by the integration: walk the evictable leaves by score class
        # (mla_leaf_index); the victims are the same, the scores fewer.
        self.indexed_eviction = indexed_eviction
        self.key_unit_tokens = key_unit_tokens
        self.hit_exponent = float(hit_exponent)
        self.hit_cap = hit_cap
        self.depth_aware = depth_aware
        self.host_aware = host_aware
        self.learning = GhostLearning(
            probation=probation, value_weight=value_weight, superseded=superseded
        )
        # Sessions the client closed: what only they used goes first (mla_sessions).
        self.sessions = SessionBook() if sessions else None
        if self.sessions is not None:
            self.sessions.listeners.append(self._closed_changed)
        # Price per byte by (start, end, backed): without depth pricing, one entry per key
        # length, so a new leaf is priced by a lookup (the cost model is frozen).
        self._density = functools.lru_cache(maxsize=1 << 12)(self._price_per_byte)
        self._node_type: Optional[type] = None  # the tree's node type, bound on first score

    @classmethod
    def from_config(cls, config: Optional[Mapping[str, Any]]) -> "MLAAwareStrategy":
        """A strategy from --radix-eviction-policy-config keys (validated, defaults filled).

        Raises :class:`PolicyConfigError` naming the key at fault.
        """
        cfg = parse_policy_config(config)
        return cls(
            cost_model_from_policy_config(cfg),
            key_unit_tokens=cfg["key_unit_tokens"],
            **{key: cfg[key] for key in _TUNABLE_KEYS},
        )

    def get_priority(self, node: Any) -> tuple[float, float]:
        # Called for every evictable leaf at every eviction, so what does not change
        # between two scores of a node is memoised on its record (see _Seen).
        if type(node) is not self._node_type:
            self._bind(type(node))
        now = self._clock()
        age = now - node.last_access_time
        learning = self.learning
        seen = learning.see(node, now, age)
        if seen.density is None or (self.host_aware and seen.backed != self._is_backed(node)):
            self._price(node, seen)
        # The memo's key: hit_count, GhostLearning.children (read inline, this runs for every
        # leaf at every eviction) and the weight; the value and whether only a closed session
        # used the node are recomputed only when one changed (a close resets the key:
        # _closed_changed).
        hits, children, weight = node.hit_count, node.__dict__.get(_CHILDREN, 0), learning.weight
        if hits != seen.hits or children != seen.children or weight != seen.weight:
            seen.hits, seen.children, seen.weight = hits, children, weight
            reuse = 1 + self._capped_hits(hits, children)
            seen.value = (seen.density * reuse ** self.hit_exponent) ** weight
            closed_hits = node.__dict__.get(CLOSED_HITS)  # mla_sessions.closed(node), inline
            seen.closed = closed_hits is not None and hits <= closed_hits
        if seen.closed:
            return (float("-inf"), node.last_access_time)
        value = seen.value
        if seen.probationary:
            age *= learning.factor
            if children == 1 and not seen.trimmed:  # seen.superseded(), inline
                age *= learning.superseded_factor
        return (-age / value if value > 0 else float("-inf"), node.last_access_time)

    def _closed_changed(self, nodes: list) -> None:
        """A close marked ``nodes`` (or forgot them): their memo is recomputed at the next
        score."""
        for node in nodes:
            seen = node.__dict__.get("_mla_seen")
            if seen is not None:
                seen.hits = None

    def score_class(self, node: Any) -> tuple:
        """The class of a node just scored: its probation state, whether it is superseded,
        its price per byte and counted hits. Nodes of one class share their factors and
        ``value``, so
        :meth:`get_priority` orders them as their ``last_access_time`` at every clock
        reading, factor and weight (what :mod:`mla_leaf_index` rests on)."""
        seen = node._mla_seen
        if seen.closed:
            return _CLOSED
        return (seen.probationary, seen.superseded(), seen.density,
                self._capped_hits(seen.hits, seen.children))

    def on_split(self, upper: Any, lower: Any) -> None:
        """The tree split a scored node to evict only its ``lower`` part
        (:mod:`mla_victim_trim`): ``upper`` stays with the node's state.

        ``lower`` keeps the node's record and, scored again, takes its new start as ghost
        signature (so its return is recognised); ``upper`` stands in for the node under its
        parent and keeps its probation state, proven or not, its price per byte and its
        children count where that exceeds the one child ``lower`` now is (so its hits stay
        capped as the node's were): a trim says nothing new of the content, and pricing the
        shorter head by its own length, or its hits by one child, would make it look
        cheaper and send it next (docs: victim trimming).
        """
        if self.sessions is not None:
            self.sessions.inherit(upper, lower)
        density = getattr(lower.__dict__.get("_mla_seen"), "density", None)
        children = GhostLearning.children(lower)
        self.get_priority(lower)
        self.get_priority(upper)
        if children > GhostLearning.children(upper):
            setattr(upper, _CHILDREN, children)
        seen = upper._mla_seen
        seen.probationary = lower._mla_seen.probationary
        seen.trimmed = True  # its tail, counted as a child, is no continuation
        if density is not None and seen.backed == lower._mla_seen.backed:
            seen.density, seen.hits = density, None  # the value is recomputed at the next score

    def value(self, node: Any) -> float:
        """Restore seconds per byte times ``(1 + reuse_hits) ** hit_exponent``."""
        return self.restore_seconds_per_byte(node) * (1 + self.reuse_hits(node)) ** self.hit_exponent

    def reuse_hits(self, node: Any) -> int:
        """``node.hit_count``; with ``hit_cap``, at most ``children + 1`` on a node that has
        had children (children as :meth:`GhostLearning.children` counts them)."""
        return self._capped_hits(node.hit_count, GhostLearning.children(node))

    def _capped_hits(self, hits: int, children: int) -> int:
        if self.hit_cap and children and hits > children + 1:
            return children + 1
        return hits

    def restore_seconds_per_byte(self, node: Any) -> float:
        """Restore time of the node's tokens over the bytes they hold (page-rounded)."""
        if type(node) is not self._node_type:
            self._bind(type(node))
        return self._restore_seconds_per_byte(node, self.host_aware and self._is_backed(node))

    def _price(self, node: Any, seen: "_Seen") -> None:
        """Price the node's bytes into its record (memoised until a split or host copy
        change; the value is recomputed from it at the next score)."""
        seen.backed = self.host_aware and self._is_backed(node)
        seen.density = self._restore_seconds_per_byte(node, seen.backed)
        seen.hits = None

    def _restore_seconds_per_byte(self, node: Any, backed: bool) -> float:
        n = len(node.key) * self.key_unit_tokens
        if n == 0:
            return 0.0
        end = prefix_end(node) * self.key_unit_tokens if self.depth_aware else n
        return self._density(end - n, end, backed)

    def _price_per_byte(self, start: int, end: int, backed: bool) -> float:
        seconds = self.cost_model.restore_seconds(start, end, backed_up=backed)
        return seconds / self.cost_model.bytes_for_tokens(end - start)

    def _bind(self, node_type: type) -> None:
        """Read the clock and host copies the way trees of ``node_type`` keep them."""
        self._node_type = node_type
        self._clock = _clock_for(node_type)
        self._is_backed = _backed_reader(node_type)


class GhostLearning:
    """What victims that come back teach: the probation and supersession factors and the
    value weight.

    Every node the strategy scores gets a :class:`_Seen` record: its ghost signature,
    whether it is *proven* (two different children have been scored under it, or it came
    back after being evicted; the upper half of a split stands in for the child it was
    split from, it is no second child) or *probationary*, and its age at its last score
    with the heap build of that score. Records stay in a table by signature after their
    node is gone (``MAX_GHOSTS`` of them, oldest first sight forgotten first). A node scored
    for the first time whose signature matches a record with a different ``creation_time``
    is a victim that came back, a miss the policy caused (a split keeps
    ``creation_time``, so the upper half of a split is no match). Each one teaches:

    - **Probation factor** (ARC's balance of recency and frequency): a probationary
      victim coming back means probation was too harsh, ``log_factor`` falls by ``STEP``;
      a proven one means it was too lenient, it rises by ``STEP``.
      ``factor = exp(log_factor)`` stays within ``[1, MAX_FACTOR]``.
    - **Supersession factor**, the same balance within probation: a *superseded* victim
      (:meth:`_Seen.superseded`: probationary, one child counted and that child gone, not
      a trimmed head) coming back means superseded leaves go too early,
      ``log_superseded`` falls by ``STEP``; a probationary victim never continued (no
      child counted) means they go too late, it rises by ``STEP``; proven victims leave
      it. ``superseded_factor = exp(log_superseded)`` stays within ``[1, MAX_FACTOR]``,
      so a superseded leaf never outlives one never continued of the same score.
    - **Value weight**: a proven victim that was *old* when last scored (at least ``OLD``
      of the oldest age in its heap build) would have gone under LRU too, so the value
      should count for more: ``weight`` rises by ``WEIGHT_STEP * (1 - RHO)``; a young
      probationary one was evicted for its low value, so it falls by
      ``WEIGHT_STEP * RHO``; the mixed cases teach the weight nothing. ``weight`` stays
      within ``WEIGHT_BOUNDS`` and settles where a share ``RHO`` of the victims that move
      it are old and proven.

    Heap builds: where the tree says where its eviction walks begin (the unified tree,
    through :mod:`mla_leaf_index`), each walk begins one (:meth:`start_build`). Elsewhere a
    tree scores each evictable leaf once per build (``RadixCache.evict``), so a node
    scored twice in the current build starts a new one, whatever the clock. A clock that has been seen to stand still
    between two scores counts ticks (the unified tree's counter, a replay's clock), and
    there a move of the clock starts a build too, so nodes first scored ahead of the
    first repeat, in the set's order, cannot land in the build before. The oldest age of
    the last ``MAX_BUILDS`` builds is kept. Steps seen at one reading of the tree's clock
    are applied together, as their net step, when the clock moves: a tree scores its
    leaves at one reading in the order of a set (by address), and a net step does not
    depend on that order, so replays on a tick clock are reproducible. Both start neutral
    (factor 1, weight 1: cost-weighted LRU); a part switched off stays neutral. With both
    off the records are still kept: the strategy memoises each node's price on its record.
    """

    STEP = 0.1
    MAX_FACTOR = 1000.0
    WEIGHT_STEP = 0.02
    RHO = 0.2
    WEIGHT_BOUNDS = (0.25, 3.0)
    OLD = 0.5
    MAX_GHOSTS = 1 << 16
    MAX_BUILDS = 1 << 12

    def __init__(self, *, probation: bool = True, value_weight: bool = True,
                 superseded: bool = True):
        self.learns_factor, self.learns_weight = probation, value_weight
        self.learns_superseded = superseded
        self.log_factor = 0.0
        self.factor = 1.0
        self.log_superseded = 0.0
        self.superseded_factor = 1.0
        self.weight = 1.0
        self.returns = [0, 0]  # victims that came back: (proven, probationary)
        self.returns_closed = 0  # ... and closed ones (mla_sessions), which teach nothing
        self.returns_by_age = [0, 0]  # the same victims: (young, old) when last scored
        self._factor_steps = 0  # net steps not yet applied: log_factor (in STEPs) ...
        self._superseded_steps = 0  # ... log_superseded (in STEPs) ...
        self._weight_step = 0.0  # ... and weight
        self._dirty = False  # a step is pending
        self._now = None
        self._clock_stands = False  # seen two scores at one clock reading
        self._build = 0
        self._build_oldest = 0.0  # oldest age scored in the current build
        self._oldest: OrderedDict = OrderedDict()  # earlier build -> its oldest age
        self._ghosts: OrderedDict = OrderedDict()  # signature -> _Seen

    def see(self, node: Any, now: float, age: float) -> "_Seen":
        """Record a score of ``node`` at clock ``now`` and ``age``; its record.

        ``factor`` applies to the node if ``record.probationary``; ``weight`` to every
        node. Both are read after this call.
        """
        if now != self._now:
            self._move_clock(now)
            if self._clock_stands:
                self._new_build()
        elif not self._clock_stands:
            self._clock_stands = True  # two scores at one reading: a tick clock
        try:
            seen = node._mla_seen
        except AttributeError:
            seen = None
        if seen is None or seen.owner is not self:
            seen = self._first_sight(node)
        elif seen.parent_id != id(node.parent):  # split: same content, new start and parent
            self._ghosts.pop(seen.signature, None)
            seen.parent_id, seen.signature = id(node.parent), ghost_signature(node)
            seen.density = None  # a shorter key: price it again
            self._remember(seen)
            node.parent._mla_split_upper = True  # it takes this node's place: see _first_sight
            self._count_child(node.parent)
        elif seen.build == self._build:
            self._new_build()
        seen.build, seen.age = self._build, age
        if age > self._build_oldest:
            self._build_oldest = age
        return seen

    def start_build(self, now: float) -> None:
        """A heap build begins at clock ``now``: for a tree that says where its eviction
        walks begin (:mod:`mla_leaf_index`, which scores only some leaves in a build)."""
        if now != self._now:
            self._move_clock(now)
        self._new_build()

    def _move_clock(self, now: float) -> None:
        """The tree's clock reads ``now``, a new reading: the steps seen at the last one
        are applied, as their net step."""
        self._now = now
        if self._dirty:
            self._apply()

    def _first_sight(self, node: Any) -> "_Seen":
        signature = ghost_signature(node)
        victim = self._ghosts.pop(signature, None)
        came_back = victim is not None and victim.creation_time != node.creation_time
        if came_back:
            self._learn(victim)
        seen = node._mla_seen = _Seen(self, node, signature)
        seen.probationary = not came_back and self.children(node) < 2
        self._remember(seen)
        if not self._split_upper(node):
            self._count_child(node.parent)
        return seen

    def _split_upper(self, node: Any) -> bool:
        """Whether ``node`` is the upper half of a split of a node already counted as a
        child of ``node.parent``: it stands in that child's place there, not beside it.

        Known when the lower half was scored since the split (it marks its new parent),
        or from the lower half's record still naming ``node.parent``.
        """
        if node.__dict__.get("_mla_split_upper"):
            return True
        grandparent = id(node.parent)
        for child in getattr(node, "children", {}).values():
            seen = child.__dict__.get("_mla_seen")
            if seen is not None and seen.owner is self and seen.parent_id == grandparent:
                return True
        return False

    def _learn(self, victim: "_Seen") -> None:
        """``victim`` came back: one step for each part switched on (none for a closed
        victim: the client's close evicted it, not the factors)."""
        if victim.closed:
            self.returns_closed += 1
            return
        self.returns[victim.probationary] += 1
        if self.learns_factor:
            self._factor_steps += 1 if victim.probationary else -1
            self._dirty = True
        if self.learns_superseded and victim.probationary:
            if victim.superseded():
                self._superseded_steps += 1
                self._dirty = True
            elif not victim.children:
                self._superseded_steps -= 1
                self._dirty = True
        if victim.build == self._build:
            oldest = self._build_oldest
        else:
            oldest = self._oldest.get(victim.build)
        if oldest:
            old = 1 if victim.age >= self.OLD * oldest else 0
            self.returns_by_age[old] += 1
            # Only unambiguous evidence moves the weight: an old proven victim (value and
            # hits should have kept it) or a young probationary one (its low value
            # evicted it early). An old probationary or young proven victim does not.
            if self.learns_weight and old != victim.probationary:
                self._weight_step += self.WEIGHT_STEP * ((1 - self.RHO) if old else -self.RHO)
                self._dirty = True

    @staticmethod
    def children(node: Any) -> int:
        """Children scored under ``node`` so far, by any learning (the upper half of a split
        stands in for the child it was split from; a victim that came back counts again)."""
        return node.__dict__.get(_CHILDREN, 0)

    def _count_child(self, parent: Any) -> None:
        """One more child scored under ``parent``; the second one proves it."""
        if parent is None:
            return
        children = self.children(parent) + 1
        setattr(parent, _CHILDREN, children)
        seen = parent.__dict__.get("_mla_seen")
        if children == 2 and seen is not None and seen.owner is self:
            seen.probationary = False

    def _remember(self, seen: "_Seen") -> None:
        self._ghosts[seen.signature] = seen
        if len(self._ghosts) > self.MAX_GHOSTS:
            self._ghosts.popitem(last=False)

    def _new_build(self) -> None:
        self._oldest[self._build] = self._build_oldest
        if len(self._oldest) >= self.MAX_BUILDS:
            self._oldest.popitem(last=False)
        self._build += 1
        self._build_oldest = 0.0

    def _apply(self) -> None:
        self.log_factor = self._stepped(self.log_factor, self._factor_steps)
        self.factor = math.exp(self.log_factor)
        self.log_superseded = self._stepped(self.log_superseded, self._superseded_steps)
        self.superseded_factor = math.exp(self.log_superseded)
        low, high = self.WEIGHT_BOUNDS
        self.weight = min(max(self.weight + self._weight_step, low), high)
        self._factor_steps = self._superseded_steps = 0
        self._weight_step, self._dirty = 0.0, False

    def _stepped(self, log_value: float, steps: int) -> float:
        """A log factor after ``steps`` net steps down, within ``[0, log(MAX_FACTOR)]``."""
        return min(max(log_value - self.STEP * steps, 0.0), math.log(self.MAX_FACTOR))


class _Seen:
    """What a :class:`GhostLearning` knows of a node it has scored, and the strategy's memo.

    It outlives the node in the table of ghosts, so it holds no node: the parent is kept
    by ``id`` (the parent a node was scored under stays in the tree while the node does,
    so a changed ``id`` always means a split). The strategy memoises on it the node's
    restore seconds per byte (``density``, with the host copy state ``backed`` it was
    priced for; ``None`` after a split) and ``value ** weight`` (``value``, for the
    ``hit_count``, children and ``weight`` it was computed with).
    """

    __slots__ = ("owner", "parent_id", "signature", "creation_time", "probationary", "age",
                 "build", "backed", "density", "hits", "children", "weight", "value",
                 "trimmed", "closed")

    def __init__(self, owner: GhostLearning, node: Any, signature: tuple):
        self.owner, self.parent_id, self.signature = owner, id(node.parent), signature
        self.creation_time = node.creation_time
        self.backed = False  # the strategy's memo: unpriced until its first score
        self.density = self.hits = self.children = self.weight = self.value = None
        self.trimmed = False  # the upper half of a victim trim (MLAAwareStrategy.on_split)
        self.closed = False  # at its last score, used only by a closed session (mla_sessions)

    def superseded(self) -> bool:
        """Probationary with one child counted at its last score, while a leaf: the child
        is gone. The upper half of a trim counts its own tail as that child: it is not
        superseded."""
        return self.probationary and self.children == 1 and not self.trimmed


def ghost_signature(node: Any) -> tuple:
    """Where a node starts, what it starts with and under which parent: the same for
    content evicted and inserted again, different for other content."""
    ids = getattr(node.key, "token_ids", node.key)
    start = prefix_end(node) - len(node.key)
    return (start, tuple(ids[:4]), node.parent.creation_time)


def _backed_reader(node_type: type):
    """Whether a node's KV has a host copy, as a bool.

    On the unified tree (the one HiCache runs on) its Full component's host value, as its
    ``backuped`` property reads it but without the property's enum lookup, which would
    cost more than the rest of a score; elsewhere a ``backuped`` attribute where a node
    has one (replays with a modelled host tier set it on the legacy tree's nodes).
    """
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedTreeNode

    if issubclass(node_type, UnifiedTreeNode):
        full = int(ComponentType.FULL)
        return lambda node: node.component_data[full].host_value is not None
    return lambda node: bool(getattr(node, "backuped", False))


def _clock_for(node_type: type):
    """The clock a tree stamps ``last_access_time`` with, read without advancing it.

    RadixCache uses its module's ``time.monotonic()`` (looked up per call, so a replay
    that gives the module a simulated clock is read consistently); the unified tree a
    module-level tick counter.
    """
    from sglang.srt.mem_cache import radix_cache
    from sglang.srt.mem_cache.unified_cache.components import base
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedTreeNode

    if issubclass(node_type, UnifiedTreeNode):
        return lambda: base._LAST_ACCESS_TIME_COUNTER_FLOAT
    return lambda: radix_cache.time.monotonic()


def prefix_end(node: Any) -> int:
    """Tokens from the root through the end of ``node``.

    Memoised on the node as ``_mla_prefix_end``: a split inserts a new parent above a
    node but never moves where the node ends, so the memo stays valid.
    """
    end = getattr(node, "_mla_prefix_end", None)
    if end is not None:
        return end
    path = []
    while node is not None and node.parent is not None and end is None:
        path.append(node)
        node = node.parent
        end = getattr(node, "_mla_prefix_end", None)
    end = end or 0
    for n in reversed(path):
        end += len(n.key)
        n._mla_prefix_end = end
    return end


def parse_policy_config(config: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """Validate --radix-eviction-policy-config keys and types; fill in defaults.

    Raises :class:`PolicyConfigError` naming an unknown key or a value of the wrong type.
    """
    config = dict(config or {})
    known = {**_SETUP_KEYS, **_TUNABLE_KEYS}
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise PolicyConfigError(
            f"mla_aware: unknown --radix-eviction-policy-config key {unknown[0]!r}; "
            f"known keys: {', '.join(sorted(known))}"
        )
    out = {}
    for key, (types, default) in known.items():
        value = config.get(key, default)
        wrong_bool = isinstance(value, bool) and types is not bool
        if value is not None and (wrong_bool or not isinstance(value, types)):
            raise PolicyConfigError(
                f"mla_aware: --radix-eviction-policy-config key {key!r} has bad value "
                f"{value!r} (expected {_type_names(types)})"
            )
        out[key] = value
    for key in ("tp_size", "page_size", "gpu_tflops", "h2d_gbps", "key_unit_tokens"):
        if out[key] <= 0:
            raise PolicyConfigError(
                f"mla_aware: --radix-eviction-policy-config key {key!r} must be > 0, "
                f"got {out[key]!r}"
            )
    if out["hit_exponent"] < 0:
        raise PolicyConfigError(
            f"mla_aware: --radix-eviction-policy-config key 'hit_exponent' must be >= 0, "
            f"got {out['hit_exponent']!r}"
        )
    return out


def cost_model_from_policy_config(cfg: Mapping[str, Any]) -> KVCostModel:
    """The cost model described by the setup keys of a parsed policy config.

    Raises :class:`PolicyConfigError` naming the key whose value is at fault.
    """
    calibration = None
    if cfg["calibration"]:
        try:
            calibration = Calibration.load(Path(cfg["calibration"]))
        except ModelConfigError as e:
            raise PolicyConfigError(f"mla_aware: key 'calibration': {e}") from None
    dtype = cfg["kv_cache_dtype"].lower()
    if dtype != "auto" and dtype not in KV_DTYPE_BYTES:
        raise PolicyConfigError(
            f"mla_aware: key 'kv_cache_dtype': {cfg['kv_cache_dtype']!r} unknown; use auto "
            f"or one of {', '.join(sorted(KV_DTYPE_BYTES))}"
        )
    try:
        return KVCostModel.from_config(
            cfg["model"],
            kv_cache_dtype=cfg["kv_cache_dtype"],
            tp_size=cfg["tp_size"],
            page_size=cfg["page_size"],
            gpu_flops_per_s=cfg["gpu_tflops"] * 1e12,
            host_to_device_bytes_per_s=cfg["h2d_gbps"] * 1e9,
            calibration=calibration,
        )
    except ModelConfigError as e:
        raise PolicyConfigError(f"mla_aware: key 'model': {e}") from None


def mla_aware_policy_config(
    user_config: Optional[Mapping[str, Any]],
    *,
    hf_config: Mapping[str, Any],
    tp_size: int,
    page_size: int,
    kv_cache_dtype: str,
    host_copies: bool = True,
) -> dict[str, Any]:
    """The ``mla_aware`` policy config for a served model, under the user's keys.

    The policy prices a node from the model's KV layout and prefill cost, so it is given
    the Hugging Face config, the TP size, the page size and the KV dtype. Keys set in
    ``--radix-eviction-policy-config`` win. A KV dtype the cost model does not price is
    left to the model's own dtype ("auto"). Where the tree keeps no host copies
    (``host_copies`` False: no HiCache), ``host_aware`` is off: there is nothing to find,
    and looking costs more than the rest of a score.
    """
    priced = ("fp8_e4m3", "fp8_e5m2", "bf16", "bfloat16")
    return {
        "model": hf_config,
        "tp_size": tp_size,
        "page_size": page_size,
        "kv_cache_dtype": kv_cache_dtype if kv_cache_dtype in priced else "auto",
        **({} if host_copies else {"host_aware": False}),
        **(user_config or {}),
    }


def create_mla_aware_strategy(**config: Any) -> MLAAwareStrategy:
    """Factory registered as ``mla_aware``: keyword arguments are the policy config."""
    return MLAAwareStrategy.from_config(config)


def _type_names(types: Union[type, tuple]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {"str": "a string", "dict": "an object", "int": "an integer",
             "float": "a number", "bool": "true or false"}
    return " or ".join(names[t.__name__] for t in types)
