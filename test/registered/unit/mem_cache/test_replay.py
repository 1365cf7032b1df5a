"""Tests for benchmark/mla_eviction/replay.py and simulator.py on SGLang's real cache.

Hand-made traces whose hits, FLOPs and rejections are worked out below from the
simulator's rules (DeepSeek-V3, 512-token blocks, 64-token pages; a request matches at
most ``(input_length - 1) // 64`` pages, as SGLang's scheduler does), small generated
workloads for determinism and the bound, and every bad command line.
"""

import contextlib
import importlib
import io
import json
import os
import stat
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from sglang.srt.mem_cache.mla_cost_model import KVCostModel
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

_BENCH = Path(__file__).resolve().parents[4] / "benchmark" / "mla_eviction"
sys.path.insert(0, str(_BENCH))
replay = importlib.import_module("replay")
simulator = importlib.import_module("simulator")
traces = importlib.import_module("traces")

V3 = KVCostModel.from_preset("deepseek-v3", page_size=64)
PAGE_BYTES = 64 * 70_272  # one 64-token page of DeepSeek-V3's bf16 latent
POOL_16_PAGES = str(16 * PAGE_BYTES)  # --capacity in bytes: a pool of 16 pages


def flops(n: int) -> float:
    """Prefill FLOPs of positions [0, n) by the cost model's formula (MLA: no window
    and no indexer): 2 * active_params per token, attention per attended position."""
    return 2 * V3.active_params * n + V3.attention_flops_per_position * n * (n + 1) / 2


