"""Export this project as a patch series against upstream SGLang, and prove it works there.

    python benchmark/mla_eviction/upstream_patch.py export --out DIR
    python benchmark/mla_eviction/upstream_patch.py check

``export`` lays out the installed sglang 0.5.23 wheel as upstream's tree
(``python/sglang/...``) in a throwaway git repository, commits it as the base, adds our
changes as commits and writes them with ``git format-patch`` into DIR
(``0001-....patch`` and so on), ready for ``git am`` in an SGLang checkout:

1. the modules: ``[tool.setuptools] py-modules`` of pyproject.toml minus the plugin and the
   version check (upstream registers the policy in its own code, and merged code needs no
   version guard);
2. the wiring, generated from the wheel's own files by exact-string edits that fail
   loudly when an anchor is missing: ``mla_aware`` in ``_EVICTION_POLICY_FACTORIES`` and
   ``RADIX_EVICTION_POLICY_CHOICES``; an ``mla_aware_eviction`` field in the memory
   namespace, resolved by a new ``handle_mla_aware_eviction`` step of the resolution
   pipeline (it selects the policy for MLA/DSA models and keeps the stock one for others);
   the Python tree core for this policy (``_rust_fallback_reason``); the served model's
   config passed to the policy where ``kv_cache_builder.py`` builds ``CacheInitParams``;
   victim trimming (``mla_victim_trim``): ``eviction(...)`` around the component walk of
   ``UnifiedRadixCache._evict`` and ``trim_victim(...)`` in each step of
   ``UnifiedTreeCore.evict_device_next_node``; the leaf index (``mla_leaf_index``):
   ``start_walk``, ``next_node`` and ``end_walk`` in the Full component's eviction walk;
   sessions (``mla_sessions``): ``note_insert(...)`` after each tree's insert and
   ``close(...)`` in ``release_radix_session`` of both trees and in
   ``SessionController.close``;
3. the tests: every ``test/registered/unit/mem_cache/test_*.py`` that depends on nothing
   outside the exported modules (no plugin, no version check, nothing under
   ``benchmark/``), plus ``test_mla_aware_eviction_wiring.py``, generated here, which tests
   the wiring through SGLang's own code paths. A test that takes only ``register()`` from
   the plugin, to put the policy in the registry, is exported without it: upstream
   registers the policy on import. The plugin's own tests are not exported; what they
   cover (flag -> policy, the stock policy for non-MLA models, the conflict with an
   explicit policy, the Python tree core, the model config reaching the policy) is what
   the wiring test covers upstream;
4. ``docs/advanced_features/mla_aware_eviction.md``, when the project has it.

``check`` lays the wheel out again in a new repository, builds and exports the series
on a branch there, applies it with ``git am`` to another branch from the pristine
wheel commit and runs the exported tests against that tree: ``PYTHONPATH`` is its ``python/``
directory, ``SGLANG_PLUGINS`` names no installed plugin, and the editable install of
this project is taken off the import path, so the tests see only the patched tree.
Exit status 0 means the series applies and its tests pass.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path
from typing import Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
SGLANG_VERSION = "0.5.23"
NOT_UPSTREAM = (
    "sglang.srt.mem_cache.mla_eviction_plugin",
    "sglang.srt.mem_cache.mla_version_check",
)
TEST_DIR = "test/registered/unit/mem_cache"
DOCS = ("docs/advanced_features/mla_aware_eviction.md",)
WIRING_TEST = f"{TEST_DIR}/test_mla_aware_eviction_wiring.py"
DEFAULT_AUTHOR = "sglang-mla-eviction <sglang-mla-eviction@users.noreply.github.com>"
# Fixed dates keep the exported series byte-identical from one run to the next.
_GIT_DATE = "2026-11-01T00:00:00+00:00"
_PLUGINS_OFF = "none-of-the-installed-plugins"
_SERIES_BRANCH = "mla-aware-eviction"
_NOT_UPSTREAM_NAMES = tuple(m.rsplit(".", 1)[1] for m in NOT_UPSTREAM)


class ExportError(RuntimeError):
    """The series cannot be built: a missing module, an anchor not found, a bad wheel."""


# ---------------------------------------------------------------------------
# What to export
# ---------------------------------------------------------------------------


def exported_modules(root: Path = ROOT) -> list[str]:
    """Dotted names of the modules upstream gets: pyproject's py-modules minus NOT_UPSTREAM."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    try:
        modules = pyproject["tool"]["setuptools"]["py-modules"]
    except KeyError:
        raise ExportError("pyproject.toml has no [tool.setuptools] py-modules") from None
    return [m for m in modules if m not in NOT_UPSTREAM]


