"""Export the mla_aware eviction policy as a patch series against upstream SGLang.

    python tools/upstream_patch.py export --out DIR
    python tools/upstream_patch.py check [--keep DIR]

``export`` lays the installed sglang 0.5.23 wheel out as upstream's tree
(``python/sglang/...``) in a throwaway git repository, with the two upstream docs pages
the series edits (``tools/upstream/pages.json``), commits that as the base, commits
the series on top and writes it with ``git format-patch`` into DIR, one PR description
beside each patch (``0001-....md``):

0001  ``EvictionStrategy.on_evict(node)``: the tree tells the strategy of each device
      victim (FullComponent's eviction walk, legacy ``RadixCache.evict``); a test.
0002  the cost model and the ``mla_aware`` policy (copied from this project), their
      registration, ``--mla-aware-eviction`` and its resolution step, the Rust
      TreeCore fallback, the served model's cost model in ``kv_cache_builder.py``, the
      flag's row in ``server_arguments.mdx``.
0003  the project's tests that need nothing but the series and SGLang, plus a wiring
      test (``tools/upstream/tests/``).
0004  the docs page (``docs/advanced_features/mla_aware_eviction.mdx`` of this
      project, when it exists) and the ``mla_aware`` rows of the eviction-policy page.

SGLang's files are changed by exact-string :class:`Edit` s whose anchors must occur
once, so a changed upstream fails loudly instead of producing a wrong patch. Dates and
author are fixed, so two exports of the same project are byte-identical.

``check`` builds and exports the series again on a fresh layout, applies it with
``git am`` to the pristine base, checks the patches (added non-test lines per patch,
forbidden strings) and the format of every Python file the series adds or changes
(ruff format and isort as upstream runs them), then runs the tests the series adds
with pytest against the patched tree: ``PYTHONPATH`` is its ``python/``, no SGLang
plugin is loaded, and this project's editable install is off the import path. Exit
status 0 only if everything passes.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from importlib import metadata, util
from pathlib import Path
from typing import Iterable, Optional, Sequence

from upstream.describe import line_counts, summary_table, write_descriptions
from upstream.edits import (
    DOCS,
    DOCS_EDITS_0002,
    EDITS_0001,
    EDITS_0002,
    MEM_CACHE,
    MESSAGES,
    SGLANG_VERSION,
    SUITE,
    TEST_DIR,
    Edit,
    ExportError,
    apply_edits,
    docs_edits_0004,
)

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent / "upstream"
# The project's page for upstream, and the product modules the series adds.
PROJECT_PAGE = "docs/advanced_features/mla_aware_eviction.mdx"
MODULES = ("mla_cost_model", "mla_aware_policy")
# Project tests that go upstream when they depend on nothing but the series.
CANDIDATE_TESTS = ("test_mla_cost_model.py", "test_mla_aware_policy.py")
NOT_UPSTREAM = (
    "sglang.srt.mem_cache.mla_eviction_plugin",
    "sglang.srt.mem_cache.latent_cache_analyzer",
    "sglang.srt.plugins",
)
FORBIDDEN = ("mla_eviction_plugin", "HookRegistry", "stage-a-test-cpu")
MAX_NON_TEST_LINES = 800
DEFAULT_AUTHOR = "sglang-mla-eviction <sglang-mla-eviction@users.noreply.github.com>"
# Fixed dates keep the exported series byte-identical from one run to the next.
_GIT_DATE = "2026-11-01T00:00:00+00:00"
_PLUGINS_OFF = "none-of-the-installed-plugins"
_SERIES_BRANCH = "mla-aware-eviction"
FORMAT_CHECKS = (
    ("ruff format", ("-m", "ruff", "format", "--line-length", "88", "--diff")),
    ("isort", ("-m", "isort", "--profile", "black", "-p", "sglang", "--diff")),
)


# ---------------------------------------------------------------------------
# Upstream docs pages and the base tree
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    """An upstream docs page the series edits, cached under tools/upstream/pages/."""

    path: str  # in upstream's tree
    commit: str
    sha256: str
    chars: int  # of the upstream file
    excerpt: Optional[tuple[int, int]]  # [start, end) characters, or the whole file

    @property
    def cache(self) -> Path:
        return HERE / "pages" / Path(self.path).name


def upstream_pages() -> tuple[str, list[Page]]:
    """The upstream repository and its pages, from ``tools/upstream/pages.json``."""
    data = json.loads((HERE / "pages.json").read_text())
    pages = [
        Page(
            p["path"],
            p["commit"],
            p["sha256"],
            p["chars"],
            tuple(p["excerpt"]) if p.get("excerpt") else None,
        )
        for p in data["pages"]
    ]
    return data["repo"], pages


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
    """Run git in ``repo`` with a fixed identity and dates; stdout, or ExportError."""
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


def layout_upstream_tree(
    dest: Path,
    sglang_dir: Optional[Path] = None,
    warnings: Optional[list] = None,
    only: Optional[Iterable[str]] = None,
) -> Path:
    """A git repository at ``dest``: the wheel as ``python/sglang`` and the cached
    upstream docs pages, committed on ``main``. A page missing from the cache, or not
    the one pages.json records, is left out with a warning.

    ``only``: lay out just these ``python/sglang/...`` files (enough to write the
    series, whose patches do not depend on the files they leave alone).
    """
    sglang_dir = sglang_dir or installed_sglang_dir()
    dest.mkdir(parents=True)
    if only is None:
        shutil.copytree(
            sglang_dir,
            dest / "python" / "sglang",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            copy_function=shutil.copyfile,
        )
    for rel in only or ():
        source = sglang_dir / Path(rel).relative_to("python/sglang")
        if not source.is_file():
            raise ExportError(f"{rel}: not in the sglang {SGLANG_VERSION} wheel")
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest / rel)
    repo, pages = upstream_pages()
    laid = []
    for page in pages:
        if not page.cache.is_file():
            _warn(
                warnings,
                f"{page.path}: no cached copy at {page.cache}; its edits are left out",
            )
            continue
        text = page.cache.read_text()
        if hashlib.sha256(text.encode()).hexdigest() != page.sha256:
            _warn(
                warnings,
                f"{page.cache}: not the page pages.json records; its edits are left out",
            )
            continue
        (dest / page.path).parent.mkdir(parents=True, exist_ok=True)
        (dest / page.path).write_text(text)
        laid.append(f"{page.path} @ {page.commit[:12]}")
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    message = f"sglang {SGLANG_VERSION} (the PyPI wheel's python package)"
    if laid:
        message += f"\n\nDocs pages from {repo}: " + ", ".join(laid)
    git(dest, "commit", "-q", "-m", message)
    return dest


def _warn(warnings: Optional[list], message: str) -> None:
    if warnings is not None and message not in warnings:
        warnings.append(message)


# ---------------------------------------------------------------------------
# Which project tests go upstream
# ---------------------------------------------------------------------------


def _docstring_ids(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _module_file(roots: Sequence[Path], module: str) -> Optional[Path]:
    """The source of ``module`` under the first of ``roots`` that has it, or None."""
    for root in roots:
        base = root / Path(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        if base.is_dir():
            return base  # a namespace package
    return None


def _top_level_names(path: Path) -> Optional[set[str]]:
    """Names a module defines at top level; None if it star-imports (anything goes)."""
    if path.is_dir():
        return {p.stem for p in path.iterdir()}
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names)
    return names


def project_dependencies(source: str, roots: Sequence[Path]) -> list[str]:
    """What ties a test to this project rather than to the series and SGLang.

    ``roots`` hold ``sglang`` with the series applied: the series' tree's
    ``python/`` (the modules it adds), then the wheel's directory.
    Reasons: an import of the plugin, the analyzer or SGLang's plugin machinery (or a
    string naming them, as ``mock.patch`` targets do); an ``sglang`` module the tree
    lacks, or a name it lacks in one it has; a module found nowhere but in this
    project; a string naming the project's ``benchmark`` directory. Docstrings are
    not read.
    """
    parsed = ast.parse(source)
    docstrings = _docstring_ids(parsed)
    found: set[str] = set()
    for node in ast.walk(parsed):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.update(_import_problems(alias.name, (), roots))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = tuple(a.name for a in node.names)
            found.update(_import_problems(node.module, names, roots))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docstrings:
                continue
            for module in NOT_UPSTREAM:
                if module.rsplit(".", 1)[1] in node.value:
                    found.add(f"names {module}")
            if "HookRegistry" in node.value:
                found.add("names HookRegistry")
            if re.search(r"(^|[/\\])benchmark([/\\]|$)", node.value):
                found.add("names benchmark/")
    return sorted(found)


def _import_problems(
    module: str, names: tuple[str, ...], roots: Sequence[Path]
) -> list[str]:
    if any(module == m or module.startswith(m + ".") for m in NOT_UPSTREAM):
        return [f"imports {module}"]
    for name in names:
        if f"{module}.{name}" in NOT_UPSTREAM:
            return [f"imports {module}.{name}"]
    top = module.split(".")[0]
    if top == "sglang":
        path = _module_file(roots, module)
        if path is None:
            return [f"imports {module}, which the series' tree lacks"]
        defined = _top_level_names(path)
        missing = [
            n
            for n in names
            if defined is not None
            and n not in defined
            and _module_file(roots, f"{module}.{n}") is None
        ]
        return [f"imports {module}.{n}, which the series' tree lacks" for n in missing]
    if top in sys.stdlib_module_names:
        return []
    spec = util.find_spec(top)
    origin = spec and (
        spec.origin or next(iter(spec.submodule_search_locations or ()), None)
    )
    if origin is None:
        return [f"imports {top}, which is not installed"]
    origin = Path(origin).resolve()
    installed = {
        Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")
    }
    if origin.is_relative_to(ROOT) and not any(
        origin.is_relative_to(p) for p in installed
    ):
        return [f"imports {top}, found only in this project"]
    return []


def exported_tests(tree: Path, root: Path = ROOT, warnings=None) -> dict[str, str]:
    """Path -> source of the candidate project tests that need only the series.

    ``tree`` has the series' modules in it. The old CPU suite name becomes upstream's
    current one. A test left out is named in ``warnings`` with the reason.
    """
    tests = {}
    for name in CANDIDATE_TESTS:
        rel = f"{TEST_DIR}/{name}"
        path = root / rel
        if not path.is_file():
            _warn(warnings, f"{rel}: not in the project; not exported")
            continue
        source = path.read_text().replace('"stage-a-test-cpu"', f'"{SUITE}"')
        roots = [tree / "python", installed_sglang_dir().parent]
        reasons = project_dependencies(source, roots)
        if reasons:
            _warn(warnings, f"{rel}: not exported: it {'; '.join(reasons)}")
            continue
        tests[rel] = source
    return tests


# ---------------------------------------------------------------------------
# The series
# ---------------------------------------------------------------------------


@dataclass
class Series:
    """What one export produced."""

    patches: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)  # test files the series adds
    left_out: list[str] = field(default_factory=list)  # project tests not exported
    with_page: bool = False


def _commit(tree: Path, paths: Sequence[str], message: str, author: str) -> None:
    git(tree, "add", "--", *paths, author=author)
    git(tree, "commit", "-q", "-m", message, author=author)


def _add_files(tree: Path, files: dict[str, str]) -> list[str]:
    """Write new files (path -> text) into ``tree``; an existing path is an error."""
    for rel, text in files.items():
        if (tree / rel).exists():
            raise ExportError(f"{rel}: already in the base tree; refusing to overwrite")
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    return list(files)


def _present(tree: Path, edits: Iterable[Edit], series: Series) -> list[Edit]:
    """The edits whose file is in the base tree; the others warned about."""
    kept = []
    for edit in edits:
        if (tree / edit.path).is_file():
            kept.append(edit)
        else:
            _warn(series.warnings, f"{edit.path}: not in the base tree; not edited")
    return kept


def build_series(tree: Path, root: Path, author: str, series: Series) -> None:
    """Commit the series on the checked-out branch of ``tree``."""
    test_files = {
        f"{TEST_DIR}/test_eviction_strategy_on_evict.py": (
            HERE / "tests" / "test_eviction_strategy_on_evict.py"
        ).read_text()
    }
    changed = apply_edits(tree, EDITS_0001)
    _commit(tree, changed + _add_files(tree, test_files), MESSAGES[1], author)
    series.tests += list(test_files)

    modules = {}
    for name in MODULES:
        path = root / "python/sglang/srt/mem_cache" / f"{name}.py"
        if not path.is_file():
            raise ExportError(f"{path}: missing; the series needs it")
        modules[f"{MEM_CACHE}/{name}.py"] = path.read_text()
    added = _add_files(tree, modules)
    edits = [*EDITS_0002, *_present(tree, DOCS_EDITS_0002, series)]
    _commit(tree, added + apply_edits(tree, edits), MESSAGES[2], author)

    tests = exported_tests(tree, root, series.warnings)
    series.left_out = [
        f"{TEST_DIR}/{n}" for n in CANDIDATE_TESTS if f"{TEST_DIR}/{n}" not in tests
    ]
    wiring = f"{TEST_DIR}/test_mla_aware_eviction_wiring.py"
    tests[wiring] = (HERE / "tests" / "test_mla_aware_eviction_wiring.py").read_text()
    _commit(tree, _add_files(tree, tests), MESSAGES[3], author)
    series.tests += list(tests)

    paths = []
    page = (
        (root / PROJECT_PAGE).read_text() if (root / PROJECT_PAGE).is_file() else None
    )
    unfit = [word for word in FORBIDDEN if page is not None and word in page]
    if page is None:
        _warn(
            series.warnings, f"{PROJECT_PAGE}: not in the project; the page is skipped"
        )
    elif unfit:
        _warn(
            series.warnings,
            f"{PROJECT_PAGE}: names {', '.join(unfit)}, which has no place upstream; "
            "the page is skipped",
        )
    else:
        series.with_page = True
        paths += _add_files(tree, {f"{DOCS}/mla_aware_eviction.mdx": page})
    paths += apply_edits(
        tree, _present(tree, docs_edits_0004(series.with_page), series)
    )
    if paths:
        _commit(tree, paths, MESSAGES[4], author)
    else:
        _warn(series.warnings, "no docs to export; patch 0004 is skipped")


def touched_files() -> list[str]:
    """The wheel's files the series edits: all a base tree needs to write it."""
    every = [*EDITS_0001, *EDITS_0002, *DOCS_EDITS_0002, *docs_edits_0004(True)]
    return sorted({e.path for e in every if e.path.startswith("python/")})


