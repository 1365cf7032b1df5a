"""Soak test: replay a long stream of generated requests through SGLang's real cache.

    python benchmark/mla_eviction/soak.py --requests 1000000 --json soak.json

Requests come from ``traces.generate_workload`` in chunks (seed ``--seed + chunk``;
block ids restart in every chunk, so later chunks reuse the ids of earlier ones:
like a long-running server seeing the same system prompts again). They run through
the simulator's :class:`Replayer` (SGLang's ``UnifiedRadixCache`` with the Python tree
core, or the legacy ``RadixCache``; the real allocator; the ``mla_aware`` policy) as
one continuous stream on ONE cache. Every ``--sample-every`` requests it records:

* ``tracemalloc_mb`` (Python heap traced since start; off with ``--no-tracemalloc``)
  and ``rss_mb``;
* ``tree_nodes``: nodes reachable from the root;
* ``memo_nodes``: tree nodes carrying the policy's ``_mla_prefix_end`` memo, and
  ``stray_memos``: live node objects (found by the garbage collector) that carry one
  but are no longer in the tree. Per node, the strategy keeps only such memos:
  ``memo_nodes <= tree_nodes`` and ``stray_memos == 0`` mean they grow with nothing
  but the tree, which the pool bounds;
* ``ghosts``: records in the policy's table of scored nodes (what it recognises when it
  comes back), which must stay within ``GhostLearning.MAX_GHOSTS``; ``log_factor`` and
  ``weight``, the probation and value weight it has learnt.

Exit status 1 when a sample breaks that, 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402


def _cache_nodes(replayer) -> tuple[list, type]:
    root = replayer.cache.root_node
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out, type(root)


def sample(replayer, served: int, t0: float) -> dict:
    nodes, node_type = _cache_nodes(replayer)
    in_tree = {id(n) for n in nodes}
    memo_nodes = sum(1 for n in nodes if hasattr(n, "_mla_prefix_end"))
    gc.collect()
    stray = sum(
        1 for o in gc.get_objects()
        if type(o) is node_type and hasattr(o, "_mla_prefix_end") and id(o) not in in_tree
    )
    r = replayer.result
    learning = getattr(replayer.strategy, "learning", None)
    book = getattr(replayer.strategy, "sessions", None)
    return {
        "requests": served,
        "elapsed_s": round(time.perf_counter() - t0, 2),
        "tracemalloc_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
        if tracemalloc.is_tracing() else None,
        "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        "tree_nodes": len(nodes),
        "memo_nodes": memo_nodes,
        "stray_memos": stray,
        "cached_pages": replayer.cache.evictable_size() + replayer.cache.protected_size(),
        "pool_pages": replayer.allocator.size,
        "free_pages": replayer.allocator.available_size(),
        "token_hit_rate": round(r.hit_tokens / max(r.prompt_tokens, 1), 4),
        "evictions": r.evictions,
        "ghosts": len(learning._ghosts) if learning else 0,
        "sessions": len(book._sessions) if book else 0,
        "session_refs": sum(len(e.refs) for e in book._sessions.values()) if book else 0,
        "log_factor": round(learning.log_factor, 3) if learning else None,
        "weight": round(learning.weight, 3) if learning else None,
    }


def run_soak(*, requests: int, cache: str = "unified", workload: str = "chat",
             mode: str = "sequential", chunk: int = 20_000, sample_every: int = 20_000,
             capacity_tokens: int = 1_000_000, page_size: int = 64, block_size: int = 512,
             seed: int = 0, progress: bool = True, trace_memory: bool = True,
             on_sample=None, max_seconds: float = float("inf")) -> list[dict]:
    """Replay ``requests`` generated requests on one cache; return the samples.

    Stops early (between requests, after a final sample) once ``max_seconds`` passed.
    """
    from simulator import ReplayConfig, Replayer, radix_clock
    from traces import generate_workload

    from sglang.srt.mem_cache.mla_cost_model import KVCostModel
    from sglang.srt.mem_cache.mla_eviction_plugin import register

    register()
    unit = block_size if mode == "sequential" else page_size
    cfg = ReplayConfig(
        policy="mla_aware", capacity_tokens=capacity_tokens, mode=mode, cache=cache,
        page_size=page_size,
        policy_config={"model": "deepseek-v3", "page_size": page_size, "key_unit_tokens": unit},
    )
    cost = KVCostModel.from_config("deepseek-v3", page_size=page_size)
    first = generate_workload(workload, num_requests=min(chunk, requests), seed=seed,
                              block_size=block_size)
    if trace_memory and not tracemalloc.is_tracing():
        tracemalloc.start()
    replayer = Replayer(first, cost, cfg)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=requests, unit="req", smoothing=0.05)
    t0 = time.perf_counter()
    samples = [sample(replayer, 0, t0)]
    served, c = 0, 0
    trace = first
    while served < requests and time.perf_counter() - t0 < max_seconds:
        if c:
            trace = generate_workload(workload, num_requests=min(chunk, requests - served),
                                      seed=seed + c, block_size=block_size)
            # Each chunk's conversations are new ones: session ids unique across chunks
            # (a closed id used again would mark the new session's nodes closed).
            trace = dataclasses.replace(trace, requests=tuple(
                r if r.session_id is None else dataclasses.replace(r, session_id=f"{c}:{r.session_id}")
                for r in trace.requests))
        replayer.trace = trace
        if mode == "sequential":
            # Request by request (to sample and stop between requests), on the replay's
            # clock as run() would; global indices keep output ids unique.
            with radix_clock(replayer.clock):
                for req in trace.requests:
                    replayer._sequential_step(served, req)
                    served += 1
                    if time.perf_counter() - t0 >= max_seconds:
                        break
                    if bar:
                        bar.update()
                    if served % sample_every == 0:
                        samples.append(sample(replayer, served, t0))
                        if on_sample:
                            on_sample(samples[-1])
        else:
            before = served
            # Drains all in flight; global indices keep output ids unique across chunks.
            replayer.run(progress=bar.update if bar else None, first_index=served)
            served += len(trace.requests)
            if served // sample_every > before // sample_every:
                samples.append(sample(replayer, served, t0))
                if on_sample:
                    on_sample(samples[-1])
        replayer.result.ttfts.clear()  # the harness's own per-request list, not the cache's
        c += 1
    if samples[-1]["requests"] != served:
        samples.append(sample(replayer, served, t0))
    if bar:
        bar.close()
    return samples


def check(samples: list[dict]) -> list[str]:
    """Samples where the policy's state exceeds the tree's or its bounded tables."""
    from sglang.srt.mem_cache.mla_aware_policy import GhostLearning
    from sglang.srt.mem_cache.mla_sessions import SessionBook

    return [
        f"after {s['requests']} requests: {s['memo_nodes']} memos on {s['tree_nodes']} "
        f"tree nodes, {s['stray_memos']} stray, {s['ghosts']} ghost records, "
        f"{s.get('sessions', 0)} sessions"
        for s in samples
        if s["memo_nodes"] > s["tree_nodes"] or s["stray_memos"]
        or s["ghosts"] > GhostLearning.MAX_GHOSTS
        or s.get("sessions", 0) > SessionBook.MAX_SESSIONS
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--cache", choices=("unified", "radix"), default="unified")
    p.add_argument("--workload", choices=("chat", "multi-turn", "few-shot", "gsp", "random"),
                   default="chat")
    p.add_argument("--mode", choices=("sequential", "timed"), default="sequential")
    p.add_argument("--chunk", type=int, default=20_000, help="requests generated at a time")
    p.add_argument("--sample-every", type=int, default=50_000)
    p.add_argument("--capacity-tokens", type=int, default=1_000_000)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tracemalloc", action="store_true")
    p.add_argument("--max-seconds", type=float, default=float("inf"),
                   help="stop after this long and report how far it got")
    p.add_argument("--json", help="write the samples here")
    args = p.parse_args(argv)
    for name in ("requests", "chunk", "sample_every", "capacity_tokens", "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    def show(s):
        print(json.dumps(s), file=sys.stderr, flush=True)

    samples = run_soak(
        requests=args.requests, cache=args.cache, workload=args.workload, mode=args.mode,
        chunk=args.chunk, sample_every=args.sample_every, capacity_tokens=args.capacity_tokens,
        page_size=args.page_size, seed=args.seed, trace_memory=not args.no_tracemalloc,
        on_sample=show, max_seconds=args.max_seconds,
    )
    problems = check(samples)
    summary = {
        "command": " ".join(["python", "benchmark/mla_eviction/soak.py", *(argv or sys.argv[1:])]),
        "requests_asked": args.requests,
        "requests": samples[-1]["requests"],
        "elapsed_s": samples[-1]["elapsed_s"],
        "max_tree_nodes": max(s["tree_nodes"] for s in samples),
        "max_rss_mb": max(s["rss_mb"] for s in samples),
        "problems": problems,
        "samples": samples,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
