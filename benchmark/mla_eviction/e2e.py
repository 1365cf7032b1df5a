"""End-to-end comparison of ``--mla-aware-eviction`` with stock SGLang, on a GPU node.

Needs a node with SGLang, this package and real weights. Two servers with identical
settings, one after the other on the same loopback port, the second with
``--mla-aware-eviction``::

    python benchmark/mla_eviction/e2e.py --model-path deepseek-ai/DeepSeek-V3 --tp-size 8 \\
        --max-total-tokens 200000 --mooncake-trace /path/to/trace.jsonl

Each server is benchmarked with ``python -m sglang.benchmark.serving`` on the
``generated-shared-prefix`` dataset (Zipf-distributed prefix groups) and on a
``mooncake`` trace, ``--cache-report --output-details --output-file OUT/<variant>_<dataset>.jsonl``,
after a ``--flush-cache``. The report is a markdown table per dataset: cached prompt
tokens (the server's ``meta_info["cached_tokens"]``, summed by the bench), hit rate,
TTFT mean/p50/p99 and throughput, with the ratio mla_aware / baseline of each.
Cache pressure is what makes the policies differ: give a ``--max-total-tokens`` (or
``--mem-fraction-static``) below the workload's working set.

``--correctness`` instead sends the same fixed prompts, one at a time, greedy
(temperature 0), to both servers through ``/generate`` and compares the output token
ids exactly: the eviction order may change what is recomputed, never what is
generated. The pool is kept small (``--max-total-tokens``, default
:data:`CORRECTNESS_MAX_TOTAL_TOKENS`) and the prompts' shared prefixes add up to several
times it, so evictions happen; ``--enable-deterministic-inference`` (on by default
here) keeps a cache hit and a recompute numerically identical. Exit status 1 on any
mismatch.

``--server-args`` adds launch options to both servers; it may not set what the script
sets, nor ``--radix-eviction-policy`` or ``--radix-cache-backend`` (the flag selects
the ``mla_aware`` policy and radix-cache backend; the baseline stays stock).

``--dry-run`` prints every command, in order, and runs nothing. Servers run in their
own process group and are always stopped (SIGTERM, then SIGKILL), whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

LOOPBACK = "127.0.0.1"
FLAG = "--mla-aware-eviction"
SCRIPT_SETS = (FLAG, "--host", "--port", "--model-path", "--tp-size")
# What the flag sets; either one in --server-args would change the baseline too.
POLICY_OPTIONS = ("--radix-eviction-policy", "--radix-cache-backend")
VARIANTS = ("baseline", "mla_aware")
DATASETS = ("gsp", "mooncake")
CORRECTNESS_MAX_TOTAL_TOKENS = 16384
_WORDS = (
    "cache latent prefix token attention layer expert router kernel tensor page "
    "block memory budget request decode prefill batch stream host device radix "
    "tree node eviction policy cost depth reuse window rank shard"
).split()


# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------


def correctness_pool_tokens(args: argparse.Namespace) -> Optional[int]:
    """--max-total-tokens of the correctness servers: the flag's value, else a small pool
    unless --mem-fraction-static sizes it."""
    if args.max_total_tokens is None and args.mem_fraction_static is None:
        return CORRECTNESS_MAX_TOTAL_TOKENS
    return args.max_total_tokens


def server_command(
    args: argparse.Namespace, variant: str, *, correctness: bool = False
) -> list[str]:
    """``launch_server`` argv; the mla_aware one is the baseline's plus the flag, last."""
    cmd = [args.python, "-m", "sglang.launch_server", "--model-path", args.model_path]
    cmd += [
        "--host",
        LOOPBACK,
        "--port",
        str(args.port),
        "--tp-size",
        str(args.tp_size),
    ]
    max_total_tokens = (
        correctness_pool_tokens(args) if correctness else args.max_total_tokens
    )
    if args.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(args.mem_fraction_static)]
    if max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(max_total_tokens)]
    if correctness and args.deterministic:
        cmd += ["--enable-deterministic-inference"]
    cmd += shlex.split(args.server_args)
    if variant == "mla_aware":
        cmd.append(FLAG)
    return cmd


