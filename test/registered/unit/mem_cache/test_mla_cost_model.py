"""KVCostModel against hand-computed figures and against SGLang's own pools on CPU."""

import json
import os
import tempfile
import unittest
from types import SimpleNamespace

import torch

from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
from sglang.srt.mem_cache.memory_pool import (
    DSATokenToKVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.mla_cost_model import (
    PRESETS,
    AttentionKind,
    Calibration,
    KVCostModel,
    ModelConfigError,
)
from sglang.srt.runtime_context import get_parallel, publish, reset_context
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

# Tiny configs whose FLOPs are worked out by hand below.
TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=4,
    intermediate_size=16,
    torch_dtype="bfloat16",
)
TINY_MLA = dict(
    architectures=["DeepseekV3ForCausalLM"],
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=2,
    v_head_dim=4,
    intermediate_size=32,
    torch_dtype="bfloat16",
)
TINY_DSA = dict(
    TINY_MLA,
    architectures=["DeepseekV32ForCausalLM"],
    num_hidden_layers=1,
    index_head_dim=4,
    index_n_heads=2,
    index_topk=2,
)
MQA = dict(
    architectures=["FalconForCausalLM"],
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=4096,
    torch_dtype="bfloat16",
)


class TestBytesPerToken(CustomTestCase):
    def test_deepseek_v3_latent(self):
        # (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B x 61 layers
        bf16 = KVCostModel.from_preset("deepseek-v3")
        self.assertEqual(bf16.attention, AttentionKind.MLA)
        self.assertEqual(bf16.bytes_per_token, 70_272)
        # fp8: x 1 B
        fp8 = KVCostModel.from_preset("deepseek-v3", kv_cache_dtype="fp8_e4m3")
        self.assertEqual(fp8.bytes_per_token, 35_136)
        self.assertEqual(KVCostModel.from_preset("deepseek-r1").bytes_per_token, 70_272)

    def test_latent_is_replicated_across_tp(self):
        for tp in (1, 2, 8, 16):
            cm = KVCostModel.from_preset("deepseek-v3", tp_size=tp)
            self.assertEqual(cm.bytes_per_token, 70_272, tp)

    def test_mha_equivalent_is_sharded_by_heads(self):
        # 128 heads x (K 192 + V 128) x 2 B x 61 layers, split over the ranks' heads.
        self.assertEqual(
            KVCostModel.from_preset("deepseek-v3").mha_equivalent_bytes_per_token,
            4_997_120,
        )
        tp8 = KVCostModel.from_preset("deepseek-v3", tp_size=8)
        self.assertEqual(tp8.mha_equivalent_bytes_per_token, 624_640)  # 16 heads
        self.assertAlmostEqual(tp8.compression_vs_mha, 624_640 / 70_272)
        # Same dtype on both sides: fp8 does not change the ratio.
        fp8 = KVCostModel.from_preset("deepseek-v3", kv_cache_dtype="fp8_e4m3")
        self.assertEqual(fp8.mha_equivalent_bytes_per_token, 2_498_560)
        self.assertAlmostEqual(fp8.compression_vs_mha, 4_997_120 / 70_272)

    def test_deepseek_v32_dsa_fp8(self):
        # fp8 latent 512 B + 4 scales x 4 B + rope 64 x 2 B = 656 B,
        # indexer key 128 B + one 4 B scale = 132 B; (656 + 132) x 61 layers.
        cm = KVCostModel.from_preset("deepseek-v3.2", kv_cache_dtype="fp8_e4m3")
        self.assertEqual(cm.attention, AttentionKind.DSA)
        self.assertEqual(cm.bytes_per_token, 48_068)
        # bf16 latent (512 + 64) x 2 B + the same fp8 indexer: (1152 + 132) x 61.
        self.assertEqual(KVCostModel.from_preset("deepseek-v3.2").bytes_per_token, 78_324)

    def test_llama_3_70b_gqa_sharded(self):
        # 2 (K, V) x 8 kv heads x 128 x 2 B x 80 layers
        tp1 = KVCostModel.from_preset("llama-3-70b")
        self.assertEqual(tp1.attention, AttentionKind.GQA)
        self.assertEqual(tp1.bytes_per_token, 327_680)
        # TP 8: one kv head per rank.
        self.assertEqual(KVCostModel.from_preset("llama-3-70b", tp_size=8).bytes_per_token, 40_960)
        self.assertEqual(tp1.compression_vs_mha, 1.0)

    def test_gqa_with_fewer_kv_heads_than_ranks_replicates(self):
        # 8 kv heads on 16 ranks: each rank still holds one whole head.
        self.assertEqual(KVCostModel.from_preset("llama-3-70b", tp_size=16).bytes_per_token, 40_960)
        # Llama-3-8B: 2 x 1 x 128 x 2 B x 32 layers
        self.assertEqual(KVCostModel.from_preset("llama-3-8b", tp_size=16).bytes_per_token, 16_384)

    def test_mqa(self):
        cm = KVCostModel.from_config(MQA)
        self.assertEqual(cm.attention, AttentionKind.MQA)
        # 2 x 1 head x 64 x 2 B x 4 layers, the same on every rank.
        self.assertEqual(cm.bytes_per_token, 1_024)
        self.assertEqual(KVCostModel.from_config(MQA, tp_size=4).bytes_per_token, 1_024)

    def test_mha(self):
        cm = KVCostModel.from_config(TINY_LLAMA)
        self.assertEqual(cm.attention, AttentionKind.MHA)
        self.assertEqual(cm.bytes_per_token, 32)  # 2 x 2 heads x 4 x 2 B x 1 layer

    def test_page_rounding(self):
        cm = KVCostModel.from_preset("deepseek-v3", page_size=64)
        page_bytes = 64 * 70_272  # 4,497,408
        self.assertEqual(cm.bytes_for_tokens(0), 0)
        self.assertEqual(cm.bytes_for_tokens(1), page_bytes)
        self.assertEqual(cm.bytes_for_tokens(64), page_bytes)
        self.assertEqual(cm.bytes_for_tokens(65), 2 * page_bytes)
        self.assertEqual(cm.tokens_for_bytes(page_bytes - 1), 0)
        self.assertEqual(cm.tokens_for_bytes(page_bytes), 64)
        self.assertEqual(cm.tokens_for_bytes(3 * page_bytes - 1), 128)
        self.assertEqual(cm.tokens_for_bytes(-5), 0)
        self.assertEqual(cm.with_setup(page_size=1).tokens_for_bytes(page_bytes - 1), 63)