def module_path(module: str) -> str:
    """Repository path of a dotted module name: ``python/sglang/.../name.py``."""
    return "python/" + module.replace(".", "/") + ".py"


def project_dependencies(source: str) -> list[str]:
    """What in a test's source ties it to this project rather than to SGLang.

    Imports of the plugin or the version check, strings naming them (``mock.patch``
    targets), and strings naming the project's ``benchmark`` directory (path joins);
    docstrings are not read, and ``sglang.benchmark`` is SGLang's own.
    """
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    imports, strings = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imports += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                strings.append(node.value)
    found = {m for name in imports + strings for m in _NOT_UPSTREAM_NAMES if m in name}
    if any(re.search(r"(^|[/\\])benchmark([/\\]|$)", s) for s in strings):
        found.add("benchmark/")
    return sorted(found)


def exported_tests(root: Path = ROOT) -> dict[str, str]:
    """Path -> upstream source of the project's tests that need only the export.

    A test that uses the plugin only to register the policy is exported without that
    (see :func:`drop_plugin_registration`); any other tie to the project leaves it out.
    """
    tests = {}
    for path in sorted((root / TEST_DIR).glob("test_*.py")):
        source = drop_plugin_registration(path.read_text(), str(path))
        if not project_dependencies(source):
            tests[str(path.relative_to(root))] = source
    return tests


_PLUGIN_REGISTER_IMPORT = f"from {NOT_UPSTREAM[0]} import register\n"
_SETUP_NAMES = ("setUp", "setUpClass", "setUpModule")


def drop_plugin_registration(source: str, name: str = "<test>") -> str:
    """``source`` without the plugin's ``register()``, if that is all it takes from the plugin.

    Upstream registers ``mla_aware`` when ``sglang.srt.mem_cache.utils`` is imported, so
    a test that imports ``register`` from the plugin and only calls it as a statement
    (``register()``) loses the import and the calls; a setUp/setUpClass that did nothing
    else goes too. Any other use of ``register`` leaves the source unchanged.
    """
    if _PLUGIN_REGISTER_IMPORT not in source:
        return source
    tree = ast.parse(source)
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "register"]
    drop: list[tuple[int, int, Optional[str]]] = []  # (first line, last line, replacement)
    for owner in ast.walk(tree):
        for body in (getattr(owner, f, None) for f in ("body", "orelse", "finalbody")):
            if not isinstance(body, list):
                continue
            for stmt in body:
                if not _is_register_call(stmt):
                    continue
                if len(body) > 1:
                    drop.append((stmt.lineno, stmt.end_lineno, None))
                elif isinstance(owner, ast.FunctionDef) and owner.name in _SETUP_NAMES:
                    first = min([owner.lineno] + [d.lineno for d in owner.decorator_list])
                    drop.append((first, owner.end_lineno, None))
                else:
                    drop.append((stmt.lineno, stmt.end_lineno, " " * stmt.col_offset + "pass"))
    if len(drop) != len(uses):
        return source
    lines = source.splitlines(keepends=True)
    for first, last, replacement in sorted(drop, reverse=True):
        blank_after = last < len(lines) and not lines[last].strip() and replacement is None
        lines[first - 1 : last + blank_after] = [replacement + "\n"] if replacement else []
    result = "".join(lines).replace(_PLUGIN_REGISTER_IMPORT, "", 1)
    try:
        ast.parse(result)
    except SyntaxError as e:
        raise ExportError(f"{name}: dropping the plugin's register() broke it: {e}") from None
    return result


def _is_register_call(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Name)
        and stmt.value.func.id == "register"
        and not stmt.value.args
        and not stmt.value.keywords
    )


