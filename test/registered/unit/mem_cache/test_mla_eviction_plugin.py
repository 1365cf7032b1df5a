"""The plugin through SGLang's own machinery: entry point, CLI, server args, the
radix-cache backend and its eviction callback, and the stock cache without the flag."""

import argparse
import os
import subprocess
import sys
import unittest
from array import array
from types import SimpleNamespace
from unittest import mock

import torch
from transformers import PretrainedConfig

from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
from sglang.srt.mem_cache import mla_eviction_plugin as plugin
from sglang.srt.mem_cache import registry
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.evict_policy import EvictionStrategy, LRUStrategy
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.mla_aware_policy import (
    MLAAwareStrategy,
    PolicyConfigError,
    create_mla_aware_strategy,
)
from sglang.srt.mem_cache.mla_cost_model import PRESETS, AttentionKind, KVCostModel
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.runtime_context import publish, reset_context
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="base-a-test-cpu")

FLAG = plugin.FLAG
SERVER_ARGS = "sglang.srt.server_args.ServerArgs."


def setUpModule():
    # What launch_server, the Engine and every scheduler process do first: run the
    # `sglang.srt.plugins` entry points (ours is in pyproject.toml), apply the hooks.
    load_plugins()
    plugin.register()  # no-op if the entry point ran
    HookRegistry.apply_hooks()


def cache_params(policy="mla_aware", config=None):
    kv = MLATokenToKVPool(
        size=64,
        page_size=1,
        dtype=torch.bfloat16,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    return CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=128, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=TokenToKVPoolAllocator(
            64, torch.bfloat16, "cpu", kv, need_sort=False
        ),
        page_size=1,
        eviction_policy=policy,
        eviction_policy_config=config,
    )


class TestRegistration(CustomTestCase):
    def test_entry_point_registers_policy_backend_and_flag(self):
        self.assertIs(
            _EVICTION_POLICY_FACTORIES["mla_aware"], create_mla_aware_strategy
        )
        self.assertEqual(RADIX_EVICTION_POLICY_CHOICES.count("mla_aware"), 1)
        self.assertIs(
            registry.get_radix_cache_factory("mla_aware"), plugin.create_mla_aware_cache
        )

    def test_only_argument_parsing_is_hooked(self):
        # No wrapper on any cache method: the hot paths are SGLang's own.
        ours = {
            target
            for target, hooks in HookRegistry._hooks.items()
            for _, hook, _ in hooks
            if getattr(hook, "__module__", None) == plugin.__name__
        }
        self.assertEqual(
            ours, {SERVER_ARGS + "add_cli_args", SERVER_ARGS + "from_cli_args"}
        )

    def test_register_is_idempotent(self):
        plugin.register()
        plugin.register()
        self.test_entry_point_registers_policy_backend_and_flag()
        hooks = HookRegistry._hooks[SERVER_ARGS + "add_cli_args"]
        self.assertEqual(sum(h is plugin.add_flag for _, h, _ in hooks), 1)

    def test_version_check(self):
        for version in ("0.5.23", "0.5.23.post1", "0.5.23+cu129"):
            self.assertEqual(plugin.check_sglang_version(version), version)
        for version, shown in (
            ("0.5.24", "0.5.24"),
            ("0.5.22", "0.5.22"),
            ("0.5.23rc1", "0.5.23rc1"),
            ("not-a-version", "not-a-version"),
        ):
            with self.subTest(version), self.assertRaises(RuntimeError) as ctx:
                plugin.check_sglang_version(version)
            self.assertIn(f"found {shown}.", str(ctx.exception))
            self.assertIn("sglang==0.5.23", str(ctx.exception))
        missing = plugin.metadata.PackageNotFoundError("sglang")
        with mock.patch.object(plugin.metadata, "version", side_effect=missing):
            with self.assertRaises(RuntimeError) as ctx:
                plugin.check_sglang_version()
        self.assertIn("found no sglang.", str(ctx.exception))


