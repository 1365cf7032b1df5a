"""Tests for benchmark/mla_eviction/reuse_by_branching.py: victims noted, returns matched."""

import contextlib
import io
import sys
import unittest
from collections import Counter
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction"))

import replay  # noqa: E402
import reuse_by_branching  # noqa: E402
from simulator import Replayer  # noqa: E402

from sglang.srt.mem_cache.mla_eviction_plugin import register  # noqa: E402

SOURCE = ["--workload", "multi-turn", "--num-requests", "300", "--seed", "1", "--capacity", "10%"]


class TestMeasure(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        register()
        cls.trace, cls.cost, (cls.config,) = replay.prepare_unified_mla_aware(
            SOURCE, policy="cost-weighted LRU", policy_config=reuse_by_branching.NEUTRAL)

    def test_every_victim_that_came_back_is_counted_once(self):
        cells = reuse_by_branching.measure(self.trace, self.cost, self.config)["cells"]
        replayer = Replayer(self.trace, self.cost, self.config)
        replayer.run()  # the same replay, unwatched: the learning counts every return
        by_bucket = [(k, v) for k, v in cells.items() if isinstance(k[0][0], int)]
        victims = sum(v for (_, what), v in by_bucket if what == "victims")
        back = sum(v for (_, what), v in by_bucket if what == "back")
        self.assertGreater(victims, back)
        self.assertEqual(back, sum(replayer.strategy.learning.returns))
        self.assertGreater(back, 0)
        by_kind = sum(v for (group, what), v in cells.items() if isinstance(group[0], str)
                      and what == "victims")
        self.assertEqual(by_kind, victims)  # each victim in one bucket and one kind

    def test_victims_by_depth_came_back_by_ghost_match_and_by_content(self):
        row = reuse_by_branching.measure(self.trace, self.cost, self.config)
        cells, depths = row["cells"], row["by"]["depth"]
        victims = sum(v for (group, what), v in cells.items()
                      if isinstance(group[0], int) and what == "victims")
        back = sum(v for (group, what), v in cells.items()
                   if isinstance(group[0], int) and what == "back")
        for view in ("depth", "kind"):
            counts = row["by"][view]
            self.assertEqual(sum(v for (_, what), v in counts.items() if what == "victims"),
                             victims)
            self.assertEqual(sum(v for (_, what), v in counts.items() if what == "back"), back)
        # A conversation's victims below its first node come back inside one node that
        # starts higher up, which the ghost match does not see; their content it does.
        deep = [d for d in range(1, reuse_by_branching.MAX_BUCKET + 1) if depths[d, "victims"]]
        self.assertTrue(deep)
        for d in deep:
            self.assertLessEqual(depths[d, "content"], depths[d, "victims"])
        self.assertGreater(sum(depths[d, "content"] for d in deep),
                           2 * sum(depths[d, "back"] for d in deep))
        table = reuse_by_branching.markdown_by([row], "depth")
        n, content = depths[1, "victims"], depths[1, "content"]
        self.assertIn(f"| 1 | {n} | {depths[1, 'back']} (", table)
        self.assertIn(f" | {content} ({100 * content / n:.0f} %) |", table)

    def test_victims_by_kind_follow_sglangs_priority_split(self):
        # Finished turns are split at the prompt boundary, the prompt one priority up:
        # the tails below it and the prompts both get evicted in a conversation workload.
        row = reuse_by_branching.measure(self.trace, self.cost, self.config)
        kinds = row["by"]["kind"]
        below, _, prompt = reuse_by_branching.KINDS
        self.assertGreater(kinds[below, "victims"], 0)
        self.assertGreater(kinds[prompt, "victims"], 0)
        table = reuse_by_branching.markdown_by([row], "kind")
        self.assertIn(f"| {below} | {kinds[below, 'victims']} | ", table)
        self.assertNotIn("| priority 0 | 0 |", table)  # empty kinds are left out

    def test_by_depth_from_the_command_line(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            self.assertEqual(reuse_by_branching.main(["--by", "depth", *SOURCE]), 0)
        self.assertIn("| depth (nodes above, root not counted) | victims |", out.getvalue())
        with contextlib.redirect_stderr(io.StringIO()) as err:
            self.assertEqual(reuse_by_branching.main(["--by", "hits", *SOURCE]), 2)
        self.assertIn("invalid choice: 'hits'", err.getvalue())

    def test_output_pages_of_their_own_are_left_out(self):
        # a Mooncake trace says nothing of outputs: each request's output pages are its own
        # (no source given: replay's default, the shipped trace)
        trace, cost, (config,) = replay.prepare_unified_mla_aware(
            ["--limit", "300", "--capacity", "5%"],
            policy="cost-weighted LRU", policy_config=reuse_by_branching.NEUTRAL)
        row = reuse_by_branching.measure(trace, cost, config)
        self.assertGreater(row["outputs"], 0)
        self.assertGreater(row["cells"][(1, 0), "victims"], 0)
        table = reuse_by_branching.markdown([row])
        self.assertIn(f"; {row['outputs']} victims were output pages of their own, left out", table)


class TestCappedVsDiagonal(CustomTestCase):
    def test_expected_share_weighs_the_diagonal_by_children(self):
        cells = Counter({
            (("capped", 1), "victims"): 10, (("capped", 1), "back"): 3,
            (("capped", 2), "victims"): 30, (("capped", 2), "back"): 3,
            (("diagonal", 1), "victims"): 50, (("diagonal", 1), "back"): 25,
            (("diagonal", 2), "victims"): 100, (("diagonal", 2), "back"): 10,
            (("other", 0), "victims"): 999, (("other", 0), "back"): 1,
        })
        n, back, expected = reuse_by_branching.capped_vs_diagonal(cells)
        self.assertEqual(n, 40)
        self.assertAlmostEqual(back, 6 / 40)
        self.assertAlmostEqual(expected, (10 * 0.5 + 30 * 0.1) / 40)
        self.assertEqual(reuse_by_branching.capped_vs_diagonal(Counter()), (0, 0.0, 0.0))
        table = reuse_by_branching.markdown([{"capacity": "5%", "cells": cells},
                                             {"capacity": "9%", "cells": Counter()}])
        self.assertIn("**5%** (came back / victims): 40 victims had more hits than children + 1 "
                      "(`hit_cap` caps them); 15 % came back, against 20 %", table)
        self.assertIn("**9%** (came back / victims): no victim had more hits", table)


class TestCli(CustomTestCase):
    def run_main(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = reuse_by_branching.main(list(argv))
        return status, out.getvalue(), err.getvalue()

    def test_table(self):
        status, out, _ = self.run_main(*SOURCE)
        self.assertEqual(status, 0)
        self.assertIn("**10%**", out)
        self.assertIn("| hits \\ children | 0 | 1 | 2 | 3 | 4+ |", out)

    def test_bad_arguments_exit_2(self):
        for argv, message in ((["--policies", "lru"], "replays cost-weighted LRU"),
                              (["--cache", "radix"], "without a host tier"),
                              (["--capacity", "0%"], "must be in (0%, 100%]")):
            with self.subTest(argv=argv):
                status, _, err = self.run_main(*SOURCE[:6], *argv)
                self.assertEqual(status, 2)
                self.assertIn(message, err)


if __name__ == "__main__":
    unittest.main()
