"""Candidate eviction policies for the replay only: measured here, not shipped.

``mla_aware_ghost`` is ``mla_aware`` with its value raised to a weight that is set online
from *ghost hits*: a leaf scored for the first time that has the position, leading key
elements and parent of a leaf scored earlier but a different ``creation_time`` is content
that came back after being evicted (a split keeps ``creation_time``, so the upper half of
a split node is not mistaken for one). If that victim was old when last scored (at least
half the age of the oldest leaf in the same heap build), recency could not have saved it
and the weight rises by ``STEP * (1 - RHO)``; if it was young, the value weighting evicted
it early and the weight falls by ``STEP * RHO``. ``RHO`` is a fitted constant (see
docs/advanced_features/mla_aware_eviction.md, "Variants tried and not kept").

A heap build is recognised by the tree's clock moving between two scores, which holds for
the unified tree's tick counter and for the replay's tick clock, not for a legacy
``RadixCache`` stamping wall-clock time in a server: one reason this is not shipped.
Its steps are applied one at a time, in the order SGLang hands over its leaves (a set,
by address), so its figures move by a few hundredths of a point between runs (18.79 and
18.83 % on the shipped trace at 5 %); the shipped probation applies a net step per clock
reading and does not.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy, ghost_signature
from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES

GHOST = "mla_aware_ghost"
MLA_POLICIES = ("mla_aware", GHOST)  # policies built from mla_aware's config keys


class GhostAdaptiveStrategy(MLAAwareStrategy):
    """``priority = (-age / value ** weight, last_access_time)``, weight learnt from ghost hits."""

    STEP = 0.02
    RHO = 0.2
    BOUNDS = (0.25, 3.0)
    OLD = 0.5  # a victim at least this share of the heap build's oldest age was "old"
    MAX_GHOSTS = 1 << 16  # leaves remembered (signature -> last score)
    MAX_BUILDS = 1 << 12  # heap builds remembered (build -> oldest leaf age)

    def __init__(self, cost_model, **kwargs):
        # Measured as mla_aware was before adaptive probation: it scores without it.
        super().__init__(cost_model, **{**kwargs, "probation": False})
        self.weight = 1.0
        self.ghost_hits = [0, 0]  # victims that were (young, old) when last scored
        self._ghosts: OrderedDict = OrderedDict()  # signature -> (creation_time, age, build)
        self._oldest: OrderedDict = OrderedDict()  # build -> oldest age scored in it
        self._clock_at = None
        self._build = 0

    def get_priority(self, node: Any) -> tuple[float, float]:
        clock, is_backed = self._node_type_readers(node)
        now = clock()
        age = now - node.last_access_time
        self._observe(node, now, age)
        value = self._value(node, is_backed) ** self.weight
        return (-age / value if value > 0 else float("-inf"), node.last_access_time)

    def _observe(self, node: Any, now: float, age: float) -> None:
        if now != self._clock_at:  # the clock moved: a new heap build
            self._clock_at = now
            self._build += 1
            _put(self._oldest, self._build, age, self.MAX_BUILDS)
        elif age > self._oldest[self._build]:
            self._oldest[self._build] = age
        seen = node.__dict__.get("_mla_ghost")
        if seen is None or seen[0] is not self:
            signature = ghost_signature(node)
            node._mla_ghost = (self, signature)
            previous = self._ghosts.pop(signature, None)
            if previous is not None and previous[0] != node.creation_time:
                self._learn(age=previous[1], build=previous[2])
        else:
            signature = seen[1]
        _put(self._ghosts, signature, (node.creation_time, age, self._build), self.MAX_GHOSTS)

    def _learn(self, age: float, build: int) -> None:
        """A victim last scored at ``age`` in heap build ``build`` came back."""
        oldest = self._oldest.get(build)
        if not oldest:
            return
        old = bool(age >= self.OLD * oldest)
        self.ghost_hits[old] += 1
        low, high = self.BOUNDS
        if old:
            self.weight = min(high, self.weight + self.STEP * (1 - self.RHO))
        else:
            self.weight = max(low, self.weight - self.STEP * self.RHO)


def _put(table: OrderedDict, key, value, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    if len(table) > limit:
        table.popitem(last=False)


def register() -> None:
    """Make the candidates available to ``--policies`` (this process only)."""
    _EVICTION_POLICY_FACTORIES.setdefault(
        GHOST, lambda **config: GhostAdaptiveStrategy.from_config(config)
    )