def export(
    out: Path,
    root: Path = ROOT,
    author: str = DEFAULT_AUTHOR,
    base: Optional[Path] = None,
) -> Series:
    """Write the series and its PR descriptions into ``out``; return what was written.

    Old ``NNNN-*.patch`` and ``NNNN-*.md`` files there are removed first. ``base``: a
    tree from :func:`layout_upstream_tree` to build on (on a branch, dropped
    afterwards) instead of laying the wheel out again. Raises ExportError when a patch
    adds more than MAX_NON_TEST_LINES non-test lines or holds a FORBIDDEN string.
    """
    out.mkdir(parents=True, exist_ok=True)
    for old in [
        *out.glob("[0-9][0-9][0-9][0-9]-*.patch"),
        *out.glob("[0-9][0-9][0-9][0-9]-*.md"),
    ]:
        old.unlink()
    series = Series()
    with tempfile.TemporaryDirectory(prefix="sglang-upstream-") as tmp:
        tree = base or layout_upstream_tree(
            Path(tmp) / "sglang", warnings=series.warnings, only=touched_files()
        )
        git(tree, "checkout", "-q", "-b", _SERIES_BRANCH, "main")
        try:
            build_series(tree, root, author, series)
            git(
                tree,
                "format-patch",
                "-q",
                "--no-signature",
                "--zero-commit",  # no commit ids, and full blob ids: the patches are
                "--full-index",  # the same from a sparse or a full base tree
                "-o",
                str(out.resolve()),
                f"main..{_SERIES_BRANCH}",
            )
        finally:
            if base is not None:
                git(tree, "checkout", "-q", "-f", "main")
                git(tree, "clean", "-q", "-f", "-d")
                git(tree, "branch", "-q", "-D", _SERIES_BRANCH)
    series.patches = sorted(out.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    write_descriptions(series, root)
    problems = patch_problems(series.patches)
    if problems:
        raise ExportError("\n".join(problems))
    return series


# ---------------------------------------------------------------------------
# Looking at patches
# ---------------------------------------------------------------------------


def patch_problems(patches: Sequence[Path]) -> list[str]:
    """Patches over the line limit, or holding a forbidden string."""
    problems = []
    for patch in patches:
        non_test, _ = line_counts(patch)
        if non_test > MAX_NON_TEST_LINES:
            problems.append(
                f"{patch.name}: adds {non_test} non-test lines (at most "
                f"{MAX_NON_TEST_LINES})"
            )
        text = patch.read_text()
        for word in FORBIDDEN:
            if word in text:
                problems.append(f"{patch.name}: contains {word!r}")
    return problems


# ---------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------


def format_problems(tree: Path, base: str = "main") -> list[str]:
    """Python files the series adds or changes that are not formatted as upstream's.

    A new file must pass ruff format (88 columns) and isort (black profile, sglang
    first-party) as it is. A changed SGLang file may keep a deviation it already
    had in the base (0.5.23 is not entirely clean); it may not gain one.
    """
    status = git(tree, "diff", "--name-status", base, "HEAD", "--", "*.py")
    problems = []
    for line in status.splitlines():
        kind, rel = line.split("\t", 1)
        for tool, argv in FORMAT_CHECKS:
            new = _format_diff(tree, argv, (tree / rel).read_text(), rel)
            if new is None:
                problems.append(
                    f"format: {rel}: {tool} could not run (python3 {' '.join(argv)})"
                )
                continue
            if kind != "A":
                old = _format_diff(tree, argv, git(tree, "show", f"{base}:{rel}"), rel)
                new -= old or set()
            if new:
                problems.append(
                    f"format: {rel}: not {tool}-clean ({len(new)} change(s) needed)"
                )
    return problems


def _format_diff(
    tree: Path, argv: Sequence[str], source: str, rel: str
) -> Optional[set]:
    """The changes ``python3 argv`` would make to ``source``, as a set of
    (removed lines, added lines) per hunk so that line offsets do not matter."""
    with tempfile.TemporaryDirectory(dir=tree) as tmp:
        path = Path(tmp) / Path(rel).name
        path.write_text(source)
        try:
            result = subprocess.run(
                ["python3", *argv, str(path)], cwd=tree, capture_output=True, text=True
            )
        except OSError:
            return None
        if result.returncode not in (0, 1) or "No module named" in result.stderr:
            return None
        changes, removed, added = set(), [], []
        for line in result.stdout.splitlines() + ["@@"]:
            if line.startswith(("@@", "---", "+++")):
                if removed or added:
                    changes.add((tuple(removed), tuple(added)))
                removed, added = [], []
            elif line.startswith("-"):
                removed.append(line[1:])
            elif line.startswith("+"):
                added.append(line[1:])
        return changes


_PYTEST = """\
import sys
from importlib.machinery import PathFinder

sys.meta_path[:] = [
    f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
]
sglang = PathFinder.find_spec("sglang")
if sglang is None or not str(sglang.submodule_search_locations[0]).startswith(sys.argv[1]):
    sys.exit(f"sglang is not the patched tree's: {sglang}")
import pytest

sys.exit(pytest.main(sys.argv[2:]))
"""


def _tree_pythonpath(tree: Path) -> str:
    """The tree's ``python/`` first; of the caller's PYTHONPATH, entries without sglang."""
    kept = [
        entry
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and not (Path(entry) / "sglang").exists()
    ]
    return os.pathsep.join([str(tree / "python"), *kept])


def check(root: Path = ROOT, keep: Optional[Path] = None) -> int:
    """Export, apply to the pristine base with ``git am``, check, run the tests.

    The series is built on a full layout of the wheel and must equal, byte for byte,
    what ``export`` writes from its sparse one.
    """
    with tempfile.TemporaryDirectory(prefix="sglang-upstream-check-") as tmp:
        work = keep or Path(tmp)
        warnings: list[str] = []
        tree = layout_upstream_tree(work / "sglang", warnings=warnings)
        try:
            series = export(work / "patches", root, base=tree)
            exported = export(work / "exported", root)
        except ExportError as e:
            print(f"FAIL export: {e}", file=sys.stderr)
            return 1
        for warning in warnings + series.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        problems = []
        if _contents(series.patches) != _contents(exported.patches):
            problems.append("export: the sparse export differs from the full one")
        git(tree, "checkout", "-q", "-b", "upstream-check", "main")
        git(tree, "am", "-q", *map(str, series.patches))
        print(f"applied {len(series.patches)} patches to sglang {SGLANG_VERSION}")
        print(summary_table(series.patches))
        problems += format_problems(tree)
        for problem in problems:
            print(f"FAIL {problem}", file=sys.stderr)
        print(
            f"checks: {'FAIL' if problems else 'ok'} (same series sparse and full; "
            "ruff format and isort of the Python files the series adds or changes)"
        )
        print(f"running {len(series.tests)} test files on the patched tree", flush=True)
        env = {
            **os.environ,
            "PYTHONPATH": _tree_pythonpath(tree),
            "SGLANG_PLUGINS": _PLUGINS_OFF,
        }
        pytest = [
            sys.executable,
            "-c",
            _PYTEST,
            str(tree),
            "-q",
            "-p",
            "no:cacheprovider",
        ]
        result = subprocess.run(pytest + series.tests, cwd=tree, env=env)
        ok = result.returncode == 0 and not problems
        print(f"upstream check: {'ok' if ok else 'FAIL'}")
        return 0 if ok else 1


def _contents(paths: Sequence[Path]) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in paths}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_export = sub.add_parser("export", help="write the series and PR descriptions")
    p_export.add_argument("--out", type=Path, required=True, help="output directory")
    p_export.add_argument(
        "--author", default=DEFAULT_AUTHOR, help='"Name <email>" of the commits'
    )
    p_check = sub.add_parser("check", help="apply the series to a fresh tree, test it")
    p_check.add_argument(
        "--keep", type=Path, help="work in this (new) directory and leave it there"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            if not re.fullmatch(r".*?\s*<.*>", args.author):
                parser.error('--author must look like "Name <email>"')
            series = export(args.out, author=args.author)
            for warning in series.warnings:
                print(f"warning: {warning}", file=sys.stderr)
            for patch in series.patches:
                print(patch)
            print(f"\n{summary_table(series.patches)}")
            return 0
        return check(keep=args.keep)
    except ExportError as e:
        print(f"upstream_patch: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
