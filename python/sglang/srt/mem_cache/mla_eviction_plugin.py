"""Plugs ``mla_aware`` and ``--mla-aware-eviction`` into an installed SGLang 0.5.23.

SGLang runs :func:`register` through the ``sglang.srt.plugins`` entry point in the
launcher and in every scheduler process, before arguments are parsed. It uses SGLang's
extension points, and re-creates for this release the one the upstream series adds:

* the policy joins the eviction-policy registry and the CLI choices;
* ``--mla-aware-eviction`` joins the server's arguments (after
  ``ServerArgs.add_cli_args``). When it, or ``--radix-eviction-policy mla_aware``, is
  given, ``ServerArgs.from_cli_args`` checks the policy config before anything loads,
  then selects the policy and the ``mla_aware`` radix-cache backend;
* that backend builds SGLang's own cache (``default_radix_cache_factory``) with the
  served model's cost model in the policy config and, through
  ``component_registry_override``, :class:`EvictionCallbackFullComponent` as the Full
  component. It calls ``on_evict`` on the strategy with each device victim: the
  upstream series' extension point, the only one the policy needs. Custom components
  run on SGLang's Python tree core, which is what a Python strategy needs.

Without the flag nothing changes: the default cache on the Rust tree core, no wrapper.
The policy prices every attention kind (MHA, GQA, MQA, MLA, DSA); the log names the
served model's kind and bytes per token.
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from sglang.srt.mem_cache.mla_aware_policy import (
    POLICY_NAME,
    PolicyConfig,
    create_mla_aware_strategy,
)
from sglang.srt.mem_cache.mla_cost_model import KV_DTYPE_BYTES, Calibration, KVCostModel
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent

logger = logging.getLogger(__name__)

FLAG = "--mla-aware-eviction"
BACKEND = POLICY_NAME  # the radix-cache backend the flag selects
SUPPORTED_SGLANG = ">=0.5.23,<0.5.24"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs."
_registered = False


def register() -> None:
    """Entry point: register the policy, the backend and the flag (idempotent).

    Raises RuntimeError on an SGLang release this package does not support.
    """
    global _registered
    check_sglang_version()
    if _registered:
        return
    from sglang.srt.arg_groups.choices import (
        RADIX_EVICTION_POLICY_CHOICES,
        add_radix_eviction_policy_choices,
    )
    from sglang.srt.mem_cache.registry import register_radix_cache_backend
    from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # 0.5.23 has no public call that registers a policy; the dict is what
    # get_eviction_strategy reads.
    _EVICTION_POLICY_FACTORIES[POLICY_NAME] = create_mla_aware_strategy
    if POLICY_NAME not in RADIX_EVICTION_POLICY_CHOICES:
        add_radix_eviction_policy_choices([POLICY_NAME])
    register_radix_cache_backend(BACKEND, create_mla_aware_cache)
    HookRegistry.register(_SERVER_ARGS + "add_cli_args", add_flag, HookType.AFTER)
    HookRegistry.register(_SERVER_ARGS + "from_cli_args", apply_flag, HookType.AROUND)
    _registered = True


def check_sglang_version(version: str | None = None) -> str:
    """The installed SGLang's version; RuntimeError naming it if unsupported."""
    if version is None:
        try:
            version = metadata.version("sglang")
        except metadata.PackageNotFoundError:
            version = None
    try:
        ok = version is not None and Version(version) in SpecifierSet(SUPPORTED_SGLANG)
    except InvalidVersion:
        ok = False
    if not ok:
        raise RuntimeError(
            f"sglang-mla-eviction supports sglang {SUPPORTED_SGLANG}; found "
            f"{version or 'no sglang'}. Install sglang==0.5.23, or leave this plugin "
            "out with SGLANG_PLUGINS set to the plugins you want."
        )
    return version


