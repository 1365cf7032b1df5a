"""The plugin through SGLang's own machinery: entry point, CLI, server args, tree-cache factory."""

import argparse
import os
import subprocess
import sys
import unittest
from types import SimpleNamespace

import torch
from transformers import PretrainedConfig

from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
from sglang.srt.mem_cache import registry
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.evict_policy import LRUStrategy
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache import mla_leaf_index, mla_victim_trim
from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy
from sglang.srt.mem_cache.mla_cost_model import PRESETS, ModelConfigError
from sglang.srt.mem_cache.mla_eviction_plugin import (
    FLAG,
    _host_copies,
    add_flag,
    apply_flag,
    prepare_tree_cache,
    register,
    register_tree_hooks,
    resolve_policy_params,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.runtime_context import publish, reset_context
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

HOOKED = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": add_flag,
    "sglang.srt.server_args.ServerArgs.from_cli_args": apply_flag,
    "sglang.srt.mem_cache.registry.create_tree_cache": prepare_tree_cache,
    **mla_victim_trim.HOOKS,
    **mla_leaf_index.HOOKS,
}
TREE_HOOKED = {**mla_victim_trim.HOOKS, **mla_leaf_index.HOOKS}


def setUpModule():
    # What launch_server, the Engine and every scheduler process do first: run the
    # `sglang.srt.plugins` entry points (ours is in pyproject.toml), apply hooks.
    load_plugins()
    register()  # no-op if the entry point already ran; applies nothing new
    HookRegistry.apply_hooks()


def cache_params(policy="mla_aware", config=None, page_size=1):
    kv = MLATokenToKVPool(
        size=64, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=8,
        qk_rope_head_dim=4, layer_num=1, device="cpu", enable_memory_saver=False,
    )
    return CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=128, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=TokenToKVPoolAllocator(
            64, torch.bfloat16, "cpu", kv, need_sort=False
        ),
        page_size=page_size,
        eviction_policy=policy,
        eviction_policy_config=config,
    )


class TestRegistration(CustomTestCase):
    def test_entry_point_registers_policy_and_hooks(self):
        self.assertIn("mla_aware", _EVICTION_POLICY_FACTORIES)
        self.assertEqual(RADIX_EVICTION_POLICY_CHOICES.count("mla_aware"), 1)
        for target, hook in HOOKED.items():
            hooks = [h for _, h, _ in HookRegistry._hooks[target] if h is hook]
            self.assertEqual(len(hooks), 1, target)
            self.assertIn(target, HookRegistry._patched)

    def test_register_is_idempotent(self):
        register()
        register()
        self.test_entry_point_registers_policy_and_hooks()

    def test_tree_hooks_register_once_each(self):
        # A replay registers them per tree it builds, after the entry point did.
        register_tree_hooks()
        register_tree_hooks()
        self.assertEqual(len(TREE_HOOKED), 5)
        for target, hook in TREE_HOOKED.items():
            hooks = [h for _, h, _ in HookRegistry._hooks[target] if h is hook]
            self.assertEqual(len(hooks), 1, target)


