"""Where a replay's cache CPU goes, by cache operation: LRU beside ``mla_aware``.

    python benchmark/mla_eviction/cpu_breakdown.py --workload gsp \\
        --workload-param group_distribution=zipf --workload-param zipf_alpha=1.1 --capacity 10%

Takes replay.py's source and capacity arguments (the shipped trace by default; the unified
tree without a host tier, SGLang's default). For each capacity it replays LRU, ``mla_aware``
and ``mla_aware`` with ``trim_victims`` off, ``--runs`` times each, one at a time and in
turn (each run starts with the next policy, so none is always timed after another), and
times every cache operation the replay's scheduler makes (``match_prefix``, ``lock``,
``unlock``, ``insert``, ``evict``) and, inside an eviction, the leaf index's walk
(``mla_leaf_index.LeafIndex``: ``start``, ``pop``, ``push``, scores included), and counts
the victims trimming split (``MLAAwareStrategy.on_split``). It prints the least µs per
request of each over the runs and, for the two ``mla_aware`` rows, what they add over LRU,
beside the bar check's allowance (1 % of ``mla_aware``'s modelled prefill per request).
The least of each column is taken on its own, so the columns of a row need not add up to
its total. Everything but the times is deterministic.
Exit status 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import replay  # noqa: E402
from simulator import Replayer  # noqa: E402

OPERATIONS = ("match_prefix", "lock", "unlock", "insert", "evict")
WALK = "leaf index walk"  # the index's share of "evict" (mla_aware only)
WALK_METHODS = ("start", "pop", "push")
SPLITS = "victims split"  # counted, not timed: how often trimming acted
UNTRIMMED = "mla_aware, trim_victims off"
CPU_SHARE = 0.01  # bar_check.py's allowance: 1 % of the modelled prefill per request


class _ByOperation(Replayer):
    """A replay that also counts its cache CPU by operation (``fn.__name__``)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.tally: collections.Counter = collections.Counter()  # seconds, and SPLITS

    def _spent(self, fn, seconds: float) -> None:
        super()._spent(fn, seconds)
        self.tally[fn.__name__] += seconds


@contextlib.contextmanager
def instrumented(tally: collections.Counter) -> Iterator[None]:
    """While open, the leaf index's walk methods add their time to ``tally[WALK]``, and
    each victim trimming splits adds 1 to ``tally[SPLITS]``."""
    from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy
    from sglang.srt.mem_cache.mla_leaf_index import LeafIndex

    originals = {name: getattr(LeafIndex, name) for name in WALK_METHODS}
    on_split = MLAAwareStrategy.on_split

    def timing(method):
        def timed(*args):
            t0 = time.perf_counter()
            try:
                return method(*args)
            finally:
                tally[WALK] += time.perf_counter() - t0
        return timed

    def counted_split(*args):
        tally[SPLITS] += 1
        return on_split(*args)

    for name, method in originals.items():
        setattr(LeafIndex, name, timing(method))
    MLAAwareStrategy.on_split = counted_split
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(LeafIndex, name, method)
        MLAAwareStrategy.on_split = on_split


def policies(config) -> dict:
    """The three replays of one capacity, by label, from its ``mla_aware`` config."""
    return {
        "lru": dataclasses.replace(config, policy="lru", policy_config=None),
        "mla_aware": config,
        UNTRIMMED: dataclasses.replace(
            config, policy_config={**config.policy_config, "trim_victims": False}),
    }


def measure(trace, cost, config, runs: int) -> list[dict]:
    """One row per policy of :func:`policies`: its evictions, victims split, modelled prefill
    per request, and the least µs per request over ``runs`` of its cache CPU (``total``),
    of each operation and of the walk."""
    configs = policies(config)
    labels = list(configs)
    least: dict = {label: collections.defaultdict(lambda: float("inf")) for label in labels}
    facts: dict = {}
    for run in range(runs):
        for label in labels[run % len(labels):] + labels[:run % len(labels)]:
            replayer = _ByOperation(trace, cost, configs[label])
            with instrumented(replayer.tally):
                result = replayer.run().summary()
            served = max(result["requests"] - result["rejected"], 1)
            times = {**replayer.tally, "total": replayer.result.cache_cpu_s}
            for key in ("total", *OPERATIONS, WALK):
                least[label][key] = min(least[label][key], 1e6 * times.get(key, 0.0) / served)
            facts[label] = {"evictions": result["evictions"], "splits": replayer.tally[SPLITS],
                            "prefill_ms": result["prefill_ms_per_request"],
                            "flop_hit_rate": result["flop_hit_rate"]}
    return [{"capacity": config.capacity_label, "policy": label, **facts[label],
             "us": dict(least[label])} for label in labels]


def markdown(rows: list[dict]) -> str:
    columns = ("total", *OPERATIONS, WALK)
    lines = ["| capacity | policy | FLOP hit | evictions | victims split | "
             + " | ".join(columns) + " | allowance |",
             "|---|---|---|---|---|" + "---|" * (len(columns) + 1)]
    lru = {}
    for r in rows:
        us = r["us"]
        if r["policy"] == "lru":
            lru = us
            cells, allowance = [f"{us[c]:.0f}" for c in columns], ""
        else:
            cells = [f"{us[c]:.0f} ({us[c] - lru[c]:+.0f})" for c in columns]
            allowance = f"{1e3 * CPU_SHARE * r['prefill_ms']:.0f}"
        lines.append(f"| {r['capacity']} | {r['policy']} | {100 * r['flop_hit_rate']:.2f} % | "
                     f"{r['evictions']} | {r['splits']} | " + " | ".join(cells)
                     + f" | {allowance} |")
    lines += ["", "µs of cache CPU per request, the least of each column over the runs; "
              "in brackets, over LRU. Allowance: 1 % of the modelled prefill per request."]
    return "\n".join(lines)


def _check(own: argparse.Namespace) -> None:
    if own.runs < 1:
        raise replay.UsageError(f"--runs must be >= 1, got {own.runs}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--runs", type=int, default=3, help="replays of each policy")
    inputs = replay.tool_inputs("cpu_breakdown.py", __doc__, p, argv,
                                policy="LRU and mla_aware", check=_check)
    if isinstance(inputs, int):
        return inputs
    own, trace, cost, configs = inputs
    replay.init_process()
    rows = [row for config in configs for row in measure(trace, cost, config, own.runs)]
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
