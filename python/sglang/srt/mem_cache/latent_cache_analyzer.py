"""What one GPU rank can cache for a model, and what MLA's latent saves, per rank.

Run as::

    python -m sglang.srt.mem_cache.latent_cache_analyzer \\
        --model deepseek-v3 --gpu-memory 80GB --weights 40GB --tp 8

``--model`` is a preset name (see ``mla_cost_model.PRESETS``) or a ``config.json``
path (or a directory holding one); ``--weights`` is what one rank holds. The report
is per attention-TP rank, which is what sizes SGLang's KV pool:

* bytes per cached token on the rank (the latent row for MLA/DSA models);
* cacheable tokens: the rank's KV pool (``gpu_memory * mem_fraction_static -
  weights``) over those bytes, in whole pages;
* the un-absorbed MHA-equivalent K/V bytes per token on the rank, and the ratio.

MLA's latent is replicated on every TP rank, whereas MHA-equivalent K/V would be
sharded by heads, so the per-rank ratio is the TP=1 ratio divided by the TP size;
the report gives both. Bad input prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from sglang.srt.mem_cache.mla_cost_model import (
    LATENT_KINDS,
    ConfigSource,
    KVCostModel,
    ModelConfigError,
    whole_page_tokens,
)
from sglang.srt.mem_cache.mla_eviction_budget import MLAEvictionBudget, parse_size


@dataclass(frozen=True)
class LatentCacheReport:
    """Figures for one model on one GPU setup; bytes and tokens are per TP rank."""

    model: str
    attention: str
    num_layers: int
    tp_size: int
    page_size: int
    kv_cache_dtype: str
    gpu_memory_bytes: int
    weights_bytes: int
    mem_fraction_static: float
    kv_pool_bytes: int
    bytes_per_token: int
    cacheable_tokens: int
    mha_equivalent_bytes_per_token: int
    mha_equivalent_tokens: int
    compression_vs_mha: float
    compression_vs_mha_tp1: float
    latent_replicated: bool


class LatentCacheAnalyzer:
    """Builds a :class:`LatentCacheReport` from a model config and a GPU setup."""

    def __init__(self, budget: MLAEvictionBudget, *, tp1_cost_model: KVCostModel,
                 kv_cache_dtype: str = "auto"):
        self.budget = budget
        self.tp1_cost_model = tp1_cost_model
        self.kv_cache_dtype = kv_cache_dtype

    @classmethod
    def from_setup(
        cls,
        model: ConfigSource,
        *,
        gpu_memory_bytes: int,
        weights_bytes: int,
        tp_size: int = 1,
        page_size: int = 1,
        kv_cache_dtype: str = "auto",
        mem_fraction_static: float = 0.9,
    ) -> "LatentCacheAnalyzer":
        """Raises ``ModelConfigError`` for a bad model or setup, ``ValueError`` for a bad budget."""
        setup = dict(kv_cache_dtype=kv_cache_dtype, page_size=page_size)
        cost_model = KVCostModel.from_config(model, tp_size=tp_size, **setup)
        budget = MLAEvictionBudget(
            cost_model,
            gpu_memory_bytes=gpu_memory_bytes,
            weights_bytes=weights_bytes,
            mem_fraction_static=mem_fraction_static,
        )
        tp1 = KVCostModel.from_config(model, tp_size=1, **setup)
        return cls(budget, tp1_cost_model=tp1, kv_cache_dtype=kv_cache_dtype)

    def report(self) -> LatentCacheReport:
        cm, budget = self.budget.cost_model, self.budget
        mha_bytes = cm.mha_equivalent_bytes_per_token
        return LatentCacheReport(
            model=cm.name,
            attention=cm.attention.value,
            num_layers=cm.num_layers,
            tp_size=cm.tp_size,
            page_size=cm.page_size,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_bytes=budget.gpu_memory_bytes,
            weights_bytes=budget.weights_bytes,
            mem_fraction_static=budget.mem_fraction_static,
            kv_pool_bytes=budget.capacity_bytes,
            bytes_per_token=_exact_int(cm.bytes_per_token),
            cacheable_tokens=budget.capacity_tokens,
            mha_equivalent_bytes_per_token=_exact_int(mha_bytes),
            mha_equivalent_tokens=whole_page_tokens(budget.capacity_bytes, mha_bytes, cm.page_size),
            compression_vs_mha=cm.compression_vs_mha,
            compression_vs_mha_tp1=self.tp1_cost_model.compression_vs_mha,
            latent_replicated=cm.attention in LATENT_KINDS,
        )


def format_report(r: LatentCacheReport) -> str:
    """The human-readable report printed by the CLI."""
    rows = [
        ("model", f"{r.model} ({r.attention.upper()} attention, {r.num_layers} layers)"),
        ("setup", f"TP {r.tp_size}, page size {r.page_size}, KV cache dtype {r.kv_cache_dtype}"),
        ("GPU memory", f"{r.gpu_memory_bytes:,} B x mem_fraction_static "
                       f"{r.mem_fraction_static:g}"),
        ("weights per rank", f"{r.weights_bytes:,} B"),
        ("KV pool per rank", f"{r.kv_pool_bytes:,} B"),
        ("bytes/token per rank", f"{r.bytes_per_token:,} B"),
        ("cacheable tokens per rank", f"{r.cacheable_tokens:,}"),
        ("MHA-equivalent K/V", f"{r.mha_equivalent_bytes_per_token:,} B/token per rank "
                               f"({r.mha_equivalent_tokens:,} tokens would fit)"),
        ("ratio per rank", f"{r.compression_vs_mha:.2f}x (TP 1: {r.compression_vs_mha_tp1:.2f}x)"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    if r.latent_replicated:
        lines.append(
            f"note: the {r.attention.upper()} latent is replicated on every TP rank, while "
            "MHA-equivalent K/V would be sharded by heads, so the per-rank ratio shrinks "
            f"as TP grows ({r.compression_vs_mha_tp1:.2f}x at TP 1, "
            f"{r.compression_vs_mha:.2f}x at TP {r.tp_size})."
        )
    else:
        lines.append(
            "note: no latent compression; K/V is sharded by KV heads across TP ranks "
            "(replicated when there are fewer KV heads than ranks)."
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang.srt.mem_cache.latent_cache_analyzer",
        description="Per-rank KV-cache capacity of a model and what MLA's latent saves.",
    )
    parser.add_argument("--model", required=True,
                        help="preset name (e.g. deepseek-v3, llama-3-70b) or config.json path")
    parser.add_argument("--gpu-memory", required=True,
                        help="memory of one GPU, e.g. 80GB (10^9 B) or 80GiB (2^30 B)")
    parser.add_argument("--weights", required=True,
                        help="model weights held by one rank, e.g. 40GB")
    parser.add_argument("--tp", type=int, default=1, help="attention tensor-parallel size")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (the model's dtype), bf16, fp16, fp8_e4m3, ...")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float, default=0.9)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit status (2 for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        analyzer = LatentCacheAnalyzer.from_setup(
            args.model,
            gpu_memory_bytes=parse_size(args.gpu_memory),
            weights_bytes=parse_size(args.weights),
            tp_size=args.tp,
            page_size=args.page_size,
            kv_cache_dtype=args.kv_cache_dtype,
            mem_fraction_static=args.mem_fraction_static,
        )
        report = analyzer.report()
    except (ModelConfigError, ValueError) as e:
        print(f"latent_cache_analyzer: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(format_report(report))
    return 0


def _exact_int(value: float) -> int:
    """Byte counts are whole numbers; the cost model keeps them as floats."""
    return int(round(value))


if __name__ == "__main__":
    sys.exit(main())