# ---------------------------------------------------------------------------
# Edits of SGLang's own files
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Edit:
    """Put ``text`` after, before or instead of ``anchor``, which must occur exactly once."""

    path: str  # in the upstream tree, e.g. python/sglang/srt/mem_cache/utils.py
    anchor: str
    text: str
    where: str = "after"  # "after", "before" or "replace"

    def apply(self, source: str) -> str:
        count = source.count(self.anchor)
        if count != 1:
            raise ExportError(
                f"{self.path}: anchor found {count} times (expected once), so this "
                f"sglang is not the {SGLANG_VERSION} the series is generated for:\n"
                f"{self.anchor}"
            )
        new = {
            "after": self.anchor + self.text,
            "before": self.text + self.anchor,
            "replace": self.text,
        }[self.where]
        return source.replace(self.anchor, new)


_SRT = "python/sglang/srt"

_MEMORY_FIELD = '''\
    mla_aware_eviction: A[
        bool,
        Arg(
            help=(
                "Evict radix-cache nodes by what they cost to restore (prefill work "
                "grows with a node's depth; a node that HiCache holds on host "
                "reloads cheaply), how often they were reused and the bytes they "
                "hold. Selects --radix-eviction-policy mla_aware for models whose KV "
                "cache is a compressed latent (MLA/DSA: DeepSeek V2/V3/R1/V3.2, Kimi "
                "K2); other models keep their policy."
            ),
        ),
    ] = False
'''

_RESOLUTION_STEP = '''

def handle_mla_aware_eviction(server_args: Any) -> None:
    """``--mla-aware-eviction``: the ``mla_aware`` eviction policy for MLA/DSA models.

    An explicit, different ``--radix-eviction-policy`` conflicts with the flag
    (ValueError). A model whose KV cache is not a compressed latent keeps its policy,
    with a log line, so the flag can stay in a launch config shared by many models.
    """
    cfg = resolving_view(server_args)
    if not cfg.mla_aware_eviction:
        return
    policy = cfg.radix_eviction_policy
    if cfg._radix_eviction_policy_explicitly_set and policy != "mla_aware":
        raise ValueError(
            f"--mla-aware-eviction conflicts with --radix-eviction-policy {policy}; "
            "drop one of them."
        )
    from sglang.srt.mem_cache.mla_cost_model import (
        LATENT_KINDS,
        KVCostModel,
        ModelConfigError,
    )

    try:
        hf_config = model_config_of(server_args).hf_config.to_dict()
        kind = KVCostModel.from_config(hf_config).attention
    except ModelConfigError as e:
        logger.info(
            "--mla-aware-eviction: %s; keeping --radix-eviction-policy %s.", e, policy
        )
        return
    if kind not in LATENT_KINDS:
        logger.info(
            "--mla-aware-eviction: %s attention has no latent KV cache; keeping "
            "--radix-eviction-policy %s.",
            kind.value.upper(),
            policy,
        )
        return
    declare_resolution(
        server_args, "handle_mla_aware_eviction", radix_eviction_policy="mla_aware"
    )
'''

_POLICY_CONFIG_CALL = '''\
    if params.eviction_policy == "mla_aware" and not params.disable:
        params.eviction_policy_config = mla_aware_policy_config(
            params.eviction_policy_config,
            hf_config=model_config.hf_config.to_dict(),
            tp_size=parallel.tp_size,
            page_size=params.page_size,
            kv_cache_dtype=str(get_model().kv_cache_dtype),
            host_copies=enable_hierarchical_cache
            or get_disagg().disaggregation_decode_retraction_backup == "host_pool",
        )
'''

# Victim trimming (mla_victim_trim): the eviction's request, then each step of the walk.
# The leaf index (mla_leaf_index): the Full component's walk, begun, stepped and ended.
_FULL_COMPONENT = f"{_SRT}/mem_cache/unified_cache/components/full.py"
_EVICT_COMPONENTS_CALL = """\
        self._evict_components(
            request_by_type,
            tracker,
            available_size_targets=available_size_targets,
            allocation_reclaim_satisfied=allocation_reclaim_satisfied,
        )
"""

