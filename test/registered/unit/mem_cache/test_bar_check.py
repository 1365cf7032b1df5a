"""Tests for benchmark/mla_eviction/bar_check.py: the issue-4 bar, row by row."""

import argparse
import contextlib
import io
import json
import sys
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction"))

import bar_check  # noqa: E402


def summary(policy, capacity, flop, *, cpu=100.0, prefill_ms=50.0, p50=1.0, gap=None):
    return {"policy": policy, "capacity": capacity, "flop_hit_rate": flop / 100,
            "cpu_us_per_request": cpu, "prefill_ms_per_request": prefill_ms,
            "ttft_p50_s": p50, "gap_closed": gap}


def group(capacity, mla, *, lru=20.0, best=("lfu", 20.0), bound=40.0, **kw):
    rows = [summary(p, capacity, lru) for p in bar_check.BUILTINS if p != best[0]]
    rows.append(summary(best[0], capacity, best[1]))
    rows.append(summary("optimal", capacity, bound))
    rows.append(summary("mla_aware", capacity, mla, **kw))
    return rows


class TestChecks(CustomTestCase):
    def by_check(self, rows):
        return {r["check"]: r for r in rows}

    def test_gain_needs_fifteen_percent_where_the_bound_leaves_ten_points(self):
        ok = self.by_check(bar_check.checks("t", group("5%", 23.01)))["gain"]
        self.assertTrue(ok["pass"])
        self.assertAlmostEqual(ok["gain"], 0.1505)
        self.assertFalse(self.by_check(bar_check.checks("t", group("5%", 22.99)))["gain"]["pass"])
        # Less than 10 points of headroom: the gain bar does not apply.
        flat = self.by_check(bar_check.checks("t", group("1%", 20.0, bound=29.9)))["gain"]
        self.assertIsNone(flat["pass"])
        self.assertFalse(flat["applies"])
        # Only at 1 % and 5 %.
        self.assertNotIn("gain", self.by_check(bar_check.checks("t", group("10%", 20.0))))

    def test_floor_is_half_a_point_below_the_best_builtin(self):
        rows = self.by_check(bar_check.checks("t", group("25%", 29.5, best=("slru", 30.0))))
        self.assertTrue(rows["floor"]["pass"])
        self.assertEqual(rows["floor"]["best_builtin"], "slru")
        rows = self.by_check(bar_check.checks("t", group("25%", 29.49, best=("slru", 30.0))))
        self.assertFalse(rows["floor"]["pass"])

    def test_session_radix_floor_takes_the_best_builtin_with_the_session_radix_cache(self):
        plain = group("5%", 46.5)
        with_sessions = [summary(p, "5%", 46.0) for p in bar_check.BUILTINS]
        with_sessions[bar_check.BUILTINS.index("priority")] = summary("priority", "5%", 47.01)
        (row,) = bar_check.session_radix_floor("t", plain, with_sessions)
        self.assertEqual((row["check"], row["best_builtin"], row["best"]), ("floor-sr", "priority", 47.01))
        self.assertFalse(row["pass"])  # 46.5 is 0.51 below
        with_sessions[bar_check.BUILTINS.index("priority")] = summary("priority", "5%", 47.0)
        self.assertTrue(bar_check.session_radix_floor("t", plain, with_sessions)[0]["pass"])
        self.assertIn("best built-in + session radix cache priority 47.00 %",
                      bar_check.markdown(bar_check.session_radix_floor("t", plain, with_sessions)))

    def test_only_sources_with_session_ids_carry_sessions(self):
        args = bar_check.parse_args(["--num-requests", "40"])
        self.assertTrue(bar_check.carries_sessions("multi-turn", args))
        self.assertFalse(bar_check.carries_sessions("chat", args))

    def test_cpu_share_of_modelled_prefill(self):
        # LRU spends 100 µs; 1 % of 50 ms is 500 µs.
        self.assertTrue(self.by_check(bar_check.checks("t", group("10%", 20.0, cpu=599.0)))["cpu"]["pass"])
        self.assertFalse(self.by_check(bar_check.checks("t", group("10%", 20.0, cpu=600.0)))["cpu"]["pass"])

    def test_cpu_is_the_least_of_the_runs(self):
        first = group("10%", 20.0, cpu=900.0)
        later = iter([[summary("lru", "10%", 20.0, cpu=80.0), summary("mla_aware", "10%", 20.0, cpu=950.0)],
                      [summary("lru", "10%", 20.0, cpu=120.0), summary("mla_aware", "10%", 20.0, cpu=700.0)]])
        calls = []

        def fake_replay(name, args, host_tier=False, policies=""):
            calls.append((policies, args.jobs))
            return next(later)

        saved, bar_check.replay_source = bar_check.replay_source, fake_replay
        try:
            out = bar_check.least_cpu("t", argparse.Namespace(cpu_runs=3, jobs=2), first)
        finally:
            bar_check.replay_source = saved
        self.assertEqual(calls, [("lru,mla_aware", 1)] * 2)  # one replay at a time
        cpu = {r["policy"]: (r["cpu_us_per_request"], r.get("cpu_runs")) for r in out}
        self.assertEqual(cpu["lru"], (80.0, 3))
        self.assertEqual(cpu["mla_aware"], (700.0, 3))
        self.assertEqual(cpu["lfu"], (100.0, None))  # other policies as replayed once
        self.assertEqual(self.by_check(bar_check.checks("t", out))["cpu"]["added_cpu_us"], 620.0)

    def test_ttft_cut_with_a_host_tier(self):
        rows = [summary("lru", "5%", 20.0, p50=1.0), summary("mla_aware", "5%", 30.0, p50=0.7)]
        (row,) = bar_check.checks("t", rows, host_tier=True)
        self.assertEqual(row["check"], "ttft")
        self.assertTrue(row["pass"])
        rows[1]["ttft_p50_s"] = 0.71
        self.assertFalse(bar_check.checks("t", rows, host_tier=True)[0]["pass"])

    def test_markdown_counts_misses(self):
        rows = bar_check.checks("t", group("5%", 21.0)) + bar_check.checks("t", group("25%", 19.0))
        text = bar_check.markdown(rows)
        self.assertIn("| gain | t | 5% |", text)
        self.assertIn("**MISS**", text)
        self.assertTrue(text.endswith("2 of 5 checks missed."))
        self.assertTrue(text.startswith("| check | source | capacity | mla_aware |"))


