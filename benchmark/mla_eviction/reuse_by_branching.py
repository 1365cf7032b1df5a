"""Which evicted nodes come back, by their hits and their children (the evidence for
``hit_cap``), or by their depth (what the learning sees of them).

    python benchmark/mla_eviction/reuse_by_branching.py --workload multi-turn --capacity 10%,25%
    python benchmark/mla_eviction/reuse_by_branching.py --by depth --capacity 5%,10%
    python benchmark/mla_eviction/reuse_by_branching.py --by kind --workload multi-turn

Takes replay.py's source and capacity arguments (the shipped trace by default). For each
capacity it replays the source through the real unified tree with ``mla_aware`` reduced to
cost-weighted LRU (no hits, no learning, so which node goes does not depend on what is
counted here) and notes every victim's ``hit_count`` and its children (as
``GhostLearning.children`` counts them); a victim *comes back* when the same content is
inserted again under the same parent later in the replay (``GhostLearning``'s ghost
match). Victims that begin with output pages of their own (generated tokens no later
prompt holds) are counted apart: the replay gives them ids of their own (a Mooncake
trace does not say what was generated), so they cannot come back whatever they are. It
prints, per capacity, the other victims and the share that came back by hits and
children, and the share of the victims ``hit_cap`` caps (more hits than children + 1, on
a node that has had children) that came back against the share of victims with as many
children and hits = children + 1.

``--by depth`` tables the same victims by their depth (nodes between them and the root)
with two shares: came back as the learning sees it (the ghost match) and came back by
content (a later prompt holds the victim's first page, wherever the tree then puts it).
The two differ where a victim's parent went too: the content then comes back inside one
node starting at the parent, which the learning matches as the parent's return only.
``--by kind`` tables them by SGLang's ``priority`` field, which ``mla_aware`` does not
read. Requests carry priority 0 in a replay; where a finished request's pages reach past
its prompt's last full page, SGLang splits its leaf at the prompt boundary and inserts
the prompt one priority up (so that eviction can drop the output first). A node below
its parent's priority is then the output tail split off a finished request, or the
prompt of a finished request whose output filled no page past it (not split, not
raised) under a raised prefix; a node at 0 otherwise is not under a raised prefix; a
node at 1 or more is a raised prompt.
Exit status 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import bisect
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import replay  # noqa: E402

# Cost-weighted LRU: the victims do not depend on hits, on what the learning would teach or
# on sessions closing (the tables were measured before mla_sessions).
NEUTRAL = {"hit_exponent": 0, "hit_cap": False, "probation": False, "value_weight": False,
           "superseded": False, "sessions": False}
MAX_BUCKET = 4  # hits, children and depths of at least 4 share a row / column
KINDS = ("below its parent's priority", "priority 0", "priority 1+")


def measure(trace, cost, config) -> dict:
    """Replay ``config`` (an ``mla_aware`` ReplayConfig with NEUTRAL keys) noting each victim
    as ``(hits, children)``, by depth and by kind, whether it came back (ghost match) and
    whether its content did, and counting apart (``outputs``) the victims that begin with an output page
    of their own.

    Victims are seen through ``Replayer.watch_victims``, and, on this replay only, returns
    by wrapping the learning's ``_learn`` (called once per victim that comes back, with
    that victim's record) and prompts by wrapping the cache's ``match_prefix`` (called at
    each attempt to admit a request, before anything is evicted for it).
    ``cells`` counts victims and returns by ``(hits, children)`` and by hit_cap kind,
    ``by["depth"]`` and ``by["kind"]`` by depth and by kind (:data:`KINDS`) with "victims",
    "back" and "content".
    """
    from sglang.srt.mem_cache.mla_aware_policy import GhostLearning
    from simulator import Replayer, holds_own_output

    replayer = Replayer(trace, cost, config)
    learning = replayer.strategy.learning
    # id of the victim's record -> [record, hits, children, back]; holding the record keeps
    # its id from being reused by a later one, so the id alone identifies it
    victims: dict[int, list] = {}
    outputs = 0
    prompts: dict[int, list] = defaultdict(list)  # page id -> the matches whose prompt holds it
    matches = 0

    match_prefix = replayer.cache.match_prefix

    def noting_match(params):
        nonlocal matches
        matches += 1
        for page in params.key.token_ids:
            prompts[page].append(matches)
        return match_prefix(params)

    def noting_victim(node):
        nonlocal outputs
        seen = node.__dict__.get("_mla_seen")
        if holds_own_output(node):
            outputs += 1
        elif seen is not None:  # every victim was scored first
            depth, up = 0, node.parent
            while up.parent is not None:
                depth, up = depth + 1, up.parent
            kind = (KINDS[0] if node.priority < node.parent.priority else
                    KINDS[1] if node.priority <= 0 else KINDS[2])
            victims[id(seen)] = [seen, node.hit_count, GhostLearning.children(node), False,
                                 depth, kind, node.key.token_ids[0], matches]

    learn = learning._learn

    def noting_learn(victim):
        noted = victims.get(id(victim))
        if noted is not None:
            noted[3] = True
        return learn(victim)

    replayer.cache.match_prefix = noting_match  # an instance attribute: this replay only
    replayer.watch_victims(noting_victim)
    learning._learn = noting_learn
    replayer.run()
    cells: Counter = Counter()
    by = {"depth": Counter(), "kind": Counter()}
    for _, hits, children, back, depth, kind, first, evicted_at in victims.values():
        for group in ((min(hits, MAX_BUCKET), min(children, MAX_BUCKET)),
                      ("capped" if children and hits > children + 1 else
                       "diagonal" if hits == children + 1 else "other", children)):
            cells[group, "victims"] += 1
            cells[group, "back"] += back
        later = prompts[first]
        content = bisect.bisect_right(later, evicted_at) < len(later)
        for view, group in (("depth", min(depth, MAX_BUCKET)), ("kind", kind)):
            by[view][group, "victims"] += 1
            by[view][group, "back"] += back
            by[view][group, "content"] += content
    return {"capacity": config.capacity_label, "cells": cells, "by": by, "outputs": outputs}


def capped_vs_diagonal(cells: Counter) -> tuple[int, float, float]:
    """Victims ``hit_cap`` caps, the share of them that came back, and the share expected
    from the victims on the diagonal (hits = children + 1) with the same children."""
    n = back = expected = 0.0
    for (group, value), count in cells.items():
        if group[0] != "capped" or value != "victims":
            continue
        children = group[1]
        diagonal = cells[("diagonal", children), "victims"]
        n += count
        back += cells[group, "back"]
        if diagonal:
            expected += count * cells[("diagonal", children), "back"] / diagonal
    return int(n), back / n if n else 0.0, expected / n if n else 0.0


def _share(cells: Counter, group) -> str:
    n = cells[group, "victims"]
    return f"{cells[group, 'back']}/{n} ({100 * cells[group, 'back'] / n:.0f} %)" if n else "—"


def markdown(rows: list[dict]) -> str:
    plus = lambda i: f"{i}+" if i == MAX_BUCKET else str(i)  # noqa: E731
    lines = []
    for row in rows:
        cells = row["cells"]
        n, back, expected = capped_vs_diagonal(cells)
        capped = (f"{n} victims had more hits than children + 1 (`hit_cap` caps them); "
                  f"{100 * back:.0f} % came back, against {100 * expected:.0f} % of those "
                  "with hits = children + 1 and as many children" if n else
                  "no victim had more hits than children + 1")
        outputs = row.get("outputs", 0)
        if outputs:
            capped += f"; {outputs} victims were output pages of their own, left out"
        lines += [
            f"**{row['capacity']}** (came back / victims): {capped}",
            "",
            "| hits \\ children | " + " | ".join(plus(c) for c in range(MAX_BUCKET + 1)) + " |",
            "|---|" + "---|" * (MAX_BUCKET + 1),
        ]
        for h in range(1, MAX_BUCKET + 1):
            lines.append(f"| {plus(h)} | "
                         + " | ".join(_share(cells, (h, c)) for c in range(MAX_BUCKET + 1)) + " |")
        lines.append("")
    return "\n".join(lines)


def markdown_by(rows: list[dict], view: str) -> str:
    """Per capacity, the victims by ``view`` ("depth" or "kind"): came back as the learning
    sees it, and by content."""
    header = {"depth": "depth (nodes above, root not counted)", "kind": "kind (`priority`)"}[view]
    groups = range(MAX_BUCKET + 1) if view == "depth" else KINDS
    lines = []
    for row in rows:
        counts = row["by"][view]
        outputs = row.get("outputs", 0)
        lines += [
            f"**{row['capacity']}**" + (
                f" ({outputs} victims were output pages of their own, left out)" if outputs else ""),
            "",
            f"| {header} | victims | came back, ghost match | came back, content |",
            "|---|---|---|---|",
        ]
        for group in groups:
            n = counts[group, "victims"]
            if n:
                label = f"{group}+" if group == MAX_BUCKET else str(group)
                lines.append(f"| {label} | {n} | " + " | ".join(
                    f"{counts[group, what]} ({100 * counts[group, what] / n:.0f} %)"
                    for what in ("back", "content")) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--by", choices=("branching", "depth", "kind"), default="branching")
    inputs = replay.tool_inputs("reuse_by_branching.py", __doc__, p, argv,
                                policy="cost-weighted LRU", policy_config=NEUTRAL)
    if isinstance(inputs, int):
        return inputs
    args, trace, cost, configs = inputs
    from sglang.srt.mem_cache.mla_eviction_plugin import register
    from tqdm import tqdm

    register()
    rows = [measure(trace, cost, c) for c in tqdm(configs, desc="replays", file=sys.stderr)]
    print(markdown(rows) if args.by == "branching" else markdown_by(rows, args.by))
    return 0


if __name__ == "__main__":
    sys.exit(main())