EDITS: tuple[Edit, ...] = (
    Edit(
        f"{_SRT}/mem_cache/utils.py",
        "    TLRUStrategy,\n)\n",
        "from sglang.srt.mem_cache.mla_aware_policy import create_mla_aware_strategy\n",
    ),
    Edit(
        f"{_SRT}/mem_cache/utils.py",
        '    "tlru": TLRUStrategy,\n',
        '    "mla_aware": create_mla_aware_strategy,\n',
    ),
    Edit(
        f"{_SRT}/arg_groups/choices.py",
        '"priority", "tlru"',
        ', "mla_aware"',
    ),
    Edit(
        f"{_SRT}/arg_groups/fields/memory.py",
        '                "to LRU. See "\n',
        '                "to LRU, and \'mla_aware\' evicts first what is cheapest to "\n'
        '                "restore per byte held (see --mla-aware-eviction). See "\n',
        where="replace",
    ),
    Edit(
        f"{_SRT}/arg_groups/fields/memory.py",
        "    disable_radix_cache: A[\n",
        _MEMORY_FIELD,
        where="before",
    ),
    Edit(
        f"{_SRT}/arg_groups/field_order.py",
        '    "return_aux_hidden_state_layer_ids",\n',
        '    "mla_aware_eviction",\n',
    ),
    Edit(
        f"{_SRT}/arg_groups/memory_hook.py",
        "    return mem_fraction_static * final_overall_factor\n",
        _RESOLUTION_STEP,
    ),
    Edit(
        f"{_SRT}/arg_groups/pipeline.py",
        "    run_hook(handle_cache_compatibility, server_args)\n",
        "    from sglang.srt.arg_groups.memory_hook import handle_mla_aware_eviction\n\n"
        "    run_hook(handle_mla_aware_eviction, server_args)\n\n",
        where="before",
    ),
    Edit(
        f"{_SRT}/arg_groups/resolution_hooks.py",
        '        "handle_cache_compatibility",\n',
        '        "handle_mla_aware_eviction",\n',
        where="before",
    ),
    Edit(
        f"{_SRT}/mem_cache/unified_cache/tree_core_registry.py",
        "def _rust_fallback_reason(params: CacheInitParams) -> Optional[str]:\n",
        '    if params.eviction_policy.lower() == "mla_aware":\n'
        '        return "the mla_aware eviction policy requires the Python TreeCore"\n',
    ),
    Edit(
        f"{_SRT}/mem_cache/kv_cache_builder.py",
        "    get_disagg,\n    get_memory,\n",
        "    get_model,\n",
    ),
    Edit(
        f"{_SRT}/mem_cache/kv_cache_builder.py",
        "from sglang.srt.mem_cache.hicache_auto_size import auto_size_hicache\n",
        "from sglang.srt.mem_cache.mla_aware_policy import mla_aware_policy_config\n",
    ),
    Edit(
        f"{_SRT}/mem_cache/kv_cache_builder.py",
        "    if params.swa_retain_window != sliding_window_size:\n",
        _POLICY_CONFIG_CALL,
        where="before",
    ),
    Edit(
        f"{_SRT}/mem_cache/unified_radix_cache.py",
        "from sglang.srt.mem_cache.common import RetractionBackup\n",
        "from sglang.srt.mem_cache import mla_sessions, mla_victim_trim\n",
        where="before",
    ),
    Edit(
        f"{_SRT}/mem_cache/unified_radix_cache.py",
        _EVICT_COMPONENTS_CALL,
        "        with mla_victim_trim.eviction(self, params.num_tokens):\n"
        + "".join("    " + line for line in _EVICT_COMPONENTS_CALL.splitlines(keepends=True)),
        where="replace",
    ),
    Edit(
        f"{_SRT}/mem_cache/unified_cache/unified_tree_core.py",
        "from sglang.srt.mem_cache.radix_cache import RadixKey\n",
        "from sglang.srt.mem_cache import mla_victim_trim\n",
        where="before",
    ),
    Edit(
        f"{_SRT}/mem_cache/unified_cache/unified_tree_core.py",
        "        result.made_progress = (\n            result.node_id is not None\n",
        "        mla_victim_trim.trim_victim(self, component_type, tracker, result)\n",
        where="before",
    ),
    Edit(
        f"{_SRT}/mem_cache/unified_radix_cache.py",
        "                    return step.result\n",
        "                    mla_sessions.note_insert(self, params, step.result)\n",
        where="before",
    ),
    Edit(
        f"{_SRT}/mem_cache/unified_radix_cache.py",
        "    def release_radix_session(self, session_id: str) -> int:\n",
        "        mla_sessions.close(self, session_id)\n",
    ),
    Edit(
        f"{_SRT}/mem_cache/radix_cache.py",
        "from sglang.srt.mem_cache.base_prefix_cache import (\n",
        "from sglang.srt.mem_cache import mla_sessions\n",
        where="before",
    ),
    Edit(
        f"{_SRT}/mem_cache/radix_cache.py",
        "        return InsertResult(prefix_len=prefix_len, last_device_node=last_node)\n",
        "        result = InsertResult(prefix_len=prefix_len, last_device_node=last_node)\n"
        "        mla_sessions.note_insert(self, params, result)\n"
        "        return result\n",
        where="replace",
    ),
    Edit(
        f"{_SRT}/mem_cache/base_prefix_cache.py",
        "from sglang.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator\n",
        "from sglang.srt.mem_cache import mla_sessions\n",
        where="before",
    ),
    Edit(
        f"{_SRT}/mem_cache/base_prefix_cache.py",
        "    def release_radix_session(self, session_id: str) -> None:\n        pass\n",
        "    def release_radix_session(self, session_id: str) -> None:\n"
        "        mla_sessions.close(self, session_id)\n",
        where="replace",
    ),
    Edit(
        f"{_SRT}/session/session_controller.py",
        "from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req\n",
        "from sglang.srt.mem_cache import mla_sessions\n",
    ),
    Edit(
        f"{_SRT}/session/session_controller.py",
        "    def close(self, recv_req: CloseSessionReqInput):\n"
        "        session_id = recv_req.session_id\n",
        "        mla_sessions.close(self.tree_cache, session_id)\n",
    ),
    Edit(_FULL_COMPONENT, "from sglang.srt.mem_cache.base_prefix_cache import (\n",
         "from sglang.srt.mem_cache import mla_leaf_index\n", where="before"),
    Edit(
        _FULL_COMPONENT,
        "    def _evict_device_start(self, request_cnt: int) -> None:\n",
        "        if mla_leaf_index.start_walk(self, request_cnt):\n            return\n",
    ),
    Edit(
        _FULL_COMPONENT,
        "        ct = self.component_type\n        lv = self._evict_device_last_node\n",
        "        index = mla_leaf_index.walking(self)\n"
        "        if index is not None:\n"
        "            return mla_leaf_index.next_node(self, index, tracker)\n",
        where="before",
    ),
    Edit(
        _FULL_COMPONENT,
        "    def _evict_device_end(self) -> None:\n",
        "        mla_leaf_index.end_walk(self)\n",
    ),
)


