"""Tests for benchmark/mla_eviction/request_diff.py: two policies compared request by request."""

import contextlib
import io
import sys
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction"))

import replay  # noqa: E402
import request_diff  # noqa: E402

SOURCE = ["--workload", "gsp", "--num-requests", "300", "--seed", "1", "--capacity", "10%",
          "--workload-param", "group_distribution=zipf", "--workload-param", "zipf_alpha=1.1"]


class TestCompare(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        replay.init_process()
        args = replay.parse_args([*SOURCE, "--policies", "mla_aware,lru", "--no-progress"])
        cls.trace, cls.cost, configs = replay.prepare(args)
        cls.runs = {c.policy: request_diff.measure(cls.trace, cls.cost, c) for c in configs}

    def test_won_minus_lost_is_the_difference_of_the_hit_rates(self):
        mla, lru = self.runs["mla_aware"], self.runs["lru"]
        self.assertEqual(len(mla["hits"]), len(self.trace.requests))
        diff = request_diff.compare(self.trace, self.cost, mla, lru)
        self.assertGreater(diff["fewer"] + diff["more"], 0)  # the two policies part here
        self.assertAlmostEqual(diff["won"] - diff["lost"],
                               100 * (mla["flop_hit_rate"] - lru["flop_hit_rate"]), places=9)
        self.assertLessEqual(sum(n for _, n in diff["pairs"]), diff["fewer"])
        for (a, b), _ in diff["pairs"]:
            self.assertLess(a, b)
        back = request_diff.compare(self.trace, self.cost, lru, mla)
        self.assertEqual((back["fewer"], back["more"]), (diff["more"], diff["fewer"]))
        self.assertAlmostEqual(back["lost"], diff["won"], places=9)

    def test_a_policy_against_itself_parts_nowhere(self):
        mla = self.runs["mla_aware"]
        diff = request_diff.compare(self.trace, self.cost, mla, mla)
        self.assertEqual((diff["fewer"], diff["more"], diff["lost"], diff["won"], diff["pairs"]),
                         (0, 0, 0.0, 0.0, []))

    def test_victims_counted_by_place(self):
        # gsp: output pages of their own go, and so do questions below the system prompts.
        victims = self.runs["lru"]["victims"]
        self.assertLessEqual(set(victims), set(request_diff.PLACES))
        self.assertGreater(victims["output pages"], 0)
        self.assertGreater(victims["deeper"], 0)
        table = request_diff.markdown(
            [{"capacity": "10%", "first": self.runs["mla_aware"], "second": self.runs["lru"],
              "diff": request_diff.compare(self.trace, self.cost, self.runs["mla_aware"],
                                           self.runs["lru"])}], ("mla_aware", "lru"))
        self.assertIn("/".join(str(victims[p]) for p in request_diff.PLACES) + " |", table)


class TestUsage(CustomTestCase):
    def test_two_different_policies_or_exit_2(self):
        for policies in ("mla_aware", "lru,lru", "lru,lfu,fifo"):
            with self.subTest(policies=policies):
                err = io.StringIO()
                with contextlib.redirect_stderr(err):
                    code = request_diff.main([*SOURCE, "--policies", policies])
                self.assertEqual(code, 2)
                self.assertIn("--policies: name two different policies", err.getvalue())

    def test_host_tier_refused(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = request_diff.main([*SOURCE, "--policies", "mla_aware,lru", "--host-tier", "4x"])
        self.assertEqual(code, 2)
        self.assertIn("without a host tier", err.getvalue())


if __name__ == "__main__":
    unittest.main()
