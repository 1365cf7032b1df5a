"""The upstream export (tools/upstream_patch.py): the series it writes, and its check.

``export`` writes a ``git format-patch`` series against the sglang 0.5.23 wheel laid
out as upstream's tree, with a PR description per patch; ``check`` applies it to a
fresh tree and runs its tests there. ``TestCheck`` runs ``check`` end to end (about
1.5 min on two cores): it is how ``make upstream-check`` is part of ``make test``.
"""

import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=150, suite="base-a-test-cpu")

_REPO = Path(__file__).resolve().parents[4]
TOOL = _REPO / "tools" / "upstream_patch.py"
sys.path.insert(0, str(TOOL.parent))

import upstream_patch  # noqa: E402
from upstream import edits  # noqa: E402

FORBIDDEN = ("mla_eviction_plugin", "HookRegistry", "stage-a-test-cpu")
SUBJECTS = {
    "0001": "mem_cache: tell the eviction strategy of each device victim "
    "(EvictionStrategy.on_evict)",
    "0002": "mem_cache: mla_aware, a cost-aware radix eviction policy "
    "(--mla-aware-eviction)",
    "0003": "test: mla_aware cost model, policy and wiring",
    "0004": "docs: mla_aware eviction",
}


def files_of(patch_text):
    """Path -> lines the patch adds to it, read from the patch text."""
    files, current, in_hunk = {}, None, False
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            files[current], in_hunk = [], False
        elif current is not None and line.startswith("@@ "):
            in_hunk = True
        elif in_hunk and line.startswith("+"):
            files[current].append(line[1:])
    return files


def non_test_lines(patch_text):
    return sum(
        len(lines)
        for path, lines in files_of(patch_text).items()
        if not path.startswith("test/")
    )


def pages_cached():
    _, pages = upstream_patch.upstream_pages()
    return all(page.cache.is_file() for page in pages)