class TestServerArgs(CustomTestCase):
    def test_cli_lists_the_flag(self):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        self.assertIn(FLAG, parser._option_string_actions)
        policy = parser._option_string_actions["--radix-eviction-policy"]
        self.assertIn("mla_aware", policy.choices)
        self.assertIn(FLAG, parser.format_help())

    def test_flag_selects_the_policy(self):
        # prepare_server_args does not read the model at this stage.
        args = prepare_server_args(["--model-path", "dummy", FLAG])
        self.assertEqual(args.radix_eviction_policy, "mla_aware")
        self.assertFalse(args._radix_eviction_policy_explicitly_set)
        self.assertEqual(
            prepare_server_args(["--model-path", "dummy"]).radix_eviction_policy, "lru"
        )

    def test_flag_with_explicit_policy(self):
        args = prepare_server_args(
            ["--model-path", "dummy", FLAG, "--radix-eviction-policy", "mla_aware"]
        )
        self.assertEqual(args.radix_eviction_policy, "mla_aware")
        self.assertTrue(args._radix_eviction_policy_explicitly_set)
        for policy in ("lru", "lfu"):
            with self.subTest(policy=policy):
                with self.assertRaises(ValueError) as ctx:
                    prepare_server_args(
                        ["--model-path", "dummy", FLAG, f"--radix-eviction-policy={policy}"]
                    )
                self.assertIn(FLAG, str(ctx.exception))
                self.assertIn(policy, str(ctx.exception))

    def test_launch_server_help_lists_the_flag(self):
        out = subprocess.run(
            [sys.executable, "-m", "sglang.launch_server", "--help"],
            capture_output=True, text=True, timeout=180,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertIn(FLAG, out.stdout)
        self.assertIn("mla_aware", out.stdout)


class TestResolvePolicyParams(CustomTestCase):
    def resolve(self, model, *, explicit, config=None, tp_size=8, kv_cache_dtype="auto",
                host_copies=True):
        params = cache_params(config=config)
        resolve_policy_params(
            params, hf_config=dict(PRESETS[model]) if isinstance(model, str) else model,
            tp_size=tp_size, kv_cache_dtype=kv_cache_dtype, explicit=explicit,
            host_copies=host_copies,
        )
        return params

    def test_flag_keeps_lru_for_llama(self):
        params = self.resolve("llama-3-70b", explicit=False)
        self.assertEqual(params.eviction_policy, "lru")
        self.assertIsNone(params.eviction_policy_config)
        self.assertIsNone(params.tree_core_backend)

    def test_explicit_policy_is_kept_for_llama(self):
        params = self.resolve("llama-3-70b", explicit=True)
        self.assertEqual(params.eviction_policy, "mla_aware")
        self.assertEqual(params.tree_core_backend, "python")

    def test_deepseek_gets_mla_aware_and_python_tree_core(self):
        for model in ("deepseek-v3", "deepseek-v3.2"):
            with self.subTest(model=model):
                params = self.resolve(model, explicit=False, kv_cache_dtype="fp8_e4m3")
                self.assertEqual(params.eviction_policy, "mla_aware")
                self.assertEqual(params.tree_core_backend, "python")
                cfg = params.eviction_policy_config
                self.assertEqual(cfg["model"]["architectures"], PRESETS[model]["architectures"])
                self.assertEqual((cfg["tp_size"], cfg["page_size"]), (8, 1))
                self.assertEqual(cfg["kv_cache_dtype"], "fp8_e4m3")

    def test_user_keys_win(self):
        user = {"tp_size": 2, "hit_exponent": 2.0}
        params = self.resolve("deepseek-v3", explicit=False, config=user)
        self.assertEqual(params.eviction_policy_config["tp_size"], 2)
        self.assertEqual(params.eviction_policy_config["hit_exponent"], 2.0)

    def test_host_awareness_follows_host_copies(self):
        with_host = self.resolve("deepseek-v3", explicit=False).eviction_policy_config
        self.assertNotIn("host_aware", with_host)  # the policy's default: on
        without = self.resolve("deepseek-v3", explicit=False, host_copies=False)
        self.assertIs(without.eviction_policy_config["host_aware"], False)
        forced = self.resolve("deepseek-v3", explicit=False, host_copies=False,
                              config={"host_aware": True})
        self.assertIs(forced.eviction_policy_config["host_aware"], True)

    def test_unknown_model(self):
        odd = {"model_type": "mystery"}
        self.assertEqual(self.resolve(odd, explicit=False).eviction_policy, "lru")
        with self.assertRaises(ModelConfigError):
            self.resolve(odd, explicit=True)


class TestCreateTreeCache(CustomTestCase):
    """The hooked ``create_tree_cache`` builds a real UnifiedRadixCache on CPU."""

    def tearDown(self):
        reset_context()

    def build(self, model, policy="mla_aware", config=None):
        reset_context()
        server_args = ServerArgs(model_path="dummy", device="cpu", radix_eviction_policy=policy)
        publish(server_args, role="tokenizer")
        params = cache_params(policy, config)
        ctx = registry.TreeCacheBuildContext(
            server_args=server_args,
            params=params,
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            enable_hierarchical_cache=False,
            disable_radix_cache=False,
            tp_worker=None,
            model_config=SimpleNamespace(hf_config=PretrainedConfig(**PRESETS[model])),
            tp_size=8,
            tp_rank=0,
            tp_group=None,
        )
        return registry.create_tree_cache(ctx), params

    def test_deepseek_builds_python_core_with_mla_aware(self):
        cache, _ = self.build("deepseek-v3")
        self.assertIsInstance(cache, UnifiedRadixCache)
        self.assertEqual(cache._tree_core_backend, "python")
        strategy = cache.tree_core.eviction_strategy
        self.assertIsInstance(strategy, MLAAwareStrategy)
        self.assertEqual(strategy.cost_model.tp_size, 8)
        self.assertEqual(strategy.cost_model.bytes_per_token, 70_272)
        self.assertFalse(strategy.host_aware)  # no HiCache: no host copies to look for
        self.assertTrue(mla_victim_trim.trims(cache))

    def test_trimming_can_be_switched_off(self):
        cache, _ = self.build("deepseek-v3", config={"trim_victims": False})
        self.assertIsInstance(cache.tree_core.eviction_strategy, MLAAwareStrategy)
        self.assertFalse(mla_victim_trim.trims(cache))

    def test_host_copies_follow_hicache(self):
        reset_context()
        publish(ServerArgs(model_path="dummy", device="cpu"), role="tokenizer")
        self.assertTrue(_host_copies(SimpleNamespace(enable_hierarchical_cache=True)))
        self.assertFalse(_host_copies(SimpleNamespace(enable_hierarchical_cache=False)))

    def test_llama_keeps_lru(self):
        # Stock LRU on the stock tree core (the compiled one where it loads).
        cache, params = self.build("llama-3-8b")
        self.assertIsInstance(cache, UnifiedRadixCache)
        self.assertEqual((params.eviction_policy, params.eviction_policy_config), ("lru", None))
        self.assertIsNone(params.tree_core_backend)
        if cache._tree_core_backend == "python":
            self.assertIsInstance(cache.tree_core.eviction_strategy, LRUStrategy)
        self.assertFalse(mla_victim_trim.trims(cache))

    def test_other_policies_untouched(self):
        cache, params = self.build("deepseek-v3", policy="lfu")
        self.assertEqual((params.eviction_policy, params.eviction_policy_config), ("lfu", None))
        self.assertIsNone(params.tree_core_backend)
        self.assertFalse(mla_victim_trim.trims(cache))


if __name__ == "__main__":
    unittest.main()
