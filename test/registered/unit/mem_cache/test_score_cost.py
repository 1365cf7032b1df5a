"""Tests for benchmark/mla_eviction/score_cost.py: scores counted, both policies timed."""

import contextlib
import dataclasses
import io
import sys
import unittest
from pathlib import Path
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction"))

import replay  # noqa: E402
import score_cost  # noqa: E402
from simulator import Replayer  # noqa: E402

from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy  # noqa: E402
from sglang.srt.mem_cache.mla_eviction_plugin import register  # noqa: E402

# Shared few-shot examples at 25 %: enough leaves outlive each walk for the index to skip some.
SOURCE = ["--workload", "few-shot", "--num-requests", "150", "--seed", "1", "--capacity", "25%"]


class TestMeasure(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        register()
        args = replay.parse_args([*SOURCE, "--policies", "mla_aware", "--no-progress"])
        cls.trace, cls.cost, (cls.config,) = replay.prepare(args)

    def test_counts_every_score_the_tree_asks_for(self):
        row = score_cost.measure(self.trace, self.cost, self.config, rounds=1)
        # The same replays, counted on the class rather than by score_cost's wrapper.
        counts = []
        for indexed in (False, True):
            config = dataclasses.replace(
                self.config, policy_config={**self.config.policy_config, "indexed_eviction": indexed})
            with mock.patch.object(MLAAwareStrategy, "get_priority", autospec=True,
                                   side_effect=MLAAwareStrategy.get_priority) as counted:
                result = Replayer(self.trace, self.cost, config).run()
            counts.append(counted.call_count / result.requests)
        self.assertEqual(row["scores_per_request"], counts[0])
        self.assertEqual(row["indexed_scores_per_request"], counts[1])
        self.assertGreater(counts[0], counts[1])  # the index scores fewer leaves
        self.assertGreater(counts[1], 0)
        self.assertGreater(row["leaves"], 0)
        self.assertGreater(row["lru_ns"], 0)
        self.assertGreater(row["mla_aware_ns"], 0)
        self.assertAlmostEqual(
            row["added_us_per_request"],
            (counts[1] * row["mla_aware_ns"] - counts[0] * row["lru_ns"]) / 1e3,
        )


class TestCli(CustomTestCase):
    def run_main(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = score_cost.main(list(argv))
        return status, out.getvalue(), err.getvalue()

    def test_table(self):
        status, out, _ = self.run_main(*SOURCE, "--rounds", "1")
        self.assertEqual(status, 0)
        self.assertIn("| 25% |", out)

    def test_bad_arguments_exit_2(self):
        for argv, message in ((["--rounds", "0"], "--rounds must be >= 1"),
                              (["--policies", "lru"], "replays mla_aware's defaults"),
                              (["--host-tier", "4x"], "without a host tier"),
                              (["--capacity", "0%"], "must be in (0%, 100%]")):
            with self.subTest(argv=argv):
                status, _, err = self.run_main(*SOURCE[:6], *argv)
                self.assertEqual(status, 2)
                self.assertIn(message, err)


if __name__ == "__main__":
    unittest.main()