class TestServerArgs(CustomTestCase):
    # prepare_server_args does not read the model at this stage.

    def test_cli_lists_the_flag(self):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        self.assertIn(FLAG, parser._option_string_actions)
        policy = parser._option_string_actions["--radix-eviction-policy"]
        self.assertIn("mla_aware", policy.choices)

    def test_flag_selects_policy_and_backend(self):
        args = prepare_server_args(["--model-path", "dummy", FLAG])
        self.assertEqual(args.radix_eviction_policy, "mla_aware")
        self.assertEqual(args.radix_cache_backend, "mla_aware")
        stock = prepare_server_args(["--model-path", "dummy"])
        self.assertEqual(
            (stock.radix_eviction_policy, stock.radix_cache_backend), ("lru", None)
        )

    def test_policy_alone_selects_the_backend(self):
        args = prepare_server_args(
            ["--model-path", "dummy", "--radix-eviction-policy", "mla_aware"]
        )
        self.assertEqual(args.radix_cache_backend, "mla_aware")

    def test_conflicts(self):
        for argv, words in (
            ([FLAG, "--radix-eviction-policy=lfu"], (FLAG, "lfu")),
            ([FLAG, "--radix-eviction-policy", "lru"], (FLAG, "lru")),
        ):
            with self.subTest(argv), self.assertRaises(ValueError) as ctx:
                prepare_server_args(["--model-path", "dummy", *argv])
            for word in words:
                self.assertIn(word, str(ctx.exception))

    def test_policy_config_checked_when_arguments_are_parsed(self):
        ok = prepare_server_args(
            [
                "--model-path",
                "dummy",
                FLAG,
                "--radix-eviction-policy-config",
                '{"learn_weight": false}',
            ]
        )
        self.assertEqual(ok.radix_eviction_policy_config, {"learn_weight": False})
        for config, key in (('{"hit_exponent": 2}', "hit_exponent"), ("[1]", "list")):
            with self.subTest(config), self.assertRaises(PolicyConfigError) as ctx:
                prepare_server_args(
                    [
                        "--model-path",
                        "dummy",
                        FLAG,
                        "--radix-eviction-policy-config",
                        config,
                    ]
                )
            self.assertIn(key, str(ctx.exception))

    def test_launch_server_help_lists_the_flag(self):
        out = subprocess.run(
            [sys.executable, "-m", "sglang.launch_server", "--help"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertIn(FLAG, out.stdout)
        self.assertIn("mla_aware", out.stdout)


class TestCacheBackend(CustomTestCase):
    """The tree cache a server builds, through SGLang's create_tree_cache."""

    def tearDown(self):
        reset_context()

    def build(self, model, policy="mla_aware", backend="mla_aware", config=None):
        reset_context()
        server_args = ServerArgs(
            model_path="dummy",
            device="cpu",
            radix_eviction_policy=policy,
            radix_cache_backend=backend,
        )
        publish(server_args, role="tokenizer")
        ctx = registry.TreeCacheBuildContext(
            server_args=server_args,
            params=cache_params(policy, config),
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
        return registry.create_tree_cache(ctx)

    def test_deepseek_gets_mla_aware_on_the_python_core(self):
        with self.assertLogs(plugin.logger, "INFO") as logs:
            cache = self.build("deepseek-v3", config={"learn_factor": False})
        self.assertIsInstance(cache, UnifiedRadixCache)
        self.assertEqual(cache._tree_core_backend, "python")
        strategy = cache.tree_core.eviction_strategy
        self.assertIsInstance(strategy, MLAAwareStrategy)
        self.assertFalse(strategy.learn_factor)
        cost = strategy.cost_model
        # (512 + 64) x 2 B x 61 layers, the latent replicated on all 8 ranks.
        self.assertEqual(
            (cost.attention, cost.bytes_per_token), (AttentionKind.MLA, 70_272)
        )
        self.assertIsInstance(
            cache.tree_core.components_by_type[ComponentType.FULL],
            plugin.EvictionCallbackFullComponent,
        )
        self.assertIn("MLA attention, 70272 B/token per rank", logs.output[0])

    def test_other_attention_kinds_are_priced_too(self):
        with self.assertLogs(plugin.logger, "INFO") as logs:
            cache = self.build("llama-3-70b")
        cost = cache.tree_core.eviction_strategy.cost_model
        # 2 x ceil(8 kv heads / 8 ranks) x 128 x 2 B x 80 layers
        self.assertEqual(
            (cost.attention, cost.bytes_per_token), (AttentionKind.GQA, 40_960)
        )
        self.assertIn("GQA attention", logs.output[0])

    def test_without_the_flag_the_cache_is_stock(self):
        cache = self.build("deepseek-v3", policy="lru", backend=None)
        self.assertIsInstance(cache, UnifiedRadixCache)
        self.assertEqual(cache._tree_core_backend, "rust")
        self.assertEqual(type(cache.tree_core).__name__, "RustUnifiedTreeCore")

    def test_backend_leaves_other_policies_alone(self):
        cache = self.build("deepseek-v3", policy="lfu")
        self.assertEqual(cache._tree_core_backend, "rust")


class RecordingStrategy(LRUStrategy):
    def __init__(self):
        self.victims = []

    def on_evict(self, node):
        self.victims.append(tuple(node.key.token_ids))


class TestEvictionCallback(CustomTestCase):
    """EvictionCallbackFullComponent tells the strategy of each victim, in order."""

    def test_victims_in_eviction_order(self):
        params = cache_params("lru")
        cost = KVCostModel.from_preset("deepseek-v3")
        plugin.prepare_params(params, cost)
        params.eviction_policy_config = None
        params.tree_components = (ComponentType.FULL,)
        cache = UnifiedRadixCache(params)
        self.assertEqual(cache._tree_core_backend, "python")
        recorder = cache.tree_core.eviction_strategy = RecordingStrategy()
        allocator = params.token_to_kv_pool_allocator
        for key in ((1, 2, 3), (1, 2, 4, 5), (7, 8)):
            value = allocator.alloc(len(key))
            cache.insert(InsertParams(key=RadixKey(array("q", key)), value=value))
        # LRU: the oldest leaf first ([3] under [1, 2]), then [4, 5], then [7, 8].
        cache.evict(EvictParams(num_tokens=3))
        self.assertEqual(recorder.victims, [(3,), (4, 5)])
        cache.evict(EvictParams(num_tokens=2))
        self.assertEqual(recorder.victims, [(3,), (4, 5), (1, 2)])

    def test_strategies_without_the_callback_still_work(self):
        params = cache_params("lru")
        plugin.prepare_params(params, KVCostModel.from_preset("deepseek-v3"))
        params.eviction_policy_config = None
        params.tree_components = (ComponentType.FULL,)
        cache = UnifiedRadixCache(params)
        self.assertFalse(hasattr(EvictionStrategy, "on_evict"))
        value = params.token_to_kv_pool_allocator.alloc(2)
        cache.insert(InsertParams(key=RadixKey(array("q", (1, 2))), value=value))
        self.assertEqual(cache.evict(EvictParams(num_tokens=2)).num_tokens_evicted, 2)
        self.assertIsInstance(
            cache.tree_core.components_by_type[ComponentType.FULL], FullComponent
        )


if __name__ == "__main__":
    unittest.main()