def bench_command(args: argparse.Namespace, variant: str, dataset: str) -> list[str]:
    """``sglang.benchmark.serving`` argv for one dataset against the running server."""
    options = {
        "--backend": "sglang",
        "--host": LOOPBACK,
        "--port": args.port,
        "--model": args.model_path,
        "--seed": args.seed,
        "--max-concurrency": args.max_concurrency,
        "--output-file": bench_output(args, variant, dataset),
    }
    if dataset == "gsp":
        options.update(
            {
                "--dataset-name": "generated-shared-prefix",
                "--request-rate": args.request_rate,
                "--gsp-num-groups": args.gsp_num_groups,
                "--gsp-prompts-per-group": args.gsp_prompts_per_group,
                "--gsp-system-prompt-len": args.gsp_system_prompt_len,
                "--gsp-question-len": args.gsp_question_len,
                "--gsp-output-len": args.gsp_output_len,
                "--gsp-group-distribution": "zipf",
                "--gsp-zipf-alpha": args.gsp_zipf_alpha,
            }
        )
    else:
        options.update(
            {
                "--dataset-name": "mooncake",
                "--dataset-path": args.mooncake_trace,
                "--mooncake-workload": args.mooncake_workload,
                "--num-prompts": args.mooncake_num_prompts,
                "--mooncake-slowdown-factor": args.mooncake_slowdown_factor,
            }
        )
    cmd = [args.python, "-m", "sglang.benchmark.serving"]
    for option, value in options.items():
        if value is not None:
            cmd += [option, str(value)]
    return cmd + [
        "--flush-cache",
        "--cache-report",
        "--output-details",
        "--disable-tqdm",
    ]


def bench_output(args: argparse.Namespace, variant: str, dataset: str) -> Path:
    return Path(args.out) / f"{variant}_{dataset}.jsonl"


def base_url(args: argparse.Namespace) -> str:
    return f"http://{LOOPBACK}:{args.port}"


def plan_lines(args: argparse.Namespace) -> list[str]:
    """What a run does, in order: commands as shell lines, other steps as comments."""
    lines = []
    for variant in VARIANTS:
        lines.append(f"# {variant} server")
        lines.append(
            shlex.join(server_command(args, variant, correctness=args.correctness))
        )
        lines.append(f"# wait for {base_url(args)}/health")
        if args.correctness:
            lines.append(
                f"# POST {base_url(args)}/generate: {args.correctness_prompts} fixed "
                f"prompts, one at a time, temperature 0, max_new_tokens "
                f"{args.correctness_output_len}"
            )
        else:
            lines += [
                shlex.join(bench_command(args, variant, d)) for d in args.datasets
            ]
        lines.append(
            f"# stop the {variant} server (its process group: SIGTERM, then SIGKILL)"
        )
    return lines


# ---------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------


