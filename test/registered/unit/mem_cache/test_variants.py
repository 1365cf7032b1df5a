"""Tests for benchmark/mla_eviction/variants.py: a variant of mla_aware against its defaults."""

import contextlib
import io
import json
import sys
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction"))

import bar_check  # noqa: E402
import variants  # noqa: E402
from sglang.srt.mem_cache import mla_victim_trim  # noqa: E402
from sglang.srt.mem_cache.mla_aware_policy import GhostLearning  # noqa: E402

SMALL = ["--sources", "chat", "--num-requests", "150", "--capacity", "5%", "--no-progress"]


class TestSets(CustomTestCase):
    def usage_error(self, argv) -> str:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as cm:
            variants.parse_args(argv)
        self.assertEqual(cm.exception.code, 2)
        return err.getvalue()

    def test_constants_by_class_or_module(self):
        self.assertEqual(variants.parse_sets(["GhostLearning.STEP=0.2"]),
                         {"GhostLearning.STEP": 0.2})
        self.assertEqual(variants.resolve("GhostLearning.STEP"), (GhostLearning, "STEP"))
        owner, attr = variants.resolve("mla_victim_trim.MIN_SURPLUS_SHARE")
        self.assertIs(owner, mla_victim_trim)
        self.assertEqual(attr, "MIN_SURPLUS_SHARE")
        # Found without the module name too; an int stands for a float.
        self.assertEqual(variants.parse_sets(["MIN_SURPLUS_SHARE=0"]), {"MIN_SURPLUS_SHARE": 0})

    def test_bad_sets_name_the_flag(self):
        cases = {
            "GhostLearning.STEPS=0.2": "no such constant",
            "GhostLearning.learns_factor=true": "not a constant",
            "GhostLearning.STEP=fast": "not JSON",
            "GhostLearning.STEP=true": "is a bool, the constant a float",
            "GhostLearning.MAX_GHOSTS=1.5": "is a float, the constant a int",
            "GhostLearning.STEP": "expected NAME=VALUE",
        }
        for spec, words in cases.items():
            with self.subTest(spec=spec):
                text = self.usage_error(["--set", spec])
                self.assertIn("--set", text)
                self.assertIn(words, text)

    def test_nothing_to_compare_and_bad_config(self):
        self.assertIn("nothing to compare", self.usage_error([]))
        text = self.usage_error(["--policy-config", '{"probaton": false}'])
        self.assertIn("--policy-config", text)
        self.assertIn("'probaton'", text)
        self.assertIn("not JSON", self.usage_error(["--policy-config", "{probation: false}"]))
        self.assertIn("expected a JSON object", self.usage_error(["--policy-config", "[1]"]))
        bad_source = ["--set", "GhostLearning.STEP=0.2", "--sources", "nope"]
        self.assertIn("--sources", self.usage_error(bad_source))

    def test_patched_restores_even_on_error(self):
        with self.assertRaises(RuntimeError):
            with variants.patched({"GhostLearning.STEP": 0.5, "MIN_SURPLUS_SHARE": 0.2}):
                self.assertEqual(GhostLearning.STEP, 0.5)
                self.assertEqual(mla_victim_trim.MIN_SURPLUS_SHARE, 0.2)
                raise RuntimeError
        self.assertEqual(GhostLearning.STEP, 0.1)
        self.assertEqual(mla_victim_trim.MIN_SURPLUS_SHARE, 0.01)


def result(source, cap, side, flop):
    return {"source": source, "capacity": cap, "side": side, "policy": "mla_aware",
            "flop_hit_rate": flop / 100, "cpu_us_per_request": 0.0,
            "prefill_ms_per_request": 1.0}


def reference_group(cap, mla, *, lru=20.0, best=21.0, bound=40.0):
    rows = [{**result("t", cap, "", lru), "policy": p} for p in bar_check.BUILTINS]
    rows[1]["flop_hit_rate"] = best / 100  # lfu
    rows.append({**result("t", cap, "", bound), "policy": "optimal"})
    rows.append(result("t", cap, "", mla))
    return rows


