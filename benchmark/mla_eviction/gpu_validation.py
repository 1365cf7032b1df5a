#!/usr/bin/env python3
"""Check MLA latent caching on one attention layer and measure what a lost token costs.

One DeepSeek-style MLA attention layer with seeded random weights at real dimensions
(``--preset v3``, ``v2-lite``; ``tiny`` for CPU tests). PyTorch only: nothing here
imports SGLang.

1. Correctness. The cache holds one latent row per token, ``[c_kv | k_rope]``
   (``kv_lora_rank + qk_rope_head_dim`` values, RoPE already applied to ``k_rope``).
   Attention read from that cache with absorbed projections (``W_UK`` folded into the
   query, ``W_UV`` applied to the latent output) must equal attention over explicitly
   expanded K/V computed from scratch, for a prefill chunk on top of a cached prefix
   and for one decode token. Errors are ``max |got - ref|`` and that over
   ``max |ref|``; beyond ``TOLERANCE[dtype]`` the script prints the errors, measures
   nothing, writes nothing and exits 1.

2. Measurements (median of ``--repeats`` after ``WARMUP`` untimed runs; CUDA events
   on GPU). The time to prefill a chunk of ``C`` new tokens on top of a cached prefix
   of depth ``D``, for each ``D`` in ``--depths``, fitted by least squares
   (coefficients kept >= 0) to::

       seconds = a * C + b * sum_{p=D}^{D+C-1} (p + 1)

   ``a`` is ``prefill_s_per_token`` and ``b`` ``prefill_s_per_token_per_position``,
   the per-layer constants of ``KVCostModel.prefill_seconds``. And the time to copy
   ``n`` latent rows (cache dtype) from pinned host memory to the GPU, fitted to
   ``seconds = h * n + latency``; ``h`` is ``h2d_s_per_token_per_layer``, recorded
   for reference: no cost the policy uses reads it (host reload pricing was removed
   from the cost model). Without a GPU the copy is a plain host-to-host copy and is
   labelled so. Only the attention layer is timed (projections, attention, output
   projection; not the MLP or MoE), in PyTorch's SDPA kernels; ``--tp N`` times one
   rank's share of the heads.

The calibration JSON (``--calibration-out``) is what
``sglang.srt.mem_cache.mla_cost_model.Calibration.load`` reads; it is written only
when the correctness check passes and the fit is one that ``Calibration`` accepts
(``a`` and ``h`` > 0, ``b`` >= 0, all finite). Exit status: 0 passed, 1 correctness
failure or unusable fit (nothing written), 2 bad command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

SCHEMA = "mla-eviction-calibration/1"
WARMUP = 3
ROPE_BASE = 10000.0
CHECK_PREFIX, CHECK_CHUNK = (
    192,
    64,
)  # correctness: cached prefix, then a chunk, then decode
H2D_TOKENS = (1024, 8192, 65536)  # latent rows per timed host-to-device copy
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # on max error / max |ref|
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MLAShape:
    """Dimensions of one MLA attention layer, and the default timing grid for it."""

    hidden: int
    heads: int
    q_lora_rank: Optional[int]  # None: the query is projected straight from hidden
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    depths: tuple[int, ...]
    chunk: int

    @property
    def row_width(self) -> int:
        """Values cached per token and layer: ``kv_lora_rank + qk_rope``."""
        return self.kv_lora_rank + self.qk_rope


PRESETS = {
    "v3": MLAShape(
        7168, 128, 1536, 512, 128, 64, 128, (0, 4096, 8192, 16384, 32768), 1024
    ),
    "v2-lite": MLAShape(
        2048, 16, None, 512, 128, 64, 128, (0, 4096, 8192, 16384, 32768), 1024
    ),
    # CPU tests: tiny attention, but a hidden size large enough that the per-token term
    # stands out of the timing noise of a shared CPU.
    "tiny": MLAShape(1024, 4, 256, 32, 16, 8, 16, (0, 512, 1024, 2048), 256),
}


class Projection(NamedTuple):
    """Per-token projections of new tokens; RoPE applied to both rope parts."""

    q_nope: torch.Tensor  # (T, heads, qk_nope)
    q_rope: torch.Tensor  # (T, heads, qk_rope)
    c_kv: torch.Tensor  # (T, kv_lora_rank), after RMSNorm
    k_rope: torch.Tensor  # (T, qk_rope), shared by all heads


class LatentCache:
    """One layer's MLA cache: row ``i`` is ``[c_kv | k_rope]`` of the token at position ``i``."""

    def __init__(
        self, shape: MLAShape, capacity: int, device: torch.device, dtype: torch.dtype
    ):
        self.shape = shape
        self.rows = torch.zeros(capacity, shape.row_width, device=device, dtype=dtype)
        self.length = 0

    def append(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write rows for the next ``len(c_kv)`` positions; raises IndexError when full."""
        end = self.length + c_kv.shape[0]
        if end > self.rows.shape[0]:
            raise IndexError(f"latent cache full: {end} > {self.rows.shape[0]} rows")
        self.rows[self.length : end, : self.shape.kv_lora_rank] = c_kv
        self.rows[self.length : end, self.shape.kv_lora_rank :] = k_rope
        self.length = end

    def latent(self) -> torch.Tensor:
        """The ``(length, row_width)`` rows in use (a view)."""
        return self.rows[: self.length]


class MLALayer:
    """DeepSeek V2/V3 MLA attention with random weights of std ``1/sqrt(fan_in)``.

    The same ``seed`` gives the same weights on every device and dtype.
    """

    def __init__(
        self, shape: MLAShape, device: torch.device, dtype: torch.dtype, seed: int = 0
    ):
        gen = torch.Generator().manual_seed(seed)

        def weight(fan_in: int, *out: int) -> torch.Tensor:
            w = torch.randn(fan_in, *out, generator=gen) / math.sqrt(fan_in)
            return w.to(device=device, dtype=dtype)

        s, qk = shape, shape.qk_nope + shape.qk_rope
        self.shape, self.device, self.dtype = s, device, dtype
        self.w_dq = weight(s.hidden, s.q_lora_rank) if s.q_lora_rank else None
        self.w_uq = weight(s.q_lora_rank or s.hidden, s.heads, qk)
        self.w_dkv = weight(s.hidden, s.row_width)
        w_ukv = weight(s.kv_lora_rank, s.heads, s.qk_nope + s.v_head)
        self.w_uk, self.w_uv = w_ukv[..., : s.qk_nope], w_ukv[..., s.qk_nope :]
        self.w_o = weight(s.heads * s.v_head, s.hidden)
        self.scale = qk**-0.5

    def project(self, hidden: torch.Tensor, start: int) -> Projection:
        """Projections of ``hidden`` (T, hidden_size) for positions ``start .. start+T-1``."""
        s = self.shape
        positions = torch.arange(start, start + hidden.shape[0], device=hidden.device)
        q_in = _rms_norm(hidden @ self.w_dq) if self.w_dq is not None else hidden
        q = torch.einsum("tc,chd->thd", q_in, self.w_uq)
        q_nope, q_rope = q.split([s.qk_nope, s.qk_rope], dim=-1)
        kv = hidden @ self.w_dkv
        c_kv = _rms_norm(kv[:, : s.kv_lora_rank])
        k_rope = _rope(kv[:, s.kv_lora_rank :], positions)
        return Projection(q_nope, _rope(q_rope, positions), c_kv, k_rope)

    def attend_absorbed(
        self, p: Projection, latent: torch.Tensor, w_uk: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """(T, heads, v_head) attention of ``p``'s T tokens, the last T rows of ``latent``.

        Scores are ``[q_nope W_UK^T | q_rope] . [c_kv | k_rope]``, one key shared by all
        heads; the output ``softmax . c_kv`` is mapped by ``W_UV``. ``w_uk`` replaces
        ``W_UK`` (the self-test perturbs it).
        """
        w_uk = self.w_uk if w_uk is None else w_uk
        q = torch.cat([torch.einsum("thn,chn->thc", p.q_nope, w_uk), p.q_rope], dim=-1)
        kv = latent[:, None, :]
        out = _causal_attention(q, kv, kv[..., : self.shape.kv_lora_rank], self.scale)
        return torch.einsum("thc,chd->thd", out, self.w_uv)

    def attend_expanded(self, p: Projection, latent: torch.Tensor) -> torch.Tensor:
        """Like :meth:`attend_absorbed`, over per-head K/V expanded from ``latent``."""
        c_kv, k_rope = latent.split(
            [self.shape.kv_lora_rank, self.shape.qk_rope], dim=-1
        )
        k_nope = torch.einsum("sc,chn->shn", c_kv, self.w_uk)
        k = torch.cat(
            [k_nope, k_rope[:, None, :].expand(-1, self.shape.heads, -1)], dim=-1
        )
        v = torch.einsum("sc,chd->shd", c_kv, self.w_uv)
        q = torch.cat([p.q_nope, p.q_rope], dim=-1)
        return _causal_attention(q, k, v, self.scale)

    def prefill(
        self, hidden: torch.Tensor, cache: LatentCache, form: str
    ) -> torch.Tensor:
        """Append ``hidden``'s tokens to ``cache`` and return the layer output (T, hidden)."""
        start = cache.length
        p = self.project(hidden, start)
        cache.append(p.c_kv, p.k_rope)
        attend = self.attend_absorbed if form == "absorbed" else self.attend_expanded
        return attend(p, cache.latent()).flatten(1) @ self.w_o


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the last dim of ``x`` (T, ..., d) at ``positions`` (T,)."""
    half = x.shape[-1] // 2
    inv_freq = ROPE_BASE ** (
        -torch.arange(half, device=x.device, dtype=torch.float32) / half
    )
    angle = (positions.float()[:, None] * inv_freq).view(
        x.shape[0], *[1] * (x.dim() - 2), half
    )
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    cos, sin = angle.cos(), angle.sin()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _causal_attention(q, k, v, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v, causal; q (T, H, d) are the last T of the S keys (S, H or 1, d).

    The lower-right causal mask lets PyTorch pick a fused kernel instead of a dense mask.
    """
    heads, (t, s) = q.shape[1], (q.shape[0], k.shape[0])
    qh, kh, vh = (x.transpose(0, 1)[None].expand(1, heads, -1, -1) for x in (q, k, v))
    mask = causal_lower_right(t, s)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


# ---- correctness -------------------------------------------------------------


def _errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (got.float() - ref.float()).abs().max().item()
    return {"max_abs_error": diff, "rel_error": diff / ref.float().abs().max().item()}


@torch.inference_mode()
def check_correctness(layer: MLALayer, perturb: float = 0.0, seed: int = 1) -> dict:
    """Absorbed attention from the latent cache versus expanded K/V from scratch.

    Caches ``CHECK_PREFIX`` tokens, prefills ``CHECK_CHUNK`` more, then decodes one, all
    in the absorbed form; the reference is the expanded form over all tokens at once.
    ``perturb`` > 0 multiplies ``W_UK`` in the absorbed path by ``1 + perturb * noise``
    (a deliberately wrong absorption). Returns the errors, the tolerance and ``passed``.
    """
    total = CHECK_PREFIX + CHECK_CHUNK + 1
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(total, layer.shape.hidden, generator=gen).to(
        layer.device, layer.dtype
    )
    w_uk = None
    if perturb:
        noise = torch.randn(layer.w_uk.shape, generator=gen).to(
            layer.device, layer.dtype
        )
        w_uk = layer.w_uk * (1 + perturb * noise)

    full = layer.project(hidden, 0)
    ref = layer.attend_expanded(full, torch.cat([full.c_kv, full.k_rope], dim=-1))

    cache = LatentCache(layer.shape, total, layer.device, layer.dtype)
    prefix = layer.project(hidden[:CHECK_PREFIX], 0)
    cache.append(prefix.c_kv, prefix.k_rope)
    results = {}
    for case, start, end in (
        ("prefill", CHECK_PREFIX, CHECK_PREFIX + CHECK_CHUNK),
        ("decode", CHECK_PREFIX + CHECK_CHUNK, total),
    ):
        p = layer.project(hidden[start:end], start)
        cache.append(p.c_kv, p.k_rope)
        got = layer.attend_absorbed(p, cache.latent(), w_uk=w_uk)
        results[case] = _errors(got, ref[start:end])
    tolerance = TOLERANCE[layer.dtype]
    return {
        "dtype": str(layer.dtype).removeprefix("torch."),
        "prefix_tokens": CHECK_PREFIX,
        "chunk_tokens": CHECK_CHUNK,
        **results,
        "tolerance_rel": tolerance,
        "passed": all(r["rel_error"] <= tolerance for r in results.values()),
    }


# ---- measurements ------------------------------------------------------------


def time_calls(
    fns: list[Callable[[], object]], device: torch.device, repeats: int
) -> list[list[float]]:
    """Seconds of ``repeats`` calls of each of ``fns``, after ``WARMUP`` untimed calls of each.

    Repeats go round-robin over ``fns``, so a burst of load on a shared machine lands on
    all of them alike rather than on one. GPU calls are timed by CUDA events.
    """
    for fn in fns:
        for _ in range(WARMUP):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            if cuda:
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                out.append(begin.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    return times


def attended_positions(depth: int, chunk: int) -> int:
    """``sum_{p=depth}^{depth+chunk-1} (p + 1)``: keys attended by a chunk at that depth."""
    return chunk * depth + chunk * (chunk + 1) // 2


@torch.inference_mode()
def measure_prefill(
    layer: MLALayer, depths, chunk: int, repeats: int, form: str
) -> list[dict]:
    """Prefill time of ``chunk`` new tokens over a cached prefix of each depth."""
    hidden = torch.randn(
        chunk, layer.shape.hidden, device=layer.device, dtype=layer.dtype
    )

    def prefill_at(depth: int) -> Callable[[], torch.Tensor]:
        cache = LatentCache(layer.shape, depth + chunk, layer.device, layer.dtype)
        cache.rows.normal_()

        def run() -> torch.Tensor:
            cache.length = depth  # drop the chunk the previous call appended
            return layer.prefill(hidden, cache, form)

        return run

    times = time_calls([prefill_at(d) for d in depths], layer.device, repeats)
    return [
        {
            "kind": "prefill",
            "form": form,
            "heads": layer.shape.heads,
            "depth": depth,
            "chunk": chunk,
            "attended_positions": attended_positions(depth, chunk),
            "seconds_median": median(seconds),
            "seconds": seconds,
        }
        for depth, seconds in zip(depths, times)
    ]


@torch.inference_mode()
def measure_h2d(
    shape: MLAShape, device: torch.device, dtype: torch.dtype, repeats: int
) -> list[dict]:
    """Copy time of ``n`` latent rows, pinned host to GPU (plain host copy without one)."""
    method = (
        "pinned host -> cuda"
        if device.type == "cuda"
        else "host -> host plain copy (no GPU)"
    )
    copies, sizes = [], []
    for n in H2D_TOKENS:
        src = torch.randn(n, shape.row_width).to(dtype)
        if device.type == "cuda":
            src = src.pin_memory()
        dst = torch.empty(n, shape.row_width, device=device, dtype=dtype)
        copies.append(lambda dst=dst, src=src: dst.copy_(src, non_blocking=True))
        sizes.append(n * shape.row_width * src.element_size())
    times = time_calls(copies, device, repeats)
    return [
        {
            "kind": "h2d",
            "method": method,
            "tokens": n,
            "bytes": size,
            "seconds_median": median(seconds),
            "seconds": seconds,
        }
        for n, size, seconds in zip(H2D_TOKENS, sizes, times)
    ]


def nonneg_lstsq(columns: list[list[float]], y: list[float]) -> list[float]:
    """Least-squares coefficients of ``y ~ sum_j c_j * columns[j]`` with every ``c_j >= 0``.

    When the unconstrained fit has a negative coefficient, the best fit on one column
    (the others 0) is returned, which for two columns is the exact constrained optimum;
    no column may be all zero.
    """
    x = torch.tensor(columns, dtype=torch.float64).T
    t = torch.tensor(y, dtype=torch.float64)[:, None]
    coef = torch.linalg.lstsq(x, t).solution[:, 0]
    if (coef >= 0).all():
        return coef.tolist()
    best, best_err = None, math.inf
    for j in range(x.shape[1]):
        cj = max((x[:, j] @ t[:, 0]).item() / (x[:, j] @ x[:, j]).item(), 0.0)
        err = (t[:, 0] - cj * x[:, j]).pow(2).sum().item()
        if err < best_err:
            best, best_err = [0.0] * x.shape[1], err
            best[j] = cj
    return best


def fit(samples: list[dict]) -> dict:
    """The three calibration constants from prefill and h2d samples (see module docstring)."""
    pre = [s for s in samples if s["kind"] == "prefill"]
    a, b = nonneg_lstsq(
        [[s["chunk"] for s in pre], [s["attended_positions"] for s in pre]],
        [s["seconds_median"] for s in pre],
    )
    h2d = [s for s in samples if s["kind"] == "h2d"]
    per_token, _latency = nonneg_lstsq(
        [[s["tokens"] for s in h2d], [1.0] * len(h2d)],
        [s["seconds_median"] for s in h2d],
    )
    return {
        "prefill_s_per_token": a,
        "prefill_s_per_token_per_position": b,
        "h2d_s_per_token_per_layer": per_token,
    }


# ---- command line ------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _depth_list(text: str) -> tuple[int, ...]:
    try:
        depths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers, e.g. 0,4096,8192"
        ) from None
    if any(d < 0 for d in depths):
        raise argparse.ArgumentTypeError(f"depths must be >= 0, got {text!r}")
    if len(set(depths)) < 2:
        raise argparse.ArgumentTypeError(
            f"need at least two different depths to fit, got {text!r}"
        )
    return depths


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parsed and checked arguments; bad values exit 2 with a message naming the flag.

    Adds ``shape`` (the preset with one rank's heads), fills in the preset's depths and
    chunk, and resolves ``auto`` device and dtype.
    """
    parser = argparse.ArgumentParser(
        description="Check MLA absorbed-latent attention and measure per-layer restore costs.",
    )
    add = parser.add_argument
    add("--preset", required=True, choices=sorted(PRESETS))
    add("--device", default="auto", choices=("auto", "cuda", "cpu"))
    add(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="compute and cache dtype (auto: bfloat16 on cuda, float32 on cpu)",
    )
    add(
        "--depths",
        type=_depth_list,
        help="cached prefix depths to time, e.g. 0,4096,8192",
    )
    add("--chunk", type=_positive_int, help="new tokens per timed prefill")
    add(
        "--tp",
        type=_positive_int,
        default=1,
        help="tensor-parallel size: one rank's share of the heads (the latent is replicated)",
    )
    add(
        "--repeats",
        type=_positive_int,
        default=7,
        help="timed runs per point (median kept)",
    )
    add(
        "--prefill-form",
        default="expanded",
        choices=("expanded", "absorbed"),
        help="attention form of the timed prefill (default expanded, as SGLang's MHA prefill)",
    )
    add(
        "--perturb-absorption",
        type=float,
        default=0.0,
        metavar="EPS",
        help="self-test: scale W_UK in the absorbed path by 1 + EPS * noise; the check must fail",
    )
    add(
        "--calibration-out",
        type=Path,
        metavar="PATH",
        help="write the calibration JSON here",
    )
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (use --device cpu)")
    out = args.calibration_out
    # A regular file or nothing yet, in a directory (never a device node or a FIFO).
    bad_target = out is not None and out.exists() and not out.is_file()
    if out is not None and (bad_target or not out.resolve().parent.is_dir()):
        parser.error(f"--calibration-out: cannot write a file at {str(out)!r}")
    shape = PRESETS[args.preset]
    if shape.heads % args.tp:
        parser.error(
            f"--tp {args.tp}: must divide the {shape.heads} heads of {args.preset}"
        )
    args.shape = dataclasses.replace(shape, heads=shape.heads // args.tp)
    args.depths = args.depths or shape.depths
    args.chunk = args.chunk or shape.chunk
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    return args


def _report_correctness(correctness: dict) -> list[str]:
    tolerance = correctness["tolerance_rel"]
    lines = [
        f"correctness: absorbed latent vs expanded K/V, prefix {CHECK_PREFIX} + chunk "
        f"{CHECK_CHUNK}, then decode (tolerance rel {tolerance:.0e})"
    ]
    for case in ("prefill", "decode"):
        e = correctness[case]
        verdict = "ok" if e["rel_error"] <= tolerance else "FAIL"
        lines.append(
            f"  {case:8s} max abs {e['max_abs_error']:.3e}  rel {e['rel_error']:.3e}  {verdict}"
        )
    return lines


# Calibration's rule: each fitted constant finite and > 0, the per-position one >= 0.
MAY_BE_ZERO = ("prefill_s_per_token_per_position",)


def unusable_constants(constants: dict) -> list[str]:
    """The fitted constants ``Calibration`` would refuse (see MAY_BE_ZERO)."""
    return [
        name
        for name, value in constants.items()
        if not math.isfinite(value)
        or value < 0
        or (value == 0 and name not in MAY_BE_ZERO)
    ]


def _report_measurements(
    args: argparse.Namespace, samples: list, constants: dict
) -> list[str]:
    lines = [
        f"prefill of one layer, {args.prefill_form} form, chunk {args.chunk}:",
        f"  {'depth':>8s} {'median ms':>10s} {'us/token':>9s}",
    ]
    for s in (s for s in samples if s["kind"] == "prefill"):
        ms = s["seconds_median"] * 1e3
        lines.append(f"  {s['depth']:8d} {ms:10.3f} {ms * 1e3 / s['chunk']:9.3f}")
    h2d = [s for s in samples if s["kind"] == "h2d"]
    lines.append(f"latent row copy ({h2d[0]['method']}):")
    for s in h2d:
        ms, rate = s["seconds_median"] * 1e3, s["bytes"] / s["seconds_median"] / 1e9
        lines.append(f"  {s['tokens']:8d} rows {ms:10.3f} ms {rate:8.2f} GB/s")
    lines.append("fit (one layer):")
    lines += [f"  {name:34s}{value:.4e}" for name, value in constants.items()]
    zero = [name for name, value in constants.items() if value == 0]
    if zero:
        lines.append(
            f"warning: {', '.join(zero)} fitted to 0 (kept >= 0): timings too noisy"
        )
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    """Run the check, then the measurements; return the exit status (see module docstring)."""
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"no GPU, CPU {platform.machine()}"
    print(
        f"MLA validation: preset {args.preset} ({args.shape.heads} heads per rank, tp {args.tp}), "
        f"{device.type} ({device_name}), {args.dtype}, torch {torch.__version__}"
    )
    layer = MLALayer(args.shape, device, dtype)
    correctness = check_correctness(layer, perturb=args.perturb_absorption)
    print("\n".join(_report_correctness(correctness)))
    if not correctness["passed"]:
        print("correctness check FAILED: nothing measured, no calibration written")
        return 1

    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # steady timings on a shared CPU
    try:
        samples = measure_prefill(
            layer, args.depths, args.chunk, args.repeats, args.prefill_form
        )
        samples += measure_h2d(layer.shape, device, dtype, args.repeats)
    finally:
        torch.set_num_threads(threads)
    constants = fit(samples)
    print("\n".join(_report_measurements(args, samples, constants)))
    unusable = unusable_constants(constants)
    if unusable:
        print(
            f"unusable fit: {', '.join(unusable)} must be > 0 for the cost model; "
            "no calibration written (rerun with more --repeats on a quieter device)"
        )
        return 1

    if args.calibration_out is not None:
        calibration = {
            "schema": SCHEMA,
            "gpu_name": device_name,
            "torch_version": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "preset": args.preset,
            "dtype": args.dtype,
            "device": device.type,
            "fit": constants,
            "samples": samples,
            "correctness": correctness,
        }
        args.calibration_out.write_text(json.dumps(calibration, indent=2) + "\n")
        print(f"calibration written to {args.calibration_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
