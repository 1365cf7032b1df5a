"""Tests for benchmark/mla_eviction/bar_check.py: the noise arithmetic, the check
verdicts on hand-made rows, bad input, and one small run end to end."""

import contextlib
import io
import json
import sys
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="base-a-test-cpu")

sys.path.insert(
    0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction")
)

import bar_check  # noqa: E402


def rows(source, capacity, **rates):
    """Replay rows for one (source, capacity): label -> FLOP hit rates in % by run
    (``mla_aware[x]`` as the keyword ``mla_aware_x``)."""
    out = []
    for label, values in rates.items():
        if label.startswith("mla_aware_"):
            label = f"mla_aware[{label[len('mla_aware_') :]}]"
        for run, rate in enumerate(values):
            out.append(
                {"source": source, "capacity": capacity, "run": run, "label": label}
                | {"flop_hit_rate": rate / 100}
            )
    return out


def group(source, capacity, mla, lru=(20.0, 20.0), best=("s3fifo", (20.0, 20.0))):
    """Every built-in and peer at ``lru`` except ``best``, and mla_aware at ``mla``."""
    rates = {p: lru for p in (*bar_check.BUILTINS, *bar_check.PEERS)}
    rates[best[0]] = best[1]
    return rows(source, capacity, **rates, mla_aware=mla)


def cpu(lru, mla, source="synthetic", capacity="5%"):
    us = {"lru": list(lru), "mla_aware": list(mla)}
    cores = {"lru": "rust", "mla_aware": "python"}
    return {
        "source": source,
        "capacity": capacity,
        "us_per_request": us,
        "cores": cores,
    }


def verdicts(check_rows, kind):
    return [
        (r["source"], r["capacity"], r["pass"])
        for r in check_rows
        if r["check"] == kind
    ]


class TestNoise(CustomTestCase):
    def test_spread_is_half_the_range(self):
        self.assertEqual(bar_check.spread([3.0]), 0.0)
        self.assertAlmostEqual(bar_check.spread([1.0, 4.0, 2.5]), 1.5)

    def test_paired_differences_mean_spread_and_class(self):
        # diffs 2, 1, 4: mean 7/3, spread (4 - 1) / 2 = 1.5, mean > spread.
        c = bar_check.compare([30.0, 32.0, 31.0], [28.0, 31.0, 27.0])
        self.assertAlmostEqual(c["mean"], 7 / 3)
        self.assertAlmostEqual(c["spread"], 1.5)
        self.assertEqual(c["class"], "win")
        # diffs -0.5, 1: mean 0.25, spread 0.75.
        c = bar_check.compare([20.0, 21.0], [20.5, 20.0])
        self.assertAlmostEqual(c["mean"], 0.25)
        self.assertAlmostEqual(c["spread"], 0.75)
        self.assertEqual(c["class"], "within spread")
        # diffs -1, -2, -0.5: mean -7/6, spread 0.75, mean < -spread.
        c = bar_check.compare([10.0, 10.0, 10.0], [11.0, 12.0, 10.5])
        self.assertAlmostEqual(c["mean"], -7 / 6)
        self.assertAlmostEqual(c["spread"], 0.75)
        self.assertEqual(c["class"], "loss")
        # Paired by run, not by sorted value: diffs 0 and 2 give mean 1 = spread.
        c = bar_check.compare([5.0, 7.0], [5.0, 5.0])
        self.assertEqual(
            (c["mean"], c["spread"], c["class"]), (1.0, 1.0, "within spread")
        )
        with self.assertRaises(ValueError):
            bar_check.compare([1.0, 2.0], [1.0])

    def test_classify_bounds_are_strict(self):
        self.assertEqual(bar_check.classify(0.3, 0.2), "win")
        self.assertEqual(bar_check.classify(0.2, 0.2), "within spread")
        self.assertEqual(bar_check.classify(-0.2, 0.2), "within spread")
        self.assertEqual(bar_check.classify(-0.3, 0.2), "loss")
        self.assertEqual(bar_check.classify(0.0, 0.0), "within spread")

    def test_rates_are_percent_in_run_order(self):
        made = rows("s", "5%", lru=(10.0, 12.0, 11.0))[::-1]
        self.assertEqual(bar_check.rates(made)[("s", "5%")]["lru"], [10.0, 12.0, 11.0])

    def test_comparisons_mla_minus_policy_and_variant_minus_mla(self):
        by = bar_check.rates(
            rows(
                "s",
                "5%",
                lru=(20.0, 21.0),
                mla_aware=(25.0, 24.0),
                mla_aware_x=(23.0, 23.0),
            )
        )
        comps = {c["policy"]: c for c in bar_check.comparisons(by)}
        self.assertEqual(set(comps), {"lru", "mla_aware[x]"})
        self.assertAlmostEqual(comps["lru"]["mean"], 4.0)  # diffs 5, 3
        self.assertAlmostEqual(comps["lru"]["spread"], 1.0)
        self.assertEqual(
            (comps["lru"]["class"], comps["lru"]["ablation"]), ("win", False)
        )
        self.assertAlmostEqual(comps["mla_aware[x]"]["mean"], -1.5)  # diffs -2, -1
        self.assertAlmostEqual(comps["mla_aware[x]"]["spread"], 0.5)
        self.assertEqual(comps["mla_aware[x]"]["class"], "loss")
        self.assertTrue(comps["mla_aware[x]"]["ablation"])


