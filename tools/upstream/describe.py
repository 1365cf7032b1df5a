"""Reading a written series (added lines per patch) and its PR descriptions.

Used by ``tools/upstream_patch.py``. Figures come from the project's
``docs/results/*.json`` at export time and are labelled as CPU replay figures.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from string import Template
from typing import Any, Sequence

from upstream.edits import DOCS, MESSAGES, SUITE

HERE = Path(__file__).resolve().parent


def is_test_path(path: str) -> bool:
    return path.startswith("test/")


def added_lines(patch_text: str) -> dict[str, int]:
    """Lines each file gains in a ``git format-patch`` text (``+`` lines of hunks)."""
    counts: dict[str, int] = {}
    current = None
    in_hunk = False
    for line in patch_text.splitlines():
        header = re.match(r"diff --git a/(\S+) b/(\S+)$", line)
        if header:
            current, in_hunk = header.group(2), False
            counts.setdefault(current, 0)
        elif line.startswith("@@") and current is not None:
            in_hunk = True
        elif in_hunk and line.startswith("+"):
            counts[current] += 1
        elif in_hunk and not line.startswith((" ", "-", "\\")):
            in_hunk = line == ""  # blank context lines never occur in git's output
    return counts


def line_counts(patch: Path) -> tuple[int, int]:
    """(added non-test lines, added test lines) of a patch file."""
    counts = added_lines(patch.read_text())
    non_test = sum(n for path, n in counts.items() if not is_test_path(path))
    return non_test, sum(counts.values()) - non_test


def summary_table(patches: Sequence[Path]) -> str:
    """Markdown table of the series: added non-test and test lines per patch."""
    rows = ["| patch | added non-test lines | added test lines |", "|---|---|---|"]
    for patch in patches:
        non_test, test = line_counts(patch)
        rows.append(f"| `{patch.name}` | {non_test} | {test} |")
    return "\n".join(rows)


def replay_figures(root: Path) -> str:
    """CPU replay figures from ``docs/results/*.json`` (``results`` rows), as tables."""
    blocks = []
    for path in sorted((root / "docs" / "results").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rows = data.get("results") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not rows:
            continue
        try:
            blocks.append(_figures_table(path.relative_to(root), data, rows, root))
        except (KeyError, TypeError, ValueError):
            continue
    if not blocks:
        return (
            "No replay results are recorded in this export's project; see docs/results "
            "in the project repository."
        )
    return "\n\n".join(blocks)


_BUILTINS = ("lru", "lfu", "fifo", "slru", "priority", "tlru")


def _figures_table(rel: Path, data: dict, rows: list, root: Path) -> str:
    def pick(cap, policy):  # the stock (Rust) core's row first, when rows name one
        found = [r for r in rows if r["capacity"] == cap and r["policy"] == policy]
        found.sort(key=lambda r: r.get("tree_core") != "rust")
        return found[0] if found else None

    def name(r):
        core = r.get("tree_core")
        return f"{r['policy']} ({core})" if core else r["policy"]

    def core(r):
        return f" ({r['tree_core']} core)" if r.get("tree_core") else ""

    def pct(r, key):
        return f"{100 * r[key]:.2f} %"

    capacities = sorted(
        {r["capacity"] for r in rows}, key=lambda c: float(str(c).rstrip("%"))
    )
    head = (
        "CPU replay figures (a trace replayed through SGLang's real radix tree on CPU "
        "with a prefill-time model; not GPU measurements) from "
        f"`{rel}`{_last_commit(root, rel)}: trace "
        f"`{Path(str(data.get('source'))).name}`, {data.get('requests')} requests, "
        f"mode {data.get('mode')}, cache {data.get('cache')}, model "
        f"{data.get('model')}. Capacity: the device pool as a share of the trace's "
        "unique blocks."
    )
    table = [
        "| capacity | token hit: lru | best built-in | mla_aware | offline bound "
        "| FLOP hit: lru → mla_aware | TTFT p50 s: lru → mla_aware "
        "| cache CPU µs/req: lru → mla_aware |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cap in capacities:
        lru, mla = pick(cap, "lru"), pick(cap, "mla_aware")
        if lru is None or mla is None:
            continue
        builtins = [
            r for r in rows if r["capacity"] == cap and r["policy"] in _BUILTINS
        ]
        best = max(builtins, key=lambda r: r["token_hit_rate"])
        bound = pick(cap, "optimal")
        table.append(
            f"| {cap} | {pct(lru, 'token_hit_rate')} | {name(best)} "
            f"{pct(best, 'token_hit_rate')} | {pct(mla, 'token_hit_rate')} | "
            f"{pct(bound, 'token_hit_rate') if bound else '-'} | "
            f"{pct(lru, 'flop_hit_rate')} → {pct(mla, 'flop_hit_rate')} | "
            f"{lru['ttft_p50_s']:.3f} → {mla['ttft_p50_s']:.3f} | "
            f"{lru['cpu_us_per_request']:.0f}{core(lru)} → "
            f"{mla['cpu_us_per_request']:.0f}{core(mla)} |"
        )
    if len(table) == 2:
        raise ValueError(f"{rel}: no capacity with both lru and mla_aware rows")
    return head + "\n\n" + "\n".join(table)


def _last_commit(root: Path, rel: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%h", "--", str(rel)],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return f" (last changed in project commit {out})" if out else ""


SERVER = (
    "python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3 --tp-size 8 \\\n"
    "  --host 127.0.0.1 --port 30000 --max-total-tokens 200000"
)
BENCH = (
    "python -m sglang.benchmark.serving --backend sglang --host 127.0.0.1 --port 30000 \\\n"
    "  --model deepseek-ai/DeepSeek-V3 --seed 1 --max-concurrency 64 \\\n"
)
BENCH_GSP = (
    "  --dataset-name generated-shared-prefix --request-rate inf \\\n"
    "  --gsp-num-groups 128 --gsp-prompts-per-group 16 --gsp-system-prompt-len 4096 \\\n"
    "  --gsp-question-len 256 --gsp-output-len 128 \\\n"
    "  --gsp-group-distribution zipf --gsp-zipf-alpha 1.1 \\\n"
)
BENCH_MOONCAKE = (
    "  --dataset-name mooncake --mooncake-workload conversation --num-prompts 1000 \\\n"
    "  --mooncake-slowdown-factor 1.0 \\\n"
)
BENCH_TAIL = "  --flush-cache --cache-report --output-details --output-file {out}\n"


def benchmark_commands() -> str:
    """The GPU commands a reviewer runs: the stock server, then the flag's."""
    parts = []
    for variant, extra in (
        ("baseline", ""),
        ("mla_aware", " \\\n  --mla-aware-eviction"),
    ):
        parts.append(f"# {variant} server (wait for http://127.0.0.1:30000/health)")
        parts.append(SERVER + extra + " &")
        for dataset, options in (("gsp", BENCH_GSP), ("mooncake", BENCH_MOONCAKE)):
            parts.append(
                BENCH + options + BENCH_TAIL.format(out=f"{variant}_{dataset}.jsonl")
            )
        parts.append("kill %1  # stop the server before the next one\n")
    return "```bash\n" + "\n".join(parts).rstrip() + "\n```"


def write_descriptions(series: Any, root: Path) -> None:
    """One PR description beside each patch (same name, ``.md``)."""
    tests = "\n".join(f"- `{t}`" for t in series.tests)
    values = {
        "commands": benchmark_commands(),
        "figures": replay_figures(root),
        "tests": tests,
        "pytest": " \\\n  ".join(["python -m pytest -q", *series.tests]),
        "suite": SUITE,
        "page": (
            f"`{DOCS}/mla_aware_eviction.mdx`, new"
            if series.with_page
            else "the policy's own page is not part of this series"
        ),
    }
    for patch in series.patches:
        number = int(patch.name[:4])
        template = (HERE / "pr" / f"{number:04d}.md").read_text()
        body = Template(template).substitute(values)
        non_test, test = line_counts(patch)
        subject = MESSAGES[number].split("\n", 1)[0]
        header = (
            f"# {subject}\n\nPatch `{patch.name}` of {len(series.patches)}: "
            f"{non_test} added non-test lines, {test} added test lines.\n\n"
        )
        patch.with_suffix(".md").write_text(header + body)
