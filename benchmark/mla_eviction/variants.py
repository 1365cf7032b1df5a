"""Compare a variant of ``mla_aware`` with its defaults on the bar's sources, in one run.

    python benchmark/mla_eviction/variants.py --set GhostLearning.STEP=0.2
    python benchmark/mla_eviction/variants.py --policy-config '{"value_weight": false}' --seed 1
    python benchmark/mla_eviction/variants.py --set mla_victim_trim.MIN_SURPLUS_SHARE=0.03 \\
        --sources mooncake,gsp-zipf --capacity 5%,10%

A variant is a policy config (``--policy-config``: keys of ``--radix-eviction-policy-config``)
and module constants (``--set NAME=VALUE``, repeatable: a constant of ``mla_aware_policy``,
``mla_victim_trim`` or ``mla_leaf_index``, reached through a class where it lives in one,
as ``GhostLearning.STEP``; the value is JSON of the constant's type). Each source
(bar_check.py's, picked by the same arguments) is replayed at each capacity with
``mla_aware`` alone, once with its defaults and once as the variant, and each row gives
the two FLOP hit rates and their difference, with a sum at the end.

With ``--reference``, a bar_check.py JSON of the same sources, seed and request count
(``docs/results/bar_check.json`` is the one for the defaults), it also counts the bar's
gain and floor checks each side misses against that file's built-ins and bound (and the
``floor-sr`` checks where the file replayed a source with the session radix cache), and
names the checks the variant turns. Replays are deterministic but for their CPU time, so a
defaults column that differs from the file's ``mla_aware`` means the file is stale: that
is reported. Exit status 0 (a report); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bar_check  # noqa: E402
import replay  # noqa: E402

SIDES = ("defaults", "variant")
MODULES = ("mla_aware_policy", "mla_victim_trim", "mla_leaf_index")
SAME = 0.005  # points: rows closer than this count as unchanged


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bar_check.add_source_arguments(p)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                   help="a module constant of the variant, e.g. GhostLearning.STEP=0.2 "
                   "(repeatable)")
    p.add_argument("--policy-config", default=None, help="the variant's mla_aware config (JSON)")
    p.add_argument("--reference", type=Path,
                   help="a bar_check.py JSON of the same sources: count gain/floor misses")
    p.add_argument("--jobs", type=int, default=replay.DEFAULT_JOBS)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--markdown")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    bar_check.resolve_sources(p, args)
    try:
        args.constants = parse_sets(args.sets)
        args.config = replay.load_policy_config(args.policy_config) or {}
    except replay.UsageError as e:
        p.error(str(e))
    if not args.constants and not args.config:
        p.error("nothing to compare: give --set and/or --policy-config")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.reference is not None:
        args.reference_replays = load_reference(p, args.reference)
    return args


def parse_sets(specs: list[str]) -> dict[str, Any]:
    """``NAME=VALUE`` specs as ``{name: value}``; each name must reach an existing
    constant and each value be JSON of its type (an int where a float is, too)."""
    out = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        name = name.strip()
        if not (sep and name and text.strip()):
            raise replay.UsageError(f"--set: expected NAME=VALUE, got {spec!r}")
        owner, attr = resolve(name)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise replay.UsageError(f"--set {name}: {text!r} is not JSON (numbers, true, "
                                    'false, "strings")') from None
        old = getattr(owner, attr)
        same_type = type(value) is type(old) or (
            isinstance(old, float) and type(value) is int)
        if not same_type:
            raise replay.UsageError(f"--set {name}: {value!r} is a {type(value).__name__}, "
                                    f"the constant a {type(old).__name__} ({old!r})")
        out[name] = value
    return out


def resolve(name: str) -> tuple[Any, str]:
    """The object holding constant ``name`` and the attribute's name.

    ``name`` is ``[module.]Attr[.Attr...]``, the module one of :data:`MODULES` (looked
    for in that order when not given). Only upper-case attributes are constants.
    """
    import importlib

    parts = name.split(".")
    modules = [parts.pop(0)] if parts[0] in MODULES else list(MODULES)
    if not parts or not parts[-1].isupper():
        raise replay.UsageError(f"--set {name}: not a constant (an UPPER_CASE attribute)")
    for module_name in modules:
        owner: Any = importlib.import_module(f"sglang.srt.mem_cache.{module_name}")
        for part in parts[:-1]:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, parts[-1]):
            return owner, parts[-1]
    raise replay.UsageError(f"--set {name}: no such constant in {', '.join(modules)}")


def load_reference(p: argparse.ArgumentParser, path: Path) -> dict[str, list[dict]]:
    """A bar_check.py JSON's replays by source, non-host-tier; ``p.error`` if unreadable."""
    try:
        replays = json.loads(path.read_text())["replays"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"--reference {path}: not a bar_check.py JSON ({type(e).__name__}: {e})")
    return {name: rows for name, rows in replays.items() if "+host" not in name}


