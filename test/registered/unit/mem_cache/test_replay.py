"""Tests for benchmark/mla_eviction/replay.py and simulator.py on SGLang's real caches."""

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock
from pathlib import Path

import numpy as np

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=120, suite="stage-a-test-cpu")

_REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(_REPO / "benchmark" / "mla_eviction"))

import replay  # noqa: E402
from simulator import Replayer, ReplayConfig, TickClock, median_make_up  # noqa: E402
from traces import Request, Trace, load_mooncake_trace  # noqa: E402

from sglang.srt.mem_cache import mla_victim_trim  # noqa: E402
from sglang.srt.mem_cache.mla_cost_model import KVCostModel  # noqa: E402

SHIPPED_TRACE = _REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def run_replay(*argv):
    """(exit status, stdout, stderr) of replay.main(argv)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = replay.main(["--no-progress", "--jobs", "1", *argv])
    return status, out.getvalue(), err.getvalue()


def write_trace(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Two conversations sharing a 2-block document, 512-token blocks.
FIXTURE = [
    {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 100, "input_length": 1300, "output_length": 10, "hash_ids": [0, 1, 3]},
    {"timestamp": 5000, "input_length": 2000, "output_length": 10, "hash_ids": [0, 1, 2, 4]},
    {"timestamp": 9000, "input_length": 600, "output_length": 10, "hash_ids": [5, 6]},
]


class TestReplayCli(CustomTestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)
        self.trace = write_trace(self.dir / "t.jsonl", FIXTURE)

    def tearDown(self):
        self.tmp.cleanup()

    def test_sequential_hits_on_fixture_are_exact(self):
        # Everything fits: request 2 reuses blocks 0,1; request 3 reuses 0,1,2 (in
        # the block model an id is its content, partial in request 1 or not).
        out = self.dir / "r.json"
        status, stdout, _ = run_replay(
            "--trace", str(self.trace), "--mode", "sequential", "--capacity", "100%",
            "--policies", "lru", "--json", str(out),
        )
        self.assertEqual(status, 0)
        r = json.loads(out.read_text())["results"][0]
        self.assertEqual(r["requests"], 4)
        self.assertEqual(r["block_hit_rate"], 5 / 12)
        self.assertIn("| lru | 100% |", stdout)

    def test_json_fields_and_bound_label(self):
        out = self.dir / "r.json"
        status, stdout, _ = run_replay(
            "--trace", str(self.trace), "--capacity", "50%,100%",
            "--policies", "lru,mla_aware,optimal", "--json", str(out),
        )
        self.assertEqual(status, 0)
        data = json.loads(out.read_text())
        self.assertEqual(len(data["results"]), 6)
        for r in data["results"]:
            for key in ("policy", "capacity_fraction", "token_hit_rate", "flop_hit_rate",
                        "ttft_p50_s", "ttft_p99_s", "cpu_us_per_request", "evictions"):
                self.assertIn(key, r)
            for key in ("token_hit_rate", "flop_hit_rate"):
                self.assertTrue(0 <= r[key] <= 1, (key, r[key]))
            self.assertEqual(r["is_bound"], r["policy"] == "optimal")
            if r["policy"] == "mla_aware":  # what its learning ended with
                learnt = r["learnt"]
                self.assertTrue(0.25 <= learnt["weight"] <= 3, learnt)
                self.assertTrue(0 <= learnt["log_factor"] <= math.log(1000), learnt)
                self.assertEqual(len(learnt["returned_proven_probationary"]), 2)
                # Every victim judged young or old came back, so was counted first.
                self.assertLessEqual(sum(learnt["returned_young_old"]),
                                     sum(learnt["returned_proven_probationary"]))
            else:
                self.assertIsNone(r["learnt"])
        self.assertIn("optimal (offline bound)", stdout)
        self.assertEqual({r["capacity_fraction"] for r in data["results"]}, {0.5, 1.0})

    def test_same_seed_same_json(self):
        def once(name):
            out = self.dir / name
            status, _, _ = run_replay(
                "--workload", "multi-turn", "--num-requests", "150", "--seed", "3",
                "--capacity", "5%,25%", "--policies", "lru,mla_aware,optimal",
                "--json", str(out),
            )
            self.assertEqual(status, 0)
            data = json.loads(out.read_text())
            for r in data["results"]:
                r.pop("cpu_us_per_request")  # a wall-clock measurement
            return data

        self.assertEqual(once("a.json"), once("b.json"))

    def test_legacy_tree_runs_on_replay_ticks_not_wall_time(self):
        """RadixCache stamps nodes with time.monotonic(); a replay gives it a tick clock,
        so nothing reads wall time and two runs agree (mla_aware scores by age)."""
        def once(name):
            out = self.dir / name
            with mock.patch("time.monotonic", side_effect=AssertionError("wall clock read")):
                status, _, err = run_replay(
                    "--workload", "multi-turn", "--num-requests", "150", "--seed", "3",
                    "--capacity", "5%", "--policies", "lru,mla_aware", "--host-tier", "4x",
                    "--json", str(out),
                )
            self.assertEqual(status, 0, err)
            data = json.loads(out.read_text())
            for r in data["results"]:
                self.assertEqual(r["cache"], "radix")
                r.pop("cpu_us_per_request")
            return data

        self.assertEqual(once("a.json"), once("b.json"))
        from sglang.srt.mem_cache import radix_cache

        self.assertIs(radix_cache.time, time)

    def test_per_read_clock_moves_at_every_read_within_its_tick(self):
        clock = TickClock(per_read=True)
        clock.advance()
        reads = [clock.monotonic() for _ in range(1000)]
        self.assertEqual(sorted(set(reads)), reads)
        self.assertTrue(1.0 < reads[0] and reads[-1] < 2.0)
        clock.advance()
        self.assertLess(reads[-1], clock.monotonic())
        ticks = TickClock()  # the default clock stands still between advances
        self.assertEqual(ticks.monotonic(), ticks.monotonic())

    def test_plot_and_markdown_written(self):
        png, md = self.dir / "p.png", self.dir / "t.md"
        status, _, _ = run_replay(
            "--trace", str(self.trace), "--capacity", "50%,100%", "--policies", "lru,optimal",
            "--plot", str(png), "--markdown", str(md),
        )
        self.assertEqual(status, 0)
        self.assertEqual(png.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
        self.assertIn("| optimal (offline bound) |", md.read_text())

    def test_bad_input_exits_2_names_file_line_field_and_writes_nothing(self):
        cases = {
            "malformed": ('{"timestamp": 0,', ":1: malformed JSON"),
            "missing": ('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}', ":1: field 'output_length'"),
            "negative": ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', ":1: field 'input_length'"),
            "inconsistent": ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', ":1: field 'hash_ids'"),
            "backwards": ('{"timestamp": 9, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                          '{"timestamp": 3, "input_length": 5, "output_length": 1, "hash_ids": [2]}', ":2: field 'timestamp'"),
            "empty": ("", "empty trace"),
        }
        for name, (text, fragment) in cases.items():
            with self.subTest(name):
                path = self.dir / f"{name}.jsonl"
                path.write_text(text)
                out = self.dir / f"{name}.json"
                status, stdout, stderr = run_replay("--trace", str(path), "--json", str(out))
                self.assertEqual(status, 2)
                self.assertIn(str(path) + fragment if fragment.startswith(":") else fragment, stderr)
                self.assertNotIn("Traceback", stderr)
                self.assertEqual(stdout, "")
                self.assertFalse(out.exists())

    def test_bad_flags_exit_2(self):
        for argv, fragment in (
            (["--capacity", "0%"], "--capacity '0%'"),
            (["--capacity", "lots"], "--capacity"),
            (["--policies", "nope"], "unknown policy 'nope'"),
            (["--page-size", "3"], "--page-size 3 must divide"),
            (["--policy-config", '{"bogus": 1}'], "'bogus'"),
            (["--model", "gpt-17"], "--model"),
            (["--clock", "per-read"], "--clock per-read needs --cache radix"),
        ):
            with self.subTest(argv):
                status, _, stderr = run_replay("--trace", str(self.trace), *argv)
                self.assertEqual(status, 2)
                self.assertIn(fragment, stderr)

    def test_memory_capacity_goes_through_the_cost_model(self):
        trace = load_mooncake_trace(self.trace)
        args = replay.parse_args(["--trace", str(self.trace), "--capacity", "80GB", "--weights", "40GB"])
        cost = replay.build_cost_model(args)
        [(label, share, tokens)] = replay.parse_capacities("80GB", args, trace, cost)
        self.assertEqual((label, share), ("80GB", None))
        self.assertEqual(tokens, 40_000_000_000 // (64 * 70272) * 64)


class TestToolInputs(CustomTestCase):
    """replay.tool_inputs: the set-up the single-policy tools share."""

    SOURCE = ["--workload", "chat", "--num-requests", "20", "--capacity", "5%"]

    def inputs(self, *argv, check=None):
        own = argparse.ArgumentParser(add_help=False)
        own.add_argument("--runs", type=int, default=1)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            got = replay.tool_inputs("tool.py", "the tool's doc", own, list(argv),
                                     policy="the tool's policy", check=check)
        return got, out.getvalue(), err.getvalue()

    def test_options_trace_cost_and_configs(self):
        (own, trace, cost, configs), _, _ = self.inputs(*self.SOURCE, "--runs", "3")
        self.assertEqual(own.runs, 3)
        self.assertEqual(len(trace.requests), 20)
        self.assertIsInstance(cost, KVCostModel)
        self.assertEqual([(c.policy, c.capacity_label) for c in configs], [("mla_aware", "5%")])

    def test_help_prints_the_doc(self):
        for flag in ("-h", "--help"):
            with self.subTest(flag=flag):
                self.assertEqual(self.inputs(flag)[:2], (0, "the tool's doc\n"))

    def test_bad_arguments_exit_2_naming_the_tool(self):
        def check(own):
            if own.runs < 1:
                raise replay.UsageError("--runs must be >= 1")

        for argv, message in ((["--runs", "x"], "argument --runs: invalid int value"),
                              (["--runs", "0"], "tool.py: error: --runs must be >= 1"),
                              (["--policies", "lru"], "tool.py: error: --policies/--policy-config:"
                                                     " this tool replays the tool's policy")):
            with self.subTest(argv=argv):
                status, _, err = self.inputs(*self.SOURCE, *argv, check=check)
                self.assertEqual(status, 2)
                self.assertIn(message, err)


class TestSimulatorInvariants(CustomTestCase):
    def test_pool_accounting_after_every_request(self):
        """free + cached + held by running requests == pool, on both trees, with and without
        victims trimmed to the shortfall."""
        trace = load_mooncake_trace(SHIPPED_TRACE, limit=300)
        cost = KVCostModel.from_preset("deepseek-v3")
        whole_surplus = None
        for cache, trim in (("unified", "none"), ("unified", "all"), ("radix", "none"), ("radix", "all")):
            with self.subTest(cache=cache, trim=trim):
                r = Replayer(trace, cost, ReplayConfig(
                    policy="lru", capacity_tokens=300_000, cache=cache, trim=trim,
                ))
                checked = []

                def check():
                    alloc, tree = r.allocator, r.cache
                    cached = tree.evictable_size() + tree.protected_size()
                    checked.append(alloc.available_size() + cached <= alloc.size)

                r.run(progress=check)
                self.assertTrue(all(checked))
                # All requests done: nothing held outside the tree.
                self.assertEqual(
                    r.allocator.available_size() + r.cache.evictable_size() + r.cache.protected_size(),
                    r.allocator.size,
                )
                self.assertEqual(r.cache.protected_size(), 0)
                result = r.result
                self.assertGreater(result.evictions, 0)
                self.assertGreater(result.shortfall_tokens, 0)
                self.assertEqual(result.evicted_tokens % r.cfg.page_size, 0)
                self.assertLessEqual(result.shortfall_tokens, result.evicted_tokens)
                surplus = result.evicted_tokens - result.shortfall_tokens  # in tokens
                # Only the unified tree without a host tier trims.
                self.assertEqual(result.trimmed, cache == "unified" and trim == "all")
                if result.trimmed:  # less than 1 % of the pool over the ask, per eviction
                    bound = mla_victim_trim.MIN_SURPLUS_SHARE * r.cfg.capacity_tokens
                    self.assertLess(surplus, result.evictions * bound)
                    self.assertLess(surplus, whole_surplus)  # the same tree freeing whole victims
                else:  # whole nodes: more than a page each (the tree counts pages)
                    self.assertGreater(result.evicted_tokens, result.evictions * r.cfg.page_size)
                    whole_surplus = surplus


class TestTtftMakeUp(CustomTestCase):
    def test_median_band_is_the_middle_one_percent_by_ttft(self):
        # 401 requests, TTFT (i + 1) ** 2 s, in no order: ranks 198..202 (n // 2 +- n // 200),
        # whose mean recompute is 200 ** 2 + mean((-2..2) ** 2).
        rows = np.array([(1.0, i * i, 2.0 * i) for i in range(401)])
        parts = median_make_up(np.random.default_rng(0).permutation(rows))
        self.assertEqual(parts, {"wait": 1.0, "recompute": 40_002.0, "reload": 400.0})

    def test_few_rows(self):
        self.assertIsNone(median_make_up(np.zeros((0, 3))))
        one = median_make_up(np.array([(1.0, 2.0, 3.0)]))
        self.assertEqual(one, {"wait": 1.0, "recompute": 2.0, "reload": 3.0})
        # Two requests: the upper middle (rank 1), not a mean of both.
        two = median_make_up(np.array([(0.0, 9.0, 0.0), (0.0, 1.0, 0.0)]))
        self.assertEqual(two["recompute"], 9.0)

    def test_each_ttft_is_split_into_wait_recompute_and_reload(self):
        """Reload seconds are the host tier's hits at the reload rate; no tier, no reload."""
        trace = load_mooncake_trace(SHIPPED_TRACE, limit=300)
        cost = KVCostModel.from_preset("deepseek-v3")
        for host in (0, 1_200_000):
            with self.subTest(host_tier_tokens=host):
                r = Replayer(trace, cost, ReplayConfig(
                    policy="lru", capacity_tokens=300_000, cache="radix", host_tier_tokens=host,
                ))
                result = r.run()
                rows = np.array(result.ttfts)
                self.assertEqual(rows.shape, (result.requests - result.rejected, 3))
                self.assertTrue((rows >= 0).all())
                reloaded = rows[:, 2].sum() / cost.reload_seconds_per_token
                self.assertAlmostEqual(reloaded, result.host_hit_tokens, delta=1e-6 * reloaded)
                self.assertEqual(result.host_hit_tokens > 0, host > 0)
                self.assertAlmostEqual(rows[:, 1:].sum(), result.prefill_s, delta=1e-9 * result.prefill_s)
                summary = result.summary()
                self.assertAlmostEqual(summary["ttft_mean_s"], rows.sum(axis=1).mean())
                parts = sum(summary["ttft_p50_parts_s"].values())
                ttft = np.sort(rows.sum(axis=1))
                n = len(ttft)
                self.assertTrue(ttft[n // 2 - n // 200] <= parts <= ttft[n // 2 + n // 200])


class TestHostTier(CustomTestCase):
    def test_a_prompt_is_backed_up_when_inserted_even_if_its_output_fills_no_page(self):
        """HiCache's default write_through backs up what each insert adds, the prompt at
        the prefill checkpoint included: a request whose output completes no page (no
        insert at its finish) still leaves its prompt on host, marked backed up, and a
        later request reloads all 1,024 tokens of it once the device has evicted it."""
        cost = KVCostModel.from_preset("deepseek-v3")
        trace = Trace("host", 512, (
            Request(0.0, 1024, 8, (1, 2)),
            Request(100.0, 1024, 8, (3, 4)),  # 17 + 17 pages do not fit in 32: evicts A
            Request(200.0, 1500, 8, (1, 2, 5)),
        ))
        r = Replayer(trace, cost, ReplayConfig(
            policy="lru", capacity_tokens=2048, cache="radix", host_tier_tokens=8192))
        result = r.run()
        self.assertEqual(result.hit_tokens, 1024)
        self.assertEqual(result.host_hit_tokens, 1024)
        cached = [n for n in r.cache.root_node.children.values()]
        self.assertTrue(cached and all(getattr(n, "backuped", False) for n in cached))


class TestKnownOutputs(CustomTestCase):
    def test_next_turn_reuses_the_previous_output_only_when_its_content_is_known(self):
        """Turn 2's prompt is turn 1's prompt + output + more: with the output's block ids
        known it hits all 24 full pages of turn 1 (1,536 tokens), without them the prompt's
        16 (1,024 tokens)."""
        cost = KVCostModel.from_preset("deepseek-v3")
        for sequence_ids, hit in (((10, 11, 12), 1536), ((), 1024)):
            with self.subTest(known=bool(sequence_ids)):
                trace = Trace("two-turns", 512, (
                    Request(0.0, 1024, 512, (10, 11), "s", sequence_ids),
                    Request(100.0, 2000, 8, (10, 11, 12, 13), "s"),
                ))
                r = Replayer(trace, cost, ReplayConfig(policy="lru", capacity_tokens=64_000))
                result = r.run()
                self.assertEqual(result.hit_tokens, hit)
                self.assertEqual(result.prompt_tokens, 3024)


class TestSessionCloses(CustomTestCase):
    def test_a_client_closes_each_session_after_its_last_request(self):
        """Two sessions of two turns and a request with none: with ``last-turn`` the tree
        hears two closes, each after its session's last request finished; with ``never``,
        none. Every insert carries its request's session id."""
        from sglang.srt.mem_cache.mla_eviction_plugin import register

        register()
        cost = KVCostModel.from_preset("deepseek-v3")
        trace = Trace("sessions", 512, (
            Request(0.0, 1024, 8, (1, 2), "a"),
            Request(1.0, 1024, 8, (3, 4), "b"),
            Request(2.0, 1024, 8, (5, 6)),
            Request(50.0, 1500, 8, (1, 2, 7), "a"),
            Request(60.0, 1500, 8, (3, 4, 8), "b"),
        ))
        for close, expected in (("last-turn", ["a", "b"]), ("never", [])):
            with self.subTest(close=close):
                r = Replayer(trace, cost, ReplayConfig(
                    policy="mla_aware", capacity_tokens=64_000, session_close=close,
                    policy_config={"model": "deepseek-v3", "page_size": 64,
                                   "key_unit_tokens": 64}))
                closes, inserts = [], []
                release, insert = r.cache.release_radix_session, r.cache.insert
                r.cache.release_radix_session = lambda sid: (
                    closes.append((sid, r.result.requests)), release(sid))[1]
                r.cache.insert = lambda params: (inserts.append(params.session_id),
                                                 insert(params))[1]
                r.run()
                self.assertEqual([sid for sid, _ in closes], expected)
                # Each close comes after its session's last request was admitted.
                self.assertTrue(all(admitted >= 4 for _, admitted in closes))
                self.assertEqual(set(inserts), {"a", "b", None})

    def test_session_radix_cache_evicts_an_open_sessions_kv_last(self):
        """With SGLang's session radix cache the third request's eviction takes the
        sessionless second request's KV, not the older KV of session ``a`` (still open:
        its last turn is to come), so that turn hits its 1,024-token history; LRU alone
        takes the oldest and the turn hits nothing."""
        cost = KVCostModel.from_preset("deepseek-v3")
        trace = Trace("open-session", 512, (
            Request(0.0, 1024, 8, (1, 2), "a"),
            Request(10.0, 1024, 8, (3, 4)),
            Request(20.0, 1024, 8, (5, 6)),  # 48 pages hold two cached prompts and a third
            Request(30.0, 1500, 8, (1, 2, 7), "a"),
        ))
        for session_radix, hit in ((True, 1024), (False, 0)):
            with self.subTest(session_radix=session_radix):
                r = Replayer(trace, cost, ReplayConfig(
                    policy="lru", capacity_tokens=3072, session_radix=session_radix))
                self.assertEqual(r.run().hit_tokens, hit)

    def test_a_new_trace_on_the_same_replayer_closes_its_own_sessions(self):
        """soak.py replays chunk after chunk on one cache, setting ``trace`` between runs:
        each chunk's sessions close after their own last request."""
        from sglang.srt.mem_cache.mla_eviction_plugin import register

        register()
        cost = KVCostModel.from_preset("deepseek-v3")
        first = Trace("one", 512, (Request(0.0, 1024, 8, (1, 2), "a"),))
        second = Trace("two", 512, (Request(0.0, 1024, 8, (3, 4), "1:a"),
                                    Request(9.0, 1500, 8, (3, 4, 5), "1:a")))
        r = Replayer(first, cost, ReplayConfig(policy="lru", capacity_tokens=64_000))
        closes = []
        release = r.cache.release_radix_session
        r.cache.release_radix_session = lambda sid: (closes.append(sid), release(sid))[1]
        r.run()
        r.trace = second
        r.run(first_index=1)
        self.assertEqual(closes, ["a", "1:a"])


class TestPool(CustomTestCase):
    def test_a_pool_after_replays_in_place_does_not_hang(self):
        """libgomp is not fork-safe: replays in place (``--jobs 1``) over a pool large
        enough for torch to start its OpenMP threads, then a forked pool, hung the pool's
        workers forever until replays ran torch on one thread (bar_check does this)."""
        script = (
            "import sys; sys.path.insert(0, sys.argv[1]); import replay\n"
            "for jobs in ('1', '2'):\n"
            "    assert replay.main(['--trace', sys.argv[2], '--num-requests', '200',"
            " '--capacity', '25%', '--policies', 'lru,mla_aware', '--jobs', jobs,"
            " '--no-progress']) == 0\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, str(_REPO / "benchmark" / "mla_eviction"),
             str(SHIPPED_TRACE)],
            capture_output=True, text=True, timeout=300,
        )
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])


class TestShippedTraceValidation(CustomTestCase):
    def test_sequential_reproduces_trace_readme(self):
        """The trace README at 5 % of the unique blocks: LRU 15.66 %, Belady 39.56 %."""
        out = Path(tempfile.mkdtemp()) / "seq.json"
        status, _, _ = run_replay(
            "--trace", str(SHIPPED_TRACE), "--mode", "sequential", "--cache", "radix",
            "--capacity", "5%", "--policies", "lru,optimal", "--json", str(out),
            "--jobs", "2",
        )
        self.assertEqual(status, 0)
        lru, optimal = json.loads(out.read_text())["results"]
        self.assertAlmostEqual(100 * lru["block_hit_rate"], 15.66, delta=0.3)
        self.assertAlmostEqual(100 * optimal["block_hit_rate"], 39.56, delta=0.3)


if __name__ == "__main__":
    unittest.main()