class TestCompare(CustomTestCase):
    def test_rows_sum_and_turned_checks(self):
        results = [
            result("t", "5%", "defaults", 22.9), result("t", "5%", "variant", 23.1),
            result("t", "10%", "defaults", 30.0), result("t", "10%", "variant", 30.001),
            result("u", "5%", "defaults", 10.0), result("u", "5%", "variant", 9.0),
        ]
        reference = {"t": reference_group("5%", 22.9) + reference_group("10%", 29.0, best=29.0)}
        out = variants.compare(results, reference)
        self.assertEqual([(r["source"], r["capacity"]) for r in out["rows"]],
                         [("t", "5%"), ("t", "10%"), ("u", "5%")])
        self.assertAlmostEqual(out["rows"][0]["difference"], 0.2)
        self.assertAlmostEqual(out["summary"]["sum"], -0.799)
        self.assertEqual((out["summary"]["up"], out["summary"]["down"]), (1, 1))
        bar = out["bar"]
        # 5 %: the gain needs 23.0 (LRU 20 + 15 %): the defaults miss it, the variant passes.
        self.assertEqual(bar["misses"], {"defaults": 1, "variant": 0})
        self.assertEqual(bar["checks"], 3)  # floor and gain at 5 %, floor at 10 %
        self.assertEqual(bar["turned"], ["gain t 5%: PASS"])
        # The reference's mla_aware at 10 % (29.0) is not this run's defaults (30.0).
        self.assertEqual(bar["stale"], ["t 10%"])
        self.assertEqual(bar["not_in_reference"], ["u 5%"])

    def test_floor_sr_where_the_reference_has_the_session_radix_cache(self):
        """A reference that replayed source t with the session radix cache adds its
        floor-sr check: 21.0 % is 0.6 below `priority`'s 21.6 % there, 21.2 % is not."""
        results = [result("t", "5%", "defaults", 21.0), result("t", "5%", "variant", 21.2)]
        with_sessions = [{**result("t", "5%", "", 21.6), "policy": "priority"},
                         {**result("t", "5%", "", 20.0), "policy": "lru"}]
        reference = {"t": reference_group("5%", 21.0, bound=25.0), "t+session-radix": with_sessions}
        bar = variants.compare(results, reference)["bar"]
        self.assertEqual(bar["checks"], 2)  # floor and floor-sr (the gain lacks headroom)
        self.assertEqual(bar["misses"], {"defaults": 1, "variant": 0})
        self.assertEqual(bar["turned"], ["floor-sr t 5%: PASS"])


class TestRun(CustomTestCase):
    def run_main(self, *argv):
        out = io.StringIO()
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(out):
            path = Path(tmp) / "v.json"
            self.assertEqual(variants.main([*SMALL, *argv, "--json", str(path)]), 0)
            return json.loads(path.read_text()), out.getvalue()

    def test_a_constant_and_the_config_it_equals(self):
        # A probation factor bounded at 1 is probation switched off: the same replay.
        by_config, text = self.run_main("--policy-config", '{"probation": false}', "--jobs", "1")
        by_constant, _ = self.run_main("--set", "GhostLearning.MAX_FACTOR=1.0", "--jobs", "2")
        (row,) = by_config["rows"]
        self.assertEqual(by_constant["rows"], by_config["rows"])
        self.assertLess(row["difference"], -0.01)  # probation pays on chat at 5 %
        self.assertIn("| chat | 5% |", text)
        self.assertEqual(GhostLearning.MAX_FACTOR, 1000.0)  # put back in this process

    def test_the_defaults_against_themselves(self):
        same, _ = self.run_main("--set", "GhostLearning.STEP=0.1", "--jobs", "1")
        self.assertEqual(same["rows"][0]["difference"], 0.0)
        self.assertEqual(same["summary"]["up"] + same["summary"]["down"], 0)


if __name__ == "__main__":
    unittest.main()