class TestExport(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.mkdtemp(prefix="test-upstream-patch-")
        cls.out = Path(cls._tmp) / "a"
        cls.again = Path(cls._tmp) / "b"
        cls.series = upstream_patch.export(cls.out)
        upstream_patch.export(cls.again)
        cls.texts = {p.name[:4]: p.read_text() for p in cls.series.patches}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls._tmp, ignore_errors=True)

    def test_writes_the_patches_and_a_description_each(self):
        names = sorted(p.name for p in self.out.iterdir())
        patches = [n for n in names if n.endswith(".patch")]
        self.assertEqual(names, sorted(patches + [n[:-6] + ".md" for n in patches]))
        self.assertEqual([n[:4] for n in patches], sorted(self.texts))
        self.assertEqual(sorted(self.texts)[:3], ["0001", "0002", "0003"])
        for number, text in self.texts.items():
            subject = re.search(
                r"^Subject: \[PATCH \d+/\d+\] (.*(?:\n .*)*)", text, re.M
            )
            self.assertEqual(subject.group(1).replace("\n ", " "), SUBJECTS[number])

    def test_each_patch_holds_its_part(self):
        mem_cache = "python/sglang/srt/mem_cache"
        self.assertEqual(
            sorted(files_of(self.texts["0001"])),
            [
                f"{mem_cache}/evict_policy.py",
                f"{mem_cache}/radix_cache.py",
                f"{mem_cache}/unified_cache/components/full.py",
                "test/registered/unit/mem_cache/test_eviction_strategy_on_evict.py",
            ],
        )
        added = files_of(self.texts["0001"])
        self.assertIn(
            "            self.tree_core.eviction_strategy.on_evict(x)",
            added[f"{mem_cache}/unified_cache/components/full.py"],
        )
        self.assertEqual(
            added[f"{mem_cache}/radix_cache.py"],
            ["            self.eviction_strategy.on_evict(x)"],
        )
        second = files_of(self.texts["0002"])
        for module in ("mla_cost_model", "mla_aware_policy"):
            source = (_REPO / f"python/sglang/srt/mem_cache/{module}.py").read_text()
            self.assertEqual(
                second[f"{mem_cache}/{module}.py"], source.splitlines(), module
            )
        self.assertFalse(any(p.startswith("test/") for p in second))
        third = files_of(self.texts["0003"])
        self.assertTrue(all(p.startswith("test/") for p in third))
        wiring = "test/registered/unit/mem_cache/test_mla_aware_eviction_wiring.py"
        self.assertIn(wiring, third)
        for path, lines in {**added, **third}.items():
            if path.startswith("test/"):
                self.assertIn("register_cpu_ci(est_time=", "\n".join(lines), path)
                self.assertIn('suite="base-a-test-cpu")', "\n".join(lines), path)

    def test_no_patch_adds_more_than_800_non_test_lines(self):
        for number, text in self.texts.items():
            self.assertLessEqual(non_test_lines(text), 800, number)

    def test_line_counts_agree_with_the_tool(self):
        for patch in self.series.patches:
            counted = upstream_patch.line_counts(patch)[0]
            self.assertEqual(counted, non_test_lines(patch.read_text()), patch.name)

    def test_no_forbidden_strings(self):
        for path in self.out.iterdir():
            text = path.read_text()
            for word in FORBIDDEN:
                self.assertNotIn(word, text, f"{path.name} holds {word!r}")

    def test_series_is_byte_identical_across_exports(self):
        first = {p.name: p.read_bytes() for p in self.out.iterdir()}
        second = {p.name: p.read_bytes() for p in self.again.iterdir()}
        self.assertEqual(first, second)

    def test_pr_descriptions(self):
        text = (self.out / (self.series.patches[1].stem + ".md")).read_text()
        for needle in (
            "python -m sglang.benchmark.serving",
            "--dataset-name mooncake",
            "--dataset-name generated-shared-prefix",
            "--gsp-num-groups",
            "--mla-aware-eviction",
            "DeepSeek-V3",
            "CPU replay",
            "#30300",
            "#34012",
            "#29173",
        ):
            self.assertIn(needle, text)
        for patch in self.series.patches:
            description = (self.out / (patch.stem + ".md")).read_text()
            self.assertTrue(description.startswith("# "), patch.name)

    @unittest.skipUnless(pages_cached(), "upstream docs pages not cached")
    def test_docs_rows(self):
        page = "docs/docs/advanced_features/server_arguments.mdx"
        added = "\n".join(files_of(self.texts["0002"])[page])
        rows = [
            re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", added + "</tr>", re.S)
        ]
        flag_rows = [r for r in rows if r and "`--mla-aware-eviction`" in r[0]]
        self.assertEqual(len(flag_rows), 1)
        self.assertEqual(len(flag_rows[0]), 4)
        self.assertIn("<code>mla_aware</code>", added)
        policy_page = "docs/docs/advanced_features/radix_eviction_policy.mdx"
        added = "\n".join(files_of(self.texts["0004"])[policy_page])
        self.assertIn("| `mla_aware` |", added)
        for key, kind, default in (
            ("calibration", "string", "none"),
            ("learn_factor", "bool", "`true`"),
            ("learn_weight", "bool", "`true`"),
        ):
            self.assertIn(f"| `{key}` | {kind} | {default} |", added)


class TestEdits(CustomTestCase):
    def test_missing_anchor_names_the_file(self):
        edit = edits.Edit("python/sglang/srt/x.py", "no such text\n", "new\n")
        with self.assertRaisesRegex(
            edits.ExportError, r"^python/sglang/srt/x\.py: anchor found 0 times"
        ):
            edit.apply("some source\n")

    def test_duplicated_anchor_names_the_file(self):
        edit = edits.Edit("python/sglang/srt/x.py", "twice\n", "new\n")
        with self.assertRaisesRegex(
            edits.ExportError, r"^python/sglang/srt/x\.py: anchor found 2 times"
        ):
            edit.apply("twice\ntwice\n")

    def test_missing_file_names_the_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertRaisesRegex(edits.ExportError, r"^python/nope\.py: "):
                edits.apply_edits(Path(tmp), [edits.Edit("python/nope.py", "a", "b")])

    def test_where(self):
        for where, expected in (
            ("after", "a-X-b"),
            ("before", "aX--b"),
            ("replace", "aX-b"),
        ):
            self.assertEqual(edits.Edit("f", "-", "X-", where).apply("a-b"), expected)


