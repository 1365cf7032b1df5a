"""The latent-cache analyzer CLI: exact figures per rank, and bad input."""

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

from sglang.srt.mem_cache.latent_cache_analyzer import LatentCacheAnalyzer, main
from sglang.srt.mem_cache.mla_cost_model import PRESETS
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

# What `make bench` runs.
BENCH_ARGS = ["--model", "deepseek-v3", "--gpu-memory", "80GB", "--weights", "40GB", "--tp", "8"]


def run_main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's own usage errors
            status = e.code
    return status, out.getvalue(), err.getvalue()


class TestReport(CustomTestCase):
    def test_deepseek_v3_80gb_40gb_tp8_json(self):
        status, out, err = run_main(BENCH_ARGS + ["--json"])
        self.assertEqual((status, err), (0, ""))
        report = json.loads(out)
        expected = {
            "model": "deepseek-v3",
            "attention": "mla",
            "num_layers": 61,
            "tp_size": 8,
            "page_size": 1,
            "kv_cache_dtype": "auto",
            "gpu_memory_bytes": 80_000_000_000,
            "weights_bytes": 40_000_000_000,
            "mem_fraction_static": 0.9,
            # 80 GB x 0.9 - 40 GB
            "kv_pool_bytes": 32_000_000_000,
            # (512 + 64) x 2 B x 61, the same on every rank
            "bytes_per_token": 70_272,
            # 32e9 // 70,272
            "cacheable_tokens": 455_373,
            # 128 heads / 8 ranks x (192 + 128) x 2 B x 61
            "mha_equivalent_bytes_per_token": 624_640,
            # 32e9 // 624,640
            "mha_equivalent_tokens": 51_229,
            "latent_replicated": True,
        }
        for key, value in expected.items():
            self.assertEqual(report[key], value, key)
        self.assertAlmostEqual(report["compression_vs_mha"], 624_640 / 70_272)  # 8.89
        self.assertAlmostEqual(report["compression_vs_mha_tp1"], 4_997_120 / 70_272)  # 71.11

    def test_text_output(self):
        status, out, _ = run_main(BENCH_ARGS)
        self.assertEqual(status, 0)
        for line in (
            "deepseek-v3 (MLA attention, 61 layers)",
            "70,272 B",
            "455,373",
            "624,640 B/token per rank",
            "8.89x (TP 1: 71.11x)",
        ):
            self.assertIn(line, out)
        self.assertIn("replicated on every TP rank", out)
        self.assertIn("sharded by heads", out)

    def test_ratio_shrinks_with_tp(self):
        ratios = []
        for tp in (1, 2, 8):
            analyzer = LatentCacheAnalyzer.from_setup(
                "deepseek-v3", gpu_memory_bytes=80 * 10**9, weights_bytes=40 * 10**9, tp_size=tp
            )
            report = analyzer.report()
            self.assertEqual(report.bytes_per_token, 70_272)
            ratios.append(report.compression_vs_mha)
        self.assertAlmostEqual(ratios[0] / ratios[1], 2.0)
        self.assertAlmostEqual(ratios[0] / ratios[2], 8.0)

    def test_gqa_model_and_options(self):
        status, out, _ = run_main(
            ["--model", "llama-3-70b", "--gpu-memory", "80GiB", "--weights", "20GiB",
             "--tp", "8", "--page-size", "16", "--mem-fraction-static", "0.85", "--json"]
        )
        self.assertEqual(status, 0)
        report = json.loads(out)
        pool = int(80 * 2**30 * 0.85) - 20 * 2**30
        self.assertEqual(report["kv_pool_bytes"], pool)
        self.assertEqual(report["bytes_per_token"], 40_960)  # 2 x 1 x 128 x 2 B x 80
        self.assertEqual(report["cacheable_tokens"], pool // (16 * 40_960) * 16)
        self.assertEqual(report["compression_vs_mha"], 1.0)
        self.assertFalse(report["latent_replicated"])

    def test_config_json_and_fp8(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "config.json")
            with open(path, "w") as f:
                json.dump(PRESETS["deepseek-v3"], f)
            status, out, _ = run_main(
                ["--model", path, "--gpu-memory", "80GB", "--weights", "40GB",
                 "--kv-cache-dtype", "fp8_e4m3", "--json"]
            )
        self.assertEqual(status, 0)
        report = json.loads(out)
        self.assertEqual(report["bytes_per_token"], 35_136)
        self.assertEqual(report["cacheable_tokens"], 32_000_000_000 // 35_136)


class TestBadInput(CustomTestCase):
    def assert_rejected(self, argv, *needles):
        status, out, err = run_main(argv)
        self.assertEqual(status, 2)
        self.assertEqual(out, "")
        self.assertNotIn("Traceback", err)
        for needle in needles:
            self.assertIn(needle, err)

    def test_unknown_preset(self):
        self.assert_rejected(
            ["--model", "deepseek-v9", "--gpu-memory", "80GB", "--weights", "40GB"],
            "deepseek-v9", "deepseek-v3",
        )

    def test_missing_config_field(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "config.json")
            config = {k: v for k, v in PRESETS["deepseek-v3"].items() if k != "qk_rope_head_dim"}
            with open(path, "w") as f:
                json.dump(config, f)
            self.assert_rejected(
                ["--model", path, "--gpu-memory", "80GB", "--weights", "40GB"],
                "'qk_rope_head_dim'",
            )

    def test_bad_size(self):
        self.assert_rejected(
            ["--model", "deepseek-v3", "--gpu-memory", "80GX", "--weights", "40GB"], "'80GX'"
        )

    def test_weights_do_not_fit(self):
        self.assert_rejected(
            ["--model", "deepseek-v3", "--gpu-memory", "80GB", "--weights", "75GB"],
            "no room for a KV cache",
        )

    def test_bad_dtype_and_tp(self):
        self.assert_rejected(BENCH_ARGS + ["--kv-cache-dtype", "int3"], "'int3'")
        self.assert_rejected(
            ["--model", "deepseek-v3", "--gpu-memory", "80GB", "--weights", "40GB", "--tp", "0"],
            "tp_size",
        )

    def test_missing_argument(self):
        self.assert_rejected(["--model", "deepseek-v3"], "--gpu-memory")


class TestModuleRun(CustomTestCase):
    """`make bench` runs the module; so does a user with a typo."""

    def run_module(self, argv):
        return subprocess.run(
            [sys.executable, "-m", "sglang.srt.mem_cache.latent_cache_analyzer", *argv],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )

    def test_make_bench_command(self):
        out = self.run_module(BENCH_ARGS)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertIn("455,373", out.stdout)
        self.assertIn("8.89x", out.stdout)

    def test_bad_input_exits_2_without_traceback(self):
        out = self.run_module(["--model", "nope", "--gpu-memory", "80GB", "--weights", "40GB"])
        self.assertEqual(out.returncode, 2)
        self.assertNotIn("Traceback", out.stderr)
        self.assertIn("latent_cache_analyzer: error: ", out.stderr)


if __name__ == "__main__":
    unittest.main()
