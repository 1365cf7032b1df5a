"""The latent-cache analyzer: sizes, the per-rank pool, the report and its CLI."""

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest
from array import array

import torch

from sglang.srt.mem_cache.allocator import (
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.latent_cache_analyzer import (
    analyze,
    kv_pool_bytes,
    main,
    parse_size,
)
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.mla_cost_model import PRESETS
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

GB = 10**9
# What `make bench` runs.
BENCH_ARGS = ["--model", "deepseek-v3", "--gpu-memory", "80GB", "--weights", "40GB"]
BENCH_ARGS += ["--tp", "8"]


def run_main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's own errors
            status = e.code
    return status, out.getvalue(), err.getvalue()


class TestParseSize(CustomTestCase):
    def test_units(self):
        cases = {
            "80GB": 80_000_000_000,
            "80gb": 80_000_000_000,
            "40GiB": 42_949_672_960,
            "512MB": 512_000_000,
            "512mib": 536_870_912,
            "1.5TB": 1_500_000_000_000,
            "2TiB": 2_199_023_255_552,
            " 64 KiB ": 65_536,
            "1kb": 1_000,
            "4096": 4_096,
            "7B": 7,
            "0.5": 0,
            "0GB": 0,
        }
        for text, expected in cases.items():
            with self.subTest(text=text):
                self.assertEqual(parse_size(text), expected)

    def test_bad_values_are_named(self):
        for text in ("", "GB", "80GX", "-1GB", "nan", "inf", "NaNGB", "1e9", "80 G B"):
            with self.subTest(text=text):
                with self.assertRaises(ValueError) as ctx:
                    parse_size(text)
                self.assertEqual(
                    str(ctx.exception),
                    f"invalid size {text!r}: expected a number >= 0 with an optional "
                    "unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
                    "(powers of 1024)",
                )
        with self.assertRaises(ValueError) as ctx:
            parse_size(float("nan"))
        self.assertIn("invalid size nan:", str(ctx.exception))


class TestPool(CustomTestCase):
    def test_pool_bytes(self):
        # 80 GB x 0.9 - 40 GB
        self.assertEqual(kv_pool_bytes(80 * GB, 40 * GB, 0.9), 32 * GB)
        # 80 GB x 0.8 - 40 GB - 3 GB
        self.assertEqual(kv_pool_bytes(80 * GB, 40 * GB, 0.8, reserved=3 * GB), 21 * GB)
        self.assertEqual(kv_pool_bytes(100, 0, 1), 100)

    def test_bad_setup(self):
        cases = [
            (
                (80 * GB, -1, 0.9),
                "sizes must be >= 0 bytes, got gpu_memory 80000000000, "
                "weights -1, reserved 0",
            ),
            ((80 * GB, 40 * GB, 0.0), "mem_fraction_static must be in (0, 1], got 0.0"),
            ((80 * GB, 40 * GB, 1.5), "mem_fraction_static must be in (0, 1], got 1.5"),
            (
                (80 * GB, 40 * GB, math.nan),
                "mem_fraction_static must be in (0, 1], got nan",
            ),
            (
                (80 * GB, 40 * GB, True),
                "mem_fraction_static must be in (0, 1], got True",
            ),
            (
                (80 * GB, 72 * GB, 0.9),
                "no room for a KV cache: gpu_memory 80,000,000,000 B x "
                "mem_fraction_static 0.9 = 72,000,000,000 B does not exceed weights "
                "72,000,000,000 B + reserved 0 B",
            ),
        ]
        for args, message in cases:
            with self.subTest(message=message):
                with self.assertRaises(ValueError) as ctx:
                    kv_pool_bytes(*args)
                self.assertEqual(str(ctx.exception), message)


class TestReport(CustomTestCase):
    def test_deepseek_v3_80gb_40gb_tp8(self):
        status, out, err = run_main(BENCH_ARGS + ["--json"])
        self.assertEqual((status, err), (0, ""))
        report = json.loads(out)
        ratio, ratio_tp1 = (
            report.pop("compression_vs_mha"),
            report.pop("compression_vs_mha_tp1"),
        )
        self.assertEqual(
            report,
            {
                "model": "deepseek-v3",
                "attention": "mla",
                "num_layers": 61,
                "tp_size": 8,
                "page_size": 1,
                "kv_cache_dtype": "auto",
                "kv_pool_bytes": 32_000_000_000,  # 80 GB x 0.9 - 40 GB
                "bytes_per_token": 70_272,  # (512 + 64) x 2 B x 61, on every rank
                # 70,272 x 455,373 = 31,999,971,456 <= 32e9 < 70,272 x 455,374
                "cacheable_tokens": 455_373,
                # 128 heads / 8 ranks x (192 + 128) x 2 B x 61
                "mha_equivalent_bytes_per_token": 624_640,
                # 624,640 x 51,229 = 31,999,682,560 <= 32e9 < 624,640 x 51,230
                "mha_equivalent_tokens": 51_229,
                "latent_replicated": True,
            },
        )
        self.assertTrue(math.isclose(ratio, 624_640 / 70_272, rel_tol=1e-12))
        self.assertTrue(math.isclose(ratio_tp1, 4_997_120 / 70_272, rel_tol=1e-12))

    def test_text(self):
        status, out, _ = run_main(BENCH_ARGS)
        self.assertEqual(status, 0)
        for text in (
            "deepseek-v3 (MLA attention, 61 layers)",
            "32,000,000,000 B",
            "70,272 B",
            "455,373",
            "624,640 B/token per rank (51,229 tokens would fit)",
            "8.89x (TP 1: 71.11x)",
            "replicated on every TP rank",
        ):
            self.assertIn(text, out)

    def test_pages_and_fp8_from_config_json(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(PRESETS["deepseek-v3"], f)
            report = analyze(d, 32 * GB, page_size=64, kv_cache_dtype="fp8_e4m3")
        # 64 x (512 + 64) x 1 B x 61 = 2,248,704 B a page;
        # 2,248,704 x 14,230 = 31,999,057,920 <= 32e9 < 2,248,704 x 14,231
        self.assertEqual(report.bytes_per_token, 35_136)
        self.assertEqual(report.cacheable_tokens, 14_230 * 64)

    def test_gqa(self):
        report = analyze("llama-3-70b", 32 * GB, tp_size=8, page_size=16)
        # 2 x 1 kv head x 128 x 2 B x 80; 16 x 40,960 = 655,360 B a page;
        # 655,360 x 48,828 = 31,999,918,080 <= 32e9 < 655,360 x 48,829
        self.assertEqual(report.bytes_per_token, 40_960)
        self.assertEqual(report.cacheable_tokens, 48_828 * 16)
        self.assertEqual(report.mha_equivalent_tokens, 48_828 * 16)
        self.assertEqual(report.compression_vs_mha, 1.0)
        self.assertFalse(report.latent_replicated)


class TestShortfall(CustomTestCase):
    """The docstring's claim, on SGLang's own tree and allocators (LRU, CPU): the
    pool counts tokens, so evicting the shortfall scaled down by MLA's compression
    fails the allocation, while the shortfall itself (what SGLang evicts) succeeds."""

    SIZE, LEAF = 256, 8

    def full_cache(self, page_size):
        kv = MLATokenToKVPool(
            size=self.SIZE,
            page_size=page_size,
            dtype=torch.bfloat16,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        if page_size == 1:
            allocator = TokenToKVPoolAllocator(
                self.SIZE, torch.bfloat16, "cpu", kv, need_sort=False
            )
        else:
            allocator = PagedTokenToKVPoolAllocator(
                self.SIZE, page_size, torch.bfloat16, "cpu", kv, need_sort=False
            )
        cache = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=allocator,
                page_size=page_size,
                eviction_policy="lru",
            )
        )
        for i in range(self.SIZE // self.LEAF):
            key = RadixKey(array("q", range(i * 1000, i * 1000 + self.LEAF)))
            cache.insert(InsertParams(key=key, value=allocator.alloc(self.LEAF)))
        self.assertEqual(allocator.available_size(), 0)
        return allocator, cache

    def test_scaled_eviction_fails_shortfall_succeeds(self):
        ratio = 624_640 / 70_272  # DeepSeek-V3 at TP 8, about 8.9
        for page_size in (1, 4):
            for requested in (16, 64, self.SIZE):
                with self.subTest(page_size=page_size, requested=requested):
                    allocator, cache = self.full_cache(page_size)
                    cache.evict(EvictParams(num_tokens=math.ceil(requested / ratio)))
                    self.assertIsNone(allocator.alloc(requested))

                    allocator, cache = self.full_cache(page_size)
                    cache.evict(EvictParams(num_tokens=requested))
                    evictable = cache.evictable_size()
                    self.assertEqual(allocator.available_size() + evictable, self.SIZE)
                    self.assertIsNotNone(allocator.alloc(requested))

                    allocator, cache = self.full_cache(page_size)
                    allocator.evict_to_free_tokens(cache, requested)  # SGLang's path
                    self.assertIsNotNone(allocator.alloc(requested))


class TestCLIErrors(CustomTestCase):
    def assert_rejected(self, argv, message):
        status, out, err = run_main(argv)
        self.assertEqual((status, out), (2, ""))
        self.assertNotIn("Traceback", err)
        self.assertEqual(err, f"latent_cache_analyzer: error: {message}\n")

    def test_setup(self):
        gpu = ["--model", "deepseek-v3", "--gpu-memory", "80GB"]
        cases = [
            (
                BENCH_ARGS + ["--mem-fraction-static", "nan"],
                "mem_fraction_static must be in (0, 1], got nan",
            ),
            (
                gpu + ["--weights", "40GB", "--tp", "0"],
                "serving setup: field 'tp_size' must be an integer >= 1, got 0",
            ),
            (
                BENCH_ARGS + ["--page-size", "0"],
                "serving setup: field 'page_size' must be an integer >= 1, got 0",
            ),
            (BENCH_ARGS + ["--tp", "two"], "argument --tp: invalid int value: 'two'"),
            (
                gpu + ["--weights", "75GB"],
                "no room for a KV cache: gpu_memory 80,000,000,000 B x "
                "mem_fraction_static 0.9 = 72,000,000,000 B does not exceed weights "
                "75,000,000,000 B + reserved 0 B",
            ),
            (
                gpu + ["--weights=-1GB"],
                "invalid size '-1GB': expected a number >= 0 with an optional unit B, "
                "KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
                "(powers of 1024)",
            ),
            (
                ["--model", "deepseek-v3"],
                "the following arguments are required: --gpu-memory, --weights",
            ),
        ]
        for argv, message in cases:
            with self.subTest(message=message):
                self.assert_rejected(argv, message)
        status, _, err = run_main(BENCH_ARGS + ["--kv-cache-dtype", "int3"])
        self.assertEqual(status, 2)
        self.assertEqual(len(err.splitlines()), 1)
        self.assertIn("'kv_cache_dtype' = 'int3' is no KV cache dtype", err)

    def test_bad_config_json(self):
        llama = dict(PRESETS["llama-3-8b"])
        cases = [
            (
                dict(llama, num_hidden_layers=0),
                "field 'num_hidden_layers' must be an integer >= 1, got 0",
            ),
            (
                dict(llama, num_attention_heads=0),
                "field 'num_attention_heads' must be an integer >= 1, got 0",
            ),
            (
                dict(llama, architectures="LlamaForCausalLM"),
                "field 'architectures' must be a non-empty list of strings, "
                "got 'LlamaForCausalLM'",
            ),
            (
                dict(llama, architectures=[7]),
                "field 'architectures' must be a non-empty list of strings, got [7]",
            ),
        ]
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "config.json")
            for config, message in cases:
                with self.subTest(message=message):
                    with open(path, "w") as f:
                        json.dump(config, f)
                    argv = ["--model", path, "--gpu-memory", "80GB", "--weights", "9GB"]
                    self.assert_rejected(argv, f"{path}: {message}")

    def test_module_run(self):
        """`make bench` runs the module; a typo exits 2 with one line, no traceback."""
        module = [sys.executable, "-m", "sglang.srt.mem_cache.latent_cache_analyzer"]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        ok = subprocess.run(
            module + BENCH_ARGS, capture_output=True, text=True, timeout=300, env=env
        )
        self.assertEqual(ok.returncode, 0, ok.stderr[-2000:])
        self.assertIn("455,373", ok.stdout)
        bad = subprocess.run(
            module + ["--model", "nope", "--gpu-memory", "80GB", "--weights", "4GB"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        self.assertEqual(bad.returncode, 2)
        self.assertNotIn("Traceback", bad.stderr)
        last = bad.stderr.strip().splitlines()[-1]
        self.assertTrue(last.startswith("latent_cache_analyzer: error: nope: no such"))


if __name__ == "__main__":
    unittest.main()
