"""Tests for benchmark/mla_eviction/policy_variants.py: the replay-only mla_aware_ghost."""

import contextlib
import io
import json
import sys
import tempfile
import unittest
from pathlib import Path
from types import SimpleNamespace

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction"))

import replay  # noqa: E402
from policy_variants import GhostAdaptiveStrategy  # noqa: E402
from simulator import TickClock, radix_clock  # noqa: E402

from sglang.srt.mem_cache.mla_aware_policy import PolicyConfigError  # noqa: E402
from sglang.srt.mem_cache.mla_cost_model import KVCostModel  # noqa: E402


class TestGhostHits(CustomTestCase):
    def setUp(self):
        # Plain nodes are read with RadixCache's clock; the replay's tick clock stands in.
        self.clock = TickClock()
        self.clock.ticks = 100.0
        self.enterContext(radix_clock(self.clock))
        self.root = SimpleNamespace(parent=None, key=[], creation_time=0.0)
        self.strategy = GhostAdaptiveStrategy(KVCostModel.from_preset("deepseek-v3"))

    def leaf(self, tokens, *, last, created):
        return SimpleNamespace(parent=self.root, key=list(tokens), hit_count=1, backuped=False,
                               last_access_time=last, creation_time=created)

    def test_weight_moves_by_the_age_of_the_victim_that_came_back(self):
        s = self.strategy
        s.get_priority(self.leaf([1, 2, 3, 4, 5], last=10.0, created=1.0))  # age 90, the oldest
        s.get_priority(self.leaf([7, 8, 9], last=90.0, created=2.0))  # age 10
        self.clock.advance()  # a later heap build
        s.get_priority(self.leaf([7, 8, 9], last=101.0, created=50.0))  # the young one is back
        self.assertEqual(s.ghost_hits, [1, 0])
        self.assertAlmostEqual(s.weight, 1 - 0.02 * 0.2)
        s.get_priority(self.leaf([1, 2, 3, 4, 5], last=101.0, created=51.0))  # the old one
        self.assertEqual(s.ghost_hits, [1, 1])
        self.assertAlmostEqual(s.weight, 1 - 0.02 * 0.2 + 0.02 * 0.8)
        # The upper half of a split keeps creation_time: not content coming back.
        s.get_priority(self.leaf([1, 2, 3, 4], last=101.0, created=51.0))
        self.assertEqual(s.ghost_hits, [1, 1])

    def test_weight_scales_value_and_stays_in_bounds(self):
        s = self.strategy
        node = self.leaf([1, 2], last=40.0, created=1.0)
        base = s.get_priority(node)[0]  # -60 / value
        s.weight = 2.0
        self.assertAlmostEqual(s.get_priority(node)[0] / base, 1 / s.value(node))
        s.weight = s.BOUNDS[1]
        s._learn(age=1e9, build=s._build)
        self.assertEqual(s.weight, s.BOUNDS[1])
        s.weight = s.BOUNDS[0]
        s._learn(age=0.0, build=s._build)
        self.assertEqual(s.weight, s.BOUNDS[0])

    def test_memory_is_bounded(self):
        s = self.strategy
        s.MAX_GHOSTS = 4
        for i in range(10):
            s.get_priority(self.leaf([i + 1], last=50.0, created=float(i)))
        self.assertEqual(len(s._ghosts), 4)

    def test_config_is_mla_awares(self):
        with self.assertRaises(PolicyConfigError):
            GhostAdaptiveStrategy.from_config({"weight": 2})
        self.assertEqual(GhostAdaptiveStrategy.from_config({"hit_exponent": 0}).hit_exponent, 0.0)


class TestReplay(CustomTestCase):
    def test_same_seed_same_result(self):
        def once():
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "r.json"
                with contextlib.redirect_stdout(io.StringIO()), \
                        contextlib.redirect_stderr(io.StringIO()):
                    status = replay.main([
                        "--no-progress", "--jobs", "1", "--workload", "multi-turn",
                        "--num-requests", "200", "--seed", "2", "--capacity", "5%",
                        "--policies", "mla_aware_ghost", "--json", str(out)])
                self.assertEqual(status, 0)
                (row,) = json.loads(out.read_text())["results"]
                row.pop("cpu_us_per_request")
                return row

        first = once()
        self.assertEqual(first["policy"], "mla_aware_ghost")
        self.assertGreater(first["flop_hit_rate"], 0)
        self.assertEqual(first, once())


if __name__ == "__main__":
    unittest.main()