@contextlib.contextmanager
def patched(constants: dict[str, Any]) -> Iterator[None]:
    """Set the constants for the duration, then put the old values back."""
    saved = []
    try:
        for name, value in constants.items():
            owner, attr = resolve(name)
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, value)
        yield
    finally:
        for owner, attr, old in reversed(saved):
            setattr(owner, attr, old)


def jobs(args) -> list[tuple]:
    """One replay per (source, capacity, side), the two sides of a row together."""
    caps = [c.strip() for c in args.capacity.split(",") if c.strip()]
    common = ("--num-requests", str(args.num_requests), "--seed", str(args.seed))
    return [(name, (*args.source_args[name], *common), cap, side)
            for name in args.sources for cap in caps for side in SIDES]


@functools.lru_cache(maxsize=2)
def _source(source_argv: tuple) -> tuple:
    """A source's trace and cost model, built once per process."""
    rargs = replay.parse_args([*source_argv, "--no-progress"])
    return replay.load_trace(rargs), replay.build_cost_model(rargs)


def run_one(job: tuple, constants: dict, config: dict) -> dict:
    """One replay of ``mla_aware`` (the variant's side patched and configured): its
    summary with ``source`` and ``side`` added."""
    from simulator import Replayer

    name, source_argv, cap, side = job
    variant = side == "variant"
    policy_config = ["--policy-config", json.dumps(config)] if variant and config else []
    rargs = replay.parse_args([*source_argv, "--capacity", cap, "--policies", "mla_aware",
                               *policy_config, "--no-progress"])
    trace, cost = _source(source_argv)
    (cfg,) = replay.plan(rargs, trace, cost)
    with patched(constants if variant else {}):
        summary = Replayer(trace, cost, cfg).run().summary()
    return {**summary, "source": name, "side": side}


def run_all(args) -> list[dict]:
    from tqdm import tqdm

    todo = jobs(args)
    one = functools.partial(run_one, constants=args.constants, config=args.config)
    with tqdm(total=len(todo), desc="replays", unit="run", disable=args.no_progress,
              file=sys.stderr) as bar:
        if args.jobs == 1:
            replay.init_process()
            results = []
            for job in todo:
                results.append(one(job))
                bar.update()
            return results
        with ProcessPoolExecutor(args.jobs, initializer=replay.init_process) as pool:
            futures = [pool.submit(one, job) for job in todo]
            for f in futures:
                f.add_done_callback(lambda _: bar.update())
            return [f.result() for f in futures]


def compare(results: list[dict], reference: dict | None = None) -> dict:
    """Rows (source, capacity, both rates, difference), a summary and, against
    ``reference`` (replays by source), the gain/floor checks each side misses."""
    by_key: dict = {}
    for r in results:
        by_key.setdefault((r["source"], r["capacity"]), {})[r["side"]] = r
    rows = []
    for (source, cap), sides in by_key.items():
        base, var = (100 * sides[s]["flop_hit_rate"] for s in SIDES)
        rows.append({"source": source, "capacity": cap, "defaults": base, "variant": var,
                     "difference": var - base})
    diffs = [r["difference"] for r in rows]
    summary = {"rows": len(rows), "sum": sum(diffs),
               "up": sum(d > SAME for d in diffs), "down": sum(d < -SAME for d in diffs)}
    out = {"rows": rows, "summary": summary}
    if reference is not None:
        out["bar"] = bar_against(by_key, reference)
    return out


