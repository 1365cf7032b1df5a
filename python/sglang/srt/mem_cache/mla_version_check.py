"""Refuse to run against an SGLang release this package was not built for.

The plugin reaches into SGLang internals that change between releases (the
``_EVICTION_POLICY_FACTORIES`` registry, ``create_tree_cache``, the argument
resolution of ``ServerArgs``, the tree-core selection of ``UnifiedRadixCache``), so
it supports exactly the releases in :data:`SUPPORTED_SGLANG`.
:func:`check_sglang_version` runs first thing in the plugin's ``register()``, which
SGLang calls in the launcher and in every scheduler process: an unsupported
release fails at startup with an install hint instead of misbehaving later.

Not part of the upstream patch series (``benchmark/mla_eviction/upstream_patch.py``):
code merged into SGLang needs no version guard.
"""

from __future__ import annotations

from importlib import metadata
from typing import Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_SGLANG = ">=0.5.23,<0.5.24"
_DISTRIBUTION = "sglang"


def installed_sglang_version() -> Optional[str]:
    """The version of the installed ``sglang`` distribution, or None if absent."""
    try:
        return metadata.version(_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def check_sglang_version(version: Optional[str] = None) -> str:
    """Return the installed SGLang version; raise RuntimeError if unsupported.

    ``version`` defaults to :func:`installed_sglang_version`. Post-releases and
    local builds (``0.5.23.post1``, ``0.5.23+cu129``) pass; pre-releases and
    development builds of 0.5.23 do not (PEP 440 orders them before it). A missing
    distribution, an unparsable version or one outside :data:`SUPPORTED_SGLANG`
    raises, naming the version found and the one to install.
    """
    if version is None:
        version = installed_sglang_version()
    try:
        supported = version is not None and Version(version) in SpecifierSet(
            SUPPORTED_SGLANG
        )
    except InvalidVersion:
        supported = False
    if not supported:
        found = "no sglang distribution" if version is None else version
        raise RuntimeError(
            f"sglang-mla-eviction supports sglang {SUPPORTED_SGLANG}; found {found}. "
            "Install sglang==0.5.23 (pip install 'sglang==0.5.23'), or a release of "
            "sglang-mla-eviction built for your SGLang, or disable this plugin with "
            "SGLANG_PLUGINS set to the plugins you want."
        )
    return version
