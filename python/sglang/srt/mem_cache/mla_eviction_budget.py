"""How many tokens one GPU rank can cache, and how many to evict for an allocation.

SGLang sizes the KV pool once at startup (``pool_configurator.py``)::

    kv_pool_bytes = gpu_memory * mem_fraction_static - weights - reserved
    max_total_num_tokens = kv_pool_bytes // cell_size   (rounded down to pages)

where ``cell_size`` is already the latent row for MLA models: a token costs the same
bytes in the pool whatever its attention kind, so the pool holds *tokens*, and an
allocation of ``n`` tokens needs ``n`` free token slots. When the pool is short,
``allocator/base.py::evict_to_free_tokens`` evicts exactly the shortfall::

    tokens_to_evict = max(0, requested - available)

Scaling that down by MLA's compression ratio ("a latent token is 8x smaller, so evict
8x fewer") leaves the allocation short: eviction frees token slots, not MHA bytes.
:meth:`MLAEvictionBudget.tokens_to_evict` therefore returns the shortfall itself, and
the eviction policy only chooses *which* nodes make it up.

Sizes on the command line (``--gpu-memory 80GB --weights 40GB``) go through
:func:`parse_size`: SI units are powers of 1000 (``GB`` = 10**9 B), IEC units powers
of 1024 (``GiB`` = 2**30 B).
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from sglang.srt.mem_cache.mla_cost_model import KVCostModel

_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in a size such as ``"80GB"``, ``"40GiB"``, ``"512MB"``, ``"1.5TB"`` or ``"4096"``.

    A bare number is bytes. Units are case-insensitive; fractions of a byte are dropped.
    Raises ``ValueError`` naming the bad value for anything else (negative numbers,
    unknown units, empty text).
    """
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in _SIZE_UNITS):
        raise ValueError(
            f"invalid size {text!r}: expected a non-negative number with an optional "
            "unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
            "(powers of 1024), e.g. 80GB or 40GiB"
        )
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"invalid size {text!r}: not a number") from None
    return int(number * _SIZE_UNITS[unit or "b"])


@dataclass(frozen=True)
class MLAEvictionBudget:
    """KV-pool capacity of one GPU rank and the eviction amount for an allocation.

    ``weights_bytes``, ``activation_bytes`` and ``reserved_bytes`` are per rank (what
    that rank holds besides its KV pool). The pool gets what
    ``mem_fraction_static`` leaves of ``gpu_memory_bytes`` after them, as SGLang's
    ``_profile_available_bytes`` computes it. Construction raises ``ValueError`` when
    an input is negative, the fraction is outside (0, 1], or nothing is left for
    the pool.
    """

    cost_model: KVCostModel
    gpu_memory_bytes: int
    weights_bytes: int
    mem_fraction_static: float = 0.9
    activation_bytes: int = 0
    reserved_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("gpu_memory_bytes", "weights_bytes", "activation_bytes", "reserved_bytes"):
            _require_non_negative(getattr(self, name), name)
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static!r}"
            )
        if self.capacity_bytes <= 0:
            raise ValueError(
                f"no room for a KV cache: gpu_memory {self.gpu_memory_bytes:,} B x "
                f"mem_fraction_static {self.mem_fraction_static} = {self.static_bytes:,} B "
                f"does not exceed weights {self.weights_bytes:,} B + activations "
                f"{self.activation_bytes:,} B + reserved {self.reserved_bytes:,} B"
            )

    @property
    def static_bytes(self) -> int:
        """The share of GPU memory SGLang may hold statically (weights plus KV pool)."""
        return int(self.gpu_memory_bytes * self.mem_fraction_static)

    @property
    def capacity_bytes(self) -> int:
        """Bytes of this rank's KV pool (may be <= 0 only while validating)."""
        return (
            self.static_bytes
            - self.weights_bytes
            - self.activation_bytes
            - self.reserved_bytes
        )

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds: whole pages of ``cost_model.bytes_per_token`` each."""
        return self.cost_model.tokens_for_bytes(self.capacity_bytes)

    def tokens_to_evict(self, requested_tokens: int, available_tokens: int) -> int:
        """Tokens the tree must evict so that ``requested_tokens`` can be allocated.

        Exactly the shortfall ``max(0, requested_tokens - available_tokens)``: 0 when
        the pool already has room (including ``requested_tokens == 0``), and never
        less than the shortfall, whatever the attention kind. The cache's own evict may
        free more (it drops whole leaves, overshooting by at most one node). Raises
        ``ValueError`` if either count is negative.
        """
        _require_non_negative(requested_tokens, "requested_tokens")
        _require_non_negative(available_tokens, "available_tokens")
        return max(0, requested_tokens - available_tokens)


def _require_non_negative(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer number of bytes or tokens, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