def bar_against(by_key: dict, reference: dict) -> dict:
    """The gain and floor checks of each side, with ``reference``'s other policies, and
    ``floor-sr`` where the reference replayed the source with the session radix cache."""
    checks: dict = {side: [] for side in SIDES}
    stale, missing = [], []
    for (source, cap), sides in by_key.items():
        group = [r for r in reference.get(source, ()) if r["capacity"] == cap]
        if not group:
            missing.append(f"{source} {cap}")
            continue
        others = [r for r in group if r["policy"] != bar_check.CANDIDATE]
        ref_mla = [r for r in group if r["policy"] == bar_check.CANDIDATE]
        if ref_mla and abs(ref_mla[0]["flop_hit_rate"] - sides["defaults"]["flop_hit_rate"]) > 1e-9:
            stale.append(f"{source} {cap}")
        for side in SIDES:
            mine = {**sides[side], "policy": bar_check.CANDIDATE}
            checks[side] += [c for c in bar_check.checks(source, [*others, mine])
                             if c["check"] in ("gain", "floor")]
            with_sessions = [r for r in reference.get(f"{source}{bar_check.SESSION_RADIX}", ())
                             if r["capacity"] == cap]
            if with_sessions:
                checks[side] += bar_check.session_radix_floor(source, [mine], with_sessions)
    misses = {side: sum(c["pass"] is False for c in checks[side]) for side in SIDES}
    turned = [
        f"{v['check']} {v['source']} {v['capacity']}: {'PASS' if v['pass'] else 'MISS'}"
        for d, v in zip(checks["defaults"], checks["variant"]) if d["pass"] != v["pass"]
    ]
    counted = sum(c["pass"] is not None for c in checks["defaults"])
    return {"misses": misses, "checks": counted, "turned": turned, "stale": stale,
            "not_in_reference": missing}


def markdown(comparison: dict, constants: dict, config: dict) -> str:
    what = [f"`{k}={json.dumps(v)}`" for k, v in constants.items()]
    if config:
        what.append(f"`--policy-config '{json.dumps(config)}'`")
    lines = [f"Variant: {', '.join(what)}", "",
             "| source | capacity | defaults | variant | difference |", "|---|---|---|---|---|"]
    for r in comparison["rows"]:
        lines.append(f"| {r['source']} | {r['capacity']} | {r['defaults']:.2f} % | "
                     f"{r['variant']:.2f} % | {r['difference']:+.2f} |")
    s = comparison["summary"]
    lines += ["", f"FLOP hit rate, variant minus defaults: {s['sum']:+.2f} points over "
              f"{s['rows']} rows ({s['up']} up, {s['down']} down, the rest within {SAME})."]
    bar = comparison.get("bar")
    if bar:
        m = bar["misses"]
        lines.append(f"Gain and floor checks (floor-sr too) missed (of {bar['checks']}): defaults "
                     f"{m['defaults']}, variant {m['variant']}"
                     + (f"; turned: {'; '.join(bar['turned'])}." if bar["turned"] else "."))
        if bar["stale"]:
            lines.append(f"The reference's mla_aware differs from these defaults at "
                         f"{', '.join(bar['stale'])}: it is stale there.")
        if bar["not_in_reference"]:
            lines.append(f"Not in the reference: {', '.join(bar['not_in_reference'])}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        results = run_all(args)
    except replay.UsageError as e:
        print(f"variants.py: error: {e}", file=sys.stderr)
        return 2
    comparison = compare(results, getattr(args, "reference_replays", None))
    text = markdown(comparison, args.constants, args.config)
    print(text)
    if args.markdown:
        replay._write_atomic(args.markdown, text + "\n")
    if args.json_path:
        payload = {"set": args.constants, "policy_config": args.config, **comparison,
                   "replays": results}
        replay._write_atomic(args.json_path, json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
