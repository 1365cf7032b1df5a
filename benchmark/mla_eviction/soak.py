"""Soak test: one cache, up to a million generated requests, the policy's state bounded.

    python benchmark/mla_eviction/soak.py --requests 1000000 --json soak.json

Requests come from ``traces.generate_workload`` in chunks of ``--chunk`` (seed
``--seed`` + chunk number). Each chunk's block ids are shifted past the earlier
chunks', so chunks share no content: every chunk brings new prompts, and victims of
earlier chunks never come back, which fills the policy's table of victims to its bound.
All chunks run, one after the other, through ONE :class:`simulator.Replayer`: SGLang's
``UnifiedRadixCache`` on the Python tree core with the plugin's eviction-callback
component, the real allocator, the ``mla_aware`` policy. Every ``--sample-every``
requests it records:

* ``tracemalloc_mb`` (Python heap traced since the start; off with
  ``--no-tracemalloc``, which runs about twice as fast) and ``rss_mb``;
* ``tree_nodes``: nodes in the tree, the root included; ``pool_pages``,
  ``free_pages`` and ``cached_pages``;
* the policy's state, kept by ``node.id``: ``seen`` (``len(_seen)``), ``children``
  (``len(_children)``) and ``ghosts`` (``len(_ghosts)``), and ``stale_seen`` /
  ``stale_children``, their keys that are no longer nodes of the tree;
* ``token_hit_rate`` (so far), ``evictions``, and the learnt ``log_factor`` and
  ``weight``.

A bound is broken when ``seen`` exceeds ``MLAAwareStrategy.MAX_SEEN`` or the tree's
nodes, ``children`` the tree's nodes, ``ghosts`` ``MAX_GHOSTS``, or a stale key is
kept. Exit status 1 then, 2 for a bad option, else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Callable, NoReturn, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKLOADS = ("chat", "few-shot", "multi-turn", "gsp", "random")


class _Stop(Exception):
    """Raised from the progress callback when the time is up."""


def shift_ids(trace, offset: int):
    """``trace`` with every block id moved up by ``offset``, and the number of ids it
    uses (its ids are dense: 0 .. D - 1)."""
    requests = trace.requests
    top = max((max((*r.hash_ids, *r.sequence_hash_ids), default=-1) for r in requests))
    moved = tuple(
        dataclasses.replace(
            r,
            hash_ids=tuple(h + offset for h in r.hash_ids),
            sequence_hash_ids=tuple(h + offset for h in r.sequence_hash_ids),
        )
        for r in requests
    )
    return dataclasses.replace(trace, requests=moved), top + 1


def tree_node_ids(tree_core) -> set:
    """Ids of the nodes in the tree, the root included."""
    ids, stack = set(), [tree_core.root_node]
    while stack:
        node = stack.pop()
        ids.add(node.id)
        stack.extend(node.children.values())
    return ids


def sample(replayer, served: int, t0: float) -> dict:
    """What the soak records after ``served`` requests (see the module docstring)."""
    import psutil

    core, cache, r = replayer.cache.tree_core, replayer.cache, replayer.result
    strategy = core.eviction_strategy
    live = tree_node_ids(core)
    traced = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None
    return {
        "requests": served,
        "elapsed_s": round(time.perf_counter() - t0, 2),
        "tracemalloc_mb": None if traced is None else round(traced / 2**20, 2),
        "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        "tree_nodes": len(live),
        "pool_pages": replayer.allocator.size,
        "free_pages": replayer.allocator.available_size(),
        "cached_pages": cache.evictable_size() + cache.protected_size(),
        "seen": len(strategy._seen),
        "children": len(strategy._children),
        "ghosts": len(strategy._ghosts),
        "stale_seen": len(strategy._seen.keys() - live),
        "stale_children": len(strategy._children.keys() - live),
        "token_hit_rate": round(r.hit_tokens / max(r.prompt_tokens, 1), 4),
        "evictions": r.evictions,
        "log_factor": round(strategy.log_factor, 4),
        "weight": round(strategy.weight, 4),
    }


def run_soak(
    *,
    requests: int,
    workload: str = "chat",
    chunk: int = 20_000,
    sample_every: int = 50_000,
    capacity_tokens: int = 131_072,
    page_size: int = 64,
    block_size: int = 512,
    seed: int = 0,
    progress: bool = True,
    trace_memory: bool = True,
    on_sample: Optional[Callable[[dict], None]] = None,
    max_seconds: float = float("inf"),
) -> list[dict]:
    """Replay ``requests`` generated requests on one cache; return the samples.

    Samples at 0, every ``sample_every`` requests and at the end. Stops early, after a
    last sample, once ``max_seconds`` have passed (between requests).
    """
    from simulator import ReplayConfig, Replayer
    from tqdm import tqdm
    from traces import generate_workload

    from sglang.srt.mem_cache.mla_aware_policy import POLICY_NAME
    from sglang.srt.mem_cache.mla_cost_model import KVCostModel

    cost = KVCostModel.from_preset("deepseek-v3", page_size=page_size)
    config = ReplayConfig(POLICY_NAME, capacity_tokens, page_size, tree_core="python")

    def make_chunk(number: int, offset: int):
        size = min(chunk, requests - number * chunk)
        trace = generate_workload(
            workload, num_requests=size, seed=seed + number, block_size=block_size
        )
        return shift_ids(trace, offset)

    trace, offset = make_chunk(0, 0)
    if trace_memory and not tracemalloc.is_tracing():
        tracemalloc.start()
    replayer = Replayer(trace, cost, config)
    t0 = time.perf_counter()
    samples = [sample(replayer, 0, t0)]
    served = 0
    bar = tqdm(
        total=requests,
        unit="req",
        smoothing=0.05,
        disable=not progress,
        file=sys.stderr,
    )

    def done_one() -> None:
        nonlocal served
        served += 1
        bar.update()
        if served % sample_every == 0:
            samples.append(sample(replayer, served, t0))
            if on_sample:
                on_sample(samples[-1])
        if time.perf_counter() - t0 >= max_seconds:
            raise _Stop

    try:
        number = 0
        while True:
            replayer.trace = trace
            replayer.run(progress=done_one)
            replayer.result.ttfts.clear()  # the harness's per-request list
            number += 1
            if number * chunk >= requests:
                break
            trace, used = make_chunk(number, offset)
            offset += used
    except _Stop:
        pass
    finally:
        bar.close()
    if samples[-1]["requests"] != served:
        samples.append(sample(replayer, served, t0))
        if on_sample:
            on_sample(samples[-1])
    return samples


def check(samples: list[dict]) -> list[str]:
    """One line per sample whose policy state breaks a bound (module docstring)."""
    from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy

    max_seen, max_ghosts = MLAAwareStrategy.MAX_SEEN, MLAAwareStrategy.MAX_GHOSTS
    problems = []
    for s in samples:
        broken = [
            f"seen {s['seen']} > MAX_SEEN {max_seen}" if s["seen"] > max_seen else "",
            f"seen {s['seen']} > tree nodes" if s["seen"] > s["tree_nodes"] else "",
            f"children {s['children']} > tree nodes"
            if s["children"] > s["tree_nodes"]
            else "",
            f"ghosts {s['ghosts']} > MAX_GHOSTS {max_ghosts}"
            if s["ghosts"] > max_ghosts
            else "",
            f"{s['stale_seen']} stale seen" if s["stale_seen"] else "",
            f"{s['stale_children']} stale children" if s["stale_children"] else "",
        ]
        broken = [b for b in broken if b]
        if broken:
            problems.append(
                f"after {s['requests']} requests ({s['tree_nodes']} tree nodes): "
                + ", ".join(broken)
            )
    return problems


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"soak.py: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--requests", type=int, default=1_000_000)
    add("--workload", choices=WORKLOADS, default="chat")
    add("--chunk", type=int, default=20_000, help="requests generated at a time")
    add("--sample-every", type=int, default=50_000)
    add("--capacity-tokens", type=int, default=131_072, help="the pool, in tokens")
    add("--page-size", type=int, default=64)
    add("--block-size", type=int, default=512, help="tokens per generated block")
    add("--seed", type=int, default=0)
    add("--no-tracemalloc", action="store_true")
    add("--no-progress", action="store_true")
    add("--max-seconds", type=float, default=float("inf"), help="stop after this long")
    add("--json", help="write the summary and samples here")
    args = p.parse_args(argv)
    for name in ("requests", "chunk", "sample_every", "page_size", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seed < 0:
        p.error("--seed must be >= 0")
    if args.block_size % args.page_size:
        p.error(f"--page-size {args.page_size} must divide --block-size")
    if args.capacity_tokens < args.page_size:
        p.error("--capacity-tokens must hold at least one page")
    if not args.max_seconds > 0:
        p.error("--max-seconds must be > 0")
    if args.json is not None:
        from replay import UsageError, check_output_path

        try:
            check_output_path("--json", args.json)
        except UsageError as e:
            p.error(str(e))
    return args


def main(argv=None) -> int:
    # SGLang's CPU-only import warnings (AWQ, GGUF) say nothing about a soak.
    warnings.filterwarnings("ignore", message=r"Only .* support", category=UserWarning)
    args = parse_args(argv)
    samples = run_soak(
        requests=args.requests,
        workload=args.workload,
        chunk=args.chunk,
        sample_every=args.sample_every,
        capacity_tokens=args.capacity_tokens,
        page_size=args.page_size,
        block_size=args.block_size,
        seed=args.seed,
        progress=not args.no_progress,
        trace_memory=not args.no_tracemalloc,
        on_sample=lambda s: print(json.dumps(s), file=sys.stderr, flush=True),
        max_seconds=args.max_seconds,
    )
    from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy

    problems = check(samples)
    argv = sys.argv[1:] if argv is None else argv
    summary = {
        "command": " ".join(["python", "benchmark/mla_eviction/soak.py", *argv]),
        "requests_asked": args.requests,
        "requests": samples[-1]["requests"],
        "elapsed_s": samples[-1]["elapsed_s"],
        "max_seen": MLAAwareStrategy.MAX_SEEN,
        "max_ghosts": MLAAwareStrategy.MAX_GHOSTS,
        "max_tree_nodes": max(s["tree_nodes"] for s in samples),
        "max_rss_mb": max(s["rss_mb"] for s in samples),
        "problems": problems,
        "samples": samples,
    }
    if args.json:
        from replay import write_outputs

        text = json.dumps(summary, indent=1) + "\n"
        write_outputs([("--json", args.json, lambda tmp: Path(tmp).write_text(text))])
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
