"""Tests for benchmark/mla_eviction/traces.py: the Mooncake loader, synthetic workloads, scaling."""

import collections
import json
import math
import os
import sys
import tempfile
import time
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 4))
sys.path.insert(0, os.path.join(_REPO, "benchmark", "mla_eviction"))

from traces import (  # noqa: E402
    WORKLOADS,
    Request,
    Trace,
    TraceError,
    generate_workload,
    load_mooncake_trace,
    scale_trace,
)

SHIPPED_TRACE = os.path.join(_REPO, os.pardir, "shared", "traces", "mooncake_synthetic_trace.jsonl")


def tree_violations(trace: Trace) -> list:
    """(id, predecessor, other predecessor) for every id seen after two different blocks."""
    parent, bad = {}, []
    for r in trace.requests:
        pred = None
        for h in r.hash_ids:
            if parent.setdefault(h, pred) != pred:
                bad.append((h, pred, parent[h]))
            pred = h
    return bad


class TraceChecks:
    """Shape checks every trace must pass, loaded or generated."""

    def assert_well_formed(self, trace: Trace) -> None:
        bs = trace.block_size
        times = [r.timestamp_s for r in trace.requests]
        self.assertEqual(times, sorted(times))
        for r in trace.requests:
            self.assertEqual(len(r.hash_ids), math.ceil(r.input_length / bs), r)
            self.assertGreaterEqual(r.output_length, 0)
        self.assertEqual(tree_violations(trace), [])


@unittest.skipUnless(os.path.exists(SHIPPED_TRACE), f"{SHIPPED_TRACE} not present")
class TestShippedTrace(CustomTestCase, TraceChecks):
    def test_counts_match_readme(self):
        start = time.perf_counter()
        trace = load_mooncake_trace(SHIPPED_TRACE)
        elapsed = time.perf_counter() - start
        self.assertLess(elapsed, 1.0)
        self.assertEqual(trace.name, "mooncake_synthetic_trace")
        self.assertEqual(trace.block_size, 512)
        self.assertEqual(len(trace.requests), 3993)
        self.assertEqual(trace.num_blocks(), 121877)
        self.assertEqual(trace.num_unique_blocks(), 43924)
        first = trace.requests[0]
        self.assertEqual((first.timestamp_s, first.input_length, first.output_length),
                         (0.0, 40160, 6))
        self.assertEqual(first.hash_ids, tuple(range(79)))
        self.assertIsNone(first.session_id)
        self.assert_well_formed(trace)

    def test_limit_reads_a_prefix(self):
        full = load_mooncake_trace(SHIPPED_TRACE)
        head = load_mooncake_trace(SHIPPED_TRACE, limit=10)
        self.assertEqual(head.requests, full.requests[:10])

    def test_block_size_is_checked_against_lengths(self):
        with self.assertRaises(TraceError) as ctx:
            load_mooncake_trace(SHIPPED_TRACE, block_size=256)
        self.assertEqual(
            str(ctx.exception),
            f"{SHIPPED_TRACE}:1: field 'hash_ids': has 79 ids, but input_length 40160 needs "
            f"ceil(40160 / 256) = 157",
        )

    def test_scale_to_twelve_thousand_requests(self):
        trace = load_mooncake_trace(SHIPPED_TRACE)
        big = scale_trace(trace, 3)
        self.assertEqual(len(big.requests), 3 * 3993)
        self.assertEqual(big.num_blocks(), 3 * 121877)
        self.assertEqual(big.num_unique_blocks(), 3 * 43924)
        self.assert_well_formed(big)