class TestTestSelection(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.TemporaryDirectory()
        cls.tree = Path(cls._tmp.name)
        module = cls.tree / "python/sglang/srt/mem_cache/mla_cost_model.py"
        module.parent.mkdir(parents=True)
        module.write_text("class KVCostModel:\n    pass\n")

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()

    def reasons(self, source):
        roots = [self.tree / "python"]
        return upstream_patch.project_dependencies(textwrap.dedent(source), roots)

    def test_series_and_installed_packages_are_fine(self):
        source = """
            '''Docstrings may name mla_eviction_plugin and benchmark/.'''
            import json
            import torch
            from sglang.srt.mem_cache.mla_cost_model import KVCostModel
        """
        self.assertEqual(self.reasons(source), [])

    def test_project_ties_are_found(self):
        cases = {
            "from sglang.srt.mem_cache.mla_eviction_plugin import register": (
                "imports sglang.srt.mem_cache.mla_eviction_plugin"
            ),
            "from sglang.srt.mem_cache.mla_cost_model import Gone": (
                "imports sglang.srt.mem_cache.mla_cost_model.Gone, which the "
                "series' tree lacks"
            ),
            "import sglang.srt.mem_cache.latent_cache_analyzer": (
                "imports sglang.srt.mem_cache.latent_cache_analyzer"
            ),
            "PATH = 'benchmark/mla_eviction/replay.py'": "names benchmark/",
            "TARGET = 'x.mla_eviction_plugin.register'": (
                "names sglang.srt.mem_cache.mla_eviction_plugin"
            ),
            "import no_such_module": "imports no_such_module, which is not installed",
            "import upstream_patch": "imports upstream_patch, found only in this project",
        }
        for source, reason in cases.items():
            self.assertIn(reason, self.reasons(source), source)


class TestFormat(CustomTestCase):
    def test_new_files_must_be_clean_and_changed_ones_gain_nothing(self):
        git = upstream_patch.git
        old = "import os\nimport sys\n\nx = [1,2]\n"  # upstream already off ruff's form
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp)
            (tree / "old.py").write_text(old)
            git(tree, "init", "-q", "-b", "main")
            git(tree, "add", "-A")
            git(tree, "commit", "-q", "-m", "base")
            git(tree, "checkout", "-q", "-b", "series")
            (tree / "old.py").write_text(old + "y = 1\n")  # keeps its deviation
            (tree / "new.py").write_text("import sys\nimport os\n")  # isort order
            git(tree, "add", "-A")
            git(tree, "commit", "-q", "-m", "change")
            self.assertEqual(
                upstream_patch.format_problems(tree),
                ["format: new.py: not isort-clean (1 change(s) needed)"],
            )
            (tree / "old.py").write_text(old + "y = {'a':1}\n")  # a new deviation
            git(tree, "commit", "-q", "-a", "-m", "worse")
            self.assertEqual(
                upstream_patch.format_problems(tree),
                [
                    "format: new.py: not isort-clean (1 change(s) needed)",
                    "format: old.py: not ruff format-clean (1 change(s) needed)",
                ],
            )


class TestCheck(CustomTestCase):
    def test_check_applies_the_series_and_its_tests_pass(self):
        result = subprocess.run(
            [sys.executable, str(TOOL), "check"],
            cwd=_REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        output = result.stdout + result.stderr
        self.assertEqual(result.returncode, 0, output[-6000:])
        self.assertIn("upstream check: ok", output)
        self.assertIn("checks: ok", output)
        self.assertRegex(output, r"applied \d patches to sglang 0\.5\.23")


if __name__ == "__main__":
    unittest.main()
