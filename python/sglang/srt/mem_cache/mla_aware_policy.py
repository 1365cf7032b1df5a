"""The ``mla_aware`` radix eviction policy: evict what is cheapest to lose.

Every evictable leaf is scored, lowest evicted first::

    priority(leaf) = -age(leaf) * factor(leaf) / ((1 + hits(leaf)) * density(leaf) ** weight)

``density`` is the prefill time of the leaf's tokens over the bytes they hold on one
rank (:class:`KVCostModel`), as if the leaf began a prompt: its tokens attend to each
other, so a long leaf is worth more per byte than a short one. ``hits`` is the tree's
``hit_count``. Frequency times restore cost per byte is GreedyDual-Size-Frequency's
value; ``mla_aware`` ages it by idle time instead of an inflation value: ``age`` counts
the tree's eviction walks since the leaf was last accessed. A walk begins when the
root's stamp (every match and insert sets it) has moved since the last score; counting
walks rather than ticks of SGLang's clock, which every cache in a process shares, keeps
one tree's order independent of another's traffic. A leaf worth twice as much may sit
idle twice as long.

``factor`` is 1 for a *proven* leaf (it came back after being evicted, or two children
have been seen under it: a prefix several requests share) and ``B >= 1`` for the rest.
``B`` and ``weight`` are learnt from victims that come back, as ARC sizes its lists from
ghost hits: a returning proven victim raises ``B`` (protect shared prefixes harder), an
unproven one lowers it; a returning victim that was old and proven raises ``weight``
(value should have kept it), one that was young and unproven lowers it (value evicted it
too early). Both start at 1.

The strategy only scores; the tree decides how much to free. It learns through
``on_evict(node)``, which the tree calls with each device victim before it goes; on a
tree that never calls it nothing is learnt. State is kept by ``node.id`` in the strategy,
never on the tree's nodes; ties go to the older leaf (SGLang's heaps order entries
``(priority, node)`` and nodes compare by ``last_access_time``).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.mla_cost_model import KVCostModel

POLICY_NAME = "mla_aware"


class PolicyConfigError(ValueError):
    """A bad ``--radix-eviction-policy-config`` for ``mla_aware``; names the key."""


@dataclass(frozen=True)
class PolicyConfig:
    """``--radix-eviction-policy-config`` for ``mla_aware``: a GPU calibration JSON of
    measured prefill constants, and whether ``B`` and ``weight`` are learnt."""

    calibration: Optional[str] = None
    learn_factor: bool = True
    learn_weight: bool = True

    @classmethod
    def parse(cls, config: Any) -> "PolicyConfig":
        """Validate a decoded JSON config (``None`` for defaults).

        Raises :class:`PolicyConfigError` naming the key at fault.
        """
        if config is None:
            return cls()
        if not isinstance(config, Mapping):
            raise PolicyConfigError(
                "mla_aware: --radix-eviction-policy-config must be a JSON object, "
                f"got {type(config).__name__}"
            )
        known = {"calibration": str, "learn_factor": bool, "learn_weight": bool}
        for key, value in config.items():
            if key not in known:
                raise PolicyConfigError(
                    f"mla_aware: unknown --radix-eviction-policy-config key {key!r}; "
                    f"known keys: {', '.join(known)}"
                )
            if type(value) is not known[key]:
                raise PolicyConfigError(
                    f"mla_aware: --radix-eviction-policy-config key {key!r} must be "
                    f"{'a string' if known[key] is str else 'true or false'}, "
                    f"got {value!r}"
                )
        return cls(**config)


class _Seen:
    """What the strategy keeps of a leaf it has scored (by ``node.id``)."""

    __slots__ = ("parent", "density", "proven", "version", "rate", "hits", "at", "walk")

    def __init__(self, parent: Any, density: float, proven: bool):
        self.parent, self.density, self.proven = parent, density, proven
        self.version, self.rate, self.hits = -1, 0.0, -1
        self.at, self.walk = None, 0  # the last access seen, and walks begun by then


class MLAAwareStrategy(EvictionStrategy):
    """Cost-, frequency- and recency-weighted priority; see the module docstring."""

    STEP = 0.1  # log B moves by this per returning victim
    MAX_FACTOR = 1000.0
    WEIGHT_STEP = 0.02  # weight moves by this, times RHO or 1 - RHO
    RHO = 0.2  # weight settles where this share of its moves are up
    WEIGHT_BOUNDS = (0.25, 3.0)
    OLD = 0.5  # a victim is old at half the age of its walk's oldest leaf or more
    MAX_GHOSTS = 1 << 16  # victims remembered, oldest forgotten first
    MAX_SEEN = 1 << 20  # a tree that never calls on_evict: forget beyond this
    MAX_WALKS = 1 << 16  # walks whose clock is kept

    def __init__(
        self,
        cost_model: KVCostModel,
        *,
        key_unit_tokens: int = 1,
        learn_factor: bool = True,
        learn_weight: bool = True,
    ):
        if not isinstance(cost_model, KVCostModel):
            raise TypeError(f"cost_model must be a KVCostModel, got {cost_model!r}")
        if type(key_unit_tokens) is not int or key_unit_tokens < 1:
            raise ValueError(f"key_unit_tokens must be >= 1, got {key_unit_tokens!r}")
        self.cost_model = cost_model
        self.key_unit_tokens = key_unit_tokens
        self.learn_factor, self.learn_weight = learn_factor, learn_weight
        self.log_factor, self.factor, self.weight = 0.0, 1.0, 1.0
        self._steps = [0, 0.0]  # pending (log B steps, weight change): see _learn
        self._seen: dict[int, _Seen] = {}
        self._children: dict[int, int] = {}  # children seen under a node, by id
        self._ghosts: OrderedDict[tuple, tuple[bool, bool]] = OrderedDict()
        self._densities: dict[int, float] = {}
        self._root: Any = None
        self._now: Optional[float] = None  # the clock at the walk being scored
        self._oldest = 0  # the oldest leaf age scored in that walk
        # This tree's clock at each walk (the last MAX_WALKS), for ages in walks.
        self._walks, self._dropped, self._stamps = 0, 0, []
        self._version = 0  # of factor and weight: older cached rates are stale

    def get_priority(self, node: Any) -> float:
        root = self._root
        if root is None:
            root = self._root = self._signature(node)[1]
        now = root.last_access_time
        if now != self._now:  # before any first sight, which may teach: see _learn
            self._new_walk(now)
        seen = self._seen.get(node.id)
        if seen is None or seen.parent is not node.parent:
            seen = self._see(node, seen)
        if seen.at != node.last_access_time:
            seen.at = node.last_access_time
            seen.walk = self._walk_of(seen.at)
        age = self._walks - seen.walk
        if age > self._oldest:
            self._oldest = age
        hits = node.hit_count
        if seen.version != self._version or seen.hits != hits:
            factor = 1.0 if seen.proven else self.factor
            seen.rate = factor / ((1 + hits) * seen.density**self.weight)
            seen.version, seen.hits = self._version, hits
        return -age * seen.rate

    def _new_walk(self, now: float) -> None:
        """The clock moved: a new walk, which applies what the last one taught."""
        self._now, self._oldest = now, 0
        self._walks += 1
        self._stamps.append(now)
        if len(self._stamps) > self.MAX_WALKS:  # older accesses count as that old
            self._dropped += len(self._stamps) // 2
            del self._stamps[: len(self._stamps) // 2]
        if self._steps != [0, 0.0]:
            self._apply()

    def on_evict(self, node: Any) -> None:
        """The tree evicts ``node`` (a leaf) from the device: remember it as a ghost."""
        seen = self._seen.pop(node.id, None)
        self._children.pop(node.id, None)
        if self._root is None:
            return
        age = self._walks - self._walk_of(node.last_access_time)
        proven = seen.proven if seen is not None else False
        signature = self._signature(node)[0]
        self._ghosts[signature] = (proven, age < self.OLD * self._oldest)
        if len(self._ghosts) > self.MAX_GHOSTS:
            self._ghosts.popitem(last=False)

    def _see(self, node: Any, seen: Optional[_Seen]) -> _Seen:
        """First score of ``node``, or the first since a split put a new parent above
        it: price it, count it as a child of its parent, and if it is evicted content
        coming back, learn from its ghost."""
        parent = node.parent
        if parent is not None:
            count = max(self._children.get(parent.id, 0) + 1, len(parent.children))
            self._children[parent.id] = count
            parent_seen = self._seen.get(parent.id)
            if count >= 2 and parent_seen is not None and not parent_seen.proven:
                parent_seen.proven, parent_seen.version = True, -1
        density = self._density(len(node.key) * self.key_unit_tokens)
        if seen is not None:  # split: same content, shorter key, new parent
            seen.parent, seen.density, seen.version = parent, density, -1
            return seen
        signature, root = self._signature(node)
        if root is not self._root:  # a new tree (or a reset one): start afresh
            self._seen.clear()
            self._children.clear()
            self._root, self._walks, self._dropped, self._stamps = root, 0, 0, []
            self._new_walk(root.last_access_time)
        if len(self._seen) >= self.MAX_SEEN:
            self._seen.clear()
        ghost = self._ghosts.pop(signature, None)
        if ghost is not None:
            self._learn(*ghost)
        proven = ghost is not None or self._children.get(node.id, 0) >= 2
        seen = self._seen[node.id] = _Seen(parent, density, proven)
        return seen

    def _walk_of(self, access: float) -> int:
        """The walks begun at or before an access at ``access`` on the tree's clock."""
        return self._dropped + bisect.bisect_right(self._stamps, access)

    def _learn(self, proven: bool, young: bool) -> None:
        """A victim came back: steps applied at the next walk, so that one walk's
        scores do not depend on the order the tree scores its leaves in."""
        if self.learn_factor:
            self._steps[0] += 1 if proven else -1
        if self.learn_weight and proven != young:
            step = self.WEIGHT_STEP
            self._steps[1] += step * (1 - self.RHO) if proven else -step * self.RHO

    def _apply(self) -> None:
        steps, change = self._steps
        self.log_factor = min(
            max(self.log_factor + self.STEP * steps, 0.0), math.log(self.MAX_FACTOR)
        )
        self.factor = math.exp(self.log_factor)
        low, high = self.WEIGHT_BOUNDS
        self.weight = min(max(self.weight + change, low), high)
        self._steps = [0, 0.0]
        self._version += 1

    def _density(self, tokens: int) -> float:
        """Prefill seconds per byte of a node of ``tokens`` tokens (memoised)."""
        density = self._densities.get(tokens)
        if density is None:
            density = self.cost_model.seconds_per_byte(max(tokens, 1))
            if len(self._densities) < 1 << 16:
                self._densities[tokens] = density
        return density

    @staticmethod
    def _signature(node: Any) -> tuple[tuple, Any]:
        """Where a node starts and what it starts with (the same for content evicted
        and inserted again), and the tree's root."""
        start, root = 0, node
        while root.parent is not None:
            root = root.parent
            start += len(root.key) if root.parent is not None else 0
        ids = getattr(node.key, "token_ids", node.key)
        return (start, tuple(ids[:8])), root


def create_mla_aware_strategy(
    cost_model: KVCostModel, key_unit_tokens: int = 1, **config: Any
) -> MLAAwareStrategy:
    """Factory registered as ``mla_aware``: the integration passes the cost model it
    built for the served model; ``config`` is the user's validated policy config."""
    parsed = PolicyConfig.parse(config)
    return MLAAwareStrategy(
        cost_model,
        key_unit_tokens=key_unit_tokens,
        learn_factor=parsed.learn_factor,
        learn_weight=parsed.learn_weight,
    )
