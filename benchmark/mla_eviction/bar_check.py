"""The project's acceptance check: ``mla_aware`` against SGLang's built-ins and the
published peers, over run-to-run noise, in one command.

    python benchmark/mla_eviction/bar_check.py \\
        --variant no-factor='{"learn_factor": false}' \\
        --variant no-weight='{"learn_weight": false}'

Each source and capacity is replayed with the built-ins (Rust tree core), the peers,
mla_aware and its ``--variant`` configs (Python core), on the trace as given and on
``--jitters`` N arrival jitters. Checks: floor (mla_aware's mean FLOP hit rate at most
0.5 points below any built-in or peer), gain (synthetic, 5 % and 10 %: >= 90 % of its
gain over LRU at a4e6c30), aim (conversation, 5 %: 1.10x LRU), cpu (cache CPU per
request <= 2.5x stock SGLang's, medians of interleaved single-process replays).
Exit status 0: every check passes; 1: one misses (or
the outputs could not be written); 2: bad input (one line on stderr, nothing run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import replay  # noqa: E402
from replay import UsageError  # noqa: E402

CANDIDATE = "mla_aware"
PYTHON_LRU = "lru (python core)"
BUILTINS = tuple(replay.BUILTINS.split(","))
PEERS = tuple(replay.PEER_NAMES.split(","))
POLICIES = ",".join((*BUILTINS, *PEERS, CANDIDATE))
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
TRACES = {
    n: f"../shared/traces/mooncake_{n}_trace.jsonl"
    for n in ("conversation", "synthetic")
}
WORKLOADS = ("chat", "few-shot", "multi-turn", "gsp")
FLOOR_POINTS, GAIN_SHARE, AIM_RATIO, CPU_LIMIT = 0.5, 0.9, 1.10, 2.5
# Targets: mla_aware's gain over LRU in FLOP-hit points on the synthetic trace at
# commit a4e6c30 (docs/results/mooncake_timed.md there): 22.45 - 13.32 at 5 %,
# 33.51 - 24.60 at 10 %.
REFERENCE_GAIN = {"5%": 9.13, "10%": 8.91}
CHECK_KEYS = ("check", "source", "capacity", "pass", "measured", "reference")
INTRO = """# mla_aware acceptance check

`{command}`

{runs} runs per (source, capacity): run 0 is the trace as given, runs 1..{jitters} \
arrival jitters (replay.py --jitter-seed); generated workloads: seeds 0..{jitters}. \
FLOP hit rates in %, mean ± spread over runs, spread = (max - min) / 2; differences \
paired by run: a win if mean > spread, a loss if mean < -spread, else within spread. \
Built-ins on SGLang's Rust tree core, peers and mla_aware on the Python core. \
Took {minutes:.1f} min.