def add_flag(_result: Any, parser: Any) -> None:
    """After ``ServerArgs.add_cli_args``: add ``--mla-aware-eviction``."""
    parser.add_argument(
        FLAG,
        action="store_true",
        help="Evict radix-cache leaves by what they cost to recompute per byte, how "
        "long they have been idle and whether they proved reusable (the mla_aware "
        "policy, on SGLang's Python tree core). Same as --radix-eviction-policy "
        "mla_aware; works for every attention kind, aimed at MLA/DSA models.",
    )


def apply_flag(original: Callable, cls: type, args: Any) -> Any:
    """Around ``ServerArgs.from_cli_args``: the flag selects the policy; with the
    policy, its config is checked (a ValueError names the key) and the backend set."""
    policy = getattr(args, "radix_eviction_policy", "lru")
    if getattr(args, "mla_aware_eviction", False):
        explicit = getattr(args, "_radix_eviction_policy_explicitly_set", False)
        if explicit and policy != POLICY_NAME:
            raise ValueError(
                f"{FLAG} conflicts with --radix-eviction-policy {policy}; drop one."
            )
        policy = args.radix_eviction_policy = POLICY_NAME
    if policy == POLICY_NAME:
        PolicyConfig.parse(getattr(args, "radix_eviction_policy_config", None))
        backend = getattr(args, "radix_cache_backend", None)
        if backend not in (None, BACKEND):
            raise ValueError(
                f"{POLICY_NAME} eviction runs on the {BACKEND!r} radix-cache backend; "
                f"drop --radix-cache-backend {backend}."
            )
        args.radix_cache_backend = BACKEND
    return original(cls, args)


def create_mla_aware_cache(ctx: Any) -> Any:
    """The ``mla_aware`` radix-cache backend: SGLang's default cache, with the served
    model's cost model for the policy and the eviction callback in the tree."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    params = ctx.params
    if params.eviction_policy.lower() == POLICY_NAME and not params.disable:
        config = PolicyConfig.parse(params.eviction_policy_config)
        cost_model = KVCostModel.from_config(
            ctx.model_config.hf_config.to_dict(),
            kv_cache_dtype=_kv_cache_dtype(ctx.server_args),
            tp_size=ctx.tp_size,
            page_size=params.page_size,
            calibration=config.calibration and Calibration.load(config.calibration),
        )
        logger.info(
            "mla_aware eviction: %s attention, %.0f B/token per rank, Python tree core",
            cost_model.attention.value.upper(),
            cost_model.bytes_per_token,
        )
        prepare_params(params, cost_model)
    return default_radix_cache_factory(ctx)


def prepare_params(params: Any, cost_model: KVCostModel, key_unit_tokens: int = 1):
    """Set ``params`` (a ``CacheInitParams``) up for a strategy that learns from
    ``on_evict``: ``cost_model`` (and ``key_unit_tokens``, tokens one key element
    stands for) joins the policy config, the callback component replaces Full."""
    params.eviction_policy_config = {
        **(params.eviction_policy_config or {}),
        "cost_model": cost_model,
        "key_unit_tokens": key_unit_tokens,
    }
    params.component_registry_override = {
        **(params.component_registry_override or {}),
        ComponentType.FULL: EvictionCallbackFullComponent,
    }


def _kv_cache_dtype(server_args: Any) -> str:
    dtype = str(getattr(server_args, "kv_cache_dtype", "auto")).lower()
    return dtype if dtype in KV_DTYPE_BYTES else "auto"


class EvictionCallbackFullComponent(FullComponent):
    """SGLang's Full component, telling the strategy of each device victim.

    The upstream series' extension point, for 0.5.23: the walk's next victim is passed
    to ``eviction_strategy.on_evict`` before it is evicted.
    """

    def _evict_device_next_node(self, *args: Any, **kwargs: Any) -> Any:
        node_id = super()._evict_device_next_node(*args, **kwargs)
        on_evict = getattr(self.tree_core.eviction_strategy, "on_evict", None)
        if node_id is not None and on_evict is not None:
            on_evict(self.tree_core.node_by_id(node_id))
        return node_id