class TestChecks(CustomTestCase):
    def run_checks(self, made, usage=cpu([100.0], [200.0])):
        return bar_check.checks(bar_check.rates(made), usage)

    def test_floor_against_the_best_builtin_or_peer(self):
        # mla_aware 29.6 mean, s3fifo 30.0: 0.4 below, within the 0.5 floor.
        ok = self.run_checks(
            group("t", "25%", (29.4, 29.8), best=("s3fifo", (30.0, 30.0)))
        )
        self.assertEqual(verdicts(ok, "floor"), [("t", "25%", True)])
        self.assertIn("s3fifo 30.00 %", ok[0]["reference"])
        self.assertIn("-0.40 pts", ok[0]["measured"])
        # 29.4 mean: 0.6 below.
        miss = self.run_checks(
            group("t", "25%", (29.2, 29.6), best=("slru", (30.0, 30.0)))
        )
        self.assertEqual(verdicts(miss, "floor"), [("t", "25%", False)])
        self.assertIn("slru", miss[0]["reference"])
        # A variant is not a rival: mla_aware[x] far above does not move the floor.
        made = group("t", "5%", (20.0, 20.0)) + rows(
            "t", "5%", mla_aware_x=(40.0, 40.0)
        )
        self.assertEqual(verdicts(self.run_checks(made), "floor"), [("t", "5%", True)])

    def test_gain_on_synthetic_at_5_and_10_percent(self):
        # diffs 8.5, 8.7: 8.6 >= 0.9 * 9.13 = 8.217.
        made = group("synthetic", "5%", (21.5, 22.1), lru=(13.0, 13.4))
        # diffs 8.0, 8.0 < 0.9 * 8.91 = 8.019.
        made += group("synthetic", "10%", (32.6, 32.6), lru=(24.6, 24.6))
        made += group("synthetic", "25%", (50.0, 50.0))  # no gain check at 25 %
        made += group("other", "5%", (10.0, 10.0))  # nor on another source
        out = self.run_checks(made)
        self.assertEqual(
            verdicts(out, "gain"),
            [("synthetic", "5%", True), ("synthetic", "10%", False)],
        )
        row = next(r for r in out if r["check"] == "gain")
        self.assertIn("+8.60 ± 0.10 pts over LRU", row["measured"])
        self.assertIn("+9.13", row["reference"])
        self.assertIn("+8.22", row["reference"])

    def test_aim_on_conversation_at_5_percent(self):
        # 18.95 / 17.1 = 1.108
        made = group("conversation", "5%", (18.9, 19.0), lru=(17.0, 17.2))
        out = self.run_checks(made)
        self.assertEqual(verdicts(out, "aim"), [("conversation", "5%", True)])
        self.assertIn("1.108x", next(r for r in out if r["check"] == "aim")["measured"])
        # 18.6 / 17.1 = 1.088
        made = group("conversation", "5%", (18.5, 18.7), lru=(17.0, 17.2))
        made += group("conversation", "10%", (10.0, 10.0))
        self.assertEqual(
            verdicts(self.run_checks(made), "aim"), [("conversation", "5%", False)]
        )

    def test_cpu_is_the_ratio_of_medians(self):
        made = group("t", "5%", (20.0, 20.0))
        # medians 110 and 260: 2.36x.
        out = self.run_checks(made, cpu([100.0, 300.0, 110.0], [250.0, 260.0, 900.0]))
        self.assertEqual(verdicts(out, "cpu"), [("synthetic", "5%", True)])
        self.assertIn("2.36x", out[-1]["measured"])
        # medians 110 and 280: 2.55x.
        out = self.run_checks(made, cpu([100.0, 300.0, 110.0], [280.0, 270.0, 900.0]))
        self.assertEqual(verdicts(out, "cpu"), [("synthetic", "5%", False)])

    def test_cpu_names_the_python_core_share(self):
        usage = cpu([100.0, 120.0, 110.0], [260.0, 250.0, 255.0])
        usage["us_per_request"]["lru (python core)"] = [230.0, 240.0, 220.0]
        out = self.run_checks(group("t", "5%", (20.0, 20.0)), usage)
        # medians 110, 230 and 255: 2.32x the Rust core, the Python core alone 2.09x.
        self.assertEqual(
            out[-1]["measured"],
            "2.32x: mla_aware 255 µs/req, lru (rust) 110 µs/req; "
            "lru (python) 230 µs/req, 2.09x",
        )


