"""Compare radix eviction policies by replaying a trace through SGLang's real cache.

    python benchmark/mla_eviction/replay.py --trace ../shared/traces/mooncake_synthetic_trace.jsonl
    python benchmark/mla_eviction/replay.py --workload chat --capacity 5%,10%

Prints a markdown table; ``--json``, ``--markdown`` and ``--plot`` write the rows, the
table and a hit-rate-vs-capacity chart. Built-in policies run on the tree core asked
for (``--tree-core``, SGLang's default ``rust``); ``mla_aware``, the published peers
(``gdsf``, ``s3fifo``, ``lhd``) and Belady's offline bound ``optimal`` run on the Python
tree core, and every row says which. Bad input exits with status 2 and one line naming
the option, file, line or field; nothing is written then. The outputs are written
together: a failure while writing them (exit status 1) leaves none of them changed and
no temporary file behind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys
import tempfile
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NoReturn, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

BUILTINS = "lru,lfu,fifo,slru,priority,tlru"
PEER_NAMES = "gdsf,s3fifo,lhd"
DEFAULT_POLICIES = f"{BUILTINS},{PEER_NAMES},mla_aware,optimal"
DEFAULT_CAPACITIES = "1%,5%,10%,25%"
DEFAULT_TRACE = "../shared/traces/mooncake_synthetic_trace.jsonl"
RATE_KEYS = ("token_hit_rate", "flop_hit_rate")


class UsageError(Exception):
    """A bad option or input file: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like the other errors
        self.exit(2, f"replay.py: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help=f"Mooncake-format JSONL (default {DEFAULT_TRACE})")
    src.add_argument("--workload", help="generator: chat, few-shot, multi-turn, gsp")
    p.add_argument("--num-requests", type=int, default=2000, help="for --workload")
    p.add_argument("--seed", type=int, default=0, help="for --workload")
    p.add_argument("--workload-param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--block-size", type=int, default=512, help="tokens per hash id")
    p.add_argument(
        "--jitter-seed",
        type=int,
        default=0,
        help="move each arrival by up to one mean gap (0: as in the trace)",
    )
    p.add_argument(
        "--capacity",
        default=DEFAULT_CAPACITIES,
        help="comma list: share of the trace's unique blocks (5%%) or memory (80GB)",
    )
    p.add_argument("--weights", default="0GB", help="subtracted from a memory capacity")
    p.add_argument("--model", default="deepseek-v3", help="preset or config.json")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.add_argument("--policy-config", help="JSON object: mla_aware's config keys")
    p.add_argument("--tree-core", choices=("rust", "python"), default="rust")
    p.add_argument(
        "--gpu-tflops",
        type=float,
        default=3200.0,
        help="sustained prefill TFLOP/s of the instance (TTFT model; 8 x 400)",
    )
    p.add_argument("--decode-ms-per-token", type=float, default=20.0)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--json", dest="json_path", help="write the rows here")
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--plot", help="write a hit-rate-vs-capacity PNG here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if not args.trace and not args.workload:
        args.trace = str(Path(__file__).resolve().parents[2] / DEFAULT_TRACE)
    return args


def check_args(args) -> None:
    """Every numeric option in range and finite, every output path writable."""
    for name in ("num_requests", "block_size", "tp", "page_size", "jobs"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be >= 1")
    if args.jitter_seed < 0:
        raise UsageError("--jitter-seed must be >= 0")
    if not (math.isfinite(args.gpu_tflops) and args.gpu_tflops > 0):
        raise UsageError(
            f"--gpu-tflops must be a finite number > 0, got {args.gpu_tflops}"
        )
    if not (math.isfinite(args.decode_ms_per_token) and args.decode_ms_per_token >= 0):
        raise UsageError(
            f"--decode-ms-per-token must be a finite number >= 0, "
            f"got {args.decode_ms_per_token}"
        )
    if args.block_size % args.page_size:
        raise UsageError(
            f"--page-size {args.page_size} must divide --block-size {args.block_size}"
        )
    for flag, path in (
        ("--json", args.json_path),
        ("--markdown", args.markdown),
        ("--plot", args.plot),
    ):
        if path is not None:
            check_output_path(flag, path)


def check_output_path(flag: str, path: str) -> None:
    """A path the run may write: a regular file or nothing yet, in a directory."""
    target = Path(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise UsageError(f"{flag} {path}: {e.strerror}") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise UsageError(f"{flag} {path}: not a regular file")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: no such directory {str(parent)!r}")
    if not os.access(parent, os.W_OK) or (
        mode is not None and not os.access(target, os.W_OK)
    ):
        raise UsageError(f"{flag} {path}: not writable")


def load_trace(args):
    from traces import (
        TraceError,
        generate_workload,
        jitter_arrivals,
        load_mooncake_trace,
    )

    try:
        if args.trace:
            trace = load_mooncake_trace(
                args.trace, block_size=args.block_size, limit=args.limit
            )
        else:
            params = {}
            for item in args.workload_param:
                key, sep, value = item.partition("=")
                if not sep:
                    raise UsageError(f"--workload-param {item!r}: expected KEY=VALUE")
                params[key] = _number(value)
            trace = generate_workload(
                args.workload,
                num_requests=args.num_requests,
                seed=args.seed,
                block_size=args.block_size,
                **params,
            )
    except (TraceError, ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    return jitter_arrivals(trace, args.jitter_seed)


def _number(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def build_cost_model(args):
    from sglang.srt.mem_cache.mla_cost_model import KVCostModel, ModelConfigError

    try:
        return KVCostModel.from_config(
            args.model,
            kv_cache_dtype=args.kv_cache_dtype,
            tp_size=args.tp,
            page_size=args.page_size,
            gpu_flops_per_s=args.gpu_tflops * 1e12,
        )
    except ModelConfigError as e:
        raise UsageError(f"--model: {e}") from None


def parse_capacities(args, trace, cost) -> list[tuple[str, Optional[float], int]]:
    """(label, share of unique blocks or None, tokens) for each --capacity item."""
    from sglang.srt.mem_cache.latent_cache_analyzer import parse_size

    out = []
    for item in filter(None, (s.strip() for s in args.capacity.split(","))):
        if item.endswith("%"):
            try:
                share = float(item[:-1]) / 100
            except ValueError:
                raise UsageError(f"--capacity {item!r}: not a percentage") from None
            if not (math.isfinite(share) and 0 < share <= 1):
                raise UsageError(f"--capacity {item!r}: must be in (0%, 100%]")
            tokens = round(share * trace.num_unique_blocks()) * trace.block_size
        else:
            share = None
            try:
                free = parse_size(item) - parse_size(args.weights)
            except ValueError as e:
                raise UsageError(f"--capacity/--weights: {e}") from None
            tokens = cost.tokens_for_bytes(free)
        if tokens < args.page_size:
            raise UsageError(f"--capacity {item!r}: less than one page of KV cache")
        out.append((item, share, tokens))
    if not out:
        raise UsageError("--capacity: no capacity given")
    return out


def plan(args, trace, cost):
    """The replay configs ``args`` asks for (UsageError on a bad policy or config)."""
    from simulator import ReplayConfig, known_policies

    from sglang.srt.mem_cache.mla_aware_policy import PolicyConfig, PolicyConfigError
    from sglang.srt.mem_cache.mla_cost_model import Calibration, ModelConfigError

    init_process()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise UsageError("--policies: no policy given")
    known = known_policies()
    for name in policies:
        if name not in known:
            raise UsageError(f"--policies: unknown {name!r}; known: {', '.join(known)}")
    config = None
    if args.policy_config is not None:
        try:
            config = json.loads(args.policy_config)
            calibration = PolicyConfig.parse(config).calibration
            if calibration is not None:
                Calibration.load(calibration)
        except json.JSONDecodeError as e:
            raise UsageError(f"--policy-config: not JSON: {e}") from None
        except (PolicyConfigError, ModelConfigError) as e:
            raise UsageError(f"--policy-config: {e}") from None
    return [
        ReplayConfig(
            policy=name,
            capacity_tokens=tokens,
            page_size=args.page_size,
            tree_core=args.tree_core,
            policy_config=config if name == "mla_aware" else None,
            decode_s_per_token=args.decode_ms_per_token / 1e3,
            capacity_fraction=share,
            capacity_label=label,
        )
        for label, share, tokens in parse_capacities(args, trace, cost)
        for name in policies
    ]


def prepare(args):
    """The trace, cost model and configs ``args`` describe (UsageError on bad input)."""
    check_args(args)
    trace = load_trace(args)
    cost = build_cost_model(args)
    return trace, cost, plan(args, trace, cost)


_WORKER: dict = {}


def init_process() -> None:
    """Set a process up to replay: one torch thread (a request's cache work is timed on
    one core; libgomp is not fork-safe), the plugin registered."""
    import torch

    from sglang.srt.mem_cache.mla_eviction_plugin import register

    torch.set_num_threads(1)
    register()


def _init_worker(args, trace=None, cost=None) -> None:
    init_process()
    _WORKER["trace"] = trace if trace is not None else load_trace(args)
    _WORKER["cost"] = cost if cost is not None else build_cost_model(args)


def _run_one(config) -> dict:
    from simulator import Replayer

    return Replayer(_WORKER["trace"], _WORKER["cost"], config).run().summary()


def run_all(args, configs, trace, cost) -> list[dict]:
    from tqdm import tqdm

    bar = tqdm(
        total=len(configs),
        desc="replays",
        unit="run",
        disable=args.no_progress,
        file=sys.stderr,
    )
    if args.jobs == 1:
        _init_worker(args, trace, cost)
        results = []
        for cfg in configs:
            results.append(_run_one(cfg))
            bar.update()
    else:
        with ProcessPoolExecutor(
            args.jobs, initializer=_init_worker, initargs=(args,)
        ) as pool:
            futures = [pool.submit(_run_one, cfg) for cfg in configs]
            for f in futures:
                f.add_done_callback(lambda _: bar.update())
            results = [f.result() for f in futures]
    bar.close()
    add_relative_figures(results)
    return results


def add_relative_figures(results: list[dict]) -> None:
    """Per capacity: the share of the LRU-to-bound FLOP-hit gap each row closes, and
    its cache CPU over stock SGLang's (LRU on the Rust tree core), where both ran."""
    by_cap: dict = {}
    for r in results:
        by_cap.setdefault(r["capacity"], []).append(r)
    for rows in by_cap.values():
        lru = next((r for r in rows if r["policy"] == "lru"), None)
        bound = next((r for r in rows if r["is_bound"]), None)
        stock = next(
            (r for r in rows if r["policy"] == "lru" and r["tree_core"] == "rust"), None
        )
        for r in rows:
            r["gap_closed"] = r["cpu_vs_stock"] = None
            if lru and bound:
                gap = bound["flop_hit_rate"] - lru["flop_hit_rate"]
                if gap > 1e-9:
                    r["gap_closed"] = (r["flop_hit_rate"] - lru["flop_hit_rate"]) / gap
            if stock and stock["cpu_us_per_request"] > 0:
                r["cpu_vs_stock"] = (
                    r["cpu_us_per_request"] / stock["cpu_us_per_request"]
                )


def markdown_table(results: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| policy | tree core | capacity | token hit | FLOP hit | gap closed | "
        "TTFT p50 (s) | evictions | rejected | cache CPU µs/req | CPU vs stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        name = r["policy"]
        name += (
            " (offline bound)" if r["is_bound"] else " (peer)" if r["is_peer"] else ""
        )
        gap = "—" if r["gap_closed"] is None else f"{100 * r['gap_closed']:.0f} %"
        p50 = "—" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.3f}"
        cpu = "—" if r["cpu_vs_stock"] is None else f"{r['cpu_vs_stock']:.2f}x"
        lines.append(
            f"| {name} | {r['tree_core']} | {r['capacity']} | "
            f"{100 * r['token_hit_rate']:.2f} % | {100 * r['flop_hit_rate']:.2f} % | "
            f"{gap} | {p50} | {r['evictions']} | {r['rejected']} | "
            f"{r['cpu_us_per_request']:.0f} | {cpu} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str, title: str) -> None:
    """Hit rates against capacity: every policy its own colour and marker; built-ins
    solid, peers dashed, the bound dotted black, ``mla_aware`` thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in results))
    colours = plt.get_cmap("tab10").colors
    markers = "osD^v<>pXh*"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    share = results[0]["capacity_fraction"] is not None
    for ax, key in zip(axes, RATE_KEYS):
        for i, policy in enumerate(policies):
            rows = [r for r in results if r["policy"] == policy]
            xs = [
                100 * r["capacity_fraction"] if share else r["capacity_tokens"]
                for r in rows
            ]
            style = {"color": colours[i % 10], "marker": markers[i % len(markers)]}
            label = policy
            if rows[0]["is_bound"]:
                style = {"color": "black", "marker": "x", "linestyle": ":"}
                label += " (offline bound)"
            elif rows[0]["is_peer"]:
                style["linestyle"] = "--"
                label += " (peer)"
            elif policy == "mla_aware":
                style["linewidth"] = 2.8
            ax.plot(xs, [100 * r[key] for r in rows], label=label, **style)
        ax.set_xlabel("capacity (% of unique blocks)" if share else "capacity (tokens)")
        ax.set_ylabel(key.replace("_", " ") + " (%)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def write_outputs(outputs: list) -> None:
    """Each ``(flag, path, write)`` in ``outputs`` (skipped when ``path`` is None):
    ``write(tmp_path)`` into a temporary file beside ``path``, then, once every one
    succeeded, the files move into place. On failure no target is touched, no
    temporary file is left behind, and OSError names the flag and path at fault."""
    umask = os.umask(0)
    os.umask(umask)
    done: list[tuple[str, Path]] = []
    try:
        for flag, path, write in outputs:
            if path is None:
                continue
            target = Path(path)
            try:
                fd, tmp = tempfile.mkstemp(
                    dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
                )
                os.close(fd)
                done.append((tmp, target))
                write(tmp)
                os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would create it
            except Exception as e:
                raise OSError(f"{flag} {path}: {e}") from e
        for tmp, target in done:
            os.replace(tmp, target)
    finally:
        for tmp, _ in done:
            if os.path.exists(tmp):
                os.unlink(tmp)


def main(argv=None) -> int:
    # SGLang's CPU-only import warnings (AWQ, GGUF) say nothing about a replay.
    warnings.filterwarnings("ignore", message=r"Only .* support", category=UserWarning)
    args = parse_args(argv)
    try:
        trace, cost, configs = prepare(args)
    except UsageError as e:
        print(f"replay.py: error: {e}", file=sys.stderr)
        return 2
    source = Path(args.trace).name if args.trace else f"workload {args.workload}"
    if args.jitter_seed:
        source += f", arrivals jittered (seed {args.jitter_seed})"
    header = (
        f"**{source}**: {len(trace.requests)} requests, {trace.num_unique_blocks()} "
        f"unique blocks, model {cost.name} ({cost.bytes_per_token:,.0f} B/token), "
        f"page {args.page_size}, built-ins on the {args.tree_core} tree core"
    )
    results = run_all(args, configs, trace, cost)
    table = markdown_table(results, header)
    print(table)
    rejected = max(r["rejected"] for r in results)
    if rejected:
        print(f"\n{rejected} request(s) larger than the whole pool were rejected.")
    payload = {
        "source": source,
        "requests": len(trace.requests),
        "unique_blocks": trace.num_unique_blocks(),
        "model": cost.name,
        "results": results,
    }
    text = json.dumps(payload, indent=2) + "\n"
    outputs = [
        ("--json", args.json_path, lambda tmp: Path(tmp).write_text(text)),
        ("--markdown", args.markdown, lambda tmp: Path(tmp).write_text(table + "\n")),
        ("--plot", args.plot, lambda tmp: plot(results, tmp, header.replace("*", ""))),
    ]
    try:
        write_outputs(outputs)
    except OSError as e:
        print(f"replay.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