def apply_edits(tree: Path, edits: Sequence[Edit] = EDITS) -> list[str]:
    """Apply ``edits`` to the files under ``tree``; return the paths changed."""
    changed: dict[str, str] = {}
    for edit in edits:
        path = tree / edit.path
        if edit.path not in changed:
            if not path.is_file():
                raise ExportError(f"{edit.path}: not in the sglang {SGLANG_VERSION} tree")
            changed[edit.path] = path.read_text()
        changed[edit.path] = edit.apply(changed[edit.path])
    for rel, text in changed.items():
        (tree / rel).write_text(text)
    return list(changed)


# The wiring test exported with the series (upstream format; runs on CPU).
WIRING_TEST_SOURCE = '''\
"""Wiring of the mla_aware eviction policy and --mla-aware-eviction into SGLang.

The policy and its cost model have their own tests; here: the registry, the CLI flag
and its resolution for MLA and non-MLA models, the tree-core choice and the policy
config built from the served model.
"""

import json
import os
import tempfile
import unittest

from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.mla_aware_policy import MLAAwareStrategy, mla_aware_policy_config
from sglang.srt.mem_cache.mla_cost_model import PRESETS
from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
    resolve_tree_core_backend,
)
from sglang.srt.mem_cache.utils import get_eviction_strategy
from sglang.srt.server_args import prepare_server_args
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")


def _model_dir(root, name):
    path = os.path.join(root, name)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(PRESETS[name], f)
    return path


class TestMLAAwareEvictionWiring(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.TemporaryDirectory()
        cls.deepseek = _model_dir(cls._tmp.name, "deepseek-v3")
        cls.llama = _model_dir(cls._tmp.name, "llama-3-8b")

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()

    def resolved_policy(self, *argv):
        server_args = prepare_server_args(
            ["--device", "cpu", "--skip-tokenizer-init", *argv]
        )
        server_args.resolve_once()
        return resolution_result(server_args, "radix_eviction_policy")

    def test_policy_is_registered(self):
        self.assertIn("mla_aware", RADIX_EVICTION_POLICY_CHOICES)
        strategy = get_eviction_strategy("mla_aware", {"model": "deepseek-v3"})
        self.assertIsInstance(strategy, MLAAwareStrategy)

    def test_flag_selects_the_policy_for_mla_models(self):
        policy = self.resolved_policy(
            "--model-path", self.deepseek, "--mla-aware-eviction"
        )
        self.assertEqual(policy, "mla_aware")

    def test_flag_keeps_the_stock_policy_for_other_models(self):
        policy = self.resolved_policy("--model-path", self.llama, "--mla-aware-eviction")
        self.assertEqual(policy, "lru")

    def test_without_the_flag_nothing_changes(self):
        self.assertEqual(self.resolved_policy("--model-path", self.deepseek), "lru")

    def test_explicit_policy_is_honoured_for_any_model(self):
        policy = self.resolved_policy(
            "--model-path", self.llama, "--radix-eviction-policy", "mla_aware"
        )
        self.assertEqual(policy, "mla_aware")

    def test_flag_conflicts_with_another_explicit_policy(self):
        with self.assertRaisesRegex(ValueError, "conflicts with --radix-eviction-policy lfu"):
            self.resolved_policy(
                "--model-path",
                self.deepseek,
                "--mla-aware-eviction",
                "--radix-eviction-policy",
                "lfu",
            )

    def test_policy_uses_the_python_tree_core(self):
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=None,
            page_size=1,
            eviction_policy="mla_aware",
        )
        self.assertEqual(resolve_tree_core_backend("rust", params), "python")

    def test_policy_config_describes_the_served_model(self):
        model = PRESETS["deepseek-v3"]
        config = mla_aware_policy_config(
            None, hf_config=model, tp_size=8, page_size=64, kv_cache_dtype="fp8_e4m3"
        )
        self.assertEqual(
            config,
            {"model": model, "tp_size": 8, "page_size": 64, "kv_cache_dtype": "fp8_e4m3"},
        )
        strategy = get_eviction_strategy("mla_aware", config)
        self.assertEqual(strategy.cost_model.tp_size, 8)
        self.assertEqual(strategy.cost_model.page_size, 64)

    def test_user_policy_config_wins(self):
        config = mla_aware_policy_config(
            {"hit_exponent": 0.5, "tp_size": 2},
            hf_config=PRESETS["deepseek-v3"],
            tp_size=8,
            page_size=1,
            kv_cache_dtype="auto",
        )
        self.assertEqual((config["hit_exponent"], config["tp_size"]), (0.5, 2))

    def test_unpriced_kv_dtype_falls_back_to_the_model_dtype(self):
        config = mla_aware_policy_config(
            None,
            hf_config=PRESETS["deepseek-v3"],
            tp_size=1,
            page_size=1,
            kv_cache_dtype="fp4_e2m1",
        )
        self.assertEqual(config["kv_cache_dtype"], "auto")


if __name__ == "__main__":
    unittest.main()
'''


