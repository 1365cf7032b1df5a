"""Tests for benchmark/mla_eviction/e2e.py: the commands it runs, its report, its control flow.

No GPU, no weights: the dry run is checked line by line, the report from small bench
output files written here, and a full run (benchmarks and --correctness) against fake
``launch_server`` / ``benchmark.serving`` programs that the script starts like the real
ones, through ``--python``.
"""

import contextlib
import io
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=45, suite="base-a-test-cpu")

_REPO = Path(__file__).resolve().parents[4]
E2E = _REPO / "benchmark" / "mla_eviction" / "e2e.py"
sys.path.insert(0, str(E2E.parent))

import e2e  # noqa: E402


def dry_run(*argv):
    result = subprocess.run(
        [sys.executable, str(E2E), "--dry-run", "--python", "python", *argv],
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.splitlines()


SERVER = (
    "python -m sglang.launch_server --model-path /models/DeepSeek-V3 --host 127.0.0.1 "
    "--port 31000 --tp-size 8 --max-total-tokens 200000 --page-size 64"
)
BENCH = (
    "python -m sglang.benchmark.serving --backend sglang --host 127.0.0.1 --port 31000 "
    "--model /models/DeepSeek-V3 --seed 1 --max-concurrency 64 "
    "--output-file /tmp/e2e/{v}_{d}.jsonl "
)
GSP = (
    "--dataset-name generated-shared-prefix --request-rate inf --gsp-num-groups 128 "
    "--gsp-prompts-per-group 16 --gsp-system-prompt-len 4096 --gsp-question-len 256 "
    "--gsp-output-len 128 --gsp-group-distribution zipf --gsp-zipf-alpha 1.1 "
)
MOONCAKE = (
    "--dataset-name mooncake --dataset-path /data/trace.jsonl --mooncake-workload "
    "conversation --num-prompts 1000 --mooncake-slowdown-factor 1.0 "
)
BENCH_TAIL = "--flush-cache --cache-report --output-details --disable-tqdm"


class TestDryRun(CustomTestCase):
    ARGS = (
        "--model-path",
        "/models/DeepSeek-V3",
        "--tp-size",
        "8",
        "--port",
        "31000",
        "--max-total-tokens",
        "200000",
        "--server-args",
        "--page-size 64",
        "--mooncake-trace",
        "/data/trace.jsonl",
        "--out",
        "/tmp/e2e",
    )

    def test_prints_every_command_in_order(self):
        expected = []
        for v, flag in (("baseline", ""), ("mla_aware", " --mla-aware-eviction")):
            expected += [
                f"# {v} server",
                SERVER + flag,
                "# wait for http://127.0.0.1:31000/health",
                BENCH.format(v=v, d="gsp") + GSP + BENCH_TAIL,
                BENCH.format(v=v, d="mooncake") + MOONCAKE + BENCH_TAIL,
                f"# stop the {v} server (its process group: SIGTERM, then SIGKILL)",
            ]
        self.assertEqual(dry_run(*self.ARGS), expected)

    def test_servers_differ_only_by_the_flag_and_benches_only_by_output(self):
        lines = [x for x in dry_run(*self.ARGS) if not x.startswith("#")]
        base_server, base_gsp, base_mc, mla_server, mla_gsp, mla_mc = lines
        self.assertEqual(mla_server, base_server + " --mla-aware-eviction")
        self.assertEqual(mla_gsp, base_gsp.replace("baseline_gsp", "mla_aware_gsp"))
        self.assertEqual(
            mla_mc, base_mc.replace("baseline_mooncake", "mla_aware_mooncake")
        )
        for line in lines:
            self.assertNotIn("0.0.0.0", line)

    def test_one_dataset(self):
        lines = dry_run(*self.ARGS, "--datasets", "mooncake")
        benches = [x for x in lines if "benchmark.serving" in x]
        self.assertEqual(len(benches), 2)
        self.assertTrue(all("--dataset-name mooncake" in x for x in benches))

    def test_server_args_may_not_set_what_the_script_sets(self):
        for extra, option in (
            ("--mla-aware-eviction", "--mla-aware-eviction"),
            ("--host 0.0.0.0", "--host"),
            ("--port=31000", "--port"),
            ("--radix-eviction-policy lfu", "--radix-eviction-policy"),
            ("--radix-eviction-policy=mla_aware", "--radix-eviction-policy"),
            ("--radix-cache-backend mla_aware", "--radix-cache-backend"),
        ):
            with self.subTest(extra=extra):
                err = io.StringIO()
                with (
                    contextlib.redirect_stderr(err),
                    self.assertRaises(SystemExit) as e,
                ):
                    e2e.parse_args(["--model-path", "M", f"--server-args={extra}"])
                self.assertEqual(e.exception.code, 2)
                self.assertIn(f"--server-args may not set {option}", err.getvalue())

    def test_flag_is_the_plugins(self):
        from sglang.srt.mem_cache.mla_eviction_plugin import FLAG

        self.assertEqual(e2e.FLAG, FLAG)

    def test_correctness_forces_evictions_with_deterministic_servers(self):
        lines = dry_run("--model-path", "M", "--correctness")
        server = (
            "python -m sglang.launch_server --model-path M --host 127.0.0.1 --port 30000 "
            "--tp-size 1 --max-total-tokens 16384 --enable-deterministic-inference"
        )
        generate = (
            "# POST http://127.0.0.1:30000/generate: 64 fixed prompts, one at a time, "
            "temperature 0, max_new_tokens 32"
        )
        self.assertEqual(
            lines,
            [
                "# baseline server",
                server,
                "# wait for http://127.0.0.1:30000/health",
                generate,
                "# stop the baseline server (its process group: SIGTERM, then SIGKILL)",
                "# mla_aware server",
                server + " --mla-aware-eviction",
                "# wait for http://127.0.0.1:30000/health",
                generate,
                "# stop the mla_aware server (its process group: SIGTERM, then SIGKILL)",
            ],
        )

    def test_correctness_keeps_a_given_pool_size(self):
        lines = dry_run(
            "--model-path", "M", "--correctness", "--mem-fraction-static", "0.3"
        )
        self.assertIn(
            "--mem-fraction-static 0.3 --enable-deterministic-inference", lines[1]
        )
        self.assertNotIn("--max-total-tokens", lines[1])


class TestCommandsParseWithInstalledSGLang(CustomTestCase):
    """Every option the script passes exists in the installed SGLang 0.5.23: the
    servers' through ServerArgs' parser (with the plugin's flag), the benches'
    through ``sglang.benchmark.serving``'s own command line (not run)."""

    def commands(self, *extra):
        args = e2e.parse_args([*TestDryRun.ARGS, *extra])
        return args, [
            *(e2e.server_command(args, v) for v in e2e.VARIANTS),
            *(e2e.server_command(args, v, correctness=True) for v in e2e.VARIANTS),
        ]

    def test_server_commands(self):
        import argparse

        from sglang.srt.mem_cache.mla_eviction_plugin import add_flag
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        add_flag(None, parser)
        _, servers = self.commands()
        for cmd in servers:
            with self.subTest(cmd=cmd):
                self.assertEqual(cmd[1:3], ["-m", "sglang.launch_server"])
                parsed = parser.parse_args(cmd[3:])
                self.assertEqual(parsed.mla_aware_eviction, e2e.FLAG in cmd)
                self.assertEqual(parsed.page_size, 64)

    def test_bench_commands(self):
        from unittest import mock

        import sglang.benchmark.serving as serving

        args, _ = self.commands()
        for variant in e2e.VARIANTS:
            for dataset in e2e.DATASETS:
                cmd = e2e.bench_command(args, variant, dataset)
                with self.subTest(cmd=cmd):
                    self.assertEqual(cmd[1:3], ["-m", "sglang.benchmark.serving"])
                    with (
                        mock.patch.object(serving, "run_benchmark") as run,
                        mock.patch("sys.argv", ["serving", *cmd[3:]]),
                    ):
                        serving.cli_main()
                    parsed = run.call_args.args[0]
                    self.assertTrue(parsed.cache_report and parsed.flush_cache)
                    self.assertEqual(
                        parsed.output_file,
                        str(e2e.bench_output(args, variant, dataset)),
                    )


def bench_line(completed, prompt, cached, ttft, throughput, with_report=True):
    mean, p50, p99 = ttft
    line = {
        "backend": "sglang",
        "completed": completed,
        "total_input_tokens": prompt,
        "mean_ttft_ms": mean,
        "median_ttft_ms": p50,
        "p99_ttft_ms": p99,
        "output_throughput": throughput,
    }
    if with_report:
        line["cache_report"] = {
            "total_prompt_tokens": prompt,
            "total_cached_tokens": cached,
        }
    else:
        line["cached_tokens"] = [cached - cached // 2, cached // 2]
    return json.dumps(line)


class TestReport(CustomTestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, *lines):
        path = self.dir / name
        path.write_text("\n".join(lines) + "\n")
        return path

    def test_reads_the_last_run_of_a_file(self):
        path = self.write(
            "b.jsonl",
            bench_line(1, 10, 5, (1, 1, 1), 1.0),
            bench_line(100, 40000, 10000, (200.0, 150.0, 900.0), 5000.0),
        )
        f = e2e.read_bench_output(path)
        self.assertEqual(
            f,
            e2e.BenchFigures(
                completed=100,
                prompt_tokens=40000,
                cached_tokens=10000,
                mean_ttft_ms=200.0,
                p50_ttft_ms=150.0,
                p99_ttft_ms=900.0,
                output_throughput=5000.0,
            ),
        )
        self.assertEqual(f.hit_rate, 0.25)

    def test_cached_tokens_from_per_request_details(self):
        path = self.write(
            "b.jsonl", bench_line(2, 100, 31, (1, 1, 1), 1.0, with_report=False)
        )
        self.assertEqual(e2e.read_bench_output(path).cached_tokens, 31)

    def test_no_cache_figures_is_an_error(self):
        line = json.loads(bench_line(2, 100, 31, (1, 1, 1), 1.0))
        del line["cache_report"]
        with self.assertRaisesRegex(ValueError, "--cache-report"):
            e2e.read_bench_output(self.write("b.jsonl", json.dumps(line)))
        with self.assertRaisesRegex(ValueError, "no benchmark result"):
            e2e.read_bench_output(self.write("empty.jsonl", ""))

    def test_ratios(self):
        self.assertEqual(e2e.ratio(3.0, 2.0), 1.5)
        self.assertIsNone(e2e.ratio(3.0, 0))

    def test_side_by_side_markdown(self):
        base = e2e.read_bench_output(
            self.write(
                "b.jsonl", bench_line(100, 40000, 10000, (200.0, 150.0, 900.0), 5000.0)
            )
        )
        mla = e2e.read_bench_output(
            self.write(
                "m.jsonl", bench_line(100, 40000, 16000, (150.0, 120.0, 450.0), 5500.0)
            )
        )
        report = e2e.format_report({"gsp": (base, mla)})
        self.assertEqual(
            report.splitlines(),
            [
                "### gsp",
                "",
                "| metric | baseline | mla_aware | mla_aware / baseline |",
                "|---|---:|---:|---:|",
                "| completed requests | 100 | 100 | 1.000 |",
                "| prompt tokens | 40000 | 40000 | 1.000 |",
                "| cached tokens | 10000 | 16000 | 1.600 |",
                "| cache hit rate | 25.00% | 40.00% | 1.600 |",
                "| TTFT mean (ms) | 200.0 | 150.0 | 0.750 |",
                "| TTFT p50 (ms) | 150.0 | 120.0 | 0.800 |",
                "| TTFT p99 (ms) | 900.0 | 450.0 | 0.500 |",
                "| output throughput (tok/s) | 5000.0 | 5500.0 | 1.100 |",
            ],
        )

    def test_zero_baseline_shows_no_ratio(self):
        zero = e2e.read_bench_output(
            self.write("z.jsonl", bench_line(1, 10, 0, (1, 1, 1), 1.0))
        )
        some = e2e.read_bench_output(
            self.write("s.jsonl", bench_line(1, 10, 5, (1, 1, 1), 1.0))
        )
        self.assertIn(
            "| cached tokens | 0 | 5 | n/a |", e2e.format_report({"x": (zero, some)})
        )


class TestCorrectnessPrompts(CustomTestCase):
    def test_fixed_and_overflowing_the_pool(self):
        pool = 16384
        prompts = e2e.correctness_prompts(64, pool)
        self.assertEqual(prompts, e2e.correctness_prompts(64, pool))
        self.assertEqual(len(prompts), 64)
        docs = {p.split("\n", 1)[0] for p in prompts}
        self.assertEqual(len(docs), 24)
        self.assertGreater(sum(len(d.split()) for d in docs), 2 * pool)
        self.assertLess(max(len(p.split()) for p in prompts), pool // 4)
        self.assertGreater(len(prompts) - len(docs), 0)  # some documents come back

    def test_compare_generations(self):
        g = e2e.Generation
        prompts = ["a", "b", "c"]
        base = [g((1, 2), "x", 5, 0), g((), "y", 5, 0), g((3,), "z", 5, 0)]
        mla = [g((1, 2), "x", 5, 3), g((), "y", 5, 3), g((4,), "z", 5, 3)]
        mismatches = e2e.compare_generations(prompts, base, mla)
        self.assertEqual(len(mismatches), 1)
        self.assertTrue(mismatches[0].startswith("prompt 2 "))


# Stands in for `python -m sglang.launch_server` and `python -m sglang.benchmark.serving`.
FAKE_SGLANG = textwrap.dedent(
    """
    import json, os, subprocess, sys, urllib.request
    from http.server import BaseHTTPRequestHandler, HTTPServer

    def option(name, default=None):
        return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default

    module, port = sys.argv[2], int(option("--port"))
    mla = "--mla-aware-eviction" in sys.argv
    if module == "sglang.launch_server":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAKE_PIDS"], "a") as f:
            f.write(f"{os.getpid()} {child.pid}\\n")
        with open(os.environ["FAKE_ARGV"], "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\\n")

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply({})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                words = body["text"].split()
                ids = [len(w) for w in words[-3:]]
                if mla and os.environ.get("FAKE_DIVERGE") and len(words) % 2:
                    ids = ids[::-1] + [0]
                meta = {"prompt_tokens": len(words), "cached_tokens": len(words) // 2}
                self.reply({"text": " ".join(map(str, ids)), "output_ids": ids, "meta_info": meta})

        HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    elif module == "sglang.benchmark.serving":
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read()
        if os.environ.get("FAKE_BENCH_FAILS"):
            sys.exit(3)
        out = option("--output-file")
        cached = 300 if "mla_aware" in out else 200
        result = {
            "completed": 10, "total_input_tokens": 1000, "output_throughput": 100.0,
            "mean_ttft_ms": 50.0, "median_ttft_ms": 40.0, "p99_ttft_ms": 90.0,
            "cache_report": {"total_prompt_tokens": 1000, "total_cached_tokens": cached},
        }
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\\n")
    """
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class TestRunAgainstFakeServers(CustomTestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)
        (self.dir / "fake_sglang.py").write_text(FAKE_SGLANG)
        python = self.dir / "python"
        python.write_text(
            f'#!/bin/sh\nexec "{sys.executable}" "{self.dir}/fake_sglang.py" "$@"\n'
        )
        python.chmod(python.stat().st_mode | stat.S_IEXEC)
        self.env = {
            **os.environ,
            "FAKE_PIDS": str(self.dir / "pids"),
            "FAKE_ARGV": str(self.dir / "argv"),
        }

    def tearDown(self):
        self.tmp.cleanup()

    def run_e2e(self, *argv, env=None):
        return subprocess.run(
            [
                sys.executable,
                str(E2E),
                "--model-path",
                "M",
                "--python",
                str(self.dir / "python"),
                "--port",
                str(free_port()),
                "--out",
                str(self.dir / "out"),
                *argv,
            ],
            capture_output=True,
            text=True,
            env=env or self.env,
            timeout=120,
        )

    def assert_servers_stopped(self, count):
        pids = [int(p) for p in (self.dir / "pids").read_text().split()]
        self.assertEqual(len(pids), 2 * count)
        self.assertEqual([p for p in pids if alive(p)], [])

    def test_benchmarks_and_report(self):
        result = self.run_e2e()
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("| cached tokens | 200 | 300 | 1.500 |", result.stdout)
        self.assertEqual(result.stdout.count("### "), 2)
        self.assertEqual(
            (self.dir / "out" / "report.md").read_text().strip(), result.stdout.strip()
        )
        self.assert_servers_stopped(2)
        base, mla = [
            json.loads(x) for x in (self.dir / "argv").read_text().splitlines()
        ]
        self.assertEqual(mla, base + ["--mla-aware-eviction"])

    def test_correctness_passes_on_identical_outputs(self):
        result = self.run_e2e("--correctness", "--correctness-prompts", "30")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("- mismatches: 0", result.stdout)
        self.assertIn("evictions forced: yes", result.stdout)
        self.assert_servers_stopped(2)

    def test_correctness_reports_mismatches(self):
        result = self.run_e2e("--correctness", env={**self.env, "FAKE_DIVERGE": "1"})
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertRegex(result.stdout, r"- mismatches: [1-9]")
        self.assert_servers_stopped(2)

    def test_servers_stop_when_a_bench_fails(self):
        result = self.run_e2e(env={**self.env, "FAKE_BENCH_FAILS": "1"})
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("CalledProcessError", result.stderr)
        self.assert_servers_stopped(1)


if __name__ == "__main__":
    unittest.main()
