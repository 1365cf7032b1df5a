"""Tests for benchmark/mla_eviction/cpu_breakdown.py: cache CPU by operation, three replays."""

import contextlib
import io
import sys
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction"))

import cpu_breakdown  # noqa: E402
import replay  # noqa: E402
from simulator import Replayer  # noqa: E402

from sglang.srt.mem_cache.mla_eviction_plugin import register  # noqa: E402

# Shared few-shot examples at 25 %: evictions and leaf index walks happen.
SOURCE = ["--workload", "few-shot", "--num-requests", "150", "--seed", "1", "--capacity", "25%"]


class TestMeasure(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        register()
        cls.trace, cls.cost, (cls.config,) = replay.prepare_unified_mla_aware(
            SOURCE, policy="test")

    def test_operations_add_up_to_the_cache_cpu(self):
        replayer = cpu_breakdown._ByOperation(self.trace, self.cost, self.config)
        with cpu_breakdown.instrumented(replayer.tally):
            result = replayer.run()
        walk = replayer.tally.pop(cpu_breakdown.WALK)
        self.assertGreater(replayer.tally.pop(cpu_breakdown.SPLITS), 0)  # trimming acted
        self.assertEqual(set(replayer.tally), set(cpu_breakdown.OPERATIONS))
        self.assertAlmostEqual(sum(replayer.tally.values()), result.cache_cpu_s, places=9)
        self.assertGreater(walk, 0)
        self.assertLess(walk, replayer.tally["evict"])  # the walk runs inside evictions

    def test_rows_per_policy(self):
        rows = cpu_breakdown.measure(self.trace, self.cost, self.config, runs=2)
        self.assertEqual([r["policy"] for r in rows], ["lru", "mla_aware", cpu_breakdown.UNTRIMMED])
        for row in rows:
            with self.subTest(policy=row["policy"]):
                config = cpu_breakdown.policies(self.config)[row["policy"]]
                plain = Replayer(self.trace, self.cost, config).run().summary()
                self.assertEqual(row["evictions"], plain["evictions"])
                self.assertEqual(row["flop_hit_rate"], plain["flop_hit_rate"])
                self.assertEqual(row["splits"] > 0, row["policy"] == "mla_aware")
                us = row["us"]
                # Each column is the least of its own runs: no run's total is below the
                # sum of the least operations (up to float rounding: the total is summed
                # in another order), nor its evictions below its walk.
                least_ops = sum(us[op] for op in cpu_breakdown.OPERATIONS)
                self.assertGreaterEqual(us["total"], least_ops * (1 - 1e-9))
                self.assertGreaterEqual(us["evict"], us[cpu_breakdown.WALK])
                self.assertGreater(us["evict"], 0)
                if row["policy"] == "lru":
                    self.assertEqual(us[cpu_breakdown.WALK], 0.0)  # the stock heap walks
                else:
                    self.assertGreater(us[cpu_breakdown.WALK], 0.0)
        self.assertFalse(Replayer(self.trace, self.cost, cpu_breakdown.policies(
            self.config)[cpu_breakdown.UNTRIMMED]).result.trimmed)

    def test_patched_methods_restored(self):
        from sglang.srt.mem_cache.mla_leaf_index import LeafIndex

        from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy

        before = {name: getattr(LeafIndex, name) for name in cpu_breakdown.WALK_METHODS}
        on_split = MLAAwareStrategy.on_split
        with contextlib.suppress(RuntimeError):
            with cpu_breakdown.instrumented(cpu_breakdown.collections.Counter()):
                self.assertIsNot(LeafIndex.start, before["start"])
                raise RuntimeError
        self.assertEqual({n: getattr(LeafIndex, n) for n in before}, before)
        self.assertIs(MLAAwareStrategy.on_split, on_split)


class TestCli(CustomTestCase):
    def run_main(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cpu_breakdown.main(list(argv))
        return status, out.getvalue(), err.getvalue()

    def test_table(self):
        status, out, _ = self.run_main(*SOURCE, "--runs", "1")
        self.assertEqual(status, 0)
        lines = [line for line in out.splitlines() if line.startswith("| 25% |")]
        self.assertEqual([line.split(" | ")[1] for line in lines],
                         ["lru", "mla_aware", cpu_breakdown.UNTRIMMED])
        self.assertRegex(lines[1], r"\| \d+ \([+-]\d+\) \|")  # what mla_aware adds over LRU

    def test_bad_arguments_exit_2(self):
        for argv, message in ((["--runs", "0"], "--runs must be >= 1"),
                              (["--policies", "lru"], "replays LRU and mla_aware"),
                              (["--host-tier", "4x"], "without a host tier"),
                              (["--capacity", "0%"], "must be in (0%, 100%]")):
            with self.subTest(argv=argv):
                status, _, err = self.run_main(*SOURCE[:6], *argv)
                self.assertEqual(status, 2)
                self.assertIn(message, err)


if __name__ == "__main__":
    unittest.main()
