"""What one GPU rank can cache for a model, and what MLA's latent saves, per rank.

Run as ``python -m sglang.srt.mem_cache.latent_cache_analyzer --model deepseek-v3
--gpu-memory 80GB --weights 40GB --tp 8``; ``--model`` is a preset or a config.json
path (or its directory), ``--weights`` what one rank holds. Per attention-TP rank, the
report gives the KV pool, the bytes per cached token, the cacheable tokens, and the
un-absorbed MHA-equivalent K/V bytes per token with their ratio. The latent is
replicated on every rank while MHA-equivalent K/V would be sharded by heads, so the
per-rank ratio is the TP 1 ratio over the TP size. The pool counts tokens and SGLang
evicts exactly an allocation's shortfall: evicting fewer tokens because MLA tokens are
small would fail the allocation. Bad input prints one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import numbers
import re
import sys
from dataclasses import asdict, dataclass
from decimal import Decimal
from typing import Any, NoReturn, Optional, Sequence

from sglang.srt.mem_cache.mla_cost_model import LATENT_KINDS, ConfigSource, KVCostModel

_PROG = "latent_cache_analyzer"
_SI = {f"{p}b": 1000**i for i, p in enumerate("kmgt", start=1)}
_IEC = {f"{p}ib": 1024**i for i, p in enumerate("kmgt", start=1)}
_SIZE_UNITS = {"": 1, "b": 1, **_SI, **_IEC}
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in a size such as ``"80GB"``, ``"40GiB"``, ``"1.5TB"`` or ``"4096"``.

    A bare number is bytes; SI units are powers of 1000, IEC units powers of 1024, both
    case-insensitive; fractions of a byte are dropped. Raises ``ValueError`` naming the
    value for anything else (negative, NaN, infinite, unknown unit, empty).
    """
    match = _SIZE_RE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if unit not in _SIZE_UNITS:
        raise ValueError(
            f"invalid size {text!r}: expected a number >= 0 with an optional unit B, "
            "KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    return int(Decimal(match.group(1)) * _SIZE_UNITS[unit])


def kv_pool_bytes(
    gpu_memory: int, weights: int, mem_fraction_static: float, reserved: int = 0
) -> int:
    """One rank's KV pool in bytes, as SGLang's ``_profile_available_bytes`` sizes it.

    ``gpu_memory * mem_fraction_static - weights - reserved``. Raises ``ValueError``
    for a negative size, a fraction outside (0, 1] (or NaN), or no room left.
    """
    if min(gpu_memory, weights, reserved) < 0:
        sizes = f"gpu_memory {gpu_memory}, weights {weights}, reserved {reserved}"
        raise ValueError(f"sizes must be >= 0 bytes, got {sizes}")
    f = mem_fraction_static
    if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 < f <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {f!r}")
    static = int(gpu_memory * f)
    if static - weights - reserved <= 0:
        raise ValueError(
            f"no room for a KV cache: gpu_memory {gpu_memory:,} B x "
            f"mem_fraction_static {f:g} = {static:,} B does not exceed weights "
            f"{weights:,} B + reserved {reserved:,} B"
        )
    return static - weights - reserved


@dataclass(frozen=True)
class LatentCacheReport:
    """Figures for one model on one setup; bytes and tokens are per TP rank."""

    model: str
    attention: str
    num_layers: int
    tp_size: int
    page_size: int
    kv_cache_dtype: str
    kv_pool_bytes: int
    bytes_per_token: int
    cacheable_tokens: int
    mha_equivalent_bytes_per_token: int
    mha_equivalent_tokens: int
    compression_vs_mha: float
    compression_vs_mha_tp1: float
    latent_replicated: bool


def analyze(model: ConfigSource, pool_bytes: int, **setup: Any) -> LatentCacheReport:
    """Report for a pool of ``pool_bytes`` per rank; setup, errors: from_config."""
    cm = KVCostModel.from_config(model, **setup)
    tp1 = KVCostModel.from_config(model, **{**setup, "tp_size": 1})
    mha, page = cm.mha_equivalent_bytes_per_token, cm.page_size
    return LatentCacheReport(
        model=cm.name,
        attention=cm.attention.value,
        num_layers=cm.num_layers,
        tp_size=cm.tp_size,
        page_size=page,
        kv_cache_dtype=setup.get("kv_cache_dtype", "auto"),
        kv_pool_bytes=pool_bytes,
        bytes_per_token=cm.bytes_per_token,
        cacheable_tokens=cm.tokens_for_bytes(pool_bytes),
        mha_equivalent_bytes_per_token=mha,
        mha_equivalent_tokens=pool_bytes // (mha * page) * page,
        compression_vs_mha=cm.compression_vs_mha,
        compression_vs_mha_tp1=tp1.compression_vs_mha,
        latent_replicated=cm.attention in LATENT_KINDS,
    )


def format_report(r: LatentCacheReport) -> str:
    """The human-readable report the CLI prints."""
    ratio = f"{r.compression_vs_mha:.2f}x"
    ratio_tp1 = f"{r.compression_vs_mha_tp1:.2f}x"
    mha = f"{r.mha_equivalent_bytes_per_token:,} B/token per rank"
    rows = {
        "model": f"{r.model} ({r.attention.upper()} attention, {r.num_layers} layers)",
        "setup": f"TP {r.tp_size}, page {r.page_size}, KV dtype {r.kv_cache_dtype}",
        "KV pool per rank": f"{r.kv_pool_bytes:,} B",
        "bytes/token per rank": f"{r.bytes_per_token:,} B",
        "cacheable tokens per rank": f"{r.cacheable_tokens:,}",
        "MHA-equivalent K/V": f"{mha} ({r.mha_equivalent_tokens:,} tokens would fit)",
        "ratio per rank": f"{ratio} (TP 1: {ratio_tp1})",
    }
    note = (
        f"note: the {r.attention.upper()} latent is replicated on every TP rank while "
        "MHA-equivalent K/V would be sharded by heads, so the per-rank ratio shrinks "
        f"as TP grows ({ratio_tp1} at TP 1, {ratio} at TP {r.tp_size})."
    )
    if not r.latent_replicated:
        note = "note: no latent; K/V is sharded by KV heads (replicated if TP > heads)."
    return "\n".join([*(f"{k:<27}{v}" for k, v in rows.items()), note])


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like the other errors
        self.exit(2, f"{_PROG}: error: {message}\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit status (2 for bad input)."""
    parser = _Parser(
        prog=f"python -m sglang.srt.mem_cache.{_PROG}",
        description="Per-rank KV-cache capacity of a model and what MLA's latent saves",
    )
    add = parser.add_argument
    add("--model", required=True, help="preset (e.g. deepseek-v3) or config.json path")
    add("--gpu-memory", required=True, help="one GPU, e.g. 80GB (10^9) or 80GiB (2^30)")
    add("--weights", required=True, help="model weights held by one rank, e.g. 40GB")
    add("--tp", dest="tp_size", type=int, default=1, help="attention TP size")
    add("--kv-cache-dtype", default="auto", help="auto (model dtype), bf16, fp8...")
    add("--page-size", type=int, default=1)
    add("--mem-fraction-static", type=float, default=0.9)
    add("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    setup = {k: vars(args)[k] for k in ("tp_size", "page_size", "kv_cache_dtype")}
    try:
        gpu, weights = parse_size(args.gpu_memory), parse_size(args.weights)
        pool = kv_pool_bytes(gpu, weights, args.mem_fraction_static)
        report = analyze(args.model, pool, **setup)
    except ValueError as e:  # ModelConfigError included
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(report), indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