class Server:
    """A server process in its own process group; a context manager that always stops it."""

    def __init__(self, cmd: Sequence[str], log_path: Path, url: str):
        self.cmd, self.log_path, self.url = list(cmd), log_path, url
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float, poll_s: float = 2.0) -> None:
        """Return once GET /health answers 200; raise if the server exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with status {self.proc.returncode} before it was "
                    f"healthy; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(poll_s)
        raise TimeoutError(
            f"{self.url}/health not ready after {timeout_s:.0f} s; see {self.log_path}"
        )

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; safe to call twice."""
        if self.proc is None or self.proc.returncode is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # Children may outlive the leader; make sure none of the group is left.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._wait_port_free()

    def _wait_port_free(self, timeout_s: float = 60.0) -> None:
        """Wait until nothing answers on the port, so the next server can bind it."""
        host, port = self.url.rsplit("/", 1)[-1].rsplit(":", 1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
            except OSError:
                return
            time.sleep(0.5)


def post_json(url: str, body: dict, timeout_s: float = 600.0) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        return json.loads(r.read())


# ---------------------------------------------------------------------------
# Benchmark report
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchFigures:
    """What one bench run measured (the last JSON line of its --output-file)."""

    completed: int
    prompt_tokens: int
    cached_tokens: int
    mean_ttft_ms: float
    p50_ttft_ms: float
    p99_ttft_ms: float
    output_throughput: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def read_bench_output(path: Path) -> BenchFigures:
    """Figures of the last run recorded in a bench ``--output-file`` (JSON lines).

    Cached tokens come from ``cache_report`` (``--cache-report``), else from the
    per-request ``cached_tokens`` list (``--output-details``); ValueError if neither.
    """
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no benchmark result")
    r = json.loads(lines[-1])
    report = r.get("cache_report")
    if report:
        prompt, cached = report["total_prompt_tokens"], report["total_cached_tokens"]
    elif "cached_tokens" in r:
        prompt, cached = r["total_input_tokens"], sum(r["cached_tokens"])
    else:
        raise ValueError(f"{path}: no cached-token figures; bench with --cache-report")
    return BenchFigures(
        completed=int(r["completed"]),
        prompt_tokens=int(prompt),
        cached_tokens=int(cached),
        mean_ttft_ms=float(r["mean_ttft_ms"]),
        p50_ttft_ms=float(r["median_ttft_ms"]),
        p99_ttft_ms=float(r["p99_ttft_ms"]),
        output_throughput=float(r["output_throughput"]),
    )


# (label, how to read it, format)
METRICS: tuple[tuple[str, Callable[[BenchFigures], float], str], ...] = (
    ("completed requests", lambda f: f.completed, "{:.0f}"),
    ("prompt tokens", lambda f: f.prompt_tokens, "{:.0f}"),
    ("cached tokens", lambda f: f.cached_tokens, "{:.0f}"),
    ("cache hit rate", lambda f: f.hit_rate, "{:.2%}"),
    ("TTFT mean (ms)", lambda f: f.mean_ttft_ms, "{:.1f}"),
    ("TTFT p50 (ms)", lambda f: f.p50_ttft_ms, "{:.1f}"),
    ("TTFT p99 (ms)", lambda f: f.p99_ttft_ms, "{:.1f}"),
    ("output throughput (tok/s)", lambda f: f.output_throughput, "{:.1f}"),
)


def ratio(mla_aware: float, baseline: float) -> Optional[float]:
    """mla_aware / baseline; None when the baseline is 0."""
    return mla_aware / baseline if baseline else None


def format_report(results: dict[str, tuple[BenchFigures, BenchFigures]]) -> str:
    """Markdown: one table per dataset, baseline and mla_aware side by side, with ratios."""
    out = []
    for dataset, (base, mla) in results.items():
        out += [
            f"### {dataset}",
            "",
            "| metric | baseline | mla_aware | mla_aware / baseline |",
            "|---|---:|---:|---:|",
        ]
        for label, get, fmt in METRICS:
            r = ratio(get(mla), get(base))
            shown = "n/a" if r is None else f"{r:.3f}"
            b, m = fmt.format(get(base)), fmt.format(get(mla))
            out.append(f"| {label} | {b} | {m} | {shown} |")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------


def correctness_prompts(
    num_prompts: int, max_total_tokens: int, seed: int = 0
) -> list[str]:
    """Fixed prompts whose shared prefixes add up to several pools' worth of tokens.

    24 "documents" of different lengths (max_total_tokens/16 to /6 words of about one
    token each, so each request fits the pool; about 2.7 pools in all) are asked about
    in a Zipf-like order: hot documents come back after others pushed them out, cold
    ones once or twice. The same arguments always give the same prompts.
    """
    rng = random.Random(seed)
    num_docs = 24
    lo, hi = max(16, max_total_tokens // 16), max(16, max_total_tokens // 6)
    docs = []
    for d in range(num_docs):
        body = " ".join(rng.choices(_WORDS, k=lo + (hi - lo) * d // (num_docs - 1)))
        docs.append(f"Document {d}: {body}\n")
    weights = [1 / (rank + 1) for rank in range(num_docs)]
    revisits = rng.choices(range(num_docs), weights, k=max(0, num_prompts - num_docs))
    order = (list(range(num_docs)) + revisits)[:num_prompts]
    return [
        f"{docs[d]}Question {i}: which word follows '{rng.choice(_WORDS)}' most often "
        "above? Answer:"
        for i, d in enumerate(order)
    ]


@dataclass(frozen=True)
class Generation:
    output_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    cached_tokens: int


def generate_all(
    url: str, prompts: Sequence[str], max_new_tokens: int
) -> list[Generation]:
    """Send the prompts one at a time, greedy; keep what each answered."""
    out = []
    for prompt in prompts:
        r = post_json(
            f"{url}/generate",
            {
                "text": prompt,
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            },
        )
        meta = r.get("meta_info", {})
        out.append(
            Generation(
                output_ids=tuple(r.get("output_ids") or ()),
                text=r["text"],
                prompt_tokens=int(meta.get("prompt_tokens", 0)),
                cached_tokens=int(meta.get("cached_tokens", 0)),
            )
        )
    return out


def compare_generations(
    prompts: Sequence[str], base: Sequence[Generation], mla: Sequence[Generation]
) -> list[str]:
    """One line per prompt whose greedy output differs (token ids, else text)."""
    mismatches = []
    for i, (p, b, m) in enumerate(zip(prompts, base, mla, strict=True)):
        if b.output_ids and m.output_ids:
            same = b.output_ids == m.output_ids
        else:
            same = b.text == m.text
        if not same:
            mismatches.append(
                f"prompt {i} ({p[:24]!r}...): baseline {b.text[:60]!r} "
                f"!= mla_aware {m.text[:60]!r}"
            )
    return mismatches


def format_correctness(
    prompts: Sequence[str],
    runs: dict[str, list[Generation]],
    mismatches: Sequence[str],
    max_total_tokens: Optional[int],
) -> str:
    base = runs["baseline"]
    # The longest request seen per document prefix approximates each document's tokens.
    docs: dict[str, int] = {}
    for p, g in zip(prompts, base):
        key = p.split(":", 1)[0]
        docs[key] = max(docs.get(key, 0), g.prompt_tokens)
    working_set = sum(docs.values())
    lines = [
        "### correctness (greedy outputs, baseline vs mla_aware)",
        "",
        f"- prompts: {len(prompts)}; distinct prefixes: {len(docs)}, "
        f"{working_set} tokens in all",
    ]
    if max_total_tokens:
        forced = (
            "yes" if working_set > max_total_tokens else "NO (raise the prompt count)"
        )
        lines.append(f"- pool: {max_total_tokens} tokens; evictions forced: {forced}")
    for variant, gens in runs.items():
        cached = sum(g.cached_tokens for g in gens)
        lines.append(f"- {variant}: cached prompt tokens {cached}")
    lines.append(f"- mismatches: {len(mismatches)}")
    lines += [f"  - {m}" for m in mismatches]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------


def run_benchmarks(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for variant in VARIANTS:
        cmd, log = server_command(args, variant), out / f"{variant}_server.log"
        with Server(cmd, log, base_url(args)) as server:
            server.wait_healthy(args.health_timeout)
            for dataset in args.datasets:
                bench_output(args, variant, dataset).unlink(missing_ok=True)
                subprocess.run(bench_command(args, variant, dataset), check=True)
    results = {
        d: tuple(read_bench_output(bench_output(args, v, d)) for v in VARIANTS)
        for d in args.datasets
    }
    report = format_report(results)
    (out / "report.md").write_text(report)
    print(report)
    return 0


def run_correctness(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    max_total_tokens = correctness_pool_tokens(args)
    prompts = correctness_prompts(
        args.correctness_prompts, max_total_tokens or CORRECTNESS_MAX_TOTAL_TOKENS
    )
    runs = {}
    for variant in VARIANTS:
        cmd = server_command(args, variant, correctness=True)
        log = out / f"{variant}_correctness_server.log"
        with Server(cmd, log, base_url(args)) as server:
            server.wait_healthy(args.health_timeout)
            runs[variant] = generate_all(
                base_url(args), prompts, args.correctness_output_len
            )
    mismatches = compare_generations(prompts, runs["baseline"], runs["mla_aware"])
    report = format_correctness(prompts, runs, mismatches, max_total_tokens)
    (out / "correctness.md").write_text(report)
    print(report)
    return 1 if mismatches else 0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Compare --mla-aware-eviction with stock SGLang on real weights.",
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--port", type=int, default=30000, help=f"on {LOOPBACK}")
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument(
        "--max-total-tokens", type=int, help="KV pool size; small forces evictions"
    )
    p.add_argument(
        "--server-args",
        default="",
        help='more launch_server args for both servers, e.g. --server-args="--page-size 64"',
    )
    p.add_argument(
        "--python", default=sys.executable, help="interpreter with sglang installed"
    )
    p.add_argument(
        "--out", default="out/e2e", help="bench outputs, server logs, report"
    )
    p.add_argument("--health-timeout", type=float, default=1800.0, help="seconds")
    p.add_argument(
        "--dry-run", action="store_true", help="print the commands, run nothing"
    )
    p.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="gsp only")
    p.add_argument("--gsp-num-groups", type=int, default=128)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=4096)
    p.add_argument("--gsp-question-len", type=int, default=256)
    p.add_argument("--gsp-output-len", type=int, default=128)
    p.add_argument("--gsp-zipf-alpha", type=float, default=1.1)
    p.add_argument(
        "--mooncake-trace", help="JSON-lines trace; default: the bench downloads one"
    )
    p.add_argument(
        "--mooncake-workload",
        default="conversation",
        choices=["mooncake", "conversation", "synthetic", "toolagent"],
    )
    p.add_argument("--mooncake-num-prompts", type=int, default=1000)
    p.add_argument("--mooncake-slowdown-factor", type=float, default=1.0)
    p.add_argument(
        "--correctness",
        action="store_true",
        help="compare greedy outputs of both servers instead of benchmarking",
    )
    p.add_argument("--correctness-prompts", type=int, default=64)
    p.add_argument("--correctness-output-len", type=int, default=32)
    p.add_argument(
        "--no-deterministic",
        dest="deterministic",
        action="store_false",
        help="correctness without --enable-deterministic-inference",
    )
    args = p.parse_args(argv)
    if args.correctness_prompts < 1:
        p.error("--correctness-prompts must be >= 1")
    given = {word.split("=", 1)[0] for word in shlex.split(args.server_args)}
    for option in SCRIPT_SETS:
        if option in given:
            p.error(f"--server-args may not set {option}; this script does")
    for option in POLICY_OPTIONS:
        if option in given:
            p.error(
                f"--server-args may not set {option}: the baseline runs stock SGLang "
                f"and {FLAG} selects the policy and its radix-cache backend"
            )
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print("\n".join(plan_lines(args)))
        return 0
    # A SIGTERM to this script unwinds through the servers' context managers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return run_correctness(args) if args.correctness else run_benchmarks(args)


if __name__ == "__main__":
    sys.exit(main())
