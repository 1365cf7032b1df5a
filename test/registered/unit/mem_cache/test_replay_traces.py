"""Tests for benchmark/mla_eviction/traces.py: the Mooncake loader, synthetic workloads,
scaling and arrival jitter."""

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
    jitter_arrivals,
    load_mooncake_trace,
    scale_trace,
)

_TRACES = os.path.join(_REPO, os.pardir, "shared", "traces")
SHIPPED_TRACE = os.path.join(_TRACES, "mooncake_synthetic_trace.jsonl")
CONVERSATION_TRACE = os.path.join(_TRACES, "mooncake_conversation_trace.jsonl")


def block_ids(trace: Trace) -> set:
    """Every block id of a trace, prompt and sequence ids together."""
    return {h for r in trace.requests for h in (*r.hash_ids, *r.sequence_hash_ids)}


def without_time(request: Request) -> tuple:
    """A request's fields other than its arrival time."""
    return (
        request.input_length,
        request.output_length,
        request.hash_ids,
        request.session_id,
        request.sequence_hash_ids,
    )


def tree_violations(trace: Trace) -> list:
    """(id, predecessor, other predecessor) for every id seen after two different
    blocks."""
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
        self.assertEqual(
            (first.timestamp_s, first.input_length, first.output_length),
            (0.0, 40160, 6),
        )
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
            f"{SHIPPED_TRACE}:1: field 'hash_ids': has 79 ids, but input_length 40160 "
            "needs ceil(40160 / 256) = 157",
        )

    def test_scale_to_twelve_thousand_requests(self):
        trace = load_mooncake_trace(SHIPPED_TRACE)
        big = scale_trace(trace, 3)
        self.assertEqual(len(big.requests), 3 * 3993)
        self.assertEqual(big.num_blocks(), 3 * 121877)
        self.assertEqual(big.num_unique_blocks(), 3 * 43924)
        self.assertEqual(block_ids(big), set(range(3 * 43924)))
        self.assert_well_formed(big)

    def test_ids_are_dense(self):
        trace = load_mooncake_trace(SHIPPED_TRACE)
        self.assertEqual(block_ids(trace), set(range(43924)))


