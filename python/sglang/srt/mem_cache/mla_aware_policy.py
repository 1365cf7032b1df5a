"""The ``mla_aware`` radix eviction policy: evict what is cheapest to lose.

A node's priority (lowest is evicted first) is the expected restore work its bytes
would save::

    value(node)    = restore_seconds(node) / bytes(node) * reuse(node)
    priority(node) = (-age(node) * factor(node) / value(node), last_access_time)

``restore_seconds`` comes from :class:`KVCostModel`: recompute positions
``[start, end)`` of the node (prefill work grows with depth), or reload them from host
memory when HiCache holds a copy (``node.backuped``), whichever is cheaper.
``reuse`` is ``(1 + hit_count) ** hit_exponent``. Dividing the node's age by its value
makes this a cost- and frequency-weighted LRU: a node twice as valuable may sit idle
twice as long. Ages are ratios of one clock, so the order does not depend on whether
the tree counts time in seconds (``RadixCache``) or in logical ticks
(``UnifiedRadixCache``).

``factor`` is 1 for a *proven* node and ``B >= 1`` for a *probationary* one
(:class:`AdaptiveProbation`): a node is proven once two different children have hung
under it (a shared prefix) or once it came back after being evicted. ``B`` is learnt
online from which kind of victim comes back, as ARC sizes its recency and frequency
lists: a probationary victim returning lowers it (toward cost-weighted LRU), a proven
one raises it (toward SLRU's strict protection).

The strategy only scores; the cache decides how much to free, so the number of tokens
evicted for an allocation is exactly what it is under LRU.
"""

from __future__ import annotations

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

POLICY_NAME = "mla_aware"

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
    "depth_aware": (bool, True),
    "host_aware": (bool, True),
    "probation": (bool, True),
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
        depth_aware: bool = True,
        host_aware: bool = True,
        probation: bool = True,
        key_unit_tokens: int = 1,
    ):
        self.cost_model = cost_model
        self.key_unit_tokens = key_unit_tokens
        self.hit_exponent = float(hit_exponent)
        self.depth_aware = depth_aware
        self.host_aware = host_aware
        self.probation = AdaptiveProbation() if probation else None
        self._readers: dict[type, tuple] = {}

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
        clock, is_backed = self._node_type_readers(node)
        value = self._value(node, is_backed)
        now = clock()
        age = now - node.last_access_time
        if self.probation is not None:
            age *= self.probation.factor_for(node, now)
        return (-age / value if value > 0 else float("-inf"), node.last_access_time)

    def value(self, node: Any) -> float:
        """Restore seconds per byte times ``(1 + hit_count) ** hit_exponent``."""
        return self._value(node, self._node_type_readers(node)[1])

    def _value(self, node: Any, is_backed) -> float:
        # The cost per byte changes only when a split shortens the node or its host
        # copy comes or goes; memoise it on the node against both (and this strategy).
        key_len = len(node.key)
        backed = self.host_aware and is_backed(node)
        memo = node.__dict__.get("_mla_density")
        if memo is None or memo[0] is not self or memo[1] != key_len or memo[2] != backed:
            memo = (self, key_len, backed, self._restore_seconds_per_byte(node, backed))
            node._mla_density = memo
        return memo[3] * (1 + node.hit_count) ** self.hit_exponent

    def restore_seconds_per_byte(self, node: Any) -> float:
        """Restore time of the node's tokens over the bytes they hold (page-rounded)."""
        backed = self.host_aware and self._node_type_readers(node)[1](node)
        return self._restore_seconds_per_byte(node, backed)

    def _restore_seconds_per_byte(self, node: Any, backed: bool) -> float:
        n = len(node.key) * self.key_unit_tokens
        if n == 0:
            return 0.0
        end = prefix_end(node) * self.key_unit_tokens if self.depth_aware else n
        seconds = self.cost_model.restore_seconds(end - n, end, backed_up=backed)
        return seconds / self.cost_model.bytes_for_tokens(n)

    def _node_type_readers(self, node: Any):
        """(clock, is-backed-up reader) for the node's tree type, looked up once per type."""
        readers = self._readers.get(type(node))
        if readers is None:
            readers = self._readers[type(node)] = (
                _clock_for(type(node)),
                _backed_reader(type(node)),
            )
        return readers


