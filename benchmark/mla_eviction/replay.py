"""Compare radix eviction policies by replaying a trace through SGLang's real cache.

    python benchmark/mla_eviction/replay.py --trace ../shared/traces/mooncake_synthetic_trace.jsonl
    python benchmark/mla_eviction/replay.py --workload chat --num-requests 2000 --capacity 5%,10%

Prints a markdown table per run; ``--json`` and ``--plot`` write machine output and a
hit-rate-vs-capacity chart. ``optimal`` is Belady's offline bound (it reads the
future) and is labelled as a bound wherever it appears. Bad input exits with status 2
and one message naming the file, line and field; nothing is written then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_POLICIES = "lru,lfu,fifo,slru,priority,tlru,mla_aware,optimal"
DEFAULT_JOBS = min(2, os.cpu_count() or 1)
DEFAULT_CAPACITIES = "1%,5%,10%,25%"
TRIM_VICTIMS = ("policy", "all", "none")  # simulator.ReplayConfig.trim
SESSION_CLOSE = ("last-turn", "never")  # simulator.ReplayConfig.session_close
RATE_KEYS = ("token_hit_rate", "flop_hit_rate")


class UsageError(Exception):
    """Bad command-line value or input file: printed as one line, exit status 2."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake-format JSONL trace")
    src.add_argument("--workload", help="built-in generator: chat, few-shot, multi-turn, random, gsp")
    p.add_argument("--num-requests", type=int, default=2000, help="requests to generate (--workload)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workload-param", action="append", default=[], metavar="KEY=VALUE",
        help="generator parameter, e.g. num_groups=64 (repeatable)",
    )
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--scale", type=int, default=1, help="tile the trace N times (disjoint ids)")
    p.add_argument("--block-size", type=int, default=512, help="tokens per hash block")
    p.add_argument("--mode", choices=("timed", "sequential"), default="timed")
    p.add_argument("--cache", choices=("unified", "radix"), default="unified",
                   help="UnifiedRadixCache (SGLang's default) or the legacy RadixCache")
    p.add_argument("--clock", choices=("tick", "per-read"), default="tick",
                   help="the legacy RadixCache's clock: one tick per cache operation, or "
                        "moving at every read as wall time does in a server")
    p.add_argument("--capacity", default=DEFAULT_CAPACITIES,
                   help="comma list: share of the trace's unique blocks (5%%) or memory (80GB)")
    p.add_argument("--weights", default="0GB", help="weights per GPU, subtracted from a memory capacity")
    p.add_argument("--model", default="deepseek-v3", help="cost-model preset or config.json")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.add_argument("--policy-config", default=None, help="JSON config for mla_aware")
    p.add_argument("--trim-victims", choices=TRIM_VICTIMS, default="policy",
                   help="free only the shortfall by trimming an eviction's last victim: where "
                        "the policy asks for it (mla_aware, as in a server, and the bound), for "
                        "every policy, or never (unified tree without a host tier only)")
    p.add_argument("--session-close", choices=SESSION_CLOSE, default="last-turn",
                   help="when a client ends a session (requests with a session id: the "
                        "multi-turn workload, a trace with session ids): after its last "
                        "request, as /close_session does, or never")
    p.add_argument("--session-radix-cache", action="store_true",
                   help="SGLang's --enable-session-radix-cache (unified tree): each finished "
                        "request's KV stays referenced by its session until the session "
                        "closes, and referenced leaves are evicted last")
    p.add_argument("--host-tier", default=None,
                   help="host tier size: a multiple of device capacity (4x) or memory (320GB)")
    p.add_argument("--gpu-tflops", type=float, default=3200.0,
                   help="sustained prefill TFLOP/s of the serving instance (default: 8 GPUs x 400)")
    p.add_argument("--h2d-gbps", type=float, default=25.0, help="host-to-device GB/s")
    p.add_argument("--decode-ms-per-token", type=float, default=20.0)
    p.add_argument("--jobs", type=int, default=DEFAULT_JOBS)
    p.add_argument("--json", dest="json_path", help="write results JSON here")
    p.add_argument("--markdown", help="write the markdown table here")
    p.add_argument("--plot", help="write a hit-rate-vs-capacity PNG here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if not args.trace and not args.workload:
        args.trace = str(Path(__file__).resolve().parents[2].parent / "shared/traces/mooncake_synthetic_trace.jsonl")
    return args


def load_trace(args):
    from traces import TraceError, generate_workload, load_mooncake_trace, scale_trace

    try:
        if args.trace:
            trace = load_mooncake_trace(args.trace, block_size=args.block_size, limit=args.limit)
        else:
            params = {}
            for item in args.workload_param:
                key, sep, value = item.partition("=")
                if not sep:
                    raise UsageError(f"--workload-param {item!r}: expected KEY=VALUE")
                params[key] = _number(value)
            trace = generate_workload(
                args.workload, num_requests=args.num_requests, seed=args.seed,
                block_size=args.block_size, **params,
            )
    except (TraceError, ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    if args.scale > 1:
        trace = scale_trace(trace, args.scale)
    return trace


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
            args.model, kv_cache_dtype=args.kv_cache_dtype, tp_size=args.tp,
            page_size=args.page_size, gpu_flops_per_s=args.gpu_tflops * 1e12,
            host_to_device_bytes_per_s=args.h2d_gbps * 1e9,
        )
    except ModelConfigError as e:
        raise UsageError(f"--model: {e}") from None


def parse_capacities(text: str, args, trace, cost) -> list[tuple[str, Optional[float], int]]:
    """(label, share of unique blocks or None, tokens) for each --capacity item."""
    unique = trace.num_unique_blocks()
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if item.endswith("%"):
            try:
                share = float(item[:-1]) / 100
            except ValueError:
                raise UsageError(f"--capacity {item!r}: not a percentage") from None
            if not 0 < share <= 1:
                raise UsageError(f"--capacity {item!r}: must be in (0%, 100%]")
            out.append((item, share, int(round(share * unique)) * trace.block_size))
        else:
            from sglang.srt.mem_cache.mla_eviction_budget import parse_size

            try:
                free = parse_size(item) - parse_size(args.weights)
            except ValueError as e:
                raise UsageError(f"--capacity/--weights: {e}") from None
            tokens = cost.tokens_for_bytes(free)
            if tokens <= 0:
                raise UsageError(f"--capacity {item!r} minus --weights {args.weights!r} leaves no KV memory")
            out.append((item, None, tokens))
    if not out:
        raise UsageError("--capacity: no capacity given")
    return out


def host_tier_tokens(text: Optional[str], capacity_tokens: int, cost) -> int:
    if not text:
        return 0
    from sglang.srt.mem_cache.mla_eviction_budget import parse_size

    if text.endswith("x"):
        try:
            return int(float(text[:-1]) * capacity_tokens)
        except ValueError:
            raise UsageError(f"--host-tier {text!r}: expected e.g. 4x or 320GB") from None
    try:
        return cost.tokens_for_bytes(parse_size(text))
    except ValueError as e:
        raise UsageError(f"--host-tier: {e}") from None


def load_policy_config(text: Optional[str]) -> Optional[dict]:
    """``--policy-config`` as a dict (None when not given), validated as the server
    validates it; UsageError naming the flag otherwise."""
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--policy-config: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise UsageError("--policy-config: expected a JSON object")
    from sglang.srt.mem_cache.mla_aware_policy import PolicyConfigError, parse_policy_config

    try:
        parse_policy_config(config)
    except PolicyConfigError as e:
        raise UsageError(f"--policy-config: {e}") from None
    return config


def plan(args, trace, cost):
    from simulator import ReplayConfig, known_policies

    from sglang.srt.mem_cache.mla_eviction_plugin import register

    register()
    known = known_policies()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in policies:
        if name not in known:
            raise UsageError(f"--policies: unknown policy {name!r}; known: {', '.join(known)}")
    policy_config = load_policy_config(args.policy_config)
    for name, value in (("--page-size", args.page_size), ("--tp", args.tp), ("--jobs", args.jobs)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if args.page_size > 1 and args.mode == "timed" and args.block_size % args.page_size:
        raise UsageError(f"--page-size {args.page_size} must divide --block-size {args.block_size}")
    cache = args.cache
    if args.host_tier and cache != "radix":
        cache = "radix"  # the modelled host tier marks nodes backed up: legacy tree only
    if args.session_radix_cache and cache != "unified":
        raise UsageError("--session-radix-cache needs the unified tree (no --cache radix, no --host-tier)")
    if args.clock != "tick" and cache != "radix":
        raise UsageError("--clock per-read needs --cache radix (the unified tree counts its own ticks)")
    configs = []
    for label, share, tokens in parse_capacities(args.capacity, args, trace, cost):
        host_tokens = host_tier_tokens(args.host_tier, tokens, cost)
        for name in policies:
            cfg = None
            if name == "mla_aware":
                cfg = {
                    "model": args.model, "kv_cache_dtype": args.kv_cache_dtype, "tp_size": args.tp,
                    "page_size": args.page_size,
                    "key_unit_tokens": args.block_size if args.mode == "sequential" else args.page_size,
                    "gpu_tflops": args.gpu_tflops, "h2d_gbps": args.h2d_gbps,
                    # as the server fills it in: no host tier, no host copies to look for
                    **({} if host_tokens else {"host_aware": False}),
                    **(policy_config or {}),
                }
            configs.append(ReplayConfig(
                policy=name, capacity_tokens=tokens, mode=args.mode, cache=cache,
                page_size=args.page_size, host_tier_tokens=host_tokens, clock=args.clock,
                policy_config=cfg, trim=args.trim_victims, session_close=args.session_close,
                session_radix=args.session_radix_cache,
                decode_s_per_token=args.decode_ms_per_token / 1e3,
                capacity_fraction=share, capacity_label=label,
            ))
    return configs


def prepare(args):
    """The trace, cost model and replay configs ``args`` describe (UsageError on bad input)."""
    trace = load_trace(args)
    cost = build_cost_model(args)
    return trace, cost, plan(args, trace, cost)


def prepare_unified_mla_aware(argv: list[str], *, policy: str, policy_config=None):
    """``prepare`` for a tool that replays ``mla_aware`` alone on the unified tree without a
    host tier (SGLang's default set-up) from replay.py's source and capacity arguments
    ``argv``; ``policy_config`` (a dict) fixes the policy's keys. Raises UsageError on bad
    input, or naming ``policy`` (what the tool replays) when ``argv`` picks policies, the
    legacy tree or a host tier."""
    if any(a.startswith("--polic") for a in argv):
        raise UsageError(f"--policies/--policy-config: this tool replays {policy}")
    config = ["--policy-config", json.dumps(policy_config)] if policy_config else []
    args = parse_args([*argv, "--policies", "mla_aware", *config, "--no-progress"])
    if args.cache != "unified" or args.host_tier:
        raise UsageError(f"this tool replays {policy} on the unified tree without a host tier "
                         "(SGLang's default)")
    return prepare(args)


def tool_inputs(tool: str, doc: str, own: argparse.ArgumentParser, argv, *, policy: str,
                policy_config=None, check=None):
    """What a tool that replays ``policy`` alone as :func:`prepare_unified_mla_aware` does
    needs: its own options (``own``, a parser made with ``add_help=False``), the trace, the
    cost model and the configs, from its options and replay.py's source and capacity
    arguments in ``argv``. Or the tool's exit status, where it is to stop there: 0 once
    ``doc`` is printed for ``-h``/``--help``; 2 once a bad argument is named on stderr as
    ``tool: error: ...`` (argparse's own messages for ``own``'s options; ``check(options)``
    may raise UsageError for their values)."""
    try:
        options, rest = own.parse_known_args(argv)
    except SystemExit:
        return 2
    if "-h" in rest or "--help" in rest:
        print(doc)
        return 0
    try:
        if check is not None:
            check(options)
        return (options, *prepare_unified_mla_aware(rest, policy=policy,
                                                     policy_config=policy_config))
    except UsageError as e:
        print(f"{tool}: error: {e}", file=sys.stderr)
        return 2


_WORKER = {}


def init_process() -> None:
    """Set a process up to replay: one torch thread, the policy registered.

    A replay times a request's cache work on one core, and libgomp is not fork-safe: a
    process that replays in place (``--jobs 1``) with torch's OpenMP threads started and
    then forks a pool leaves the workers waiting at a barrier for threads they do not
    have (bar_check's one-at-a-time CPU runs hung the next source's pool that way).
    """
    import torch

    from sglang.srt.mem_cache.mla_eviction_plugin import register

    torch.set_num_threads(1)
    register()


def _init_worker(args, trace=None, cost=None):
    """:func:`init_process`; keep the trace and cost model (built again from ``args`` in
    a pool worker)."""
    init_process()
    _WORKER["trace"] = trace if trace is not None else load_trace(args)
    _WORKER["cost"] = cost if cost is not None else build_cost_model(args)


def _run_one(config):
    from simulator import Replayer

    return Replayer(_WORKER["trace"], _WORKER["cost"], config).run().summary()


def run_all(args, configs, trace, cost) -> list[dict]:
    from tqdm import tqdm

    bar = tqdm(total=len(configs), desc="replays", unit="run", disable=args.no_progress, file=sys.stderr)
    results = []
    if args.jobs == 1:
        _init_worker(args, trace, cost)
        for cfg in configs:
            results.append(_run_one(cfg))
            bar.update()
    else:
        with ProcessPoolExecutor(args.jobs, initializer=_init_worker, initargs=(args,)) as pool:
            futures = [pool.submit(_run_one, cfg) for cfg in configs]
            for f in as_completed(futures):
                bar.update()
            results = [f.result() for f in futures]
    bar.close()
    add_gap_closed(results)
    return results


def add_gap_closed(results: list[dict]) -> None:
    """Share of the LRU-to-optimal flop_hit_rate gap each policy closes, per capacity."""
    by_cap: dict = {}
    for r in results:
        by_cap.setdefault(r["capacity"], {})[r["policy"]] = r
    for group in by_cap.values():
        lru, opt = group.get("lru"), group.get("optimal")
        for r in group.values():
            r["gap_closed"] = None
            if lru and opt and opt["flop_hit_rate"] - lru["flop_hit_rate"] > 1e-9:
                r["gap_closed"] = (r["flop_hit_rate"] - lru["flop_hit_rate"]) / (
                    opt["flop_hit_rate"] - lru["flop_hit_rate"]
                )


def markdown_table(results: list[dict], header: str) -> str:
    lines = [header, "",
             "| policy | capacity | token hit | FLOP hit | gap closed | TTFT p50 (s) | TTFT p99 (s) | evictions | cache CPU µs/req |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        name = f"{r['policy']} (offline bound)" if r["is_bound"] else r["policy"]
        gap = "—" if r.get("gap_closed") is None else f"{100 * r['gap_closed']:.0f} %"
        p50 = "—" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.3f}"
        p99 = "—" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s']:.2f}"
        lines.append(
            f"| {name} | {r['capacity']} | {100 * r['token_hit_rate']:.2f} % | "
            f"{100 * r['flop_hit_rate']:.2f} % | {gap} | {p50} | {p99} | {r['evictions']} | "
            f"{r['cpu_us_per_request']:.0f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key in zip(axes, RATE_KEYS):
        policies = dict.fromkeys(r["policy"] for r in results)
        for policy in policies:
            rows = [r for r in results if r["policy"] == policy]
            xs = [r["capacity_fraction"] if r["capacity_fraction"] is not None else r["capacity_tokens"] for r in rows]
            label = f"{policy} (offline bound)" if policy == "optimal" else policy
            style = dict(linestyle="--", color="black") if policy == "optimal" else {}
            if policy == "mla_aware":
                style = dict(linewidth=2.5, color="tab:red")
            ax.plot([100 * x if rows[0]["capacity_fraction"] is not None else x for x in xs],
                    [100 * r[key] for r in rows], marker="o", label=label, **style)
        ax.set_xlabel("capacity (% of unique blocks)" if results[0]["capacity_fraction"] is not None else "capacity (tokens)")
        ax.set_ylabel(key.replace("_", " ") + " (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def _write_atomic(path: str, text_or_writer) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    if callable(text_or_writer):
        text_or_writer(str(tmp))
    else:
        tmp.write_text(text_or_writer)
    os.replace(tmp, target)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        trace, cost, configs = prepare(args)
    except UsageError as e:
        print(f"replay.py: error: {e}", file=sys.stderr)
        return 2
    source = args.trace if args.trace else f"workload {args.workload} (seed {args.seed})"
    unique = trace.num_unique_blocks()
    header = (
        f"**{Path(source).name if args.trace else source}**: {len(trace.requests)} requests, "
        f"{trace.num_blocks()} blocks ({unique} unique), mode {args.mode}, "
        f"cache {configs[0].cache}, model {cost.name} ({cost.bytes_per_token:,.0f} B/token), "
        f"page {args.page_size}" + (f", host tier {args.host_tier} (modelled)" if args.host_tier else "")
        + (", session radix cache" if args.session_radix_cache else "")
    )
    results = run_all(args, configs, trace, cost)
    table = markdown_table(results, header)
    print(table)
    payload = {
        "source": source,
        "mode": args.mode,
        "cache": configs[0].cache,
        "model": cost.name,
        "requests": len(trace.requests),
        "unique_blocks": unique,
        "host_tier": args.host_tier,
        "host_tier_modelled": bool(args.host_tier),
        "session_radix_cache": args.session_radix_cache,
        "session_close": args.session_close,
        "results": results,
    }
    if args.json_path:
        _write_atomic(args.json_path, json.dumps(payload, indent=2) + "\n")
    if args.markdown:
        _write_atomic(args.markdown, table + "\n")
    if args.plot:
        _write_atomic(args.plot, lambda tmp: plot(results, tmp, header.replace("*", "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
