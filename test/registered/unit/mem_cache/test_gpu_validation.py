"""Tests for benchmark/mla_eviction/gpu_validation.py on CPU, with the tiny preset.

Absorbed attention from the latent cache must equal expanded K/V attention (prefill on
a cached prefix, and decode), a wrong absorption must be caught, the calibration JSON
must load into the cost model with positive constants, and bad command lines exit 2.
"""

import contextlib
import dataclasses
import datetime
import importlib.util
import io
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import torch

from sglang.srt.mem_cache.mla_cost_model import Calibration, KVCostModel
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="base-a-test-cpu")

_REPO = Path(__file__).resolve().parents[4]
SCRIPT = _REPO / "benchmark" / "mla_eviction" / "gpu_validation.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("mla_gpu_validation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gv = _load_script()
CPU = torch.device("cpu")
TINY = gv.PRESETS["tiny"]


def run_main(*argv):
    """(exit status, stdout, stderr) of the script's main(argv), run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = gv.main(list(argv))
        except SystemExit as e:
            status = e.code
    return status, out.getvalue(), err.getvalue()


class TestAbsorbedEqualsExpanded(CustomTestCase):
    def test_fp32_prefill_and_decode_match(self):
        result = gv.check_correctness(gv.MLALayer(TINY, CPU, torch.float32))
        self.assertTrue(result["passed"])
        self.assertEqual(result["tolerance_rel"], 1e-4)
        self.assertEqual((result["prefix_tokens"], result["chunk_tokens"]), (192, 64))
        for case in ("prefill", "decode"):
            self.assertLess(result[case]["rel_error"], 1e-5, case)
            self.assertLess(result[case]["max_abs_error"], 1e-5, case)

    def test_query_without_lora_matches(self):
        # V2-Lite layout: the query is projected straight from the hidden state.
        shape = dataclasses.replace(TINY, q_lora_rank=None)
        layer = gv.MLALayer(shape, CPU, torch.float32)
        self.assertIsNone(layer.w_dq)
        self.assertTrue(gv.check_correctness(layer)["passed"])

    def test_bf16_within_bf16_tolerance(self):
        result = gv.check_correctness(gv.MLALayer(TINY, CPU, torch.bfloat16))
        self.assertEqual(result["dtype"], "bfloat16")
        self.assertTrue(result["passed"])
        for case in ("prefill", "decode"):
            self.assertGreater(result[case]["rel_error"], 0.0)  # bf16 really rounds
            self.assertLess(result[case]["rel_error"], 2e-2)

    def test_perturbed_absorption_is_detected(self):
        result = gv.check_correctness(
            gv.MLALayer(TINY, CPU, torch.float32), perturb=1e-2
        )
        self.assertFalse(result["passed"])
        for case in ("prefill", "decode"):
            self.assertGreater(result[case]["rel_error"], 1e-3, case)

    def test_rope_rotates_only_the_rope_parts_by_position(self):
        layer = gv.MLALayer(TINY, CPU, torch.float32)
        hidden = torch.randn(3, TINY.hidden)
        at0, at7 = layer.project(hidden, 0), layer.project(hidden, 7)
        torch.testing.assert_close(at0.c_kv, at7.c_kv, rtol=0, atol=0)
        torch.testing.assert_close(at0.q_nope, at7.q_nope, rtol=0, atol=0)
        self.assertGreater((at0.k_rope - at7.k_rope).abs().max().item(), 1e-3)
        self.assertGreater((at0.q_rope - at7.q_rope).abs().max().item(), 1e-3)
        torch.testing.assert_close(at0.k_rope.norm(dim=-1), at7.k_rope.norm(dim=-1))

    def test_cache_rows_are_latent_and_rope_key(self):
        cache = gv.LatentCache(TINY, 4, CPU, torch.float32)
        c_kv, k_rope = torch.randn(3, TINY.kv_lora_rank), torch.randn(3, TINY.qk_rope)
        cache.append(c_kv, k_rope)
        self.assertEqual(tuple(cache.latent().shape), (3, 40))
        torch.testing.assert_close(cache.latent(), torch.cat([c_kv, k_rope], dim=-1))
        with self.assertRaises(IndexError):
            cache.append(c_kv[:2], k_rope[:2])


class TestFit(CustomTestCase):
    def test_unusable_constants_follow_calibrations_rule(self):
        good = {
            "prefill_s_per_token": 1e-6,
            "prefill_s_per_token_per_position": 0.0,  # may be 0
            "h2d_s_per_token_per_layer": 1e-9,
        }
        self.assertEqual(gv.unusable_constants(good), [])
        Calibration("gpu", *good.values())  # accepted as well
        for name, value in (
            ("prefill_s_per_token", 0.0),
            ("h2d_s_per_token_per_layer", 0.0),
            ("prefill_s_per_token_per_position", float("nan")),
            ("prefill_s_per_token", float("inf")),
        ):
            with self.subTest(name=name, value=value):
                bad = dict(good, **{name: value})
                self.assertEqual(gv.unusable_constants(bad), [name])
                with self.assertRaises(ValueError):
                    Calibration("gpu", *bad.values())

    def test_attended_positions(self):
        self.assertEqual(gv.attended_positions(0, 4), 1 + 2 + 3 + 4)
        self.assertEqual(gv.attended_positions(3, 2), 4 + 5)

    def test_recovers_exact_constants(self):
        a, b, h, latency = 2e-6, 3e-8, 5e-9, 1e-5
        samples = [
            {
                "kind": "prefill",
                "chunk": 256,
                "attended_positions": gv.attended_positions(d, 256),
                "seconds_median": a * 256 + b * gv.attended_positions(d, 256),
            }
            for d in (0, 512, 2048)
        ] + [
            {"kind": "h2d", "tokens": n, "seconds_median": h * n + latency}
            for n in (1024, 8192, 65536)
        ]
        fit = gv.fit(samples)
        names = ["prefill_s_per_token", "prefill_s_per_token_per_position"]
        self.assertEqual(list(fit), names + ["h2d_s_per_token_per_layer"])
        for got, want in zip(fit.values(), (a, b, h)):
            self.assertAlmostEqual(got / want, 1.0, places=9)

    def test_negative_coefficient_is_clamped_to_zero(self):
        # Time falling with depth: the depth term is 0 and the token term the best
        # fit on its own column.
        coef = gv.nonneg_lstsq([[2.0, 2.0], [1.0, 3.0]], [3.0, 1.0])
        self.assertEqual(coef, [1.0, 0.0])


class TestCalibrationOutput(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.path = Path(cls.tmp.name) / "calibration.json"
        cls.status, cls.stdout, _ = run_main(
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--repeats",
            "9",
            "--calibration-out",
            str(cls.path),
        )
        cls.data = json.loads(cls.path.read_text())

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_exit_zero_and_report(self):
        self.assertEqual(self.status, 0, self.stdout)
        self.assertIn("prefill  max abs", self.stdout)
        self.assertIn("host -> host plain copy (no GPU)", self.stdout)
        self.assertIn(f"calibration written to {self.path}", self.stdout)

    def test_json_shape(self):
        d = self.data
        self.assertEqual(
            set(d),
            {
                "schema",
                "gpu_name",
                "torch_version",
                "date",
                "preset",
                "dtype",
                "device",
                "fit",
                "samples",
                "correctness",
            },
        )
        self.assertEqual(d["schema"], "mla-eviction-calibration/1")
        self.assertEqual(
            (d["preset"], d["dtype"], d["device"]), ("tiny", "float32", "cpu")
        )
        self.assertEqual(d["torch_version"], torch.__version__)
        datetime.date.fromisoformat(d["date"])
        self.assertTrue(d["correctness"]["passed"])
        prefill = [s for s in d["samples"] if s["kind"] == "prefill"]
        self.assertEqual([s["depth"] for s in prefill], [0, 512, 1024, 2048])
        for s in prefill:
            self.assertEqual(
                s["attended_positions"], gv.attended_positions(s["depth"], 256)
            )
            self.assertEqual((s["form"], s["heads"], s["chunk"]), ("expanded", 4, 256))
            self.assertEqual(len(s["seconds"]), 9)
        h2d = [s for s in d["samples"] if s["kind"] == "h2d"]
        self.assertEqual([s["tokens"] for s in h2d], [1024, 8192, 65536])
        self.assertEqual(h2d[0]["bytes"], 1024 * (32 + 8) * 4)
        self.assertEqual(
            {s["method"] for s in h2d}, {"host -> host plain copy (no GPU)"}
        )

    def test_loads_into_cost_model_with_positive_constants(self):
        cal = Calibration.load(self.path)
        fit = self.data["fit"]
        self.assertEqual(cal.prefill_s_per_token, fit["prefill_s_per_token"])
        # Written only when Calibration accepts it: a, h > 0 and b >= 0.
        self.assertGreater(cal.prefill_s_per_token, 0)
        self.assertGreaterEqual(cal.prefill_s_per_token_per_position, 0)
        self.assertGreater(cal.h2d_s_per_token_per_layer, 0)
        model = KVCostModel.from_preset("deepseek-v3", calibration=cal)
        # 61 layers; positions 0..9 attend to 1 + 2 + ... + 10 = 55 tokens.
        want = 61 * (
            10 * cal.prefill_s_per_token + 55 * cal.prefill_s_per_token_per_position
        )
        self.assertAlmostEqual(model.prefill_seconds(0, 10) / want, 1.0, delta=1e-12)
        # h is recorded, not priced: no cost depends on it.
        other = dataclasses.replace(cal, h2d_s_per_token_per_layer=1.0)
        model2 = KVCostModel.from_preset("deepseek-v3", calibration=other)
        self.assertEqual(model2.prefill_seconds(0, 10), model.prefill_seconds(0, 10))

    def test_unusable_fit_exits_1_and_writes_nothing(self):
        path = Path(self.tmp.name) / "zero.json"
        zero = {
            "prefill_s_per_token": 0.0,
            "prefill_s_per_token_per_position": 1e-9,
            "h2d_s_per_token_per_layer": 1e-9,
        }
        with mock.patch.object(gv, "fit", return_value=zero):
            status, out, _ = run_main(
                "--preset", "tiny", "--device", "cpu", "--repeats", "1",
                "--depths", "0,64", "--chunk", "16", "--calibration-out", str(path),
            )  # fmt: skip
        self.assertEqual(status, 1)
        self.assertIn("unusable fit: prefill_s_per_token must be > 0", out)
        self.assertFalse(path.exists())

    def test_failed_check_exits_1_and_writes_nothing(self):
        path = Path(self.tmp.name) / "bad.json"
        status, out, _ = run_main(
            "--preset",
            "tiny",
            "--perturb-absorption",
            "0.01",
            "--calibration-out",
            str(path),
        )
        self.assertEqual(status, 1)
        self.assertIn("FAIL", out)
        self.assertIn("no calibration written", out)
        self.assertFalse(path.exists())


class TestCommandLine(CustomTestCase):
    def test_bad_values_exit_2_naming_the_flag(self):
        cases = [
            ([], "--preset"),
            (["--preset", "v4"], "--preset"),
            (["--preset", "tiny", "--device", "tpu"], "--device"),
            (["--preset", "tiny", "--dtype", "fp8"], "--dtype"),
            (["--preset", "tiny", "--depths", "0,abc"], "--depths"),
            (["--preset", "tiny", "--depths", "0,-512"], "--depths"),
            (["--preset", "tiny", "--depths", "512,512"], "two different depths"),
            (["--preset", "tiny", "--chunk", "0"], "--chunk"),
            (["--preset", "tiny", "--repeats", "many"], "--repeats"),
            (["--preset", "tiny", "--tp", "3"], "--tp 3: must divide the 4 heads"),
            (
                ["--preset", "tiny", "--calibration-out", "/no/such/dir/c.json"],
                "--calibration-out",
            ),
            (["--preset", "tiny", "--calibration-out", "/dev/null"], "/dev/null"),
            (["--preset", "tiny", "--calibration-out", "/tmp"], "--calibration-out"),
        ]
        if not torch.cuda.is_available():
            cases.append((["--preset", "tiny", "--device", "cuda"], "no CUDA device"))
        for argv, message in cases:
            with self.subTest(argv=argv):
                status, _, err = run_main(*argv)
                self.assertEqual(status, 2)
                self.assertIn(message, err)

    def test_script_exits_2_as_a_process(self):
        bad = subprocess.run(
            [sys.executable, str(SCRIPT), "--preset", "tiny", "--depths", "7"],
            capture_output=True,
            text=True,
        )
        self.assertEqual(bad.returncode, 2)
        self.assertIn(
            "argument --depths: need at least two different depths", bad.stderr
        )


if __name__ == "__main__":
    unittest.main()