| check | source | capacity | measured | reference | result |
|---|---|---|---|---|---|"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv) -> argparse.Namespace:
    """The options, checked (UsageError); ``args.sources`` maps each source to its
    replay.py arguments, ``args.variants`` each row label to its policy config."""
    from sglang.srt.mem_cache.mla_aware_policy import PolicyConfig, PolicyConfigError
    from sglang.srt.mem_cache.mla_cost_model import Calibration, ModelConfigError

    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", help="comma list (default: every trace)")
    p.add_argument("--trace", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--capacity", default="5%,10%,25%")
    p.add_argument("--jitters", type=int, default=3, help="runs beyond the first")
    p.add_argument("--num-requests", type=int, default=2000, help="per workload")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON")
    p.add_argument("--cpu-rounds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--markdown", default=str(RESULTS / "bar_check.md"))
    p.add_argument("--json", dest="json_path", default=str(RESULTS / "bar_check.json"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("jitters", "num_requests", "cpu_rounds", "jobs"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be >= 1, got {getattr(args, name)}")
    traces = {name: str(REPO / path) for name, path in TRACES.items()}
    for spec in args.trace:
        name, sep, path = spec.partition("=")
        if not (sep and name and path) or "," in name or name in WORKLOADS:
            raise UsageError(f"--trace {spec!r}: expected NAME=PATH (NAME no workload)")
        traces[name] = path
    names = args.sources.split(",") if args.sources else [*traces]
    names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    known = [*traces, *WORKLOADS]
    for name in names or [""]:
        if name not in known:
            raise UsageError(f"--sources: unknown {name!r}; known: {', '.join(known)}")
    args.sources = {
        n: ["--trace", traces[n]] if n in traces else ["--workload", n] for n in names
    }
    args.variants = {}
    for spec in args.variant:
        name, sep, text = spec.partition("=")
        label = f"{CANDIDATE}[{name}]"
        if not (sep and name) or label in args.variants:
            raise UsageError(f"--variant {spec!r}: expected a new NAME=JSON")
        try:
            args.variants[label] = json.loads(text)
            calibration = PolicyConfig.parse(args.variants[label]).calibration
            if calibration is not None:
                Calibration.load(calibration)
        except json.JSONDecodeError as e:
            raise UsageError(f"--variant {name}: not JSON: {e}") from None
        except (PolicyConfigError, ModelConfigError) as e:
            raise UsageError(f"--variant {name}: {e}") from None
    replay.check_output_path("--markdown", args.markdown)
    replay.check_output_path("--json", args.json_path)
    return args


def plan(args) -> tuple[list, dict]:
    """The replays, as (row labels, replay.py arguments, config), and per source its
    first run's (trace, cost model, configs)."""
    tasks, first = [], {}
    for name, source in args.sources.items():
        for run in range(args.jitters + 1):
            seed = ["--jitter-seed", str(run)]
            if source[0] == "--workload":
                seed = ["--seed", str(run), "--num-requests", str(args.num_requests)]
            argv = (*source, *seed, "--capacity", args.capacity, "--policies", POLICIES)
            try:
                trace, cost, configs = replay.prepare(replay.parse_args(argv))
            except UsageError as e:
                raise UsageError(f"source {name}: {e}") from None
            first.setdefault(name, (trace, cost, configs))
            meta = {"source": name, "run": run}
            tasks += [({**meta, "label": c.policy}, argv, c) for c in configs]
            mla = [c for c in configs if c.policy == CANDIDATE]
            for label, config in args.variants.items():
                mla_v = [dataclasses.replace(c, policy_config=config) for c in mla]
                tasks += [({**meta, "label": label}, argv, c) for c in mla_v]
    return tasks, first


_LOADED: dict = {}


def _replay(argv: tuple, config) -> dict:
    """One replay's summary, in a process set up by replay.init_process()."""
    from simulator import Replayer

    if argv not in _LOADED:
        rargs = replay.parse_args(list(argv))
        _LOADED[argv] = (replay.load_trace(rargs), replay.build_cost_model(rargs))
    return Replayer(*_LOADED[argv], config).run().summary()


def replay_all(args, tasks, bar) -> list[dict]:
    """Each task's labels and replay summary (``cpu_vs_stock`` set per run)."""
    with ProcessPoolExecutor(args.jobs, initializer=replay.init_process) as pool:
        futures = [pool.submit(_replay, argv, c) for _, argv, c in tasks]
        for f in futures:
            f.add_done_callback(lambda _: bar.update())
        results = [f.result() for f in futures]
    rows = [{**meta, **r} for (meta, _, _), r in zip(tasks, results)]
    for key in dict.fromkeys((r["source"], r["run"]) for r in rows):
        replay.add_relative_figures([r for r in rows if (r["source"], r["run"]) == key])
    return rows


def cpu_rounds(args, first: dict, bar) -> dict:
    """Cache CPU per request of stock SGLang (LRU, Rust core), of LRU on the Python
    core (what mla_aware's tree costs without its policy) and of mla_aware, replayed
    alternately in this process, ``args.cpu_rounds`` times each."""
    from simulator import Replayer

    source = "synthetic" if "synthetic" in first else next(iter(first))
    trace, cost, configs = first[source]
    caps = [c.capacity_label for c in configs]
    cap = "5%" if source == "synthetic" and "5%" in caps else caps[0]
    at_cap = {c.policy: c for c in configs if c.capacity_label == cap}
    runs = {
        "lru": at_cap["lru"],
        PYTHON_LRU: dataclasses.replace(at_cap["lru"], tree_core="python"),
        CANDIDATE: at_cap[CANDIDATE],
    }
    replay.init_process()
    us: dict = {name: [] for name in runs}
    cores: dict = {}  # the tree core SGLang ran each on
    for _ in range(args.cpu_rounds):
        for name, config in runs.items():
            summary = Replayer(trace, cost, config).run().summary()
            us[name].append(summary["cpu_us_per_request"])
            cores[name] = summary["tree_core"]
            bar.update()
    return {"source": source, "capacity": cap, "us_per_request": us, "cores": cores}


def spread(values) -> float:
    return (max(values) - min(values)) / 2


def classify(mean: float, half: float) -> str:
    return "win" if mean > half else "loss" if mean < -half else "within spread"


def compare(a: list, b: list) -> dict:
    """``a`` minus ``b`` (rates by run), paired by run: mean, spread and class."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean, half = statistics.fmean(diffs), spread(diffs)
    return {"mean": mean, "spread": half, "class": classify(mean, half)}


def rates(rows: list[dict]) -> dict:
    """(source, capacity) -> row label -> FLOP hit rate in % by run."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: r["run"]):
        group = out.setdefault((r["source"], r["capacity"]), {})
        group.setdefault(r["label"], []).append(100 * r["flop_hit_rate"])
    return out


def checks(by_cap: dict, cpu: dict) -> list[dict]:
    """The check rows from :func:`rates` and :func:`cpu_rounds`' result."""
    out = []
    for (source, cap), by in by_cap.items():
        mla, lru = statistics.fmean(by[CANDIDATE]), statistics.fmean(by["lru"])
        means = {p: statistics.fmean(by[p]) for p in (*BUILTINS, *PEERS) if p in by}
        best = max(means, key=means.get)
        got = f"mla_aware {mla:.2f} % ({mla - means[best]:+.2f} pts)"
        ref = (
            f"best built-in/peer {best} {means[best]:.2f} %, floor -{FLOOR_POINTS} pts"
        )
        out.append(("floor", source, cap, mla >= means[best] - FLOOR_POINTS, got, ref))
        if source == "synthetic" and cap in REFERENCE_GAIN:
            gain, target = compare(by[CANDIDATE], by["lru"]), REFERENCE_GAIN[cap]
            got = f"{gain['mean']:+.2f} ± {gain['spread']:.2f} pts over LRU"
            got += f" ({mla:.2f} % vs {lru:.2f} %)"
            ref = f">= 90 % of {target:+.2f} pts (a4e6c30) = {GAIN_SHARE * target:+.2f}"
            ok = gain["mean"] >= GAIN_SHARE * target
            out.append(("gain", source, cap, ok, got, ref))
        if source == "conversation" and cap == "5%":
            ratio = mla / lru if lru else float("inf")
            got = f"{ratio:.3f}x LRU ({mla:.2f} % vs {lru:.2f} %)"
            out.append(("aim", source, cap, ratio >= AIM_RATIO, got, f"{AIM_RATIO}x"))
    us = cpu["us_per_request"]
    base, mla = statistics.median(us["lru"]), statistics.median(us[CANDIDATE])
    ratio = mla / base if base else float("inf")
    core = cpu["cores"]["lru"]
    got = f"{ratio:.2f}x: mla_aware {mla:.0f} µs/req, lru ({core}) {base:.0f} µs/req"
    if us.get(PYTHON_LRU):  # the tree core's share, for the reader
        alone = statistics.median(us[PYTHON_LRU])
        got += f"; lru (python) {alone:.0f} µs/req, {alone / base:.2f}x"
    ref = f"<= {CPU_LIMIT}x stock SGLang (medians, {len(us['lru'])} rounds)"
    out.append(("cpu", cpu["source"], cpu["capacity"], ratio <= CPU_LIMIT, got, ref))
    return [dict(zip(CHECK_KEYS, row)) for row in out]


def comparisons(by_cap: dict) -> list[dict]:
    """mla_aware minus every other policy, and every variant minus mla_aware."""
    out = []
    for (source, cap), by in by_cap.items():
        for label, values in by.items():
            variant = label.startswith(f"{CANDIDATE}[")
            if label != CANDIDATE:
                a, b = (values, by[CANDIDATE]) if variant else (by[CANDIDATE], values)
                meta = {"source": source, "capacity": cap, "policy": label}
                out.append({**meta, "ablation": variant, **compare(a, b)})
    return out


def markdown(command, args, first, by_cap, check_rows, comps, seconds) -> str:
    n, minutes = args.jitters, seconds / 60
    lines = [INTRO.format(command=command, runs=n + 1, jitters=n, minutes=minutes)]
    for c in check_rows:
        cells = [c[k] for k in CHECK_KEYS if k != "pass"]
        cells.append("PASS" if c["pass"] else "**MISS**")
        lines.append("| " + " | ".join(cells) + " |")
    missed = sum(not c["pass"] for c in check_rows)
    lines += ["", f"{len(check_rows) - missed} of {len(check_rows)} checks passed."]
    for source, (trace, _, configs) in first.items():
        caps = list(dict.fromkeys(c.capacity_label for c in configs))
        head = ["", f"| policy | {' | '.join(caps)} |", "|---" * (len(caps) + 1) + "|"]
        lines += ["", f"## {source}", "", f"{len(trace.requests)} requests, "]
        lines[-1] += f"{trace.num_unique_blocks()} unique blocks (run 0)."
        lines += ["", "FLOP hit rate (%), mean ± spread over runs:", *head]
        for label in by_cap[(source, caps[0])]:
            values = [by_cap[(source, cap)][label] for cap in caps]
            cells = [f"{statistics.fmean(v):.2f} ± {spread(v):.2f}" for v in values]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        for ablation in (False, True):
            table: dict = {}
            for c in comps:
                if c["source"] == source and c["ablation"] == ablation:
                    cell = f"{c['mean']:+.2f} ± {c['spread']:.2f} {c['class']}"
                    table.setdefault(c["policy"], []).append(cell)
            title = "Ablation: variant minus mla_aware" if ablation else CANDIDATE
            title += "" if ablation else " minus each policy"
            if table:
                lines += ["", f"{title} (points, paired by run):", *head]
                lines += [f"| {p} | " + " | ".join(v) + " |" for p, v in table.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from tqdm import tqdm

    argv = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "benchmark/mla_eviction/bar_check.py", *argv])
    start = time.monotonic()
    try:
        args = parse_args(argv)
        tasks, first = plan(args)
    except UsageError as e:
        print(f"bar_check.py: error: {e}", file=sys.stderr)
        return 2
    total = len(tasks) + 3 * args.cpu_rounds
    bar = tqdm(total=total, desc="replays", disable=args.no_progress, file=sys.stderr)
    rows = replay_all(args, tasks, bar)
    cpu = cpu_rounds(args, first, bar)
    bar.close()
    by_cap = rates(rows)
    check_rows, comps = checks(by_cap, cpu), comparisons(by_cap)
    seconds = time.monotonic() - start
    text = markdown(command, args, first, by_cap, check_rows, comps, seconds)
    print(text, end="")
    payload = {"command": command, "runs": args.jitters + 1, "seconds": round(seconds)}
    payload.update(checks=check_rows, comparisons=comps, cpu=cpu, rows=rows)
    blob = json.dumps(payload, indent=2) + "\n"
    outs = [("--markdown", args.markdown, text), ("--json", args.json_path, blob)]
    writes = [(f, p, lambda tmp, t=t: Path(tmp).write_text(t)) for f, p, t in outs]
    try:
        replay.write_outputs(writes)  # both or neither
    except OSError as e:
        print(f"bar_check.py: error: {e}", file=sys.stderr)
        return 1
    return 0 if all(c["pass"] for c in check_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