class TestPrefillAndRestore(CustomTestCase):
    def test_prefill_flops_mha_by_hand(self):
        cm = KVCostModel.from_config(TINY_LLAMA)
        # q, o: 2 x 8 x (2 x 4) = 128; k, v: 2 x 8 x (2 x 4) = 128; MLP 3 x 8 x 16 = 384
        self.assertEqual(cm.active_params, 640)
        # QK^T and AV: 2 FLOPs x 2 heads x (4 + 4) per attended token
        self.assertEqual(cm.attention_flops_per_position, 32)
        # positions 0, 1, 2 attend 1, 2, 3 tokens
        self.assertEqual(cm.prefill_flops(0, 3), 2 * 640 * 3 + 32 * (1 + 2 + 3))  # 4032
        self.assertEqual(cm.prefill_flops(2, 4), 2 * 640 * 2 + 32 * (3 + 4))  # 2784
        self.assertEqual(cm.prefill_flops(5, 5), 0)
        self.assertEqual(cm.prefill_flops(5, 2), 0)

    def test_prefill_flops_mla_by_hand(self):
        cm = KVCostModel.from_config(TINY_MLA)
        # per layer: q 16x2x6 = 192, kv_a 16x(8+2) = 160, kv_b 8x2x(4+4) = 128,
        # o 2x4x16 = 128, MLP 3x16x32 = 1536 -> 2144; two layers
        self.assertEqual(cm.active_params, 4_288)
        self.assertEqual(cm.attention_flops_per_position, 2 * 2 * (6 + 4) * 2)  # 80
        self.assertEqual(cm.prefill_flops(0, 4), 2 * 4_288 * 4 + 80 * (1 + 2 + 3 + 4))
        self.assertEqual(cm.bytes_per_token, (8 + 2) * 2 * 2)

    def test_prefill_flops_dsa_window_by_hand(self):
        cm = KVCostModel.from_config(TINY_DSA)
        self.assertEqual(cm.attention_window, 2)
        # absorbed sparse attention: 2 x 2 heads x ((8 + 2) + 8); indexer 2 x 2 x 4
        self.assertEqual(cm.attention_flops_per_position, 72)
        self.assertEqual(cm.indexer_flops_per_position, 16)
        # attention sees min(p + 1, 2) tokens, the indexer all p + 1 of them;
        # active: 608 (as TINY_MLA, one layer) + indexer 16x2x4 + 16x(4+2) + MLP 1536
        self.assertEqual(cm.active_params, 608 + 224 + 1_536)
        expected = 2 * 2_368 * 4 + 72 * (1 + 2 + 2 + 2) + 16 * (1 + 2 + 3 + 4)
        self.assertEqual(cm.prefill_flops(0, 4), expected)

    def test_deepseek_v3_active_params(self):
        # attention per layer: q 7168x1536 + 1536x128x192, kv_a 7168x576,
        # kv_b 512x128x256, o 128x128x7168 = 187,105,280; x 61
        # 3 dense MLPs of 3x7168x18432; 58 MoE layers of 9 experts x 3x7168x2048 + gate
        attention = 61 * 187_105_280
        dense = 3 * 3 * 7168 * 18432
        moe = 58 * (9 * 3 * 7168 * 2048 + 7168 * 256)
        cm = KVCostModel.from_preset("deepseek-v3")
        self.assertEqual(cm.active_params, attention + dense + moe)  # 35,697,917,952
        self.assertEqual(cm.attention_flops_per_position, 4_997_120)

    def test_deeper_tokens_cost_more(self):
        cm = KVCostModel.from_preset("deepseek-v3")
        self.assertGreater(cm.prefill_seconds(10_000, 10_064), cm.prefill_seconds(0, 64))

    def test_restore_is_min_only_when_backed_up(self):
        cm = KVCostModel.from_preset("deepseek-v3")
        recompute = cm.prefill_flops(0, 4) / 400e12
        reload = 4 * 70_272 / 25e9
        self.assertAlmostEqual(cm.prefill_seconds(0, 4), recompute)
        self.assertAlmostEqual(cm.restore_seconds(0, 4), recompute)
        self.assertLess(reload, recompute)
        self.assertAlmostEqual(cm.restore_seconds(0, 4, backed_up=True), reload)
        # A tiny model recomputes faster than it reloads: backed up or not, recompute.
        tiny = KVCostModel.from_config(TINY_LLAMA)
        tiny_recompute = 4_032 / 400e12
        self.assertLess(tiny_recompute, 3 * 32 / 25e9)
        self.assertAlmostEqual(tiny.restore_seconds(0, 3, backed_up=True), tiny_recompute)
        self.assertEqual(cm.restore_seconds(4, 4, backed_up=True), 0)

    def test_calibrated_times(self):
        cal = Calibration("test-gpu", 1e-6, 1e-9, 2e-8)
        cm = KVCostModel.from_config(TINY_MLA, calibration=cal)
        # 2 layers x (1e-6 x 4 tokens + 1e-9 x (1 + 2 + 3 + 4) attended)
        self.assertAlmostEqual(cm.prefill_seconds(0, 4), 2 * (4e-6 + 10e-9))
        self.assertAlmostEqual(cm.reload_seconds_per_token, 2 * 2e-8)


