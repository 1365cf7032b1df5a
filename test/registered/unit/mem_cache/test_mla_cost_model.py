"""KVCostModel against figures worked out by hand, and against SGLang's pools on CPU."""

import dataclasses
import json
import math
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
    LATENT_KINDS,
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

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

# Tiny configs whose sizes and FLOPs are worked out by hand in the tests below.
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
# Two layers, the first dense, then MoE with a low-rank query.
TINY_MOE = dict(
    TINY_MLA,
    q_lora_rank=4,
    moe_intermediate_size=8,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
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


class RelativeCase(CustomTestCase):
    def assertRel(self, actual, expected, rel=1e-9):
        """Equal within ``rel`` of ``expected`` (no absolute slack)."""
        self.assertTrue(
            math.isclose(actual, expected, rel_tol=rel, abs_tol=0.0),
            f"{actual!r} != {expected!r} within rel {rel}",
        )


class TestBytesPerToken(RelativeCase):
    def test_deepseek_v3_latent_is_replicated(self):
        # (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B x 61 layers, on every rank
        for tp in (1, 2, 8, 16):
            cm = KVCostModel.from_preset("deepseek-v3", tp_size=tp)
            self.assertEqual(cm.attention, AttentionKind.MLA)
            self.assertEqual(cm.bytes_per_token, 70_272, tp)
        self.assertEqual(KVCostModel.from_preset("deepseek-r1").bytes_per_token, 70_272)
        # fp8: (512 + 64) x 1 B x 61
        fp8 = KVCostModel.from_preset("deepseek-v3", kv_cache_dtype="fp8_e4m3")
        self.assertEqual(fp8.bytes_per_token, 35_136)

    def test_mha_equivalent_is_sharded_by_heads(self):
        # 128 heads x (K 128 + 64 + V 128) x 2 B x 61 layers; TP 8: 16 heads a rank
        self.assertEqual(
            KVCostModel.from_preset("deepseek-v3").mha_equivalent_bytes_per_token,
            4_997_120,
        )
        tp8 = KVCostModel.from_preset("deepseek-v3", tp_size=8)
        self.assertEqual(tp8.mha_equivalent_bytes_per_token, 624_640)
        self.assertRel(tp8.compression_vs_mha, 624_640 / 70_272)
        fp8 = KVCostModel.from_preset("deepseek-v3", kv_cache_dtype="fp8")
        self.assertEqual(fp8.mha_equivalent_bytes_per_token, 2_498_560)
        self.assertRel(fp8.compression_vs_mha, 2_498_560 / 35_136)

    def test_deepseek_v32_dsa(self):
        # fp8 latent 512 B + 512 / 128 scales x 4 B + rope 64 x 2 B = 656 B,
        # indexer key 128 B + one 4 B scale = 132 B; (656 + 132) x 61 layers
        fp8 = KVCostModel.from_preset("deepseek-v3.2", kv_cache_dtype="fp8_e4m3")
        self.assertEqual(fp8.attention, AttentionKind.DSA)
        self.assertEqual(fp8.bytes_per_token, 48_068)
        # bf16 latent (512 + 64) x 2 B + the same fp8 indexer: (1152 + 132) x 61
        bf16 = KVCostModel.from_preset("deepseek-v3.2", tp_size=8)
        self.assertEqual(bf16.bytes_per_token, 78_324)

    def test_llama_3_70b_gqa_sharded_then_replicated(self):
        # 2 (K, V) x 8 kv heads x 128 x 2 B x 80 layers
        tp1 = KVCostModel.from_preset("llama-3-70b")
        self.assertEqual(tp1.attention, AttentionKind.GQA)
        self.assertEqual(tp1.bytes_per_token, 327_680)
        self.assertEqual(tp1.compression_vs_mha, 1.0)
        # TP 2: 4 kv heads a rank; TP 8: one; TP 16: still one whole head a rank
        for tp, expected in ((2, 163_840), (8, 40_960), (16, 40_960)):
            cm = KVCostModel.from_preset("llama-3-70b", tp_size=tp)
            self.assertEqual(cm.bytes_per_token, expected, tp)
        # Llama-3-8B on 16 ranks: 2 x 1 x 128 x 2 B x 32 layers
        llama_8b = KVCostModel.from_preset("llama-3-8b", tp_size=16)
        self.assertEqual(llama_8b.bytes_per_token, 16_384)

    def test_mqa_and_mha(self):
        # One kv head, replicated: 2 x 1 x 64 x 2 B x 4 layers at any TP
        for tp in (1, 4):
            cm = KVCostModel.from_config(MQA, tp_size=tp)
            self.assertEqual(cm.attention, AttentionKind.MQA)
            self.assertEqual(cm.bytes_per_token, 1_024)
        # 2 x 2 heads x 4 x 2 B x 1 layer; fp32 doubles it
        mha = KVCostModel.from_config(TINY_LLAMA)
        self.assertEqual(mha.attention, AttentionKind.MHA)
        self.assertEqual(mha.bytes_per_token, 32)
        self.assertEqual(
            KVCostModel.from_config(TINY_LLAMA, kv_cache_dtype="fp32").bytes_per_token,
            64,
        )

    def test_pages(self):
        cm = KVCostModel.from_preset("deepseek-v3", page_size=64)
        page = 4_497_408  # 64 x 70,272
        self.assertEqual(cm.bytes_for_tokens(0), 0)
        self.assertEqual(cm.bytes_for_tokens(-3), 0)
        self.assertEqual(cm.bytes_for_tokens(1), page)
        self.assertEqual(cm.bytes_for_tokens(64), page)
        self.assertEqual(cm.bytes_for_tokens(65), 2 * page)
        self.assertEqual(cm.tokens_for_bytes(page - 1), 0)
        self.assertEqual(cm.tokens_for_bytes(page), 64)
        self.assertEqual(cm.tokens_for_bytes(3 * page - 1), 128)
        self.assertEqual(cm.tokens_for_bytes(-5), 0)
        self.assertEqual(cm.tokens_for_bytes(float("nan")), 0)
        self.assertEqual(cm.with_setup(page_size=1).tokens_for_bytes(page - 1), 63)


class TestPrefill(RelativeCase):
    def test_mha_by_hand(self):
        cm = KVCostModel.from_config(TINY_LLAMA)
        # q, o: 2 x 8 x (2 x 4) = 128; k, v: 2 x 8 x (2 x 4) = 128; MLP 3 x 8 x 16
        self.assertEqual(cm.active_params, 640)
        # QK^T and AV: 2 FLOPs x 2 heads x (4 + 4) per attended token
        self.assertEqual(cm.attention_flops_per_position, 32)
        # positions 0, 1, 2 attend 1, 2, 3 tokens
        self.assertRel(cm.prefill_flops(0, 3), 4_032)  # 2 x 640 x 3 + 32 x 6
        self.assertRel(cm.prefill_flops(2, 4), 2_784)  # 2 x 640 x 2 + 32 x (3 + 4)
        self.assertEqual(cm.prefill_flops(5, 5), 0)
        self.assertEqual(cm.prefill_flops(5, 2), 0)
        self.assertRel(cm.prefill_seconds(0, 3), 1.008e-11)  # 4,032 / 400e12
        fast = KVCostModel.from_config(TINY_LLAMA, gpu_flops_per_s=2e12)
        self.assertRel(fast.prefill_seconds(0, 3), 2.016e-9)  # 4,032 / 2e12

    def test_mla_by_hand(self):
        cm = KVCostModel.from_config(TINY_MLA)
        # per layer: q 16 x 2 x 6 = 192, kv_a 16 x (8 + 2) = 160,
        # kv_b 8 x 2 x (4 + 4) = 128, o 2 x 4 x 16 = 128, MLP 3 x 16 x 32 = 1,536
        self.assertEqual(cm.active_params, 4_288)  # 2 layers x 2,144
        self.assertEqual(cm.attention_flops_per_position, 80)  # 2 x 2 x 10 x 2
        # 2 x 4,288 x 4 + 80 x (1 + 2 + 3 + 4)
        self.assertRel(cm.prefill_flops(0, 4), 35_104)
        self.assertEqual(cm.bytes_per_token, 40)  # (8 + 2) x 2 B x 2 layers

    def test_seconds_per_byte_by_hand(self):
        cm = KVCostModel.from_config(TINY_MLA)
        # 35,104 FLOPs / 400e12 FLOP/s over 4 tokens x 40 B
        self.assertRel(cm.seconds_per_byte(4), 35_104 / 400e12 / 160)
        # page 4: 3 tokens take a whole page, 160 B; 2 x 4,288 x 3 + 80 x 6 FLOPs
        paged = KVCostModel.from_config(TINY_MLA, page_size=4)
        self.assertRel(paged.seconds_per_byte(3), 26_208 / 400e12 / 160)
        self.assertEqual((cm.seconds_per_byte(0), cm.seconds_per_byte(-2)), (0.0, 0.0))

    def test_moe_with_low_rank_query_by_hand(self):
        cm = KVCostModel.from_config(TINY_MOE)
        # attention per layer: q 16 x 4 + 4 x 2 x 6 = 112, kv_a 160, kv_b 128, o 128
        # layer 0 dense MLP 3 x 16 x 32 = 1,536; layer 1 (1 shared + 2 routed)
        # x 3 x 16 x 8 + gate 16 x 4 = 1,216
        self.assertEqual(cm.active_params, 2 * 528 + 1_536 + 1_216)  # 3,808
        self.assertRel(cm.prefill_flops(0, 1), 2 * 3_808 + 80)

    def test_dsa_window_by_hand(self):
        cm = KVCostModel.from_config(TINY_DSA)
        self.assertEqual(cm.attention_window, 2)
        # absorbed sparse attention 2 x 2 heads x ((8 + 2) + 8); indexer 2 x 2 x 4
        self.assertEqual(cm.attention_flops_per_position, 72)
        self.assertEqual(cm.indexer_flops_per_position, 16)
        # 608 (TINY_MLA's attention, one layer) + indexer q 16 x 2 x 4, k 16 x 4,
        # weights 16 x 2 + MLP 1,536
        self.assertEqual(cm.active_params, 2_368)
        # attention sees min(p + 1, 2) tokens, the indexer all p + 1
        # 2 x 2,368 x 4 + 72 x (1 + 2 + 2 + 2) + 16 x (1 + 2 + 3 + 4)
        self.assertRel(cm.prefill_flops(0, 4), 19_608)
        # positions 3, 4: 2 x 2,368 x 2 + 72 x (2 + 2) + 16 x (4 + 5)
        self.assertRel(cm.prefill_flops(3, 5), 9_904)

    def test_deepseek_v3_active_params(self):
        # attention a layer: q 7168 x 1536 + 1536 x 128 x 192, kv_a 7168 x 576,
        # kv_b 512 x 128 x 256, o 128 x 128 x 7168 = 187,105,280; x 61
        # 3 dense MLPs of 3 x 7168 x 18432; 58 MoE layers of 9 experts
        # x 3 x 7168 x 2048 + gate 7168 x 256
        cm = KVCostModel.from_preset("deepseek-v3")
        self.assertEqual(cm.active_params, 35_697_917_952)
        self.assertEqual(cm.attention_flops_per_position, 4_997_120)
        # 2 x 35,697,917,952 x 2 + 4,997,120 x (1 + 2)
        self.assertRel(cm.prefill_flops(0, 2), 142_806_663_168)

    def test_calibrated_seconds(self):
        cal = Calibration("test-gpu", 1e-6, 1e-9, 2e-8)
        # 2 layers x (1e-6 x 4 tokens + 1e-9 x (1 + 2 + 3 + 4) attended)
        mla = KVCostModel.from_config(TINY_MLA, calibration=cal)
        self.assertRel(mla.prefill_seconds(0, 4), 8.02e-6)
        # DSA: 1 layer x (1e-6 x 4 + 1e-9 x (1 + 2 + 2 + 2)), window 2
        dsa = KVCostModel.from_config(TINY_DSA, calibration=cal)
        self.assertRel(dsa.prefill_seconds(0, 4), 4.007e-6)
        self.assertEqual(dsa.prefill_seconds(4, 4), 0)
        uncal = KVCostModel.from_config(TINY_MLA).with_setup(calibration=cal)
        self.assertRel(uncal.prefill_seconds(0, 4), 8.02e-6)

    def test_deeper_tokens_cost_more(self):
        cm = KVCostModel.from_preset("deepseek-v3")
        self.assertGreater(
            cm.prefill_seconds(10_000, 10_064), cm.prefill_seconds(0, 64)
        )

    def test_negative_position_raises(self):
        cm = KVCostModel.from_config(TINY_LLAMA)
        with self.assertRaisesRegex(
            ValueError, r"positions must be >= 0, got \[-1, 2\)"
        ):
            cm.prefill_flops(-1, 2)


class TestAgainstSGLangPools(CustomTestCase):
    """Bytes per row and layer of SGLang's own KV pools, built on CPU."""

    ROWS = 16

    @staticmethod
    def _per_row_per_layer(pool, total_bytes, layers):
        rows = pool.size + pool.page_size  # SGLang pads one page (slot 0 is scratch)
        return int(total_bytes) / rows / layers

    def test_mla_pool_bf16_and_fp8(self):
        for dtype, kv_dtype in (
            (torch.bfloat16, "bf16"),
            (torch.float8_e4m3fn, "fp8_e4m3"),
        ):
            with self.subTest(kv_dtype=kv_dtype):
                pool = MLATokenToKVPool(
                    size=self.ROWS,
                    page_size=1,
                    dtype=dtype,
                    kv_lora_rank=512,
                    qk_rope_head_dim=64,
                    layer_num=2,
                    device="cpu",
                    enable_memory_saver=False,
                )
                cm = KVCostModel.from_preset("deepseek-v3", kv_cache_dtype=kv_dtype)
                self.assertEqual(
                    self._per_row_per_layer(pool, pool.get_kv_size_bytes(), 2),
                    cm.bytes_per_token_per_layer,
                )

    def test_dsa_pool(self):
        for dtype, kv_dtype, kv_dim in (
            (torch.float8_e4m3fn, "fp8_e4m3", 656),
            (torch.bfloat16, "bf16", 576),
        ):
            with self.subTest(kv_dtype=kv_dtype):
                cm = KVCostModel.from_preset("deepseek-v3.2", kv_cache_dtype=kv_dtype)
                with get_parallel().override(
                    attn_dcp_size=1, dcp_enabled=False, attn_dcp_rank=0
                ):
                    pool = DSATokenToKVPool(
                        size=128,
                        page_size=64,
                        kv_lora_rank=512,
                        dtype=dtype,
                        qk_rope_head_dim=64,
                        layer_num=2,
                        device="cpu",
                        index_head_dim=128,
                        enable_memory_saver=False,
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
                    size=self.ROWS,
                    page_size=1,
                    dtype=torch.bfloat16,
                    head_num=8 // tp,
                    head_dim=128,
                    layer_num=2,
                    device="cpu",
                    enable_memory_saver=False,
                )
                k_bytes, v_bytes = pool.get_kv_size_bytes()
                self.assertEqual(
                    self._per_row_per_layer(pool, k_bytes + v_bytes, 2),
                    cm.bytes_per_token_per_layer,
                )

    def test_calculate_mla_kv_cache_dim(self):
        def model_config(preset):
            hf_config = SimpleNamespace(**PRESETS[preset])
            return SimpleNamespace(
                hf_config=hf_config, kv_lora_rank=512, qk_rope_head_dim=64
            )

        dim = calculate_mla_kv_cache_dim(
            model_config=model_config("deepseek-v3"), kv_cache_dtype=torch.bfloat16
        )
        self.assertEqual(
            dim * 2 * 61, KVCostModel.from_preset("deepseek-v3").bytes_per_token
        )
        # The DSA layout depends on the published attention backends.
        reset_context()
        try:
            publish(ServerArgs(model_path="dummy", device="cpu"), role="tokenizer")
            dim = calculate_mla_kv_cache_dim(
                model_config=model_config("deepseek-v3.2"),
                kv_cache_dtype=torch.float8_e4m3fn,
            )
        finally:
            reset_context()
        indexer = 128 + 128 // DSATokenToKVPool.quant_block_size * 4
        fp8 = KVCostModel.from_preset("deepseek-v3.2", kv_cache_dtype="fp8_e4m3")
        self.assertEqual((dim + indexer) * 61, fp8.bytes_per_token)


V3 = PRESETS["deepseek-v3"]
LLAMA = PRESETS["llama-3-8b"]
# (model config, from_config kwargs, the whole message)
BAD_MODELS = [
    (
        dict(V3, num_hidden_layers=0),
        {},
        "model config: field 'num_hidden_layers' must be an integer >= 1, got 0",
    ),
    (
        dict(LLAMA, num_attention_heads=0),
        {},
        "model config: field 'num_attention_heads' must be an integer >= 1, got 0",
    ),
    (
        dict(LLAMA, num_key_value_heads=0),
        {},
        "model config: field 'num_key_value_heads' must be an integer >= 1, got 0",
    ),
    (
        dict(LLAMA, head_dim=-4),
        {},
        "model config: field 'head_dim' must be an integer >= 1, got -4",
    ),
    (
        dict(LLAMA, hidden_size=True),
        {},
        "model config: field 'hidden_size' must be an integer >= 1, got True",
    ),
    (
        dict(LLAMA, intermediate_size=0),
        {},
        "model config: field 'intermediate_size' must be an integer >= 1, got 0",
    ),
    (
        dict(V3, kv_lora_rank="512"),
        {},
        "model config: field 'kv_lora_rank' must be an integer >= 1, got '512'",
    ),
    (
        dict(V3, qk_rope_head_dim=0),
        {},
        "model config: field 'qk_rope_head_dim' must be an integer >= 1, got 0",
    ),
    (
        dict(V3, num_experts_per_tok=0.5),
        {},
        "model config: field 'num_experts_per_tok' must be an integer >= 1, got 0.5",
    ),
    (
        dict(V3, first_k_dense_replace=62),
        {},
        "model config: field 'first_k_dense_replace' must be <= num_hidden_layers "
        "(61), got 62",
    ),
    (
        dict(PRESETS["deepseek-v3.2"], index_topk=0),
        {},
        "model config: field 'index_topk' must be an integer >= 1, got 0",
    ),
    (
        {k: v for k, v in V3.items() if k != "kv_lora_rank"},
        {},
        "model config: missing field 'kv_lora_rank'",
    ),
    (
        {k: v for k, v in LLAMA.items() if k != "architectures"},
        {},
        "model config: missing field 'architectures'",
    ),
    (
        dict(LLAMA, architectures="LlamaForCausalLM"),
        {},
        "model config: field 'architectures' must be a non-empty list of strings, "
        "got 'LlamaForCausalLM'",
    ),
    (
        dict(LLAMA, architectures=[1, 2]),
        {},
        "model config: field 'architectures' must be a non-empty list of strings, "
        "got [1, 2]",
    ),
    (
        dict(LLAMA, architectures={"LlamaForCausalLM": 1}),
        {},
        "model config: field 'architectures' must be a non-empty list of strings, "
        "got {'LlamaForCausalLM': 1}",
    ),
    (
        dict(LLAMA, architectures=[]),
        {},
        "model config: field 'architectures' must be a non-empty list of strings, "
        "got []",
    ),
    (
        dict(LLAMA, architectures=["BertModel"]),
        {},
        "model config: field 'architectures' = ['BertModel'] names no causal LM",
    ),
    (
        dict(V3, torch_dtype="float64"),
        {},
        "model config: field 'torch_dtype' = 'float64' is no KV cache dtype; use one "
        "of bf16, bfloat16, float16, float32, float8_e4m3fn, float8_e5m2, fp16, "
        "fp32, fp8, fp8_e4m3, fp8_e5m2, half",
    ),
    (
        V3,
        dict(kv_cache_dtype="int3"),
        "serving setup: field 'kv_cache_dtype' = 'int3' is no KV cache dtype; use "
        "one of bf16, bfloat16, float16, float32, float8_e4m3fn, float8_e5m2, fp16, "
        "fp32, fp8, fp8_e4m3, fp8_e5m2, half",
    ),
    (
        V3,
        dict(tp_size=0),
        "serving setup: field 'tp_size' must be an integer >= 1, got 0",
    ),
    (
        V3,
        dict(tp_size=True),
        "serving setup: field 'tp_size' must be an integer >= 1, got True",
    ),
    (
        V3,
        dict(page_size=-1),
        "serving setup: field 'page_size' must be an integer >= 1, got -1",
    ),
    (
        V3,
        dict(page_size=2.0),
        "serving setup: field 'page_size' must be an integer >= 1, got 2.0",
    ),
    (
        V3,
        dict(gpu_flops_per_s=float("nan")),
        "serving setup: field 'gpu_flops_per_s' must be a finite number > 0, got nan",
    ),
    (
        V3,
        dict(gpu_flops_per_s=float("inf")),
        "serving setup: field 'gpu_flops_per_s' must be a finite number > 0, got inf",
    ),
    (
        V3,
        dict(gpu_flops_per_s=0),
        "serving setup: field 'gpu_flops_per_s' must be a finite number > 0, got 0",
    ),
    (
        V3,
        dict(gpu_flops_per_s=-1e12),
        "serving setup: field 'gpu_flops_per_s' must be a finite number > 0, "
        "got -1000000000000.0",
    ),
    (
        V3,
        dict(gpu_flops_per_s=True),
        "serving setup: field 'gpu_flops_per_s' must be a finite number > 0, got True",
    ),
    (
        "llama-9000",
        {},
        "llama-9000: no such config.json, and 'llama-9000' is not a preset "
        "(deepseek-r1, deepseek-v3, deepseek-v3.2, llama-3-70b, llama-3-8b, "
        "mistral-7b, qwen2.5-7b)",
    ),
    (42, {}, "model config must be a path or a dict, got 42"),
]


class TestBadInput(CustomTestCase):
    def test_messages(self):
        for config, kwargs, message in BAD_MODELS:
            with self.subTest(message=message):
                with self.assertRaises(ModelConfigError) as ctx:
                    KVCostModel.from_config(config, **kwargs)
                self.assertEqual(str(ctx.exception), message)
                self.assertIsInstance(ctx.exception, ValueError)

    def test_unknown_preset(self):
        with self.assertRaises(ModelConfigError) as ctx:
            KVCostModel.from_preset("deepseek-v9")
        self.assertEqual(
            str(ctx.exception),
            "unknown model preset 'deepseek-v9'; known: deepseek-r1, deepseek-v3, "
            "deepseek-v3.2, llama-3-70b, llama-3-8b, mistral-7b, qwen2.5-7b",
        )

    def test_with_setup(self):
        cm = KVCostModel.from_preset("deepseek-v3")
        with self.assertRaises(ModelConfigError) as ctx:
            cm.with_setup(page_size=0)
        self.assertEqual(
            str(ctx.exception),
            "serving setup: field 'page_size' must be an integer >= 1, got 0",
        )
        with self.assertRaises(ModelConfigError) as ctx:
            cm.with_setup(tp_size=8)
        self.assertEqual(
            str(ctx.exception), "serving setup: with_setup cannot change ['tp_size']"
        )

    def test_config_files(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "config.json")
            with open(path, "w") as f:
                json.dump(dict(V3, num_hidden_layers=0), f)
            for source in (path, d):
                with self.assertRaises(ModelConfigError) as ctx:
                    KVCostModel.from_config(source)
                self.assertEqual(
                    str(ctx.exception),
                    f"{path}: field 'num_hidden_layers' must be an integer >= 1, got 0",
                )
            listed = os.path.join(d, "list.json")
            with open(listed, "w") as f:
                f.write("[1, 2]")
            with self.assertRaises(ModelConfigError) as ctx:
                KVCostModel.from_config(listed)
            self.assertEqual(
                str(ctx.exception), f"{listed}: top level must be a JSON object"
            )
            broken = os.path.join(d, "broken.json")
            with open(broken, "w") as f:
                f.write("{not json")
            with self.assertRaises(ModelConfigError) as ctx:
                KVCostModel.from_config(broken)
            self.assertTrue(
                str(ctx.exception).startswith(f"{broken}: not a readable JSON config: ")
            )


class TestCalibration(RelativeCase):
    FIT = dict(
        prefill_s_per_token=1e-6,
        prefill_s_per_token_per_position=1e-9,
        h2d_s_per_token_per_layer=2e-8,
    )

    def write(self, d, **fit):
        path = os.path.join(d, "calibration.json")
        with open(path, "w") as f:
            f.write(json.dumps(dict(gpu_name="H200", fit=dict(self.FIT, **fit))))
        return path

    def test_load(self):
        with tempfile.TemporaryDirectory() as d:
            cal = Calibration.load(self.write(d, prefill_s_per_token_per_position=0))
        self.assertEqual(cal, Calibration("H200", 1e-6, 0.0, 2e-8))

    def test_bad_values_name_file_and_field(self):
        cases = [
            ("prefill_s_per_token", float("nan"), "> 0", "nan"),
            ("prefill_s_per_token", 0, "> 0", "0"),
            ("prefill_s_per_token_per_position", -1e-9, ">= 0", "-1e-09"),
            ("prefill_s_per_token_per_position", float("inf"), ">= 0", "inf"),
            ("h2d_s_per_token_per_layer", 0.0, "> 0", "0.0"),
            ("h2d_s_per_token_per_layer", "2e-8", "> 0", "'2e-8'"),
        ]
        with tempfile.TemporaryDirectory() as d:
            for field, value, bound, shown in cases:
                with self.subTest(field=field, value=value):
                    path = self.write(d, **{field: value})
                    with self.assertRaises(ModelConfigError) as ctx:
                        Calibration.load(path)
                    self.assertEqual(
                        str(ctx.exception),
                        f"{path}: calibration: field {field!r} must be a finite "
                        f"number {bound}, got {shown}",
                    )
            fit = {k: v for k, v in self.FIT.items() if k != "prefill_s_per_token"}
            path = os.path.join(d, "missing.json")
            with open(path, "w") as f:
                json.dump(dict(gpu_name="H200", fit=fit), f)
            with self.assertRaises(ModelConfigError) as ctx:
                Calibration.load(path)
            self.assertEqual(
                str(ctx.exception),
                f"{path}: missing calibration field 'prefill_s_per_token'",
            )

    def test_direct_construction(self):
        with self.assertRaises(ModelConfigError) as ctx:
            Calibration("H200", 1e-6, 1e-9, float("nan"))
        self.assertEqual(
            str(ctx.exception),
            "calibration: field 'h2d_s_per_token_per_layer' must be a finite "
            "number > 0, got nan",
        )


class TestConfigReadingByHand(RelativeCase):
    """What each config field, default and preset contributes, worked out by hand
    (added for the mutants the tests above let survive: docs/reliability.md)."""

    def test_dense_multi_layer_by_hand(self):
        cm = KVCostModel.from_preset("llama-3-8b")
        # QK^T and AV: 2 FLOPs x 32 heads x (128 + 128) x 32 layers
        self.assertEqual(cm.attention_flops_per_position, 524_288)
        # 32 x (q, o: 2 x 4096 x 32 x 128 + k, v: 2 x 4096 x 8 x 128
        #       + MLP 3 x 4096 x 14336) = 32 x 218,103,808
        self.assertEqual(cm.active_params, 6_979_321_856)
        # 2 x 8 kv heads x 128 x 2 B x 32 layers; Qwen2.5-7B 4 heads x 28 layers,
        # Mistral-7B as Llama-3-8B
        self.assertEqual(cm.bytes_per_token, 131_072)
        qwen, mistral = (
            KVCostModel.from_preset(p) for p in ("qwen2.5-7b", "mistral-7b")
        )
        self.assertEqual(
            (qwen.bytes_per_token, mistral.bytes_per_token), (57_344, 131_072)
        )

    def test_other_dense_presets_by_hand(self):
        # per layer: q, o 2 x hidden x heads x 128 + k, v 2 x hidden x kv x 128
        # + MLP 3 x hidden x intermediate; attention 2 x heads x 256 per layer
        for preset, params, attn_flops in (
            # 80 x (2 x 8192 x 72 x 128 + 3 x 8192 x 28672)
            ("llama-3-70b", 68_451_041_280, 2_621_440),
            # 28 x (2 x 3584 x 32 x 128 + 3 x 3584 x 18944)
            ("qwen2.5-7b", 6_525_288_448, 401_408),
            # as Llama-3-8B: 32 x (2 x 4096 x 40 x 128 + 3 x 4096 x 14336)
            ("mistral-7b", 6_979_321_856, 524_288),
        ):
            with self.subTest(preset=preset):
                cm = KVCostModel.from_preset(preset)
                self.assertEqual(cm.active_params, params)
                self.assertEqual(cm.attention_flops_per_position, attn_flops)

    def test_direct_construction_names_the_field(self):
        with self.assertRaises(ModelConfigError) as ctx:
            KVCostModel("m", AttentionKind.MHA, 2, 10, 50, 4, tp_size=0)
        self.assertEqual(
            str(ctx.exception),
            "serving setup: field 'tp_size' must be an integer >= 1, got 0",
        )

    def test_unreadable_calibration_file(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "calibration.json")
            with open(path, "w") as f:
                f.write("{not json")
            with self.assertRaises(ModelConfigError) as ctx:
                Calibration.load(path)
        self.assertTrue(
            str(ctx.exception).startswith(f"{path}: bad calibration JSON: Expecting"),
            str(ctx.exception),
        )

    def test_head_dim_defaults_to_hidden_over_heads(self):
        config = {k: v for k, v in TINY_LLAMA.items() if k != "head_dim"}
        cm = KVCostModel.from_config(
            dict(config, hidden_size=12, num_attention_heads=4)
        )
        # head_dim 12 // 4 = 3; 2 x 2 kv heads (of 4: GQA) x 3 x 2 B x 1 layer
        self.assertEqual((cm.attention, cm.bytes_per_token), (AttentionKind.GQA, 24))

    def test_multi_layer_dsa_by_hand(self):
        cm = KVCostModel.from_config(dict(TINY_DSA, num_hidden_layers=2))
        self.assertEqual(cm.attention_flops_per_position, 144)  # 2 x 2 x (16 + 2) x 2
        self.assertEqual(cm.indexer_flops_per_position, 32)  # 2 x 2 heads x 4 x 2
        v32 = KVCostModel.from_preset("deepseek-v3.2")
        self.assertEqual(v32.indexer_flops_per_position, 999_424)  # 2 x 64 x 128 x 61
        self.assertEqual(v32.attention_window, 2048)

    def test_fp8_dsa_scales_count_whole_blocks(self):
        # latent 8 B + no scale (8 < 128) + rope 2 x 2 B; indexer 4 B + no scale
        cm = KVCostModel.from_config(TINY_DSA, kv_cache_dtype="fp8")
        self.assertEqual(cm.bytes_per_token_per_layer, 16)
        v32 = KVCostModel.from_preset("deepseek-v3.2", kv_cache_dtype="fp8")
        for model in (cm, v32):
            self.assertIs(type(model.bytes_per_token_per_layer), int)

    def test_names(self):
        cases = [
            (
                dict(TINY_LLAMA, _name_or_path="org/tiny", model_type="llama"),
                "org/tiny",
            ),
            (dict(TINY_LLAMA, model_type="llama"), "llama"),
            (TINY_LLAMA, "model"),
        ]
        for config, name in cases:
            self.assertEqual(KVCostModel.from_config(config).name, name)
        named = KVCostModel.from_config(dict(TINY_LLAMA, model_type="x"), name="mine")
        self.assertEqual(named.name, "mine")
        self.assertEqual(KVCostModel.from_config("DeepSeek-V3").name, "deepseek-v3")
        self.assertEqual(KVCostModel.from_config("DeepSeek-V3").bytes_per_token, 70_272)

    def test_dtype_field_and_default(self):
        config = {k: v for k, v in TINY_LLAMA.items() if k != "torch_dtype"}
        # 2 x 2 heads x 4 x b x 1 layer: fp32 (the newer "dtype" key) 4 B, default 2 B
        self.assertEqual(
            KVCostModel.from_config(dict(config, dtype="float32")).bytes_per_token, 64
        )
        self.assertEqual(KVCostModel.from_config(config).bytes_per_token, 32)

    def test_kind_from_fields_or_architecture(self):
        custom = dict(TINY_MLA, architectures=["CustomForCausalLM"])
        self.assertEqual(KVCostModel.from_config(custom).attention, AttentionKind.MLA)
        indexed = dict(TINY_MLA, index_head_dim=4, index_n_heads=2, index_topk=2)
        self.assertEqual(KVCostModel.from_config(indexed).attention, AttentionKind.DSA)
        no_latent = {k: v for k, v in TINY_MLA.items() if k != "kv_lora_rank"}
        for arch, field in (
            ("DeepseekV2ForCausalLM", "kv_lora_rank"),
            ("DeepseekV3ForCausalLM", "kv_lora_rank"),
            ("KimiK2ForCausalLM", "kv_lora_rank"),
            ("DeepseekV32ForCausalLM", "index_head_dim"),
            ("GlmMoeDsaForCausalLM", "index_head_dim"),
        ):
            with self.subTest(arch=arch), self.assertRaises(ModelConfigError) as ctx:
                config = no_latent if field == "kv_lora_rank" else TINY_MLA
                KVCostModel.from_config(dict(config, architectures=[arch]))
            self.assertEqual(
                str(ctx.exception), f"model config: missing field {field!r}"
            )
        self.assertEqual(
            [k.value for k in AttentionKind], ["mha", "gqa", "mqa", "mla", "dsa"]
        )
        self.assertEqual(LATENT_KINDS, {AttentionKind.MLA, AttentionKind.DSA})

    def test_moe_keys_and_defaults(self):
        # num_local_experts (Mixtral's key), no shared experts, no dense layers:
        # attention 2 x 8 x (2 + 2) x 4 = 256; MLP (0 + 2) x 3 x 8 x 8 + gate 8 x 4
        moe = dict(TINY_LLAMA, num_local_experts=4, num_experts_per_tok=2)
        moe["moe_intermediate_size"] = 8
        self.assertEqual(KVCostModel.from_config(moe).active_params, 256 + 416)
        explicit = dict(moe, n_shared_experts=0, first_k_dense_replace=0)
        self.assertEqual(KVCostModel.from_config(explicit).active_params, 672)
        # first_k_dense_replace = num_hidden_layers: every layer dense,
        # 2 x (attention 528 + MLP 1,536)
        dense = dict(TINY_MOE, first_k_dense_replace=2)
        self.assertEqual(KVCostModel.from_config(dense).active_params, 4_128)

    def test_calibrated_seconds_past_the_start(self):
        cal = Calibration("test-gpu", 1e-6, 1e-9, 2e-8)
        mla = KVCostModel.from_config(TINY_MLA, calibration=cal)
        # 2 layers x (1e-6 x 2 tokens + 1e-9 x (3 + 4) attended)
        self.assertRel(mla.prefill_seconds(2, 4), 4.014e-6)

    def test_tokens_for_bytes_is_exact_past_float_precision(self):
        cm = KVCostModel.from_preset("deepseek-v3")
        self.assertEqual(cm.tokens_for_bytes(70_272 * 2**53 - 1), 2**53 - 1)
        self.assertEqual(cm.tokens_for_bytes(70_272), 1)

    def test_negative_position_message(self):
        with self.assertRaises(ValueError) as ctx:
            KVCostModel.from_config(TINY_LLAMA).prefill_seconds(-1, 2)
        self.assertEqual(str(ctx.exception), "positions must be >= 0, got [-1, 2)")

    def test_defaults_and_frozen(self):
        cm = KVCostModel("m", AttentionKind.MHA, 2, 10, 50, 4)
        # tp 1, page 1, 400 TFLOP/s, no window, indexer or MHA equivalent
        self.assertEqual((cm.tp_size, cm.page_size, cm.attention_window), (1, 1, None))
        self.assertEqual(cm.bytes_for_tokens(3), 60)
        # (2 x 50 x 2 + 4 x (1 + 2)) / 400e12
        self.assertRel(cm.prefill_seconds(0, 2), 212 / 400e12)
        self.assertEqual((cm.compression_vs_mha, cm.indexer_flops_per_position), (0, 0))
        faster = cm.with_setup(gpu_flops_per_s=800e12)
        self.assertRel(faster.prefill_seconds(0, 2), 212 / 800e12)
        for frozen in (cm, Calibration("g", 1.0, 0.0, 1.0)):
            with self.assertRaises(dataclasses.FrozenInstanceError):
                frozen.name = "x"

    def test_booleans_are_not_numbers(self):
        for args in ((True, 1e-9, 2e-8), (1e-6, True, 2e-8), (1e-6, 1e-9, True)):
            with self.subTest(args=args), self.assertRaises(ModelConfigError):
                Calibration("g", *args)
        with self.assertRaises(ModelConfigError):
            KVCostModel.from_config(dict(TINY_LLAMA, num_hidden_layers=True))


if __name__ == "__main__":
    unittest.main()
