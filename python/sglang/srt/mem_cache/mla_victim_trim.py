"""Free only what an eviction asks for: trim the walk's last victim instead of dropping it.

SGLang asks its radix tree for the shortfall of an allocation, and the tree frees whole
leaves until that much is free: the last victim usually frees more than was asked for
(about twice the shortfall on the shipped Mooncake trace, docs/advanced_features/
mla_aware_eviction.md). Where trimming is on and freeing the last victim whole would
leave more than ``MIN_SURPLUS_SHARE`` of the pool free beyond the request, the victim is
split first (on a page boundary) and only the tail still missing is evicted; the head
stays cached with the victim's age, hits and creation time, and a strategy with an
``on_split(upper, lower)`` method is told, so it can carry the victim's state over to the
head. A smaller surplus is left free: the next allocations take it, while an eviction that
frees exactly its request leaves none, so the next allocation needs another eviction
(another heap build over every evictable leaf).

Trimming is on for a cache whose eviction strategy has a true ``trim_victims`` attribute
(``mla_aware`` by default) and whose tree :func:`supports` it: SGLang's
``UnifiedRadixCache`` on its Python tree core, with the Full component alone (MHA, GQA,
MQA, MLA and DSA models), no host memory and no session-partitioned eviction. HiCache
(victims are demoted to host, not dropped) and hybrid SWA/Mamba trees keep whole-node
eviction. How many tokens an eviction is asked to free never changes, only how many it
frees: the walk stops where it stopped before, with less freed.

The tree calls two functions: :func:`eviction` around ``UnifiedRadixCache._evict`` (it
notes the Full component's request for the walk) and :func:`trim_victim` after each step
of ``UnifiedTreeCore.evict_device_next_node`` (it trims the victim the step picked,
before the cache evicts it). The plugin wraps both methods through SGLang's
``HookRegistry`` (:func:`register_hooks`); the upstream patch calls them in place.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

_REQUEST = "_mla_trim_request"  # tree-core attribute: (Full request, least surplus trimmed)
MIN_SURPLUS_SHARE = 0.01  # of the pool: a victim is trimmed only to save more than this


def supports(cache: Any) -> bool:
    """Whether victims of ``cache`` can be trimmed (see the module docstring)."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return (
        isinstance(cache, UnifiedRadixCache)
        and isinstance(getattr(cache, "tree_core", None), UnifiedTreeCore)
        and tuple(cache.tree_components) == (ComponentType.FULL,)
        and getattr(cache, "cache_controller", None) is None
        and not getattr(cache, "enable_session_radix_cache", False)
    )


def trims(cache: Any) -> bool:
    """Whether ``cache`` trims victims: its strategy asks for it and the tree supports it."""
    core = getattr(cache, "tree_core", None)
    strategy = getattr(core, "eviction_strategy", None)
    return bool(getattr(strategy, "trim_victims", False)) and supports(cache)


@contextlib.contextmanager
def eviction(cache: Any, num_tokens: int) -> Iterator[None]:
    """Around one eviction of ``cache`` asked to free ``num_tokens`` Full tokens.

    The Full walk's own quota cannot stand in for the request: an allocation-driven walk
    runs to an availability target with its quota raised to everything evictable.
    """
    if not trims(cache):
        yield
        return
    core = cache.tree_core
    setattr(core, _REQUEST, (num_tokens, MIN_SURPLUS_SHARE * cache.token_to_kv_pool_allocator.size))
    try:
        yield
    finally:
        setattr(core, _REQUEST, None)


def trim_victim(core: Any, component_type: Any, tracker: dict, result: Any) -> None:
    """After a step of ``core``'s eviction walk: trim the victim it picked (``result``) to
    what the walk still misses (its request less ``tracker``'s count), rounded up to a page,
    where that saves at least ``MIN_SURPLUS_SHARE`` of the pool.

    Outside :func:`eviction` on a trimming cache, nothing. A walk already past its request
    (an availability target the allocator has not yet seen met) takes whole victims.
    """
    walk = getattr(core, _REQUEST, None)
    if walk is None or result.node_id is None:
        return
    request, least_surplus = walk
    missing = request - tracker.get(component_type, 0)
    if missing > 0:
        action = trim(core, core.node_by_id(result.node_id), missing, least_surplus)
        if action is not None:
            result.cache_actions.append(action)


def trim(core: Any, victim: Any, missing: int, least_surplus: float = 1) -> Any:
    """Split ``victim`` so that it keeps only its last ``missing`` tokens (page-rounded);
    the new head above it keeps the victim's age. No-op where that would keep fewer than
    ``least_surplus`` tokens (none where the victim is no longer than ``missing``).

    Returns the split's cache action (``None`` on a tree without host memory).
    """
    page = core.page_size
    keep = len(victim.key) - -(-missing // page) * page
    if keep <= 0 or keep < least_surplus:
        return None
    last_access_time = victim.last_access_time
    head, action = core._split_node(victim.key, victim, keep)
    head.last_access_time = last_access_time
    on_split = getattr(core.eviction_strategy, "on_split", None)
    if on_split is not None:
        on_split(head, victim)
    return action


def register_hooks() -> None:
    """Wrap both tree methods through SGLang's ``HookRegistry`` (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in HOOKS.items():
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType.AROUND)


def _around_evict(original: Callable, cache: Any, params: Any, *args: Any, **kwargs: Any):
    with eviction(cache, params.num_tokens):
        return original(cache, params, *args, **kwargs)


def _around_next_node(
    original: Callable, core: Any, component_type: Any, tracker: dict, *args: Any
):
    result = original(core, component_type, tracker, *args)
    trim_victim(core, component_type, tracker, result)
    return result


# SGLang method -> the AROUND hook the plugin wraps it with.
HOOKS = {
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._evict": _around_evict,
    "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore."
    "evict_device_next_node": _around_next_node,
}
