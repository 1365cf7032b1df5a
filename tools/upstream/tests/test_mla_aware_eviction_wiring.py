"""Wiring of the mla_aware eviction policy into SGLang, on CPU.

The registry and the CLI choice, --mla-aware-eviction and its resolution (the
conflict with another explicit policy, a bad policy config rejected before anything
loads), the Rust TreeCore fallback, and the served model's cost model reaching the
strategy through the KV cache builder. The policy and the cost model have their own
tests.
"""

import json
import unittest
from array import array
from types import SimpleNamespace

import torch

from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.kv_cache_builder import add_mla_aware_cost_model
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.mla_aware_policy import (
    MLAAwareStrategy,
    PolicyConfigError,
    create_mla_aware_strategy,
)
from sglang.srt.mem_cache.mla_cost_model import PRESETS, KVCostModel
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
    _rust_fallback_reason,
    resolve_tree_core_backend,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES, get_eviction_strategy
from sglang.srt.server_args import prepare_server_args
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

SIZE = 256


def _resolved_policy(*argv):
    server_args = prepare_server_args(
        ["--model-path", "dummy", "--device", "cpu", *argv]
    )
    server_args.resolve_once()
    return resolution_result(server_args, "radix_eviction_policy")


def _model_config(name="deepseek-v3"):
    return SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: PRESETS[name]))


def _params(policy="mla_aware", config=None, page_size=1, disable=False):
    kv_pool = MLATokenToKVPool(
        size=SIZE,
        page_size=page_size,
        dtype=torch.bfloat16,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    return CacheInitParams(
        disable=disable,
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=SIZE, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=TokenToKVPoolAllocator(
            SIZE, torch.bfloat16, "cpu", kv_pool, need_sort=False
        ),
        page_size=page_size,
        eviction_policy=policy,
        eviction_policy_config=config,
    )


class TestRegistry(CustomTestCase):
    def test_policy_is_registered_and_offered(self):
        self.assertIn("mla_aware", RADIX_EVICTION_POLICY_CHOICES)
        self.assertIs(
            _EVICTION_POLICY_FACTORIES["mla_aware"], create_mla_aware_strategy
        )
        cost_model = KVCostModel.from_preset("deepseek-v3")
        strategy = get_eviction_strategy("mla_aware", {"cost_model": cost_model})
        self.assertIsInstance(strategy, MLAAwareStrategy)
        self.assertIs(strategy.cost_model, cost_model)

    def test_strategy_needs_the_builder_s_cost_model(self):
        with self.assertRaises(TypeError):
            get_eviction_strategy("mla_aware")

    def test_rust_tree_core_falls_back_to_python(self):
        params = _params()
        reason = _rust_fallback_reason(params)
        self.assertIn("mla_aware", reason)
        self.assertEqual(resolve_tree_core_backend("rust", params), "python")


class TestServerArgs(CustomTestCase):
    def test_flag_selects_the_policy(self):
        self.assertEqual(_resolved_policy("--mla-aware-eviction"), "mla_aware")

    def test_without_the_flag_nothing_changes(self):
        self.assertEqual(_resolved_policy(), "lru")

    def test_policy_can_be_named_directly(self):
        for argv in (
            ["--radix-eviction-policy", "mla_aware"],
            ["--radix-eviction-policy", "mla_aware", "--mla-aware-eviction"],
        ):
            self.assertEqual(_resolved_policy(*argv), "mla_aware")

    def test_flag_conflicts_with_another_explicit_policy(self):
        for policy in ("lfu", "lru"):
            with self.assertRaisesRegex(
                ValueError,
                f"--mla-aware-eviction conflicts with --radix-eviction-policy {policy}",
            ):
                _resolved_policy(
                    "--mla-aware-eviction", "--radix-eviction-policy", policy
                )

    def test_bad_policy_config_fails_at_resolution(self):
        for config, key in (
            ({"learn_rate": 1}, "learn_rate"),
            ({"learn_factor": 1}, "learn_factor"),
        ):
            for argv in (
                ["--mla-aware-eviction"],
                ["--radix-eviction-policy", "mla_aware"],
            ):
                with self.assertRaisesRegex(PolicyConfigError, repr(key)):
                    _resolved_policy(
                        *argv, "--radix-eviction-policy-config", json.dumps(config)
                    )

    def test_good_policy_config_is_accepted(self):
        config = json.dumps({"learn_factor": False, "learn_weight": True})
        policy = _resolved_policy(
            "--mla-aware-eviction", "--radix-eviction-policy-config", config
        )
        self.assertEqual(policy, "mla_aware")


class TestKVCacheBuilder(CustomTestCase):
    def test_cost_model_reaches_the_strategy_of_both_trees(self):
        for unified in (False, True):
            params = _params(config={"learn_weight": False})
            add_mla_aware_cost_model(
                params, _model_config(), kv_cache_dtype="fp8_e4m3", tp_size=8
            )
            expected = KVCostModel.from_config(
                PRESETS["deepseek-v3"], kv_cache_dtype="fp8_e4m3", tp_size=8
            )
            config = params.eviction_policy_config
            self.assertEqual(config["cost_model"], expected)
            self.assertEqual(config["key_unit_tokens"], 1)
            self.assertIs(config["learn_weight"], False)
            if unified:
                params.tree_components = (ComponentType.FULL,)
                cache = UnifiedRadixCache(params)
                self.assertEqual(cache._tree_core_backend, "python")
                strategy = cache.tree_core.eviction_strategy
            else:
                cache = RadixCache(params)
                strategy = cache.eviction_strategy
            self.assertIsInstance(strategy, MLAAwareStrategy)
            self.assertEqual(strategy.cost_model, expected)
            self.assertEqual(strategy.cost_model.bytes_per_token, 35136)
            self.assertFalse(strategy.learn_weight)
            self.assertTrue(strategy.learn_factor)
            self.evict_everything(cache, params.token_to_kv_pool_allocator)

    def evict_everything(self, cache, allocator):
        for first in (1, 2, 3):
            tokens = [first] * 4 + [first + 10] * (4 * first)
            value = allocator.alloc(len(tokens))
            cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value))
        cache.evict(EvictParams(num_tokens=SIZE))
        self.assertEqual(cache.evictable_size(), 0)
        self.assertEqual(allocator.available_size(), SIZE)

    def test_page_size_and_unpriced_kv_dtype(self):
        params = _params(page_size=16)
        add_mla_aware_cost_model(
            params, _model_config(), kv_cache_dtype="fp4_e2m1", tp_size=1
        )
        cost_model = params.eviction_policy_config["cost_model"]
        self.assertEqual(cost_model.page_size, 16)
        self.assertEqual(cost_model.bytes_per_token, 70272)  # the model's bf16

    def test_other_policies_and_disabled_caches_are_left_alone(self):
        def unread():
            raise AssertionError("the model config was read")

        model_config = SimpleNamespace(hf_config=SimpleNamespace(to_dict=unread))
        for params in (_params(policy="lru"), _params(disable=True)):
            add_mla_aware_cost_model(
                params, model_config, kv_cache_dtype="auto", tp_size=1
            )
            self.assertIsNone(params.eviction_policy_config)


if __name__ == "__main__":
    unittest.main()
