"""Tests for benchmark/mla_eviction/continuations.py: session histories kept to the next turn."""

import contextlib
import io
import sys
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction"))

import continuations  # noqa: E402
import replay  # noqa: E402
import request_diff  # noqa: E402
from traces import Request, Trace  # noqa: E402

SOURCE = ["--workload", "multi-turn", "--num-requests", "300", "--seed", "1", "--capacity", "5%"]


def request(t, blocks, input_length=None):
    return Request(t, input_length or 512 * len(blocks), 10, tuple(blocks))


class TestFindContinuations(CustomTestCase):
    def test_extends_the_whole_earlier_prompt_but_its_last_block(self):
        trace = Trace("t", 512, (
            request(0.0, [0, 1, 2], 1200),      # 0
            request(5.0, [0, 1, 3, 4], 1900),   # 1: extends 0 (its partial last block differs)
            request(7.0, [0, 9]),               # 2: shares the first block only
            request(9.0, [0, 1, 3, 4, 5]),      # 3: extends 1 wholly
            request(20.0, [0, 1, 7]),           # 4: branches off 3's history: extends nothing
            request(30.0, [0, 1, 3, 4, 9]),     # 5: extends 1 as 3 did: 3's sibling, not its turn
        ))
        found = continuations.find_continuations(trace)
        self.assertEqual([(c.index, c.predecessor, c.shared_tokens, c.gap_s) for c in found],
                         [(1, 0, 1024, 5.0), (3, 1, 1900, 4.0)])

    def test_multi_turn_continuations_are_next_turns_of_one_session(self):
        trace = replay.load_trace(replay.parse_args([*SOURCE, "--no-progress"]))
        found = continuations.find_continuations(trace)
        self.assertGreater(len(found), len(trace.requests) // 4)
        previous_turn, last_seen = {}, {}
        for i, req in enumerate(trace.requests):
            previous_turn[i] = last_seen.get(req.session_id)
            last_seen[req.session_id] = i
        first_with = {}  # first block -> the first request starting with it
        for i, req in enumerate(trace.requests):
            first_with.setdefault(req.hash_ids[0], i)
        for c in found:
            # A first turn extends the first prompt of its system prompt where that prompt
            # was the system prompt and a partial block: blocks cannot tell the two apart.
            if c.predecessor != first_with[trace.requests[c.predecessor].hash_ids[0]]:
                self.assertEqual(c.predecessor, previous_turn[c.index])
            self.assertGreater(c.shared_tokens, 0)
            self.assertGreaterEqual(c.gap_s, 0)


class TestTables(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        args = replay.parse_args([*SOURCE, "--policies", "lru,optimal", "--no-progress"])
        cls.trace, cls.cost, configs = replay.prepare(args)
        (cls.runs,) = request_diff.measure_all(cls.trace, cls.cost, configs).values()
        cls.found = continuations.find_continuations(cls.trace)
        cls.tables = continuations.tables(cls.trace, cls.cost, cls.found,
                                          {p: r["hits"] for p, r in cls.runs.items()})

    def test_points_sum_to_the_flop_hit_rate(self):
        rows = self.tables["by_shared"]
        self.assertEqual(sum(r["n"] for r in rows), len(self.trace.requests))
        self.assertEqual(rows[-1]["n"], len(self.trace.requests) - len(self.found))
        for policy, run in self.runs.items():
            self.assertAlmostEqual(sum(r[policy] for r in rows), 100 * run["flop_hit_rate"],
                                   places=9)

    def test_served_shares_are_shares(self):
        rows = self.tables["by_gap"]
        self.assertEqual(sum(r["n"] for r in rows), len(self.found))
        for row in rows:
            for policy in self.runs:
                if row["n"]:
                    self.assertGreaterEqual(row[policy], 0.0)
                    self.assertLessEqual(row[policy], 1.0)
                else:
                    self.assertIsNone(row[policy])
        # The bound serves at least as much of the histories as LRU does, band by band.
        self.assertGreaterEqual(sum(r["optimal"] * r["n"] for r in rows if r["n"]),
                                sum(r["lru"] * r["n"] for r in rows if r["n"]))

    def test_bands(self):
        self.assertEqual(continuations.band(59.9, continuations.GAP_BANDS_S), 0)
        self.assertEqual(continuations.band(60, continuations.GAP_BANDS_S), 1)
        self.assertEqual(continuations.band(10_000, continuations.GAP_BANDS_S), 4)
        self.assertEqual(continuations.band_names((0, 2048, 8192), "k tokens", 1024),
                         ["0-2 k tokens", "2-8 k tokens", "≥ 8 k tokens"])


class TestUsage(CustomTestCase):
    def test_policies_given_either_way_are_kept(self):
        for given in (["--policies", "lru"], ["--policies=lru"]):
            with self.subTest(given=given):
                out = io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                    self.assertEqual(continuations.main([*SOURCE, *given]), 0)
                self.assertIn("| gap | continuations | lru |\n", out.getvalue())

    def test_host_tier_refused(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = continuations.main([*SOURCE, "--host-tier", "4x"])
        self.assertEqual(code, 2)
        self.assertIn("without a host tier", err.getvalue())


if __name__ == "__main__":
    unittest.main()