@unittest.skipUnless(
    os.path.exists(CONVERSATION_TRACE), f"{CONVERSATION_TRACE} not present"
)
class TestConversationTrace(CustomTestCase, TraceChecks):
    def test_counts_match_readme(self):
        trace = load_mooncake_trace(CONVERSATION_TRACE)
        self.assertEqual(len(trace.requests), 12031)
        self.assertEqual(trace.num_unique_blocks(), 182790)
        self.assertEqual(block_ids(trace), set(range(182790)))
        self.assert_well_formed(trace)


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
        self.assertTrue(
            str(ctx.exception).startswith(message.format(path=path)),
            f"{str(ctx.exception)!r} does not start with {message!r}",
        )

    def assert_exact_error(self, lines, message: str, **kwargs) -> None:
        path = self.write(*lines)
        with self.assertRaises(TraceError) as ctx:
            load_mooncake_trace(path, **kwargs)
        self.assertEqual(str(ctx.exception), message.format(path=path))

    OK_LINE = (
        '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}'
    )

    def test_exact_parse(self):
        path = self.write(
            self.OK_LINE,
            "",
            '{"timestamp": 1500.5, "input_length": 1025, "output_length": 7, '
            '"hash_ids": [0, 2, 3], "chat_id": 42, "extra": [1]}',
            "   ",
            '{"timestamp": 2000, "input_length": 0, "output_length": 0, '
            '"hash_ids": [], '
            '"session_id": "s1"}',
        )
        trace = load_mooncake_trace(path)
        self.assertEqual(
            trace,
            Trace(
                "fixture",
                512,
                (
                    Request(0.0, 1000, 5, (0, 1)),
                    Request(1.5005, 1025, 7, (0, 2, 3), "42"),
                    Request(2.0, 0, 0, (), "s1"),
                ),
            ),
        )
        self.assertEqual(trace.num_blocks(), 5)
        self.assertEqual(trace.num_unique_blocks(), 4)
        self.assertEqual(
            load_mooncake_trace(path, limit=2).requests, trace.requests[:2]
        )

    def test_block_size_parameter(self):
        path = self.write(
            '{"timestamp": 0, "input_length": 33, "output_length": 1, '
            '"hash_ids": [7, 8, 9]}'
        )
        self.assertEqual(
            load_mooncake_trace(path, block_size=16).requests[0].hash_ids, (0, 1, 2)
        )

    def test_malformed_json(self):
        self.assert_error(
            [self.OK_LINE, '{"timestamp": 1,'],
            "{path}:2: malformed JSON: Expecting property name enclosed in double "
            "quotes at column 17",
        )

    def test_not_an_object(self):
        self.assert_error(["[1, 2]"], "{path}:1: expected a JSON object, got a list")

    def test_missing_fields(self):
        full = json.loads(self.OK_LINE)
        for field in full:
            obj = {k: v for k, v in full.items() if k != field}
            with self.subTest(field=field):
                self.assert_error(
                    [self.OK_LINE, json.dumps(obj)],
                    f"{{path}}:2: field '{field}': missing",
                )

    def test_wrong_types(self):
        cases = [
            ("timestamp", "true"),
            ("timestamp", '"0"'),
            ("timestamp", "null"),
            ("input_length", "true"),
            ("input_length", "1000.0"),
            ("input_length", '"1000"'),
            ("output_length", "false"),
            ("output_length", "[5]"),
            ("hash_ids", '{"0": 1}'),
            ("hash_ids", '"0,1"'),
            ("hash_ids", "[0, true]"),
            ("hash_ids", "[0, 1.0]"),
            ("hash_ids", '[0, "1"]'),
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
            [
                '{"timestamp": 0, "input_length": true, "output_length": 5, '
                '"hash_ids": [0]}'
            ],
            "{path}:1: field 'input_length': expected an integer, got a boolean (true)",
        )
        self.assert_error(
            [
                '{"timestamp": 0, "input_length": 600, "output_length": 5, '
                '"hash_ids": [0, 1.5]}'
            ],
            "{path}:1: field 'hash_ids': element 1 is a float (1.5), expected an "
            "integer",
        )
        self.assert_error(
            [
                '{"timestamp": "soon", "input_length": 6, "output_length": 5, '
                '"hash_ids": [0]}'
            ],
            "{path}:1: field 'timestamp': expected a number, got a string (\"soon\")",
        )

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
                self.assert_error(
                    [json.dumps(obj)], f"{{path}}:1: field '{field}': must be"
                )

    def test_length_mismatch_names_both_numbers(self):
        self.assert_error(
            [
                self.OK_LINE,
                '{"timestamp": 1, "input_length": 1024, "output_length": 1, '
                '"hash_ids": [0, 1, 4]}',
            ],
            "{path}:2: field 'hash_ids': has 3 ids, but input_length 1024 needs "
            "ceil(1024 / 512) = 2",
        )

    def test_timestamps_going_backwards(self):
        self.assert_error(
            [
                '{"timestamp": 5, "input_length": 1, "output_length": 1, '
                '"hash_ids": [0]}',
                '{"timestamp": 9, "input_length": 1, "output_length": 1, '
                '"hash_ids": [0]}',
                '{"timestamp": 8, "input_length": 1, "output_length": 1, '
                '"hash_ids": [0]}',
            ],
            "{path}:3: field 'timestamp': 8 is earlier than 9 on line 2",
        )

    def test_ids_must_form_a_tree(self):
        self.assert_error(
            [
                self.OK_LINE,
                '{"timestamp": 1, "input_length": 1000, "output_length": 1, '
                '"hash_ids": [2, 1]}',
            ],
            "{path}:2: field 'hash_ids': id 1 at position 1 follows id 2, but on "
            "line 1 it follows id 0",
        )
        self.assert_error(
            [
                self.OK_LINE,
                '{"timestamp": 1, "input_length": 100, "output_length": 1, '
                '"hash_ids": [1]}',
            ],
            "{path}:2: field 'hash_ids': id 1 at position 0 follows nothing",
        )
        self.assert_error(
            [
                '{"timestamp": 1, "input_length": 1000, "output_length": 1, '
                '"hash_ids": [3, 3]}'
            ],
            "{path}:1: field 'hash_ids': id 3 at position 1 follows id 3",
        )

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
                f.write(
                    json.dumps(
                        {
                            "timestamp": r.timestamp_s * 1000,
                            "input_length": r.input_length,
                            "output_length": r.output_length,
                            "hash_ids": list(r.hash_ids),
                            "session_id": r.session_id,
                        }
                    )
                    + "\n"
                )
        loaded = load_mooncake_trace(self.path, block_size=64)
        # The loader renumbers ids (output-only ids never reach the file): the same
        # blocks, up to a one-to-one renaming.
        renamed = {}
        for a, b in zip(loaded.requests, trace.requests, strict=True):
            self.assertAlmostEqual(a.timestamp_s, b.timestamp_s, places=9)
            self.assertEqual(
                (a.input_length, a.output_length, a.session_id),
                (b.input_length, b.output_length, b.session_id),
            )
            for x, y in zip(a.hash_ids, b.hash_ids, strict=True):
                self.assertEqual(renamed.setdefault(x, y), y)
        self.assertEqual(len(set(renamed.values())), len(renamed))
        self.assertEqual(set(renamed), set(range(len(renamed))))

    # Dense ids: any JSON integer maps to 0, 1, 2, ... in order of first appearance.
    # 2**64 + 1 = 18446744073709551617, 2**64 + 2 = 18446744073709551618.

    def test_ids_beyond_64_bits_stay_distinct(self):
        path = self.write(
            '{"timestamp": 0, "input_length": 100, "output_length": 1, '
            '"hash_ids": [18446744073709551617]}',
            '{"timestamp": 1, "input_length": 100, "output_length": 1, '
            '"hash_ids": [18446744073709551618]}',
            '{"timestamp": 2, "input_length": 100, "output_length": 1, '
            '"hash_ids": [18446744073709551617]}',
        )
        trace = load_mooncake_trace(path)
        self.assertEqual([r.hash_ids for r in trace.requests], [(0,), (1,), (0,)])
        self.assertEqual(trace.num_unique_blocks(), 2)

    def test_ids_equal_modulo_two_to_the_64_stay_distinct(self):
        # 1 and 2**64 + 1 share their low 64 bits, as do -1 and 2**64 - 1.
        path = self.write(
            '{"timestamp": 0, "input_length": 100, "output_length": 1, '
            '"hash_ids": [1]}',
            '{"timestamp": 0, "input_length": 100, "output_length": 1, '
            '"hash_ids": [18446744073709551617]}',
            '{"timestamp": 0, "input_length": 100, "output_length": 1, '
            '"hash_ids": [-1]}',
            '{"timestamp": 0, "input_length": 100, "output_length": 1, '
            '"hash_ids": [18446744073709551615]}',
        )
        trace = load_mooncake_trace(path)
        self.assertEqual([r.hash_ids for r in trace.requests], [(0,), (1,), (2,), (3,)])

    def test_id_of_ten_to_the_thirty(self):
        path = self.write(
            '{"timestamp": 0, "input_length": 600, "output_length": 1, '
            '"hash_ids": [1000000000000000000000000000000, 18446744073709551617]}',
            '{"timestamp": 5, "input_length": 1500, "output_length": 1, '
            '"hash_ids": [1000000000000000000000000000000, 18446744073709551617, 7]}',
        )
        trace = load_mooncake_trace(path)
        self.assertEqual(
            trace,
            Trace(
                "fixture",
                512,
                (Request(0.0, 600, 1, (0, 1)), Request(0.005, 1500, 1, (0, 1, 2))),
            ),
        )

    def test_ids_numbered_in_order_of_first_appearance(self):
        path = self.write(
            '{"timestamp": 0, "input_length": 1500, "output_length": 1, '
            '"hash_ids": [70, 80, 90]}',
            '{"timestamp": 0, "input_length": 1000, "output_length": 1, '
            '"hash_ids": [70, 5]}',
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [3]}',
        )
        trace = load_mooncake_trace(path)
        self.assertEqual(
            [r.hash_ids for r in trace.requests], [(0, 1, 2), (0, 3), (4,)]
        )

    def test_tree_errors_name_the_file_ids(self):
        self.assert_exact_error(
            [
                '{"timestamp": 0, "input_length": 1000, "output_length": 1, '
                '"hash_ids": [18446744073709551617, 18446744073709551618]}',
                '{"timestamp": 0, "input_length": 1000, "output_length": 1, '
                '"hash_ids": [1000000000000000000000000000000, 18446744073709551618]}',
            ],
            "{path}:2: field 'hash_ids': id 18446744073709551618 at position 1 follows "
            "id 1000000000000000000000000000000, but on line 1 it follows "
            "id 18446744073709551617; ids must form a tree",
        )

    def test_integer_too_long_to_parse(self):
        self.assert_error(
            [
                '{"timestamp": 0, "input_length": 10, "output_length": 1, '
                '"hash_ids": [1' + "0" * 5000 + "]}"
            ],
            "{path}:1: cannot parse: ",
        )

    # Bounds: lengths <= 10,000,000 tokens, timestamps finite and <= 1e12 ms,
    # at most ceil(10,000,000 / block_size) ids.

    def test_length_bounds(self):
        for field in ("input_length", "output_length"):
            obj = json.loads(self.OK_LINE)
            obj[field] = 10_000_001
            with self.subTest(field=field):
                self.assert_exact_error(
                    ["", json.dumps(obj)],
                    f"{{path}}:2: field '{field}': must be <= 10000000 tokens, "
                    "got 10000001",
                )
        self.assert_exact_error(
            [
                '{"timestamp": 0, "input_length": 5, "output_length": '
                "100000000000000000000000000000000000000000000000000, "
                '"hash_ids": [0]}'
            ],
            "{path}:1: field 'output_length': must be <= 10000000 tokens, "
            "got 1000000000000000000000000000000000000...",
        )

    def test_largest_lengths_load(self):
        path = self.write(
            '{"timestamp": 0, "input_length": 10000000, "output_length": 10000000, '
            '"hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}'
        )
        (request,) = load_mooncake_trace(path, block_size=1_000_000).requests
        self.assertEqual(
            (request.input_length, request.output_length), (10_000_000, 10_000_000)
        )
        self.assertEqual(request.hash_ids, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9))

    def test_too_many_ids(self):
        self.assert_exact_error(
            [
                '{"timestamp": 0, "input_length": 1000, "output_length": 1, '
                '"hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}'
            ],
            "{path}:1: field 'hash_ids': has 11 ids, more than "
            "ceil(10000000 / 1000000) = 10",
            block_size=1_000_000,
        )
        obj = json.loads(self.OK_LINE)
        obj["hash_ids"] = list(range(19533))
        self.assert_exact_error(
            [self.OK_LINE, json.dumps(obj)],
            "{path}:2: field 'hash_ids': has 19533 ids, more than "
            "ceil(10000000 / 512) = 19532",
        )

    def test_timestamp_bounds(self):
        cases = [
            ("1e400", "must be finite, got inf"),
            ("-1e400", "must be finite, got -inf"),
            ("Infinity", "must be finite, got inf"),
            ("NaN", "must be finite, got nan"),
            ("1000000000001", "must be <= 1000000000000 ms, got 1000000000001"),
            ("2e12", "must be <= 1000000000000 ms, got 2000000000000.0"),
            ("-0.5", "must be >= 0, got -0.5"),
        ]
        for raw, what in cases:
            line = self.OK_LINE.replace('"timestamp": 0', f'"timestamp": {raw}')
            with self.subTest(timestamp=raw):
                self.assert_exact_error(
                    [self.OK_LINE, line], f"{{path}}:2: field 'timestamp': {what}"
                )

    def test_largest_timestamp_loads(self):
        line = self.OK_LINE.replace('"timestamp": 0', '"timestamp": 1000000000000')
        (request,) = load_mooncake_trace(self.write(line)).requests
        self.assertEqual(request.timestamp_s, 1_000_000_000.0)


