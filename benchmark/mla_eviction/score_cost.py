"""What one eviction score costs, timed on a real tree's leaves, and how many a request needs.

    python benchmark/mla_eviction/score_cost.py --workload few-shot --capacity 5%,25%

Takes replay.py's source and capacity arguments (the shipped trace by default). For each
capacity it replays the source with ``mla_aware`` through the real unified tree twice,
counting the scores asked for: with the stock heap, which scores every evictable leaf at
every eviction as it does for LRU (``indexed_eviction`` off), and with the leaf index
(``mla_leaf_index``, the default), which takes the same victims. Then it scores the tree's
evictable leaves at the end, LRU and the replay's own ``mla_aware`` strategy in turn,
``--rounds`` times, and prints the least nanoseconds per score of each, and the scoring
CPU the policy adds per request: its scores at its price less the stock heap's at LRU's.
The index's own bookkeeping is not in it (the replay's cache CPU has it). Taking turns within milliseconds keeps the
machine's slow spells out of the difference, which one replay's cache CPU cannot (it moves
by a third between runs; see docs/advanced_features/mla_aware_eviction.md). The leaves
are warm in the CPU's caches here, so a replay pays more per score; this is the floor.
Exit status 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import replay  # noqa: E402

POLICY = "mla_aware"


def measure(trace, cost, config, rounds: int) -> dict:
    """Replay ``config`` (an ``mla_aware`` ReplayConfig) counting scores, with the stock heap
    and with the leaf index; time both policies on the leaves left at the end."""
    from sglang.srt.mem_cache.evict_policy import LRUStrategy
    from simulator import _strategy_owner

    stock = dataclasses.replace(config, policy_config={**(config.policy_config or {}),
                                                       "indexed_eviction": False})
    full_heap, _, _ = _count_scores(trace, cost, stock)
    indexed, replayer, score = _count_scores(trace, cost, config)
    leaves = list(_strategy_owner(replayer.cache).evictable_device_leaves)
    lru = LRUStrategy().get_priority
    best = {"lru": float("inf"), POLICY: float("inf")}
    for _ in range(rounds if leaves else 0):
        for name, fn in (("lru", lru), (POLICY, score)):
            seconds = timeit.timeit(lambda: [fn(n) for n in leaves], number=10)
            best[name] = min(best[name], seconds / (10 * len(leaves)))
    added = indexed * best[POLICY] - full_heap * best["lru"] if leaves else 0.0
    return {
        "capacity": config.capacity_label,
        "leaves": len(leaves),
        "scores_per_request": full_heap,
        "indexed_scores_per_request": indexed,
        "lru_ns": 1e9 * best["lru"] if leaves else None,
        "mla_aware_ns": 1e9 * best[POLICY] if leaves else None,
        "added_us_per_request": 1e6 * added,
    }


def _count_scores(trace, cost, config):
    """Replay ``config``; the scores per request the tree asked for, the replayer, and its
    strategy's own score function."""
    from simulator import Replayer

    replayer = Replayer(trace, cost, config)
    strategy = replayer.strategy
    scores = 0
    score = strategy.get_priority

    def counted(node):
        nonlocal scores
        scores += 1
        return score(node)

    strategy.get_priority = counted  # the tree and the index look it up on the strategy
    result = replayer.run()
    del strategy.get_priority
    return scores / max(result.requests, 1), replayer, score


def markdown(rows: list[dict]) -> str:
    lines = ["| capacity | leaves at the end | scores per request, stock heap | "
             "scores per request, leaf index | LRU ns/score | mla_aware ns/score | "
             "scoring added per request |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ns = (f"{r['lru_ns']:.0f} | {r['mla_aware_ns']:.0f}" if r["leaves"] else "— | —")
        lines.append(f"| {r['capacity']} | {r['leaves']} | {r['scores_per_request']:.1f} | "
                     f"{r['indexed_scores_per_request']:.1f} | {ns} | "
                     f"{r['added_us_per_request']:.0f} µs |")
    return "\n".join(lines)


def _check(own: argparse.Namespace) -> None:
    if own.rounds < 1:
        raise replay.UsageError(f"--rounds must be >= 1, got {own.rounds}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--rounds", type=int, default=5, help="turns of timing each policy")
    inputs = replay.tool_inputs("score_cost.py", __doc__, p, argv,
                                policy="mla_aware's defaults", check=_check)
    if isinstance(inputs, int):
        return inputs
    own, trace, cost, configs = inputs
    from sglang.srt.mem_cache.mla_eviction_plugin import register

    register()
    print(markdown([measure(trace, cost, c, own.rounds) for c in configs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