# ---------------------------------------------------------------------------
# Git plumbing
# ---------------------------------------------------------------------------


def installed_sglang_dir() -> Path:
    """The installed sglang package directory; it must be the 0.5.23 wheel."""
    version = metadata.version("sglang")
    if version != SGLANG_VERSION:
        raise ExportError(
            f"the series is generated from the sglang {SGLANG_VERSION} wheel; "
            f"found sglang {version}"
        )
    spec = util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ExportError("sglang is not importable")
    return Path(list(spec.submodule_search_locations)[0])


def git(repo: Path, *args: str, author: str = DEFAULT_AUTHOR) -> str:
    """Run git in ``repo`` with a fixed identity and dates; return stdout, raise on failure."""
    name, email = re.fullmatch(r"(.*?)\s*<(.*)>", author).groups()
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_AUTHOR_DATE": _GIT_DATE,
        "GIT_COMMITTER_DATE": _GIT_DATE,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
    }
    result = subprocess.run(
        ["git", "-c", "core.compression=0", "-c", "commit.gpgsign=false", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise ExportError(f"git {' '.join(args)} failed in {repo}:\n{result.stderr}")
    return result.stdout


def layout_upstream_tree(dest: Path, sglang_dir: Optional[Path] = None) -> Path:
    """A git repository at ``dest`` holding the wheel as ``python/sglang``, committed."""
    sglang_dir = sglang_dir or installed_sglang_dir()
    dest.mkdir(parents=True)
    shutil.copytree(
        sglang_dir,
        dest / "python" / "sglang",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        copy_function=shutil.copyfile,
    )
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", f"sglang {SGLANG_VERSION} (the PyPI wheel's python package)")
    return dest


def _add_files(tree: Path, files: dict[str, str]) -> list[str]:
    """Write new files (path -> text) into ``tree``; an existing path is an error."""
    for rel, text in files.items():
        if (tree / rel).exists():
            raise ExportError(f"{rel}: already in the sglang tree; refusing to overwrite")
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    return list(files)


def _read(root: Path, paths: Iterable[str]) -> dict[str, str]:
    missing = [p for p in paths if not (root / p).is_file()]
    if missing:
        raise ExportError(f"listed for export but missing from {root}: {', '.join(missing)}")
    return {p: (root / p).read_text() for p in paths}


def _commit(tree: Path, paths: Sequence[str], message: str, author: str) -> None:
    git(tree, "add", "--", *paths, author=author)
    git(tree, "commit", "-q", "-m", message, author=author)


def build_series(tree: Path, root: Path = ROOT, author: str = DEFAULT_AUTHOR) -> None:
    """Commit our changes on top of the base commit of ``tree``."""
    modules = exported_modules(root)
    paths = _add_files(tree, _read(root, [module_path(m) for m in modules]))
    _commit(
        tree,
        paths,
        "mem_cache: MLA-aware KV cost model and the mla_aware eviction policy\n\n"
        "Adds a per-token cost model (bytes per rank and prefill work by depth, from the\n"
        "model config; MLA, DSA, MHA/GQA) and the mla_aware policy, which evicts first\n"
        "the nodes that are cheapest to restore per byte held, weighted by reuse. The\n"
        "policy only scores nodes: how much is freed is unchanged.\n\n"
        f"Modules: {', '.join(m.rsplit('.', 1)[1] for m in modules)}.",
        author,
    )
    changed = apply_edits(tree)
    _commit(
        tree,
        changed,
        "mem_cache: register mla_aware and add --mla-aware-eviction\n\n"
        "- mla_aware in _EVICTION_POLICY_FACTORIES and RADIX_EVICTION_POLICY_CHOICES;\n"
        "- --mla-aware-eviction (memory namespace), resolved by handle_mla_aware_eviction:\n"
        "  the policy for MLA/DSA models, the stock one for others, an error next to\n"
        "  another explicit --radix-eviction-policy;\n"
        "- the Python TreeCore for this policy (the Rust one knows the built-ins only);\n"
        "- the served model's config, TP size, page size and KV dtype passed to the\n"
        "  policy where the KV cache builder makes CacheInitParams.",
        author,
    )
    tests = _add_files(tree, {**exported_tests(root), WIRING_TEST: WIRING_TEST_SOURCE})
    _commit(
        tree,
        tests,
        "test: unit tests for the MLA-aware cost model, policy and wiring\n\n"
        "CPU-only, registered in stage-a-test-cpu.",
        author,
    )
    docs = [d for d in DOCS if (root / d).is_file()]
    if docs:
        _commit(tree, _add_files(tree, _read(root, docs)), "docs: MLA-aware eviction", author)


def export(
    out: Path,
    root: Path = ROOT,
    author: str = DEFAULT_AUTHOR,
    base: Optional[Path] = None,
) -> list[Path]:
    """Write the series into ``out`` (old ``NNNN-*.patch`` there are removed); return it.

    ``base``: a tree from :func:`layout_upstream_tree` to build the series on (on a
    branch, left as it was found) instead of laying the wheel out again.
    """
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("[0-9][0-9][0-9][0-9]-*.patch"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="sglang-upstream-") as tmp:
        tree = base or layout_upstream_tree(Path(tmp) / "sglang")
        git(tree, "checkout", "-q", "-b", _SERIES_BRANCH, "main")
        try:
            build_series(tree, root, author)
            git(
                tree,
                "format-patch",
                "-q",
                "--no-signature",
                "-o",
                str(out.resolve()),
                f"main..{_SERIES_BRANCH}",
            )
        finally:
            if base is not None:
                git(tree, "checkout", "-q", "-f", "main")
                git(tree, "clean", "-q", "-f", "-d")
                git(tree, "branch", "-q", "-D", _SERIES_BRANCH)
    return sorted(out.glob("[0-9][0-9][0-9][0-9]-*.patch"))


# Runs pytest on the patched tree (argv: the tree, then pytest's arguments). The
# editable install of this project comes off the import path first (it would serve the
# plugin), and the run is refused unless ``import sglang`` finds the tree's package.
_PYTEST = """\
import sys
from importlib.machinery import PathFinder

sys.meta_path[:] = [
    f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
]
sglang = PathFinder.find_spec("sglang")
if sglang is None or not sglang.origin.startswith(sys.argv[1]):
    sys.exit(f"sglang is not the patched tree's: {sglang and sglang.origin}")
import pytest

sys.exit(pytest.main(sys.argv[2:]))
"""


def _tree_pythonpath(tree: Path) -> str:
    """The tree's ``python/`` first; of the caller's PYTHONPATH, entries without an sglang."""
    kept = [
        entry
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and not (Path(entry) / "sglang").exists()
    ]
    return os.pathsep.join([str(tree / "python"), *kept])


def check(root: Path = ROOT, keep: Optional[Path] = None) -> int:
    """Export, apply to a fresh upstream tree with ``git am``, run the exported tests there.

    The wheel is laid out once, in a new repository whose ``main`` is the pristine
    wheel; the series is built on a branch there (then dropped, the work tree restored
    and cleaned) and applied with ``git am`` to a second branch from ``main``. (A
    second copy of the wheel would cost more file-system time than the tests.)
    """
    with tempfile.TemporaryDirectory(prefix="sglang-upstream-check-") as tmp:
        work = keep or Path(tmp)
        tree = layout_upstream_tree(work / "sglang")
        patches = export(work / "patches", root, base=tree)
        git(tree, "checkout", "-q", "-b", "upstream-check", "main")
        git(tree, "am", "-q", *map(str, patches))
        tests = [str(p.relative_to(tree)) for p in sorted((tree / TEST_DIR).glob("test_*.py"))]
        print(f"applied {len(patches)} patches to sglang {SGLANG_VERSION} in {tree}", flush=True)
        env = {
            **os.environ,
            "PYTHONPATH": _tree_pythonpath(tree),
            "SGLANG_PLUGINS": _PLUGINS_OFF,
        }
        print(f"running {len(tests)} test files against the patched tree", flush=True)
        result = subprocess.run(
            [sys.executable, "-c", _PYTEST, str(tree), "-q", "-p", "no:cacheprovider", *tests],
            cwd=tree,
            env=env,
        )
        return result.returncode


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_export = sub.add_parser("export", help="write the patch series into --out")
    p_export.add_argument("--out", type=Path, required=True, help="directory for the .patch files")
    p_export.add_argument(
        "--author", default=DEFAULT_AUTHOR, help='"Name <email>" of the commits'
    )
    p_check = sub.add_parser("check", help="apply the series to a fresh tree and run its tests")
    p_check.add_argument(
        "--keep", type=Path, help="work in this (new) directory and leave it for inspection"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            if not re.fullmatch(r".*?\s*<.*>", args.author):
                parser.error('--author must look like "Name <email>"')
            for patch in export(args.out, author=args.author):
                print(patch)
            return 0
        return check(keep=args.keep)
    except ExportError as e:
        print(f"upstream_patch: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