class TestWorkloads(CustomTestCase, TraceChecks):
    N = 300

    def test_every_workload_is_deterministic_and_well_formed(self):
        self.assertEqual(
            set(WORKLOADS), {"chat", "few-shot", "multi-turn", "random", "gsp"}
        )
        for name in WORKLOADS:
            with self.subTest(workload=name):
                trace = generate_workload(name, num_requests=self.N, seed=1)
                self.assertEqual(
                    trace, generate_workload(name, num_requests=self.N, seed=1)
                )
                self.assertNotEqual(
                    trace, generate_workload(name, num_requests=self.N, seed=2)
                )
                self.assertEqual(len(trace.requests), self.N)
                self.assertEqual(trace.block_size, 512)
                self.assert_well_formed(trace)
                # ids are numbered in order of first appearance (prompt, then prompt +
                # output)
                seen = list(
                    dict.fromkeys(
                        h
                        for r in trace.requests
                        for h in (*r.hash_ids, *r.sequence_hash_ids)
                    )
                )
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
                self.assertGreater(
                    r.input_length, prev.input_length + prev.output_length
                )
                full = prev.input_length // 512
                self.assertEqual(r.hash_ids[:full], prev.hash_ids[:full])
                if prev.input_length % 512:  # the partial last block becomes a new id
                    self.assertNotEqual(r.hash_ids[full], prev.hash_ids[full])
                self.assertGreaterEqual(r.timestamp_s - prev.timestamp_s, 5.0)
                # The previous output is content this prompt holds: its full blocks
                # match.
                done = (prev.input_length + prev.output_length) // 512
                self.assertEqual(
                    len(prev.sequence_hash_ids),
                    math.ceil((prev.input_length + prev.output_length) / 512),
                )
                self.assertEqual(r.hash_ids[:done], prev.sequence_hash_ids[:done])
                self.assertEqual(prev.sequence_hash_ids[:full], prev.hash_ids[:full])
            last[r.session_id] = r
        self.assertGreater(follow_ups, self.N // 3)
        self.assertGreater(len(last), 10)

    def test_gsp_uniform_groups(self):
        trace = generate_workload(
            "gsp",
            num_requests=20,
            seed=0,
            num_groups=4,
            prompts_per_group=5,
            system_prompt_len=1024,
        )
        counts = collections.Counter(r.hash_ids[0] for r in trace.requests)
        self.assertEqual(sorted(counts.values()), [5, 5, 5, 5])
        self.assertEqual(
            {(r.input_length, r.output_length) for r in trace.requests},
            {(1024 + 128, 256)},
        )
        # the two system-prompt blocks are shared, the question block is not
        self.assertEqual(trace.num_unique_blocks(), 4 * 2 + 20)

    def test_gsp_zipf_groups(self):
        trace = generate_workload(
            "gsp",
            num_requests=400,
            seed=0,
            num_groups=8,
            prompts_per_group=50,
            group_distribution="zipf",
            zipf_alpha=1.5,
        )
        counts = collections.Counter(r.hash_ids[0] for r in trace.requests)
        self.assertLessEqual(len(counts), 8)
        self.assertGreater(max(counts.values()), 2 * 400 // 8)

    def test_gsp_multi_turn_and_ranges(self):
        trace = generate_workload(
            "gsp",
            num_requests=60,
            seed=0,
            num_groups=2,
            prompts_per_group=10,
            num_turns=3,
            range_ratio=0.5,
        )
        sessions = collections.Counter(r.session_id for r in trace.requests)
        self.assertEqual(len(sessions), 20)
        self.assertEqual(set(sessions.values()), {3})
        self.assertEqual(len({r.hash_ids[0] for r in trace.requests}), 2)
        last = {}
        for r in (
            trace.requests
        ):  # lengths as sglang's compute_random_lens: [full * ratio, full]
            prev = last.get(r.session_id)
            if prev is None:  # system prompt + first question
                self.assertTrue(1024 + 64 <= r.input_length <= 2048 + 128, r)
            else:  # previous prompt + its output + a new question
                self.assertEqual(r.output_length, prev.output_length)
                self.assertTrue(
                    64
                    <= r.input_length - prev.input_length - prev.output_length
                    <= 128,
                    r,
                )
            self.assertTrue(128 <= r.output_length <= 256)
            if prev is not None:
                done = (prev.input_length + prev.output_length) // 512
                self.assertEqual(r.hash_ids[:done], prev.sequence_hash_ids[:done])
            last[r.session_id] = r
        # A conversation's last output is never read again: unknown content.
        self.assertEqual(sum(r.sequence_hash_ids == () for r in trace.requests), 20)
        # derived prompts_per_group: just enough slots, cut to num_requests
        self.assertEqual(
            len(generate_workload("gsp", num_requests=70, seed=0).requests), 70
        )

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
            (
                "gsp",
                {"num_groups": 2, "prompts_per_group": 3},
                "fewer than num_requests",
            ),
        ]
        for name, params, message in cases:
            with self.subTest(name=name, params=params):
                with self.assertRaises(ValueError) as ctx:
                    generate_workload(name, num_requests=10, seed=0, **params)
                self.assertIn(message, str(ctx.exception))
        for kwargs in (
            {"num_requests": 0, "seed": 0},
            {"num_requests": 5, "seed": -1},
            {"num_requests": 5, "seed": 0, "block_size": 0},
        ):
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
        # Generated ids are 0 .. D-1 (prompt and sequence ids); copy k adds k * D.
        stride = len(block_ids(trace))
        self.assertEqual(block_ids(trace), set(range(stride)))
        self.assertEqual(block_ids(big), set(range(4 * stride)))
        self.assertEqual(
            big.requests[n + 5].sequence_hash_ids,
            tuple(h + stride for h in trace.requests[5].sequence_hash_ids),
        )
        for k in range(1, 4):
            self.assertGreater(
                big.requests[k * n].timestamp_s, big.requests[k * n - 1].timestamp_s
            )
            self.assertEqual(
                big.requests[k * n].session_id, f"{k}:{trace.requests[0].session_id}"
            )
        self.assertEqual(
            len({r.session_id for r in big.requests}),
            4 * len({r.session_id for r in trace.requests}),
        )

    def test_one_copy_and_bad_counts(self):
        trace = generate_workload("random", num_requests=10, seed=0)
        self.assertEqual(scale_trace(trace, 1).requests, trace.requests)
        for copies in (0, -1, 2.0):
            with self.subTest(copies=copies), self.assertRaises(ValueError):
                scale_trace(trace, copies)

    def test_sequence_ids_count_in_the_stride(self):
        # Id 2 is only in a sequence (an output no prompt holds); 3 distinct ids.
        trace = Trace(
            "t",
            4,
            (Request(0.0, 4, 4, (0,), "s", (0, 2)), Request(1.0, 4, 1, (1,))),
        )
        big = scale_trace(trace, 2)
        self.assertEqual(
            big,
            Trace(
                "tx2",
                4,
                (
                    Request(0.0, 4, 4, (0,), "s", (0, 2)),
                    Request(1.0, 4, 1, (1,)),
                    Request(2.0, 4, 4, (3,), "1:s", (3, 5)),
                    Request(3.0, 4, 1, (4,)),
                ),
            ),
        )

    def test_sparse_ids_are_renumbered(self):
        trace = Trace(
            "t",
            4,
            (
                Request(0.0, 8, 1, (2**64 + 1, 20)),
                Request(2.0, 4, 1, (2**64 + 1,), None, (2**64 + 1, 7)),
            ),
        )
        self.assertEqual(
            scale_trace(trace, 3).requests,
            (
                Request(0.0, 8, 1, (0, 1)),
                Request(2.0, 4, 1, (0,), None, (0, 2)),
                Request(4.0, 8, 1, (3, 4)),
                Request(6.0, 4, 1, (3,), None, (3, 5)),
                Request(8.0, 8, 1, (6, 7)),
                Request(10.0, 4, 1, (6,), None, (6, 8)),
            ),
        )


class TestJitterArrivals(CustomTestCase, TraceChecks):
    # Arrivals at 0, 1, 2, 4 and 8 s: the mean gap is (8 - 0) / 4 = 2 s.
    LINES = [
        '{"timestamp": 0, "input_length": 100, "output_length": 1, '
        '"hash_ids": [0], "session_id": "a"}',
        '{"timestamp": 1000, "input_length": 600, "output_length": 2, '
        '"hash_ids": [0, 1], "session_id": "b"}',
        '{"timestamp": 2000, "input_length": 200, "output_length": 3, '
        '"hash_ids": [2], "session_id": "c"}',
        '{"timestamp": 4000, "input_length": 1100, "output_length": 4, '
        '"hash_ids": [0, 1, 3], "session_id": "d"}',
        '{"timestamp": 8000, "input_length": 300, "output_length": 5, '
        '"hash_ids": [4], "session_id": "e"}',
    ]
    ARRIVAL_S = {"a": 0.0, "b": 1.0, "c": 2.0, "d": 4.0, "e": 8.0}
    MEAN_GAP_S = 2.0

    def setUp(self):
        self._dir = tempfile.TemporaryDirectory()
        path = os.path.join(self._dir.name, "fixture.jsonl")
        with open(path, "w") as f:
            f.write("\n".join(self.LINES) + "\n")
        self.trace = load_mooncake_trace(path)

    def tearDown(self):
        self._dir.cleanup()

    def assert_jittered(self, jittered: Trace, max_offset: float) -> None:
        times = [r.timestamp_s for r in jittered.requests]
        self.assertEqual(times, sorted(times))
        self.assertTrue(all(t >= 0 for t in times), times)
        for r in jittered.requests:
            offset = r.timestamp_s - self.ARRIVAL_S[r.session_id]
            self.assertLessEqual(abs(offset), max_offset + 1e-12, r)
        self.assertEqual(
            collections.Counter(map(without_time, jittered.requests)),
            collections.Counter(map(without_time, self.trace.requests)),
        )
        self.assertEqual(jittered.block_size, 512)
        self.assert_well_formed(jittered)

    def test_seed_zero_is_the_trace_itself(self):
        self.assertIs(jitter_arrivals(self.trace, 0), self.trace)
        self.assertIs(jitter_arrivals(self.trace, 0, scale=5.0), self.trace)

    def test_same_seed_same_arrivals(self):
        a = jitter_arrivals(self.trace, 3)
        b = jitter_arrivals(self.trace, 3)
        self.assertEqual(
            [r.timestamp_s for r in a.requests], [r.timestamp_s for r in b.requests]
        )
        self.assertEqual(a, b)
        self.assertEqual(a.name, "fixture~jitter3")
        self.assertNotEqual(
            [r.timestamp_s for r in a.requests], [0.0, 1.0, 2.0, 4.0, 8.0]
        )
        self.assertNotEqual(a, jitter_arrivals(self.trace, 4))

    def test_offsets_within_one_mean_gap(self):
        for seed in range(1, 21):
            with self.subTest(seed=seed):
                self.assert_jittered(jitter_arrivals(self.trace, seed), self.MEAN_GAP_S)

    def test_scale(self):
        for seed in range(1, 11):
            with self.subTest(seed=seed):
                self.assert_jittered(jitter_arrivals(self.trace, seed, scale=0.25), 0.5)
        # scale 0: no offset, so the requests keep their times and order
        still = jitter_arrivals(self.trace, 7, scale=0)
        self.assertEqual(still.name, "fixture~jitter7")
        self.assertEqual(still.requests, self.trace.requests)

    def test_clamped_at_zero(self):
        # Four arrivals at 0 s and one at 4 s: mean gap 1 s; an offset below 0 is cut.
        trace = Trace(
            "z",
            512,
            tuple(Request(t, 10, 1, (i,)) for i, t in enumerate([0.0] * 4 + [4.0])),
        )
        clamped = 0
        for seed in range(1, 6):
            jittered = jitter_arrivals(trace, seed)
            times = [r.timestamp_s for r in jittered.requests]
            self.assertEqual(times, sorted(times))
            self.assertTrue(all(0.0 <= t <= 5.0 for t in times), times)
            clamped += times.count(0.0)
        self.assertGreater(clamped, 0)

    def test_one_request_has_no_gap(self):
        one = Trace("one", 512, (Request(3.0, 10, 1, (0,)),))
        self.assertEqual(jitter_arrivals(one, 9).requests, one.requests)

    def test_generated_multi_turn_stays_well_formed(self):
        trace = generate_workload("multi-turn", num_requests=200, seed=0)
        jittered = jitter_arrivals(trace, 11)
        self.assert_well_formed(jittered)
        self.assertEqual(
            collections.Counter(map(without_time, jittered.requests)),
            collections.Counter(map(without_time, trace.requests)),
        )

    def test_bad_arguments(self):
        for kwargs in (
            {"seed": -1},
            {"seed": True},
            {"seed": 1.0},
            {"seed": 1, "scale": -0.5},
            {"seed": 1, "scale": float("nan")},
            {"seed": 1, "scale": float("inf")},
            {"seed": 1, "scale": "1"},
        ):
            with self.subTest(**kwargs), self.assertRaises(ValueError):
                jitter_arrivals(self.trace, **kwargs)


if __name__ == "__main__":
    unittest.main()
