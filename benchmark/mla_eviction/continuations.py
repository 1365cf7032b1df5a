"""How much of each session's history a policy keeps until the session's next turn.

    python benchmark/mla_eviction/continuations.py --trace PATH/conversation_trace.jsonl \
        --capacity 5% --policies lru,mla_aware,optimal

A *continuation* is a request whose prompt extends an earlier request's whole prompt but for
its last block (a conversation's next turn: the history, the answer and a new message; the
last block of the earlier prompt was partial, so it hashes differently once it is full) and
shares at least one full block that the earlier prompt was the first to bring (not only a
prefix the earlier one shared too, such as a system prompt) and at least two blocks in all
(every prompt of a trace may share a first block). Its *predecessor* is the latest earlier
request through the longest prefix it shares; its *gap* the time between the two arrivals.
A turn that added less than a block to its history is not followed: its next turn shares no
more with it than with the turn before, as a sibling would.

Takes replay.py's arguments (unified tree, no host tier; ``--policies`` defaults to
lru,mla_aware,optimal) and, for each capacity and policy, prints two tables:

- by gap: the continuations in each band and the share of their shared prefix each policy
  served from cache (hit tokens over shared tokens, at most 1, averaged);
- by the length of the shared prefix: the FLOP hit-rate points each policy earned there
  (points of all prompts' prefill FLOPs, as replay.py's FLOP hit rate), with the requests
  that continue nothing as a row of their own, so each policy's column sums to its FLOP hit
  rate.

Exit status 2 on bad arguments.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import replay  # noqa: E402
import request_diff  # noqa: E402

GAP_BANDS_S = (0, 60, 120, 240, 480)  # lower bounds, seconds
SHARED_BANDS_TOKENS = (0, 2048, 8192, 32768)  # lower bounds, tokens
DEFAULT_POLICIES = "lru,mla_aware,optimal"


@dataclass(frozen=True)
class Continuation:
    index: int  # the request, by its place in the trace
    predecessor: int
    shared_tokens: int  # the shared blocks, capped at the predecessor's prompt
    gap_s: float


def find_continuations(trace) -> list[Continuation]:
    """The trace's continuations (module docstring), in trace order.

    A trie of block ids remembers the latest request through each prefix; a request's
    predecessor is the one remembered at the deepest entry its blocks reach, read as its
    walk passes (and overwrites) it.
    """
    root: dict = {}  # block id -> [children, latest request through it]
    reached: list[int] = []  # per request: blocks it shared with an earlier one
    out = []
    for i, req in enumerate(trace.requests):
        children, depth, predecessor = root, 0, None
        for block in req.hash_ids:
            entry = children.get(block)
            if entry is None:  # new from here on: every entry below is new too
                entry = children[block] = [{}, i]
            else:
                depth, predecessor, entry[1] = depth + 1, entry[1], i
            children = entry[0]
        reached.append(depth)
        if predecessor is not None and depth >= 2 and depth > reached[predecessor]:
            before = trace.requests[predecessor]
            if depth >= len(before.hash_ids) - 1:
                shared = min(depth * trace.block_size, before.input_length)
                out.append(Continuation(i, predecessor, shared,
                                        req.timestamp_s - before.timestamp_s))
    return out


def band(value: float, bounds: tuple) -> int:
    """Index of the band of ``value`` among ascending lower ``bounds``."""
    return sum(value >= b for b in bounds[1:])


def band_names(bounds: tuple, unit: str, scale: float = 1) -> list[str]:
    def fmt(b):
        return f"{b / scale:g}"
    names = [f"{fmt(lo)}-{fmt(hi)} {unit}" for lo, hi in zip(bounds, bounds[1:])]
    return names + [f"≥ {fmt(bounds[-1])} {unit}"]


def tables(trace, cost, continuations: list[Continuation], hits: dict[str, dict]) -> dict:
    """Per gap band: count and each policy's mean served share; per shared-length band (and
    "continues nothing"): count and each policy's FLOP points (:func:`request_diff.points`).
    ``hits``: policy -> request index -> hit tokens (:func:`request_diff.measure`)."""
    earned = request_diff.points(trace, cost)
    by_gap = [{"n": 0, **{p: 0.0 for p in hits}} for _ in GAP_BANDS_S]
    by_shared = [{"n": 0, **{p: 0.0 for p in hits}} for _ in range(len(SHARED_BANDS_TOKENS) + 1)]
    continuing = {c.index: c for c in continuations}
    for c in continuations:
        row = by_gap[band(c.gap_s, GAP_BANDS_S)]
        row["n"] += 1
        for policy, h in hits.items():
            row[policy] += min(h.get(c.index, 0), c.shared_tokens) / c.shared_tokens
    for i in range(len(trace.requests)):
        c = continuing.get(i)
        row = by_shared[-1 if c is None else band(c.shared_tokens, SHARED_BANDS_TOKENS)]
        row["n"] += 1
        for policy, h in hits.items():
            row[policy] += earned(h.get(i, 0))
    for row in by_gap:
        for policy in hits:
            row[policy] = row[policy] / row["n"] if row["n"] else None
    return {"by_gap": by_gap, "by_shared": by_shared}


def markdown(capacity: str, t: dict, policies: list[str]) -> str:
    head = " | ".join(policies)
    out = [f"**{capacity}**: continuations by gap, share of the shared prefix served", "",
           f"| gap | continuations | {head} |", "|---|---|" + "---|" * len(policies)]
    for name, row in zip(band_names(GAP_BANDS_S, "s"), t["by_gap"]):
        cells = " | ".join("—" if row[p] is None else f"{row[p]:.2f}" for p in policies)
        out.append(f"| {name} | {row['n']} | {cells} |")
    out += ["", f"**{capacity}**: FLOP hit-rate points by shared prefix", "",
            f"| shared prefix | requests | {head} |", "|---|---|" + "---|" * len(policies)]
    names = band_names(SHARED_BANDS_TOKENS, "k tokens", 1024) + ["continues nothing"]
    for name, row in zip(names, t["by_shared"]):
        out.append(f"| {name} | {row['n']} | " + " | ".join(f"{row[p]:.2f}" for p in policies)
                   + " |")
    sums = [sum(row[p] for row in t["by_shared"]) for p in policies]
    out.append("| all | " + str(sum(row["n"] for row in t["by_shared"])) + " | "
               + " | ".join(f"{s:.2f}" for s in sums) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    if not any(a == "--policies" or a.startswith("--policies=") for a in argv):
        argv += ["--policies", DEFAULT_POLICIES]
    prepared = request_diff.prepare(argv, "continuations.py")
    if isinstance(prepared, int):
        return prepared
    _, trace, cost, configs = prepared
    found = find_continuations(trace)
    print(f"{trace.name}: {len(trace.requests)} requests, {len(found)} continuations\n")
    for cap, runs in request_diff.measure_all(trace, cost, configs).items():
        hits = {policy: run["hits"] for policy, run in runs.items()}
        print(markdown(cap, tables(trace, cost, found, hits), list(hits)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
