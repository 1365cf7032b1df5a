"""Tests for the release checks: the SGLang version guard and the upstream patch series.

``benchmark/mla_eviction/upstream_patch.py`` exports the project as ``git format-patch``
files against the sglang 0.5.23 wheel and ``check`` applies them to a fresh tree and
runs the exported tests there (about 1.5 min: two copies of the wheel and a pytest run).
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from importlib import metadata
from pathlib import Path
from unittest import mock

from sglang.srt.mem_cache import mla_version_check
from sglang.srt.mem_cache.mla_version_check import SUPPORTED_SGLANG, check_sglang_version
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=150, suite="stage-a-test-cpu")

_REPO = Path(__file__).resolve().parents[4]
SCRIPT = _REPO / "benchmark" / "mla_eviction" / "upstream_patch.py"
sys.path.insert(0, str(SCRIPT.parent))

import upstream_patch  # noqa: E402


class TestVersionCheck(CustomTestCase):
    def with_installed(self, version):
        def lookup(name):
            self.assertEqual(name, "sglang")
            if version is None:
                raise metadata.PackageNotFoundError(name)
            return version

        return mock.patch.object(mla_version_check.metadata, "version", lookup)

    def test_supported_range(self):
        self.assertEqual(SUPPORTED_SGLANG, ">=0.5.23,<0.5.24")

    def test_supported_versions_pass(self):
        for version in ("0.5.23", "0.5.23.post1", "0.5.23+cu129"):
            with self.with_installed(version):
                self.assertEqual(check_sglang_version(), version)

    def test_unsupported_versions_raise_with_an_install_hint(self):
        for version in ("0.5.22", "0.5.24", "0.6.0", "0.5.23rc1", "not-a-version"):
            with self.with_installed(version), self.assertRaises(RuntimeError) as ctx:
                check_sglang_version()
            self.assertTrue(
                str(ctx.exception).startswith(
                    "sglang-mla-eviction supports sglang >=0.5.23,<0.5.24; "
                    f"found {version}. Install sglang==0.5.23 "
                ),
                str(ctx.exception),
            )

    def test_missing_sglang_raises(self):
        with self.with_installed(None), self.assertRaisesRegex(
            RuntimeError, "found no sglang distribution"
        ):
            check_sglang_version()

    def test_the_installed_sglang_is_supported(self):
        self.assertEqual(check_sglang_version(), metadata.version("sglang"))


class TestSelection(CustomTestCase):
    def test_modules_come_from_pyproject_minus_plugin_and_version_check(self):
        modules = upstream_patch.exported_modules()
        self.assertIn("sglang.srt.mem_cache.mla_cost_model", modules)
        self.assertIn("sglang.srt.mem_cache.mla_aware_policy", modules)
        for module in upstream_patch.NOT_UPSTREAM:
            self.assertNotIn(module, modules)
        for module in modules:
            self.assertTrue((_REPO / upstream_patch.module_path(module)).is_file(), module)

    def test_tests_that_need_the_project_are_not_exported(self):
        dependencies = upstream_patch.project_dependencies
        self.assertEqual(
            dependencies("from sglang.srt.mem_cache.mla_eviction_plugin import register"),
            ["mla_eviction_plugin"],
        )
        self.assertEqual(
            dependencies("import sglang.srt.mem_cache.mla_version_check as v"),
            ["mla_version_check"],
        )
        self.assertEqual(
            dependencies('mock.patch("sglang.srt.mem_cache.mla_eviction_plugin.x")'),
            ["mla_eviction_plugin"],
        )
        self.assertEqual(
            dependencies('sys.path.insert(0, os.path.join(ROOT, "benchmark", "x"))'),
            ["benchmark/"],
        )
        self.assertEqual(
            dependencies(
                '"""Mentions the plugin (mla_eviction_plugin) and benchmark/."""\n'
                "from sglang.benchmark.serving import run_benchmark\n"
                "from sglang.srt.mem_cache.mla_cost_model import KVCostModel\n"
            ),
            [],
        )
        exported = upstream_patch.exported_tests()
        self.assertNotIn(f"{upstream_patch.TEST_DIR}/test_mla_eviction_plugin.py", exported)
        self.assertNotIn(f"{upstream_patch.TEST_DIR}/test_upstream_patch.py", exported)
        self.assertNotIn(f"{upstream_patch.TEST_DIR}/test_e2e_dry_run.py", exported)


PLUGIN_TEST = """\
import unittest
from sglang.srt.mem_cache.mla_eviction_plugin import register
from sglang.srt.mem_cache.utils import get_eviction_strategy


