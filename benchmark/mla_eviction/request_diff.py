"""Where two policies part: the requests one serves from cache and the other does not, and
what each evicted.

    python benchmark/mla_eviction/request_diff.py --workload gsp --num-requests 2000 --seed 0 \
        --workload-param group_distribution=zipf --workload-param zipf_alpha=1.1 \
        --capacity 25% --policies mla_aware,priority

Takes replay.py's arguments with exactly two ``--policies`` (the first is read against the
second). For each capacity it replays both and compares them request by request: how many
requests the first hit less of, and the FLOP hit-rate points that costs it, how many it hit
more of, and what it won there (won minus lost is the difference of the two FLOP hit rates),
with the commonest (first, second) hit lengths in tokens among the losses. Each policy's
victims are counted by where they sat: right under the root (the head of every prompt
that starts with it: a system prompt, a conversation's first turn), deeper, or output pages
of their own (generated tokens no later prompt holds). Exit status 2 on bad arguments.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import replay  # noqa: E402

PLACES = ("under the root", "deeper", "output pages")
TOP_PAIRS = 3  # commonest (first, second) hit lengths shown per capacity


def measure(trace, cost, config) -> dict:
    """Replay ``config``, noting each request's hit tokens (by its index in the trace) and
    each victim's place (:data:`PLACES`).

    Hits are seen by wrapping the replayer's ``_account_hit`` (called once per served
    request) on this replay only, victims through ``Replayer.watch_victims``. Returns
    ``{"flop_hit_rate", "hits": {index: tokens}, "victims": Counter by place}``.
    """
    from simulator import Replayer, holds_own_output

    replayer = Replayer(trace, cost, config)
    index = {id(req): i for i, req in enumerate(trace.requests)}
    hits: dict[int, int] = {}
    victims: Counter = Counter()
    account_hit = replayer._account_hit

    def noting_hit(req, device_pages, host_pages):
        counted = account_hit(req, device_pages, host_pages)
        hits[index[id(req)]] = counted[0]
        return counted

    def noting_victim(node):
        place = (PLACES[2] if holds_own_output(node) else
                 PLACES[0] if node.parent.parent is None else PLACES[1])
        victims[place] += 1

    replayer._account_hit = noting_hit  # an instance attribute: this replay only
    replayer.watch_victims(noting_victim)
    result = replayer.run()
    return {"flop_hit_rate": result.summary()["flop_hit_rate"], "hits": hits,
            "victims": victims}


def points(trace, cost):
    """A request's hit tokens -> the FLOP hit-rate points they earn: their prefill FLOPs in
    % of all the trace's prompts' (over all requests, those points sum to the FLOP hit
    rate)."""
    total = sum(cost.prefill_flops(0, r.input_length) for r in trace.requests)
    return lambda tokens: 100 * cost.prefill_flops(0, tokens) / total


def compare(trace, cost, first: dict, second: dict) -> dict:
    """Requests ``first`` hit less / more of than ``second``: counts, FLOP hit-rate points
    lost / won (:func:`points`) and the commonest (first, second) hit lengths among the
    losses."""
    earned = points(trace, cost)
    lost = won = 0.0
    fewer = more = 0
    pairs: Counter = Counter()
    for i, a in first["hits"].items():
        b = second["hits"].get(i, 0)
        if a == b:
            continue
        gained = earned(a) - earned(b)
        if a < b:
            fewer, lost = fewer + 1, lost - gained
            pairs[a, b] += 1
        else:
            more, won = more + 1, won + gained
    return {"fewer": fewer, "lost": lost, "more": more, "won": won,
            "pairs": pairs.most_common(TOP_PAIRS)}


def markdown(rows: list[dict], names: tuple[str, str]) -> str:
    a, b = names
    out = [f"`{a}` against `{b}`, request by request (points: % of all prompts' prefill FLOPs)",
           "",
           f"| capacity | FLOP hit {a} / {b} | requests {a} hit less of | points lost | "
           f"requests it hit more of | points won | commonest losses (hit tokens {a}, {b}: "
           f"requests) | victims {a} ({', '.join(PLACES)}) | victims {b} |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["diff"]
        pairs = "; ".join(f"{x}, {y}: {n}" for (x, y), n in d["pairs"]) or "—"
        va, vb = ("/".join(str(v[p]) for p in PLACES) for v in (r["first"]["victims"],
                                                               r["second"]["victims"]))
        out.append(f"| {r['capacity']} | {100 * r['first']['flop_hit_rate']:.2f} / "
                   f"{100 * r['second']['flop_hit_rate']:.2f} % | {d['fewer']} | "
                   f"{d['lost']:.2f} | {d['more']} | {d['won']:.2f} | {pairs} | {va} | {vb} |")
    return "\n".join(out)


def prepare(argv: list[str], prog: str, check=None):
    """replay.py's arguments ``argv`` for a tool that replays the unified tree without a host
    tier (SGLang's default): ``(args, trace, cost, configs)``, or exit status 2 after the
    error is printed. ``check(args)`` may raise ``replay.UsageError`` for the tool's own
    rules."""
    try:
        args = replay.parse_args([*argv, "--no-progress"])
        if check is not None:
            check(args)
        if args.cache != "unified" or args.host_tier:
            raise replay.UsageError(f"{prog} replays the unified tree without a host "
                                    "tier (SGLang's default)")
        return (args, *replay.prepare(args))
    except replay.UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse has printed its message
        return e.code if isinstance(e.code, int) else 2


def measure_all(trace, cost, configs) -> dict[str, dict[str, dict]]:
    """:func:`measure` of every config, with a progress bar: capacity label -> policy ->
    its measure."""
    from tqdm import tqdm

    replay.init_process()
    out: dict[str, dict] = {}
    for config in tqdm(configs, desc="replays", file=sys.stderr):
        out.setdefault(config.capacity_label, {})[config.policy] = measure(trace, cost, config)
    return out


def _two_policies(args) -> None:
    names = args.policies.split(",")
    if len(names) != 2 or names[0] == names[1]:
        raise replay.UsageError("--policies: name two different policies, e.g. mla_aware,lru")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    prepared = prepare(argv, "request_diff.py", _two_policies)
    if isinstance(prepared, int):
        return prepared
    args, trace, cost, configs = prepared
    names = tuple(args.policies.split(","))
    rows = [{"capacity": cap, "first": runs[names[0]], "second": runs[names[1]],
             "diff": compare(trace, cost, runs[names[0]], runs[names[1]])}
            for cap, runs in measure_all(trace, cost, configs).items()]
    print(markdown(rows, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