class AdaptiveProbation:
    """How much faster probationary nodes age than proven ones, learnt from ghost hits.

    A node is *proven* once two different children have been scored under it (a prefix
    that several continuations share) or once it came back after being evicted (seen
    twice, as ARC's frequency list); otherwise it is *probationary* and its age counts
    ``factor`` times. ``factor = exp(log_factor)`` starts at 1 (plain cost-weighted LRU)
    and stays within ``[1, MAX_FACTOR]``.

    Ghost hits: the first time a node is scored, its signature (start position, leading
    key elements, parent's ``creation_time``) is looked up among the nodes scored before.
    A match with a different ``creation_time`` is evicted content that came back (a
    split keeps ``creation_time``, so the upper half of a split is no match). A returning
    probationary victim means probation was too harsh: ``log_factor`` falls by ``STEP``;
    a returning proven victim means it was too lenient: it rises by ``STEP``. The steps of
    ghost hits seen at one reading of the tree's clock are applied together, as their
    net step, once the clock moves: a tree scores all its evictable leaves at one
    reading, in the order of a set of nodes (by address), and a net step does not depend
    on that order. Memory is bounded by ``MAX_GHOSTS`` signatures (oldest forgotten
    first).
    """

    STEP = 0.1
    MAX_FACTOR = 1000.0
    MAX_GHOSTS = 1 << 16

    def __init__(self):
        self.log_factor = 0.0
        self.factor = 1.0
        self.returns = [0, 0]  # victims that came back: (proven, probationary)
        self._pending = 0  # probationary minus proven returns not yet applied
        self._now = None
        self._ghosts: OrderedDict = OrderedDict()  # signature -> (creation_time, probationary)

    def factor_for(self, node: Any, now: float) -> float:
        """``factor`` if ``node`` is probationary, else 1; records what it learns.

        ``now`` is the tree's clock, read only to group scores into batches: ghost hits
        seen at one reading are applied together, as their net step, when it changes.
        """
        if now != self._now:
            self._now = now
            if self._pending:
                self._apply()
        seen = node.__dict__.get("_mla_probation")
        if seen is None or seen.owner is not self or seen.parent is not node.parent:
            seen = self._see(node, seen)
        return self.factor if seen.probationary else 1.0

    def _see(self, node: Any, seen: Optional["_Seen"]) -> "_Seen":
        """First score of ``node``, or first since a split put a new parent above it."""
        signature = ghost_signature(node)
        if seen is None or seen.owner is not self:
            victim = self._ghosts.pop(signature, None)
            came_back = victim is not None and victim[0] != node.creation_time
            if came_back:
                self.returns[victim[1]] += 1
                self._pending += 1 if victim[1] else -1
            seen = node._mla_probation = _Seen(self)
            seen.probationary = not came_back and node.__dict__.get("_mla_children", 0) < 2
        else:  # split: same content and children, new start and parent
            self._ghosts.pop(seen.signature, None)
        seen.parent, seen.signature = node.parent, signature
        self._remember(signature, node.creation_time, seen.probationary)
        self._count_child(node.parent)
        return seen

    def _count_child(self, parent: Any) -> None:
        """One more child scored under ``parent``; the second one proves it."""
        if parent is None:
            return
        children = parent._mla_children = parent.__dict__.get("_mla_children", 0) + 1
        seen = parent.__dict__.get("_mla_probation")
        if children == 2 and seen is not None and seen.owner is self and seen.probationary:
            seen.probationary = False
            self._remember(seen.signature, parent.creation_time, False)

    def _remember(self, signature: tuple, creation_time: float, probationary: bool) -> None:
        self._ghosts[signature] = (creation_time, probationary)
        if len(self._ghosts) > self.MAX_GHOSTS:
            self._ghosts.popitem(last=False)

    def _apply(self) -> None:
        step = -self.STEP * self._pending
        self._pending = 0
        self.log_factor = min(max(self.log_factor + step, 0.0), math.log(self.MAX_FACTOR))
        self.factor = math.exp(self.log_factor)


class _Seen:
    """What an :class:`AdaptiveProbation` knows of a node it has scored."""

    __slots__ = ("owner", "parent", "signature", "probationary")

    def __init__(self, owner: AdaptiveProbation):
        self.owner = owner


def ghost_signature(node: Any) -> tuple:
    """Where a node starts, what it starts with and under which parent: the same for
    content evicted and inserted again, different for other content."""
    ids = getattr(node.key, "token_ids", node.key)
    start = prefix_end(node) - len(node.key)
    return (start, tuple(ids[:4]), node.parent.creation_time)


def _backed_reader(node_type: type):
    """HiCache's ``backuped`` property where the tree has one, else a plain attribute."""
    if hasattr(node_type, "backuped"):
        return lambda node: node.backuped
    return lambda node: node.__dict__.get("backuped", False)


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
) -> dict[str, Any]:
    """The ``mla_aware`` policy config for a served model, under the user's keys.

    The policy prices a node from the model's KV layout and prefill cost, so it is given
    the Hugging Face config, the TP size, the page size and the KV dtype. Keys set in
    ``--radix-eviction-policy-config`` win. A KV dtype the cost model does not price is
    left to the model's own dtype ("auto").
    """
    priced = ("fp8_e4m3", "fp8_e5m2", "bf16", "bfloat16")
    return {
        "model": hf_config,
        "tp_size": tp_size,
        "page_size": page_size,
        "kv_cache_dtype": kv_cache_dtype if kv_cache_dtype in priced else "auto",
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