class A(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        register()

    def test_a(self):
        register()
        get_eviction_strategy("mla_aware")


class B(unittest.TestCase):
    def setUp(self):
        register()
        self.x = 1

    def test_b(self):
        if self.x:
            register()
"""

UPSTREAM_TEST = """\
import unittest
from sglang.srt.mem_cache.utils import get_eviction_strategy


class A(unittest.TestCase):
    def test_a(self):
        get_eviction_strategy("mla_aware")


class B(unittest.TestCase):
    def setUp(self):
        self.x = 1

    def test_b(self):
        if self.x:
            pass
"""


class TestPluginRegistrationDropped(CustomTestCase):
    def test_register_calls_and_import_go(self):
        self.assertEqual(upstream_patch.drop_plugin_registration(PLUGIN_TEST), UPSTREAM_TEST)
        self.assertEqual(upstream_patch.project_dependencies(UPSTREAM_TEST), [])

    def test_other_uses_of_the_plugin_keep_the_test_out(self):
        source = PLUGIN_TEST + "\nHOOK = register\n"
        self.assertEqual(upstream_patch.drop_plugin_registration(source), source)
        self.assertEqual(upstream_patch.project_dependencies(source), ["mla_eviction_plugin"])


class TestEdits(CustomTestCase):
    def test_anchor_must_occur_once(self):
        edit = upstream_patch.Edit("f.py", "b\n", "x\n")
        self.assertEqual(edit.apply("a\nb\nc\n"), "a\nb\nx\nc\n")
        before = upstream_patch.Edit("f.py", "b\n", "x\n", where="before")
        self.assertEqual(before.apply("a\nb\n"), "a\nx\nb\n")
        replace = upstream_patch.Edit("f.py", "b\n", "x\n", where="replace")
        self.assertEqual(replace.apply("a\nb\n"), "a\nx\n")
        for source in ("a\nc\n", "b\nb\n"):
            with self.assertRaisesRegex(upstream_patch.ExportError, "f.py: anchor found"):
                edit.apply(source)

    def test_every_edit_applies_to_the_installed_wheel(self):
        sglang_dir = upstream_patch.installed_sglang_dir()
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp)
            for path in {e.path for e in upstream_patch.EDITS}:
                src = sglang_dir / Path(path).relative_to("python/sglang")
                (tree / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, tree / path)
            changed = upstream_patch.apply_edits(tree)
            self.assertEqual(len(changed), len({e.path for e in upstream_patch.EDITS}))
            for path in changed:
                compile((tree / path).read_text(), path, "exec")


class TestSeries(CustomTestCase):
    """The slow part: one `check --keep DIR` run, then its series and its outcome."""

    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.TemporaryDirectory()
        cls.work = Path(cls._tmp.name) / "work"
        cls.result = subprocess.run(
            [sys.executable, str(SCRIPT), "check", "--keep", str(cls.work)],
            capture_output=True,
            text=True,
            env={**os.environ, "SGLANG_PLUGINS": ""},
            timeout=420,
        )

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()

    def test_check_applies_the_series_and_its_tests_pass(self):
        out = self.result.stdout[-4000:] + self.result.stderr[-4000:]
        self.assertEqual(self.result.returncode, 0, out)
        self.assertRegex(self.result.stdout, r"applied \d+ patches to sglang 0\.5\.23")
        self.assertRegex(self.result.stdout, r"\d+ passed")
        self.assertNotRegex(self.result.stdout, r"\d+ (failed|error)")

    def test_export_writes_a_numbered_format_patch_series(self):
        patches = sorted((self.work / "patches").iterdir())
        self.assertGreaterEqual(len(patches), 3)
        total = len(patches)
        for n, patch in enumerate(patches, 1):
            self.assertRegex(patch.name, rf"^{n:04d}-[\w.-]+\.patch$")
            text = patch.read_text()
            head = text.splitlines()[:4]
            self.assertRegex(head[0], r"^From [0-9a-f]{40} Mon Sep 17 00:00:00 2001$")
            self.assertRegex(head[1], r"^From: .+ <.+@.+>$")
            self.assertRegex(head[2], r"^Date: ")
            self.assertRegex(head[3], rf"^Subject: \[PATCH {n}/{total}\] ")
            self.assertIn("\n---\n", text)
            self.assertRegex(text, r"\ndiff --git a/")
            self.assertNotIn("mla_eviction_plugin.py", text)
            self.assertNotIn("mla_version_check.py", text)
        first = patches[0].read_text()
        for module in upstream_patch.exported_modules():
            self.assertIn(f"+++ b/{upstream_patch.module_path(module)}", first)
        series = "\n".join(p.read_text() for p in patches)
        for path in (
            "srt/mem_cache/utils.py",
            "srt/arg_groups/choices.py",
            "srt/arg_groups/fields/memory.py",
            "srt/arg_groups/memory_hook.py",
            "srt/arg_groups/pipeline.py",
            "srt/mem_cache/unified_cache/tree_core_registry.py",
            "srt/mem_cache/kv_cache_builder.py",
        ):
            self.assertIn(f"+++ b/python/sglang/{path}", series)
        for test in [*upstream_patch.exported_tests(), upstream_patch.WIRING_TEST]:
            self.assertIn(f"+++ b/{test}", series)

    def test_export_command_line(self):
        with self.assertRaises(SystemExit):
            upstream_patch.main(["export", "--out", str(self.work / "x"), "--author", "nobody"])
        with self.assertRaises(SystemExit):
            upstream_patch.main(["export"])


if __name__ == "__main__":
    unittest.main()