def fixture_trace(path: Path, n: int = 200) -> None:
    """``n`` Mooncake-format requests: 30 conversations under 5 system prompts of 2
    blocks, turn t carrying t + 1 blocks of its own conversation."""
    with open(path, "w") as f:
        for i in range(n):
            conv, turn = i % 30, i // 30
            ids = [1000 * (conv % 5), 1000 * (conv % 5) + 1]
            ids += [100000 + 100 * conv + k for k in range(turn + 1)]
            line = {"timestamp": 200 * i, "input_length": 512 * len(ids) - 100}
            line |= {"output_length": 50, "hash_ids": ids}
            f.write(json.dumps(line) + "\n")


class TestCli(CustomTestCase):
    def run_main(self, argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = bar_check.main(argv)
        return status, out.getvalue(), err.getvalue()

    def test_bad_input_exits_2_with_one_line_naming_the_option(self):
        with tempfile.TemporaryDirectory() as tmp:
            outs = ["--markdown", f"{tmp}/r.md", "--json", f"{tmp}/r.json"]
            cases = [
                (["--sources", "nope"], "--sources"),
                (["--sources", ","], "--sources"),
                (["--variant", "x={bad"], "--variant"),
                (["--variant", 'x={"nope": 1}'], "--variant"),
                (["--variant", "={}"], "--variant"),
                (["--variant", 'c={"calibration": "/no/such.json"}'], "--variant"),
                (["--jitters", "0"], "--jitters"),
                (["--jitters", "-1"], "--jitters"),
                (["--jitters", "x"], "--jitters"),
                (["--cpu-rounds", "0"], "--cpu-rounds"),
                (["--trace", "no-path"], "--trace"),
                (["--trace", "chat=/x.jsonl"], "--trace"),
                (["--trace", f"t={tmp}/none.jsonl", "--sources", "t"], "none.jsonl"),
                (["--sources", "chat", "--capacity", "5x"], "--capacity"),
                (["--markdown", tmp], "--markdown"),
                (["--json", tmp], "--json"),
            ]
            for argv, names in cases:
                with self.subTest(argv=argv):
                    extra = [] if argv[0] in ("--markdown", "--json") else outs
                    status, out, err = self.run_main([*argv, *extra, "--no-progress"])
                    self.assertEqual(status, 2)
                    self.assertEqual(len(err.strip().splitlines()), 1, err)
                    self.assertIn(names, err)
                    self.assertEqual(out, "")
            self.assertEqual(sorted(p.name for p in Path(tmp).iterdir()), [])

    def test_small_run_writes_markdown_and_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "fx.jsonl"
            fixture_trace(trace)
            md, js = Path(tmp) / "r.md", Path(tmp) / "r.json"
            argv = ["--trace", f"fx={trace}", "--sources", "fx,chat"]
            argv += ["--num-requests", "100", "--capacity", "25%", "--jitters", "1"]
            argv += ["--cpu-rounds", "1", "--jobs", "1", "--no-progress"]
            argv += ["--variant", 'nf={"learn_factor": false}']
            argv += ["--markdown", str(md), "--json", str(js)]
            status, out, _ = self.run_main(argv)
            payload, text = json.loads(js.read_text()), md.read_text()
        self.assertEqual(out, text)
        keys = {"command", "runs", "seconds", "checks", "comparisons", "cpu", "rows"}
        self.assertEqual(set(payload), keys)
        self.assertEqual(payload["runs"], 2)
        checks = payload["checks"]
        self.assertEqual(status, 0 if all(c["pass"] for c in checks) else 1)
        self.assertEqual(
            [(c["check"], c["source"]) for c in checks],
            [("floor", "fx"), ("floor", "chat"), ("cpu", "fx")],  # cpu: first source
        )
        self.assertEqual(
            payload["cpu"]["us_per_request"].keys(),
            {"lru", "lru (python core)", "mla_aware"},
        )
        self.assertEqual(
            [len(v) for v in payload["cpu"]["us_per_request"].values()], [1, 1, 1]
        )
        labels = [*bar_check.BUILTINS, *bar_check.PEERS, "mla_aware", "mla_aware[nf]"]
        got = sorted((r["source"], r["run"], r["label"]) for r in payload["rows"])
        want = sorted(
            (s, run, p) for s in ("fx", "chat") for run in (0, 1) for p in labels
        )
        self.assertEqual(got, want)
        for r in payload["rows"]:
            python = r["policy"] == "mla_aware" or r["is_peer"]
            self.assertEqual(r["tree_core"], "python" if python else "rust")
            self.assertEqual(r["policy"], r["label"].split("[")[0])
        self.assertEqual(len(payload["comparisons"]), 2 * (len(labels) - 1))
        self.assertIn("bar_check.py --trace", text.splitlines()[2])
        self.assertIn(
            "| check | source | capacity | measured | reference | result |", text
        )
        for section in ("## fx", "## chat", "mla_aware minus each policy", "Ablation"):
            self.assertIn(section, text)
        for c in checks:
            result = "PASS" if c["pass"] else "**MISS**"
            self.assertIn(f"| {c['check']} | {c['source']} | 25% |", text)
            self.assertIn(f"{c['reference']} | {result} |", text)
        self.assertIn("| mla_aware[nf] | ", text)


if __name__ == "__main__":
    unittest.main()