class TestAgainstSGLangPools(CustomTestCase):
    """Per-row bytes of SGLang's real KV pools, built on CPU, per layer."""

    ROWS = 16

    @staticmethod
    def _per_row_per_layer(pool, total_bytes, layers):
        rows = pool.size + pool.page_size  # SGLang pads one page (slot 0 is scratch)
        return int(total_bytes) / rows / layers

    def test_mla_pool_bf16_and_fp8(self):
        for dtype, kv_dtype in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8_e4m3")):
            with self.subTest(kv_dtype=kv_dtype):
                pool = MLATokenToKVPool(
                    size=self.ROWS, page_size=1, dtype=dtype, kv_lora_rank=512,
                    qk_rope_head_dim=64, layer_num=2, device="cpu",
                    enable_memory_saver=False,
                )
                cm = KVCostModel.from_preset("deepseek-v3", kv_cache_dtype=kv_dtype)
                self.assertEqual(
                    self._per_row_per_layer(pool, pool.get_kv_size_bytes(), 2),
                    cm.bytes_per_token_per_layer,
                )

    def test_dsa_pool(self):
        for dtype, kv_dtype in ((torch.float8_e4m3fn, "fp8_e4m3"), (torch.bfloat16, "bf16")):
            with self.subTest(kv_dtype=kv_dtype):
                cm = KVCostModel.from_preset("deepseek-v3.2", kv_cache_dtype=kv_dtype)
                kv_dim = 656 if dtype == torch.float8_e4m3fn else 576
                with get_parallel().override(attn_dcp_size=1, dcp_enabled=False, attn_dcp_rank=0):
                    pool = DSATokenToKVPool(
                        size=128, page_size=64, kv_lora_rank=512, dtype=dtype,
                        qk_rope_head_dim=64, layer_num=2, device="cpu",
                        index_head_dim=128, enable_memory_saver=False,
                        kv_cache_dim=kv_dim,
                    )
                self.assertEqual(
                    self._per_row_per_layer(pool, pool.get_kv_size_bytes(), 2),
                    cm.bytes_per_token_per_layer,
                )

    def test_mha_pool_llama_3_70b(self):
        for tp in (1, 8):
            with self.subTest(tp=tp):
                cm = KVCostModel.from_preset("llama-3-70b", tp_size=tp)
                pool = MHATokenToKVPool(
                    size=self.ROWS, page_size=1, dtype=torch.bfloat16,
                    head_num=max(1, 8 // tp), head_dim=128, layer_num=2,
                    device="cpu", enable_memory_saver=False,
                )
                k_bytes, v_bytes = pool.get_kv_size_bytes()
                self.assertEqual(
                    self._per_row_per_layer(pool, k_bytes + v_bytes, 2),
                    cm.bytes_per_token_per_layer,
                )

    def test_calculate_mla_kv_cache_dim(self):
        bf16 = KVCostModel.from_preset("deepseek-v3")
        v3 = SimpleNamespace(
            hf_config=SimpleNamespace(**PRESETS["deepseek-v3"]),
            kv_lora_rank=512,
            qk_rope_head_dim=64,
        )
        dim = calculate_mla_kv_cache_dim(model_config=v3, kv_cache_dtype=torch.bfloat16)
        self.assertEqual(dim * 2 * 61, bf16.bytes_per_token)

        # The DSA layout depends on the published attention backends.
        reset_context()
        try:
            publish(ServerArgs(model_path="dummy", device="cpu"), role="tokenizer")
            v32 = SimpleNamespace(
                hf_config=SimpleNamespace(**PRESETS["deepseek-v3.2"]),
                kv_lora_rank=512,
                qk_rope_head_dim=64,
            )
            dim = calculate_mla_kv_cache_dim(
                model_config=v32, kv_cache_dtype=torch.float8_e4m3fn
            )
        finally:
            reset_context()
        indexer = 128 + 128 // DSATokenToKVPool.quant_block_size * 4
        fp8 = KVCostModel.from_preset("deepseek-v3.2", kv_cache_dtype="fp8_e4m3")
        self.assertEqual((dim + indexer) * 61, fp8.bytes_per_token)


class TestBadInput(CustomTestCase):
    def test_unknown_preset(self):
        with self.assertRaises(ModelConfigError) as ctx:
            KVCostModel.from_preset("deepseek-v9")
        self.assertIn("deepseek-v9", str(ctx.exception))
        self.assertIn("deepseek-v3", str(ctx.exception))  # lists the known ones

    def test_config_json_missing_field_names_it(self):
        for drop, config in (("kv_lora_rank", PRESETS["deepseek-v3"]),
                             ("num_hidden_layers", PRESETS["llama-3-8b"]),
                             ("architectures", PRESETS["llama-3-8b"])):
            with self.subTest(field=drop), tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "config.json")
                with open(path, "w") as f:
                    json.dump({k: v for k, v in config.items() if k != drop}, f)
                for source in (path, d):
                    with self.assertRaises(ModelConfigError) as ctx:
                        KVCostModel.from_config(source)
                    self.assertIn(repr(drop), str(ctx.exception))
                    self.assertIn(path, str(ctx.exception))

    def test_config_field_of_wrong_type(self):
        with self.assertRaises(ModelConfigError) as ctx:
            KVCostModel.from_config(dict(PRESETS["deepseek-v3"], kv_lora_rank="512"))
        self.assertIn("'kv_lora_rank'", str(ctx.exception))

    def test_missing_or_unreadable_file(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(ModelConfigError):
                KVCostModel.from_config(os.path.join(d, "nope.json"))
            bad = os.path.join(d, "config.json")
            with open(bad, "w") as f:
                f.write("{not json")
            with self.assertRaises(ModelConfigError) as ctx:
                KVCostModel.from_config(bad)
            self.assertIn(bad, str(ctx.exception))

    def test_bad_dtype(self):
        with self.assertRaises(ModelConfigError) as ctx:
            KVCostModel.from_preset("deepseek-v3", kv_cache_dtype="int3")
        self.assertIn("'int3'", str(ctx.exception))

    def test_bad_setup(self):
        for field, kwargs in (("tp_size", dict(tp_size=0)), ("page_size", dict(page_size=-1))):
            with self.subTest(field=field):
                with self.assertRaises(ModelConfigError) as ctx:
                    KVCostModel.from_preset("deepseek-v3", **kwargs)
                self.assertIn(field, str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
