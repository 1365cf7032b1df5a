"""Tests for benchmark/mla_eviction/soak.py: a few thousand requests on one cache keep
mla_aware's state within its bounds, and a broken bound is reported."""

import contextlib
import importlib
import io
import json
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=25, suite="base-a-test-cpu")

sys.path.insert(
    0, str(Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction")
)
soak = importlib.import_module("soak")
traces = importlib.import_module("traces")

GHOSTS = 256  # a small table of victims, to see it fill and hold


def run_main(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = soak.main(["--no-progress", *argv])
        except SystemExit as e:
            status = e.code
    return status, out.getvalue(), err.getvalue()


class TestSoak(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        with mock.patch.object(MLAAwareStrategy, "MAX_GHOSTS", GHOSTS):
            cls.samples = soak.run_soak(
                requests=3000,
                chunk=1000,
                sample_every=500,
                capacity_tokens=64 * 64,
                progress=False,
                trace_memory=False,
            )
            cls.problems = soak.check(cls.samples)

    def test_bounds_hold_on_every_sample(self):
        self.assertEqual(self.problems, [])
        self.assertEqual(
            [s["requests"] for s in self.samples], list(range(0, 3001, 500))
        )
        for s in self.samples:
            with self.subTest(requests=s["requests"]):
                self.assertEqual((s["stale_seen"], s["stale_children"]), (0, 0))
                self.assertLessEqual(s["seen"], s["tree_nodes"])
                self.assertLessEqual(s["children"], s["tree_nodes"])
                self.assertLessEqual(s["tree_nodes"] - 1, s["pool_pages"])  # root
                # Running requests hold pages outside the tree until they finish.
                self.assertLessEqual(
                    s["cached_pages"] + s["free_pages"], s["pool_pages"]
                )
        last = self.samples[-1]  # every chunk drains: nothing runs at the end
        self.assertEqual(last["cached_pages"] + last["free_pages"], last["pool_pages"])

    def test_the_victim_table_fills_and_holds_at_its_bound(self):
        ghosts = [s["ghosts"] for s in self.samples]
        self.assertEqual(max(ghosts), GHOSTS)
        self.assertEqual(ghosts[-1], GHOSTS)
        self.assertGreater(self.samples[-1]["evictions"], 500)

    def test_a_broken_bound_is_reported(self):
        ok = dict(self.samples[-1], requests=7, tree_nodes=5, seen=5, children=5)
        self.assertEqual(soak.check([ok]), [])
        for change, words in (
            ({"seen": 6}, "seen 6 > tree nodes"),
            ({"children": 6}, "children 6 > tree nodes"),
            ({"ghosts": MLAAwareStrategy.MAX_GHOSTS + 1}, "> MAX_GHOSTS"),
            ({"stale_seen": 1}, "1 stale seen"),
            ({"stale_children": 2}, "2 stale children"),
        ):
            with self.subTest(change=change):
                (problem,) = soak.check([dict(ok, **change)])
                self.assertIn("after 7 requests (5 tree nodes)", problem)
                self.assertIn(words, problem)

    def test_chunks_share_no_block(self):
        trace = traces.generate_workload("multi-turn", num_requests=50, seed=0)
        ids = {h for r in trace.requests for h in (*r.hash_ids, *r.sequence_hash_ids)}
        moved, used = soak.shift_ids(trace, 1000)
        self.assertEqual(used, len(ids))  # dense: 0 .. D - 1
        got = {h for r in moved.requests for h in (*r.hash_ids, *r.sequence_hash_ids)}
        self.assertEqual(got, {h + 1000 for h in ids})


class TestCommandLine(CustomTestCase):
    def test_writes_the_summary_and_exits_0(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "soak.json"
            status, stdout, err = run_main(
                "--requests", "300", "--chunk", "200", "--sample-every", "100",
                "--capacity-tokens", "4096", "--no-tracemalloc", "--json", str(out),
            )  # fmt: skip
            self.assertEqual(status, 0, err)
            data = json.loads(out.read_text())
        self.assertEqual(json.loads(stdout)["problems"], [])
        self.assertEqual((data["requests"], data["problems"]), (300, []))
        self.assertEqual(len(data["samples"]), 4)
        self.assertEqual(len(err.splitlines()), 3)  # one line per sample after 0

    def test_bad_options_exit_2_with_one_line(self):
        for argv, words in (
            (["--requests", "0"], "--requests"),
            (["--page-size", "100"], "--page-size 100"),
            (["--capacity-tokens", "10"], "--capacity-tokens"),
            (["--json", "/dev/null"], "--json /dev/null: not a regular file"),
            (["--workload", "nope"], "--workload"),
        ):
            with self.subTest(argv=argv):
                status, stdout, err = run_main(*argv)
                self.assertEqual((status, stdout), (2, ""))
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertIn(words, err)


if __name__ == "__main__":
    unittest.main()