def tiny_trace(directory: Path) -> Path:
    """A 12-request Mooncake-format trace written to ``directory/t.jsonl``."""
    lines = [{"timestamp": 1000 * i, "input_length": 1500, "output_length": 10,
              "hash_ids": [0, 1 + i % 3, 4 + i]} for i in range(12)]
    path = directory / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


class TestCli(CustomTestCase):
    def test_unknown_source_exits_2(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as ctx:
            bar_check.main(["--sources", "nope"])
        self.assertEqual(ctx.exception.code, 2)
        self.assertIn("unknown ['nope']", err.getvalue())

    def test_trace_adds_a_named_source(self):
        args = bar_check.parse_args(["--trace", "conv=/data/conversation_trace.jsonl"])
        self.assertEqual(args.sources, [*bar_check.SOURCES, "conv"])
        self.assertEqual(args.source_args["conv"], ["--trace", "/data/conversation_trace.jsonl"])
        only = bar_check.parse_args(["--trace", "conv=/x.jsonl", "--sources", "conv"])
        self.assertEqual(only.sources, ["conv"])

    def test_bad_trace_spec_exits_2(self):
        for spec, says in (("conv", "expected NAME=PATH"), ("=/x.jsonl", "expected NAME=PATH"),
                           ("a,b=/x.jsonl", "expected NAME=PATH"), ("chat=/x.jsonl", "is taken")):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as ctx:
                bar_check.parse_args(["--trace", spec])
            self.assertEqual(ctx.exception.code, 2)
            self.assertIn(says, err.getvalue())

    def test_trace_source_end_to_end(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = tiny_trace(Path(tmp))
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                status = bar_check.main(["--trace", f"tiny={path}", "--sources", "tiny",
                                         "--capacity", "25%", "--jobs", "1", "--cpu-runs", "1",
                                         "--no-progress"])
            self.assertEqual(status, 0)
            self.assertIn("| floor | tiny | 25% |", out.getvalue())
            self.assertIn("| ttft | tiny+host4x | 25% |", out.getvalue())
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                status = bar_check.main(["--trace", f"gone={path}.missing", "--sources", "gone",
                                         "--no-progress"])
            self.assertEqual(status, 2)
            self.assertIn("t.jsonl.missing: no such file", err.getvalue())

    def test_trim_victims_reaches_every_replay(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = tiny_trace(Path(tmp))
            for trim, lru_trims in (("policy", False), ("all", True), ("none", False)):
                with self.subTest(trim=trim):
                    args = bar_check.parse_args(["--trace", f"tiny={path}", "--sources", "tiny",
                                                 "--capacity", "25%", "--jobs", "1",
                                                 "--trim-victims", trim, "--no-progress"])
                    with contextlib.redirect_stderr(io.StringIO()):
                        results = bar_check.replay_source("tiny", args)
                    trimmed = {r["policy"]: r["trimmed"] for r in results}
                    self.assertEqual(trimmed["lru"], lru_trims)
                    self.assertEqual(trimmed["mla_aware"], trim != "none")
                    self.assertEqual(trimmed["optimal"], trim != "none")

    def test_small_run_end_to_end(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            status = bar_check.main(["--sources", "chat", "--num-requests", "120", "--seed", "1",
                                     "--capacity", "5%", "--jobs", "1", "--cpu-runs", "2",
                                     "--no-progress"])
        self.assertEqual(status, 0)
        text = out.getvalue()
        for check in ("floor", "gain", "cpu"):
            self.assertIn(f"| {check} | chat | 5% |", text)


if __name__ == "__main__":
    unittest.main()