def run_replay(*argv):
    """(exit status, stdout, stderr) of replay.main(argv), in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = replay.main(["--no-progress", "--jobs", "1", *argv])
        except SystemExit as e:  # argparse's own errors
            status = e.code
    return status, out.getvalue(), err.getvalue()


def line(ms, input_length, hash_ids, output_length=10):
    return {
        "timestamp": ms,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


# A pool of 16 pages. Request 1 (600 tokens + 10 out = 10 pages) leaves its 9 full
# prompt pages; request 2, the same prompt, hits all 9 (576 tokens). Request 3 needs
# ceil(1110 / 64) = 18 pages > 16: rejected. Request 4 (640 + 10 = 11 pages) finds 7
# free, evicts the 9-page leaf of requests 1-2 (its shortfall is 4; leaves go whole) and
# leaves 10 pages; request 5, the same page-aligned prompt, hits (640 - 1) // 64 = 9
# pages, not 10: the last prompt token is always computed.
HAND = [
    line(0, 600, [0, 1]),
    line(10_000, 600, [0, 1]),
    line(20_000, 1100, [7, 8, 9]),
    line(30_000, 640, [3, 4]),
    line(40_000, 640, [3, 4]),
]
HAND_PROMPT = 600 + 600 + 640 + 640  # the rejected request's prompt does not count
HAND_HIT = 576 + 576

# Ids past 64 bits: 2**64 + 1 is not 1. Request 3 repeats request 1: a real hit.
WIDE = [
    line(0, 600, [2**64 + 1, 2**64 + 2]),
    line(10_000, 600, [1, 2]),
    line(20_000, 600, [2**64 + 1, 2**64 + 2]),
]


class _TempDir(CustomTestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def trace(self, rows, name="t.jsonl") -> str:
        path = self.dir / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    def replay_json(self, *argv):
        out = self.dir / "out.json"
        status, stdout, err = run_replay(*argv, "--json", str(out))
        self.assertEqual(status, 0, err)
        return json.loads(out.read_text()), stdout


class TestHandTrace(_TempDir):
    def test_hits_rejections_and_flops_are_exact(self):
        data, stdout = self.replay_json(
            "--trace",
            self.trace(HAND),
            "--capacity",
            POOL_16_PAGES,
            "--policies",
            "lru,mla_aware,optimal",
        )
        self.assertIsNone(V3.attention_window)
        self.assertEqual(V3.indexer_flops_per_position, 0)
        flop_rate = 2 * flops(576) / (2 * flops(600) + 2 * flops(640))
        for r in data["results"]:
            with self.subTest(policy=r["policy"]):
                self.assertEqual(r["capacity_tokens"], 16 * 64)
                self.assertEqual((r["requests"], r["rejected"]), (5, 1))
                self.assertEqual(r["token_hit_rate"], HAND_HIT / HAND_PROMPT)
                self.assertAlmostEqual(r["flop_hit_rate"] / flop_rate, 1.0, delta=1e-12)
                self.assertEqual((r["evictions"], r["evicted_tokens"]), (1, 9 * 64))
        self.assertIn("1 request(s) larger than the whole pool were rejected.", stdout)

    def test_a_rejected_request_is_counted_on_a_trace_of_only_it(self):
        data, stdout = self.replay_json(
            "--trace",
            self.trace([HAND[2]]),
            "--capacity",
            POOL_16_PAGES,
            "--policies",
            "lru",
        )
        r = data["results"][0]
        self.assertEqual((r["requests"], r["rejected"], r["token_hit_rate"]), (1, 1, 0))
        self.assertIsNone(r["ttft_p50_s"])
        self.assertIn("1 request(s) larger than the whole pool", stdout)

    def test_ids_past_64_bits_do_not_alias(self):
        data, _ = self.replay_json(
            "--trace", self.trace(WIDE), "--capacity", "100%", "--policies", "lru"
        )
        r = data["results"][0]
        self.assertEqual(r["capacity_tokens"], 4 * 512)  # 4 distinct blocks
        self.assertEqual(r["token_hit_rate"], 576 / 1800)

    def test_tree_core_per_row(self):
        trace = self.trace(HAND[:2])
        policies = "lru,fifo,mla_aware,gdsf,optimal"
        data, stdout = self.replay_json(
            "--trace", trace, "--capacity", "100%", "--policies", policies
        )
        cores = {r["policy"]: r["tree_core"] for r in data["results"]}
        self.assertEqual(
            cores,
            {
                "lru": "rust",
                "fifo": "rust",
                "mla_aware": "python",
                "gdsf": "python",
                "optimal": "python",
            },
        )
        self.assertIn("| lru | rust | 100% |", stdout)
        data, _ = self.replay_json(
            "--trace", trace, "--capacity", "100%", "--policies", "lru",
            "--tree-core", "python",
        )  # fmt: skip
        self.assertEqual(data["results"][0]["tree_core"], "python")

    def test_pool_accounting_holds_after_a_replay(self):
        trace = traces.generate_workload("chat", num_requests=120, seed=1)
        for policy in ("lru", "mla_aware", "optimal"):
            config = simulator.ReplayConfig(policy, capacity_tokens=64 * 100)
            r = simulator.Replayer(trace, V3, config)
            result = r.run()
            with self.subTest(policy=policy):
                cached = r.cache.evictable_size() + r.cache.protected_size()
                self.assertEqual(r.cache.protected_size(), 0)  # nothing is running
                self.assertEqual(r.allocator.available_size() + cached, 100)
                self.assertEqual(result.requests, 120)
                self.assertGreater(result.evictions, 0)

    def test_replayer_refuses_what_it_cannot_run(self):
        trace = traces.Trace("t", 512, ())
        config = simulator.ReplayConfig
        for bad, message in (
            (config("nope", 640), "unknown policy"),
            (config("lru", 640, tree_core="go"), "tree core"),
            (config("lru", 640, page_size=100), "page size"),
            (config("lru", 63), "below one page"),
        ):
            with self.subTest(config=bad):
                with self.assertRaisesRegex(ValueError, message):
                    simulator.Replayer(trace, V3, bad)


class TestGeneratedWorkloads(_TempDir):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.tmp_cls = tempfile.TemporaryDirectory()
        out = Path(cls.tmp_cls.name) / "all.json"
        cls.argv = (
            "--workload", "multi-turn", "--num-requests", "150", "--seed", "3",
            "--capacity", "5%,25%",
        )  # fmt: skip
        status, _, err = run_replay(*cls.argv, "--json", str(out))
        assert status == 0, err
        cls.rows = json.loads(out.read_text())["results"]

    @classmethod
    def tearDownClass(cls):
        cls.tmp_cls.cleanup()
        super().tearDownClass()

    def test_every_policy_ran_at_every_capacity(self):
        names = replay.DEFAULT_POLICIES.split(",")
        self.assertEqual([r["policy"] for r in self.rows], names * 2)
        for r in self.rows:
            self.assertEqual((r["requests"], r["rejected"]), (150, 0))

    def test_the_bound_is_at_least_every_policy(self):
        for capacity in ("5%", "25%"):
            rows = [r for r in self.rows if r["capacity"] == capacity]
            bound = next(r for r in rows if r["is_bound"])
            for r in rows:
                for key in replay.RATE_KEYS:
                    with self.subTest(capacity=capacity, policy=r["policy"], key=key):
                        self.assertGreaterEqual(bound[key], r[key] * (1 - 1e-12))
            lru = next(r for r in rows if r["policy"] == "lru")
            self.assertGreater(bound["flop_hit_rate"], lru["flop_hit_rate"])

    def test_a_replay_is_deterministic(self):
        data, _ = self.replay_json(*self.argv, "--policies", "mla_aware")
        again = data["results"]
        first = [r for r in self.rows if r["policy"] == "mla_aware"]
        for a, b in zip(first, again):
            for row in (a, b):
                for key in ("cpu_us_per_request", "cpu_vs_stock", "gap_closed"):
                    row.pop(key)
            self.assertEqual(a, b)
        self.assertEqual(len(again), 2)


class TestCommandLine(_TempDir):
    def assert_usage_error(self, argv, *fragments):
        """Exit 2, one stderr line naming the fragments, nothing written."""
        before = sorted(os.listdir(self.dir))
        status, stdout, err = run_replay(*argv)
        self.assertEqual(status, 2, err)
        self.assertEqual(stdout, "")
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertTrue(err.startswith("replay.py: error: "), err)
        for fragment in fragments:
            self.assertIn(fragment, err)
        self.assertEqual(sorted(os.listdir(self.dir)), before)

    def test_bad_options_exit_2_naming_the_option(self):
        trace = self.trace(HAND[:2])
        out = str(self.dir / "out.json")
        cases = [
            (["--policies", "nope"], "--policies", "'nope'"),
            (["--policies", " , "], "--policies"),
            (["--capacity", "0%"], "--capacity '0%'"),
            (["--capacity", "150%"], "--capacity '150%'"),
            (["--capacity", "abc"], "--capacity", "'abc'"),
            (["--capacity", str(PAGE_BYTES - 1)], "less than one page"),
            (["--capacity", "1%"], "less than one page"),  # 1 % of 2 blocks: none
            (["--page-size", "100"], "--page-size 100", "--block-size 512"),
            (["--tp", "0"], "--tp"),
            (["--jobs", "0"], "--jobs"),
            (["--gpu-tflops", "nan"], "--gpu-tflops"),
            (["--gpu-tflops", "inf"], "--gpu-tflops"),
            (["--gpu-tflops", "0"], "--gpu-tflops"),
            (["--decode-ms-per-token", "-1"], "--decode-ms-per-token"),
            (["--decode-ms-per-token", "nan"], "--decode-ms-per-token"),
            (["--policy-config", "{"], "--policy-config", "not JSON"),
            (["--policy-config", "[1]"], "--policy-config", "JSON object"),
            (["--policy-config", '{"speed": 1}'], "--policy-config", "'speed'"),
            (["--policy-config", '{"learn_weight": 1}'], "'learn_weight'"),
            (["--policy-config", '{"calibration": "/no/c.json"}'], "/no/c.json"),
            (["--tree-core", "go"], "--tree-core"),
            (["--tp", "two"], "--tp"),
        ]
        for extra, *fragments in cases:
            with self.subTest(argv=extra):
                argv = ["--trace", trace, "--capacity", "100%", "--json", out, *extra]
                self.assert_usage_error(argv, *fragments)

    def test_bad_trace_files_name_the_file_and_line(self):
        missing = self.dir / "missing.jsonl"
        self.assert_usage_error(["--trace", str(missing)], str(missing), "no such file")
        bad = self.trace([HAND[0], line(1000, -5, [])], name="bad.jsonl")
        self.assert_usage_error(
            ["--trace", bad], f"{bad}:2: field 'input_length': must be >= 0, got -5"
        )
        self.assert_usage_error(
            ["--workload", "chat", "--workload-param", "rate=-1"], "'rate'"
        )

    def test_outputs_must_be_regular_files_in_a_directory(self):
        trace = self.trace(HAND[:2])
        fifo = self.dir / "fifo"
        os.mkfifo(fifo)
        for flag, path, fragment in (
            ("--json", str(self.dir), "not a regular file"),
            ("--json", str(self.dir / "no" / "out.json"), "no such directory"),
            ("--json", "/dev/null", "not a regular file"),
            ("--markdown", str(fifo), "not a regular file"),
            ("--plot", "/dev/null", "not a regular file"),
        ):
            with self.subTest(flag=flag, path=path):
                argv = ["--trace", trace, "--capacity", "100%", flag, path]
                self.assert_usage_error(argv, f"{flag} {path}: {fragment}")
        self.assertTrue(stat.S_ISCHR(os.stat("/dev/null").st_mode))
        self.assertTrue(stat.S_ISFIFO(os.stat(fifo).st_mode))

    def test_a_failed_write_changes_no_output_and_leaves_no_temporary(self):
        trace = self.trace(HAND[:2])
        out, md = self.dir / "out.json", self.dir / "table.md"
        out.write_text("old\n")
        argv = ["--trace", trace, "--capacity", "100%", "--policies", "lru"]
        argv += ["--json", str(out), "--markdown", str(md)]
        boom = OSError("disk full")
        with mock.patch.object(replay, "plot", side_effect=boom):
            status, _, err = run_replay(*argv, "--plot", str(self.dir / "p.png"))
        self.assertEqual(status, 1)
        want = f"replay.py: error: --plot {self.dir / 'p.png'}: disk full"
        self.assertEqual(err.splitlines(), [want])
        self.assertEqual(sorted(os.listdir(self.dir)), ["out.json", "t.jsonl"])
        self.assertEqual(out.read_text(), "old\n")
        # Without the failure every file is written, readable as open() makes it.
        status, _, err = run_replay(*argv)
        self.assertEqual(status, 0, err)
        self.assertEqual(json.loads(out.read_text())["requests"], 2)
        self.assertTrue(md.read_text().startswith("**t.jsonl**"))
        umask = os.umask(0)
        os.umask(umask)
        self.assertEqual(stat.S_IMODE(os.stat(md).st_mode), 0o666 & ~umask)
        self.assertEqual(
            sorted(os.listdir(self.dir)), ["out.json", "t.jsonl", "table.md"]
        )

    def test_as_a_process_a_bad_option_is_one_stderr_line(self):
        result = subprocess.run(
            [sys.executable, str(_BENCH / "replay.py"), "--trace", self.trace(HAND)]
            + ["--policies", "nope", "--no-progress"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(result.returncode, 2)
        self.assertEqual(result.stdout, "")
        self.assertEqual(len(result.stderr.splitlines()), 1, result.stderr)
        self.assertIn("--policies: unknown 'nope'", result.stderr)


if __name__ == "__main__":
    unittest.main()
