"""Plugs the ``mla_aware`` policy and ``--mla-aware-eviction`` into an installed SGLang.

Loaded through the ``sglang.srt.plugins`` entry point, so SGLang runs :func:`register`
in the launcher and again in every scheduler process, before arguments are parsed and
before the tree cache is built. Nothing in the installed ``sglang`` is edited:

* the policy goes into SGLang's eviction-policy registry and CLI choices;
* ``--mla-aware-eviction`` is added to ``ServerArgs.add_cli_args`` and, when given,
  turns into ``radix_eviction_policy = "mla_aware"`` in ``ServerArgs.from_cli_args``,
  a real field that travels to the scheduler with the rest of the server args;
* in the scheduler, the tree-cache factory is wrapped to (a) describe the served model
  to the policy (its config, TP size, page size, KV dtype), (b) keep stock LRU for a
  non-MLA model when the policy came from the flag rather than an explicit
  ``--radix-eviction-policy mla_aware``, (c) select the Python tree core of
  ``UnifiedRadixCache``, since the compiled one knows only the built-in policies, and
  (d) say in the log whether victims will be trimmed to the shortfall
  (:mod:`mla_victim_trim`, whose two tree hooks :func:`register` installs as well, as it
  does the three walk hooks of :mod:`mla_leaf_index` and the insert and close hooks of
  :mod:`mla_sessions`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from sglang.srt.mem_cache import mla_leaf_index, mla_sessions, mla_victim_trim
from sglang.srt.mem_cache.mla_aware_policy import (
    POLICY_NAME,
    create_mla_aware_strategy,
    mla_aware_policy_config,
)
from sglang.srt.mem_cache.mla_cost_model import LATENT_KINDS, KVCostModel, ModelConfigError

logger = logging.getLogger(__name__)

FLAG = "--mla-aware-eviction"


def register() -> None:
    """Entry point: register the policy and install the hooks (idempotent).

    Raises RuntimeError on an SGLang release this package does not support.
    """
    from sglang.srt.mem_cache.mla_version_check import check_sglang_version

    check_sglang_version()
    from sglang.srt.arg_groups.choices import (
        RADIX_EVICTION_POLICY_CHOICES,
        add_radix_eviction_policy_choices,
    )
    from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _EVICTION_POLICY_FACTORIES[POLICY_NAME] = create_mla_aware_strategy
    if POLICY_NAME not in RADIX_EVICTION_POLICY_CHOICES:
        add_radix_eviction_policy_choices([POLICY_NAME])
    hooks = {
        "sglang.srt.server_args.ServerArgs.add_cli_args": (add_flag, HookType.AFTER),
        "sglang.srt.server_args.ServerArgs.from_cli_args": (apply_flag, HookType.AROUND),
        "sglang.srt.mem_cache.registry.create_tree_cache": (
            prepare_tree_cache,
            HookType.AROUND,
        ),
    }
    for target, (hook, kind) in hooks.items():
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, kind)
    register_tree_hooks()


def register_tree_hooks() -> None:
    """Register the tree's hooks only (idempotent): victim trimming, the leaf index and
    the session tags and closes.

    What a caller that builds trees itself, without a server (a trace replay), needs for
    them to evict as a server's do; ``HookRegistry.apply_hooks()`` installs them.
    """
    mla_victim_trim.register_hooks()
    mla_leaf_index.register_hooks()
    mla_sessions.register_hooks()


def add_flag(_result: Any, parser: Any) -> None:
    """AFTER ``ServerArgs.add_cli_args``: add ``--mla-aware-eviction``."""
    parser.add_argument(
        FLAG,
        action="store_true",
        help="Evict prefix-cache nodes by what they cost to restore (prefill work, "
        "cheap host reload under HiCache), how likely they are reused and the "
        "bytes they hold. Same as --radix-eviction-policy mla_aware for MLA/DSA models "
        "(DeepSeek V2/V3/R1/V3.2); other models keep the stock policy.",
    )


def apply_flag(original: Callable, cls: type, args: Any) -> Any:
    """AROUND ``ServerArgs.from_cli_args``: the flag selects the policy field."""
    if getattr(args, "mla_aware_eviction", False):
        policy = getattr(args, "radix_eviction_policy", "lru")
        if getattr(args, "_radix_eviction_policy_explicitly_set", False) and policy != POLICY_NAME:
            raise ValueError(
                f"{FLAG} conflicts with --radix-eviction-policy {policy}; drop one of them."
            )
        args.radix_eviction_policy = POLICY_NAME
    return original(cls, args)


def prepare_tree_cache(original: Callable, ctx: Any) -> Any:
    """AROUND ``create_tree_cache``: describe the model to the policy, pick the tree core;
    log whether the tree will trim victims."""
    params = ctx.params
    if params.eviction_policy.lower() == POLICY_NAME and not params.disable:
        resolve_policy_params(
            params,
            hf_config=ctx.model_config.hf_config.to_dict(),
            tp_size=ctx.tp_size,
            kv_cache_dtype=str(getattr(ctx.server_args, "kv_cache_dtype", "auto")),
            explicit=_policy_explicitly_set(),
            host_copies=_host_copies(ctx),
        )
    cache = original(ctx)
    strategy = getattr(getattr(cache, "tree_core", None), "eviction_strategy", None)
    if getattr(strategy, "trim_victims", False):
        if mla_victim_trim.supports(cache):
            logger.info("mla_aware eviction: an eviction frees only what it is asked for.")
        else:
            logger.info(
                "mla_aware eviction: whole victims are evicted (trimming needs the unified "
                "tree with the Full component alone and no HiCache)."
            )
    return cache


def resolve_policy_params(
    params: Any,
    *,
    hf_config: dict,
    tp_size: int,
    kv_cache_dtype: str,
    explicit: bool,
    host_copies: bool = True,
) -> None:
    """Fill the policy config of ``params`` (a ``CacheInitParams``) for the served model.

    Keys the user set in ``--radix-eviction-policy-config`` win. For a model whose
    attention is not MLA/DSA the flag alone keeps LRU (``explicit`` False). Without host
    copies in the tree (``host_copies`` False) the policy does not look for them.
    """
    try:
        kind = KVCostModel.from_config(hf_config).attention
    except ModelConfigError as e:
        if explicit:
            raise
        logger.info("%s: model not understood (%s); keeping the stock LRU policy.", FLAG, e)
        params.eviction_policy, params.eviction_policy_config = "lru", None
        return
    if kind not in LATENT_KINDS and not explicit:
        logger.info(
            "%s: %s attention is not latent-compressed; keeping the stock LRU policy "
            "(use --radix-eviction-policy mla_aware to force it).",
            FLAG,
            kind.value.upper(),
        )
        params.eviction_policy, params.eviction_policy_config = "lru", None
        return
    params.eviction_policy_config = mla_aware_policy_config(
        params.eviction_policy_config,
        hf_config=hf_config,
        tp_size=tp_size,
        page_size=params.page_size,
        kv_cache_dtype=kv_cache_dtype,
        host_copies=host_copies,
    )
    if params.tree_core_backend != "python":
        logger.info(
            "mla_aware eviction: using the Python tree core of UnifiedRadixCache "
            "(the compiled tree core supports only the built-in policies)."
        )
        params.tree_core_backend = "python"


def _host_copies(ctx: Any) -> bool:
    """Whether the tree will keep host copies: when ``create_tree_cache`` attaches HiCache."""
    from sglang.srt.runtime_context import get_disagg

    return bool(
        ctx.enable_hierarchical_cache
        or get_disagg().disaggregation_decode_retraction_backup == "host_pool"
    )


def _policy_explicitly_set() -> bool:
    from sglang.srt.runtime_context import get_memory

    return bool(getattr(get_memory(), "_radix_eviction_policy_explicitly_set", False))