class TestLoaderFixture(CustomTestCase):
    def setUp(self):
        self._dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self._dir.name, "fixture.jsonl")

    def tearDown(self):
        self._dir.cleanup()

    def write(self, *lines: str) -> str:
        with open(self.path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return self.path

    def assert_error(self, lines, message: str, **kwargs) -> None:
        path = self.write(*lines)
        with self.assertRaises(TraceError) as ctx:
            load_mooncake_trace(path, **kwargs)
        self.assertTrue(str(ctx.exception).startswith(message.format(path=path)),
                        f"{str(ctx.exception)!r} does not start with {message!r}")

    OK_LINE = '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}'

    def test_exact_parse(self):
        path = self.write(
            self.OK_LINE,
            "",
            '{"timestamp": 1500.5, "input_length": 1025, "output_length": 7, '
            '"hash_ids": [0, 2, 3], "chat_id": 42, "extra": [1]}',
            "   ",
            '{"timestamp": 2000, "input_length": 0, "output_length": 0, "hash_ids": [], '
            '"session_id": "s1"}',
        )
        trace = load_mooncake_trace(path)
        self.assertEqual(trace, Trace("fixture", 512, (
            Request(0.0, 1000, 5, (0, 1)),
            Request(1.5005, 1025, 7, (0, 2, 3), "42"),
            Request(2.0, 0, 0, (), "s1"),
        )))
        self.assertEqual(trace.num_blocks(), 5)
        self.assertEqual(trace.num_unique_blocks(), 4)
        self.assertEqual(load_mooncake_trace(path, limit=2).requests, trace.requests[:2])

    def test_block_size_parameter(self):
        path = self.write('{"timestamp": 0, "input_length": 33, "output_length": 1, '
                          '"hash_ids": [7, 8, 9]}')
        self.assertEqual(load_mooncake_trace(path, block_size=16).requests[0].hash_ids, (7, 8, 9))

    def test_malformed_json(self):
        self.assert_error([self.OK_LINE, '{"timestamp": 1,'],
                          "{path}:2: malformed JSON: Expecting property name enclosed in double "
                          "quotes at column 17")

    def test_not_an_object(self):
        self.assert_error(["[1, 2]"], "{path}:1: expected a JSON object, got a list")

    def test_missing_fields(self):
        full = json.loads(self.OK_LINE)
        for field in full:
            obj = {k: v for k, v in full.items() if k != field}
            with self.subTest(field=field):
                self.assert_error([self.OK_LINE, json.dumps(obj)],
                                  f"{{path}}:2: field '{field}': missing")

    def test_wrong_types(self):
        cases = [
            ("timestamp", "true"), ("timestamp", '"0"'), ("timestamp", "null"),
            ("input_length", "true"), ("input_length", "1000.0"), ("input_length", '"1000"'),
            ("output_length", "false"), ("output_length", "[5]"),
            ("hash_ids", '{"0": 1}'), ("hash_ids", '"0,1"'),
            ("hash_ids", "[0, true]"), ("hash_ids", "[0, 1.0]"), ("hash_ids", '[0, "1"]'),
        ]
        full = json.loads(self.OK_LINE)
        for field, raw in cases:
            obj = dict(full)
            obj[field] = "@"
            line = json.dumps(obj).replace('"@"', raw)
            with self.subTest(field=field, value=raw):
                self.assert_error(["", line], f"{{path}}:2: field '{field}': ")

    def test_wrong_type_messages(self):
        self.assert_error(
            ['{"timestamp": 0, "input_length": true, "output_length": 5, "hash_ids": [0]}'],
            "{path}:1: field 'input_length': expected an integer, got a boolean (true)")
        self.assert_error(
            ['{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1.5]}'],
            "{path}:1: field 'hash_ids': element 1 is a float (1.5), expected an integer")
        self.assert_error(
            ['{"timestamp": "soon", "input_length": 6, "output_length": 5, "hash_ids": [0]}'],
            "{path}:1: field 'timestamp': expected a number, got a string (\"soon\")")

    def test_not_utf8(self):
        with open(self.path, "wb") as f:
            f.write(self.OK_LINE.encode() + b"\n" + b'{"timestamp": "\xff"}\n')
        with self.assertRaises(TraceError) as ctx:
            load_mooncake_trace(self.path)
        self.assertEqual(str(ctx.exception), f"{self.path}:2: not UTF-8: byte 16")

    def test_negative_values(self):
        for field in ("timestamp", "input_length", "output_length"):
            obj = json.loads(self.OK_LINE)
            obj[field] = -1
            with self.subTest(field=field):
                self.assert_error([json.dumps(obj)], f"{{path}}:1: field '{field}': must be")

    def test_length_mismatch_names_both_numbers(self):
        self.assert_error(
            [self.OK_LINE,
             '{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1, 4]}'],
            "{path}:2: field 'hash_ids': has 3 ids, but input_length 1024 needs "
            "ceil(1024 / 512) = 2")

    def test_timestamps_going_backwards(self):
        self.assert_error(
            ['{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [0]}',
             '{"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": [0]}',
             '{"timestamp": 8, "input_length": 1, "output_length": 1, "hash_ids": [0]}'],
            "{path}:3: field 'timestamp': 8 is earlier than 9 on line 2")

    def test_ids_must_form_a_tree(self):
        self.assert_error(
            [self.OK_LINE,
             '{"timestamp": 1, "input_length": 1000, "output_length": 1, "hash_ids": [2, 1]}'],
            "{path}:2: field 'hash_ids': id 1 at position 1 follows id 2, but on line 1 it "
            "follows id 0")
        self.assert_error(
            [self.OK_LINE,
             '{"timestamp": 1, "input_length": 100, "output_length": 1, "hash_ids": [1]}'],
            "{path}:2: field 'hash_ids': id 1 at position 0 follows nothing")
        self.assert_error(
            ['{"timestamp": 1, "input_length": 1000, "output_length": 1, "hash_ids": [3, 3]}'],
            "{path}:1: field 'hash_ids': id 3 at position 1 follows id 3")

    def test_empty_file(self):
        for lines in ([], ["", "  "]):
            path = self.write(*lines)
            with self.subTest(lines=lines), self.assertRaises(TraceError) as ctx:
                load_mooncake_trace(path)
            self.assertEqual(str(ctx.exception), f"{path}: empty trace (no requests)")

    def test_missing_file(self):
        path = os.path.join(self._dir.name, "absent.jsonl")
        with self.assertRaises(TraceError) as ctx:
            load_mooncake_trace(path)
        self.assertEqual(str(ctx.exception), f"{path}: no such file")

    def test_bad_arguments(self):
        path = self.write(self.OK_LINE)
        for kwargs in ({"block_size": 0}, {"block_size": True}, {"limit": 0}):
            with self.subTest(**kwargs), self.assertRaises(ValueError):
                load_mooncake_trace(path, **kwargs)

    def test_generated_trace_round_trips(self):
        trace = generate_workload("multi-turn", num_requests=200, seed=3, block_size=64)
        with open(self.path, "w") as f:
            for r in trace.requests:
                f.write(json.dumps({"timestamp": r.timestamp_s * 1000,
                                    "input_length": r.input_length,
                                    "output_length": r.output_length,
                                    "hash_ids": list(r.hash_ids),
                                    "session_id": r.session_id}) + "\n")
        loaded = load_mooncake_trace(self.path, block_size=64)
        for a, b in zip(loaded.requests, trace.requests, strict=True):
            self.assertAlmostEqual(a.timestamp_s, b.timestamp_s, places=9)
            self.assertEqual((a.input_length, a.output_length, a.hash_ids, a.session_id),
                             (b.input_length, b.output_length, b.hash_ids, b.session_id))


class TestWorkloads(CustomTestCase, TraceChecks):
    N = 300

    def test_every_workload_is_deterministic_and_well_formed(self):
        self.assertEqual(set(WORKLOADS), {"chat", "few-shot", "multi-turn", "random", "gsp"})
        for name in WORKLOADS:
            with self.subTest(workload=name):
                trace = generate_workload(name, num_requests=self.N, seed=1)
                self.assertEqual(trace, generate_workload(name, num_requests=self.N, seed=1))
                self.assertNotEqual(trace, generate_workload(name, num_requests=self.N, seed=2))
                self.assertEqual(len(trace.requests), self.N)
                self.assertEqual(trace.block_size, 512)
                self.assert_well_formed(trace)
                # ids are numbered in order of first appearance (prompt, then prompt + output)
                seen = list(dict.fromkeys(
                    h for r in trace.requests for h in (*r.hash_ids, *r.sequence_hash_ids)))
                self.assertEqual(seen, list(range(len(seen))))
                self.assertTrue(WORKLOADS[name].description)

    def test_block_size_parameter(self):
        trace = generate_workload("chat", num_requests=50, seed=0, block_size=16)
        self.assertEqual(trace.block_size, 16)
        self.assert_well_formed(trace)

    def test_sharing_shapes(self):
        random_trace = generate_workload("random", num_requests=self.N, seed=0)
        self.assertEqual(random_trace.num_unique_blocks(), random_trace.num_blocks())
        for name, max_roots in (("chat", 8), ("few-shot", 4)):
            trace = generate_workload(name, num_requests=self.N, seed=0)
            roots = {r.hash_ids[0] for r in trace.requests}
            self.assertLessEqual(len(roots), max_roots, name)
            self.assertLess(trace.num_unique_blocks(), trace.num_blocks() / 2, name)
            self.assertTrue(all(r.session_id is None for r in trace.requests))
            # No later prompt holds these outputs: their content stays unknown.
            self.assertTrue(all(r.sequence_hash_ids == () for r in trace.requests))

    def test_multi_turn_extends_previous_turn(self):
        trace = generate_workload("multi-turn", num_requests=self.N, seed=4)
        last = {}
        follow_ups = 0
        for r in trace.requests:
            self.assertIsNotNone(r.session_id)
            prev = last.get(r.session_id)
            if prev is not None:
                follow_ups += 1
                self.assertGreater(r.input_length, prev.input_length + prev.output_length)
                full = prev.input_length // 512
                self.assertEqual(r.hash_ids[:full], prev.hash_ids[:full])
                if prev.input_length % 512:  # the partial last block becomes a new id
                    self.assertNotEqual(r.hash_ids[full], prev.hash_ids[full])
                self.assertGreaterEqual(r.timestamp_s - prev.timestamp_s, 5.0)
                # The previous output is content this prompt holds: its full blocks match.
                done = (prev.input_length + prev.output_length) // 512
                self.assertEqual(len(prev.sequence_hash_ids),
                                 math.ceil((prev.input_length + prev.output_length) / 512))
                self.assertEqual(r.hash_ids[:done], prev.sequence_hash_ids[:done])
                self.assertEqual(prev.sequence_hash_ids[:full], prev.hash_ids[:full])
            last[r.session_id] = r
        self.assertGreater(follow_ups, self.N // 3)
        self.assertGreater(len(last), 10)

    def test_gsp_uniform_groups(self):
        trace = generate_workload("gsp", num_requests=20, seed=0, num_groups=4,
                                  prompts_per_group=5, system_prompt_len=1024)
        counts = collections.Counter(r.hash_ids[0] for r in trace.requests)
        self.assertEqual(sorted(counts.values()), [5, 5, 5, 5])
        self.assertEqual({(r.input_length, r.output_length) for r in trace.requests},
                         {(1024 + 128, 256)})
        # the two system-prompt blocks are shared, the question block is not
        self.assertEqual(trace.num_unique_blocks(), 4 * 2 + 20)

    def test_gsp_zipf_groups(self):
        trace = generate_workload("gsp", num_requests=400, seed=0, num_groups=8,
                                  prompts_per_group=50, group_distribution="zipf",
                                  zipf_alpha=1.5)
        counts = collections.Counter(r.hash_ids[0] for r in trace.requests)
        self.assertLessEqual(len(counts), 8)
        self.assertGreater(max(counts.values()), 2 * 400 // 8)

    def test_gsp_multi_turn_and_ranges(self):
        trace = generate_workload("gsp", num_requests=60, seed=0, num_groups=2,
                                  prompts_per_group=10, num_turns=3, range_ratio=0.5)
        sessions = collections.Counter(r.session_id for r in trace.requests)
        self.assertEqual(len(sessions), 20)
        self.assertEqual(set(sessions.values()), {3})
        self.assertEqual(len({r.hash_ids[0] for r in trace.requests}), 2)
        last = {}
        for r in trace.requests:  # lengths as sglang's compute_random_lens: [full * ratio, full]
            prev = last.get(r.session_id)
            if prev is None:  # system prompt + first question
                self.assertTrue(1024 + 64 <= r.input_length <= 2048 + 128, r)
            else:  # previous prompt + its output + a new question
                self.assertEqual(r.output_length, prev.output_length)
                self.assertTrue(64 <= r.input_length - prev.input_length - prev.output_length
                                <= 128, r)
            self.assertTrue(128 <= r.output_length <= 256)
            if prev is not None:
                done = (prev.input_length + prev.output_length) // 512
                self.assertEqual(r.hash_ids[:done], prev.sequence_hash_ids[:done])
            last[r.session_id] = r
        # A conversation's last output is never read again: unknown content.
        self.assertEqual(sum(r.sequence_hash_ids == () for r in trace.requests), 20)
        # derived prompts_per_group: just enough slots, cut to num_requests
        self.assertEqual(len(generate_workload("gsp", num_requests=70, seed=0).requests), 70)

    def test_bad_names_and_params(self):
        cases = [
            ("nope", {}, "unknown workload 'nope'"),
            ("chat", {"colour": 1}, "unknown parameter(s) ['colour']"),
            ("chat", {"rate": 0}, "parameter 'rate'"),
            ("chat", {"user_len": (10, 5)}, "parameter 'user_len'"),
            ("multi-turn", {"think_time_s": (0, 5)}, "parameter 'think_time_s'"),
            ("gsp", {"group_distribution": "pareto"}, "parameter 'group_distribution'"),
            ("gsp", {"group_distribution": "zipf"}, "requires zipf_alpha"),
            ("gsp", {"zipf_alpha": 1.0}, "only meaningful"),
            ("gsp", {"num_groups": 2, "prompts_per_group": 3}, "fewer than num_requests"),
        ]
        for name, params, message in cases:
            with self.subTest(name=name, params=params):
                with self.assertRaises(ValueError) as ctx:
                    generate_workload(name, num_requests=10, seed=0, **params)
                self.assertIn(message, str(ctx.exception))
        for kwargs in ({"num_requests": 0, "seed": 0}, {"num_requests": 5, "seed": -1},
                       {"num_requests": 5, "seed": 0, "block_size": 0}):
            with self.subTest(**kwargs), self.assertRaises(ValueError):
                generate_workload("chat", **kwargs)


class TestScaleTrace(CustomTestCase, TraceChecks):
    def test_copies_are_disjoint_and_later(self):
        trace = generate_workload("multi-turn", num_requests=100, seed=0)
        big = scale_trace(trace, 4)
        n = len(trace.requests)
        self.assertEqual(big.name, "multi-turnx4")
        self.assertEqual(len(big.requests), 4 * n)
        self.assertEqual(big.num_blocks(), 4 * trace.num_blocks())
        self.assertEqual(big.num_unique_blocks(), 4 * trace.num_unique_blocks())
        self.assert_well_formed(big)
        self.assertEqual(big.requests[:n], trace.requests)
        stride = max(h for r in trace.requests for h in r.hash_ids) + 1
        self.assertEqual(big.requests[n + 5].sequence_hash_ids,
                         tuple(h + stride for h in trace.requests[5].sequence_hash_ids))
        for k in range(1, 4):
            self.assertGreater(big.requests[k * n].timestamp_s, big.requests[k * n - 1].timestamp_s)
            self.assertEqual(big.requests[k * n].session_id,
                             f"{k}:{trace.requests[0].session_id}")
        self.assertEqual(len({r.session_id for r in big.requests}),
                         4 * len({r.session_id for r in trace.requests}))

    def test_one_copy_and_bad_counts(self):
        trace = generate_workload("random", num_requests=10, seed=0)
        self.assertEqual(scale_trace(trace, 1).requests, trace.requests)
        for copies in (0, -1, 2.0):
            with self.subTest(copies=copies), self.assertRaises(ValueError):
                scale_trace(trace, copies)


if __name__ == "__main__":
    unittest.main()
