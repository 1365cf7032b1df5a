"""The bad-input table of docs/reliability.md, produced by running every case.

    .venv/bin/python tools/reliability/bad_inputs.py           # print the table
    .venv/bin/python tools/reliability/bad_inputs.py --check   # exit 1: a row is off
                                                               # or the doc differs

Each case feeds one bad input to the real entry point: ``PolicyConfig.parse`` (what
``--radix-eviction-policy-config`` reaches), ``KVCostModel.from_config`` and
``Calibration.load``, the analyzer's and ``replay.py``'s ``main`` (in process, as the
CLI runs them), ``load_mooncake_trace`` through ``replay.py --trace``, and SGLang's own
``prepare_server_args`` with the plugin's hooks applied. The outcome is what happened:
``exit N`` with the last line on stderr, or the exception raised with its message.
Temporary paths print as ``<tmp>``. ``test_mla_eviction_invariants.TestBadInputTable``
runs the same cases: each must be rejected as its row says, name what is at fault, and
the doc must hold this table verbatim.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "reliability.md"
BEGIN = "<!-- bad-input table: tools/reliability/bad_inputs.py -->"
END = "<!-- end of bad-input table -->"


@dataclass(frozen=True)
class Case:
    surface: str
    shown: str  # the input as the table shows it
    run: Callable[[Path], tuple[str, str]]  # (outcome, message), given a temp dir
    expect: str  # the outcome the row must have: "exit 2" or an exception's name
    names: tuple[str, ...]  # what the message must name (written by hand)


def _raises(fn: Callable[[], object]) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # the outcome is the exception, whatever it is
        return type(e).__name__, str(e)
    return "accepted", ""


def _cli(main: Callable, argv: list[str]) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
    lines = err.getvalue().strip().splitlines()
    if "Traceback" in err.getvalue():
        return f"exit {status} with a traceback", lines[-1] if lines else ""
    return f"exit {status}", lines[-1] if lines else ""


# ---- the entry points ---------------------------------------------------------------


def policy(config) -> Callable[[Path], tuple[str, str]]:
    from sglang.srt.mem_cache.mla_aware_policy import PolicyConfig

    return lambda tmp: _raises(lambda: PolicyConfig.parse(config))


def model(config, **setup) -> Callable[[Path], tuple[str, str]]:
    from sglang.srt.mem_cache.mla_cost_model import KVCostModel

    def run(tmp: Path):
        source = config(tmp) if callable(config) else config
        return _raises(lambda: KVCostModel.from_config(source, **setup))

    return run


def calibration(text: str) -> Callable[[Path], tuple[str, str]]:
    from sglang.srt.mem_cache.mla_cost_model import Calibration

    def run(tmp: Path):
        path = tmp / "calibration.json"
        if text is not None:
            path.write_text(text)
        return _raises(lambda: Calibration.load(path))

    return run


def analyzer(*argv: str) -> Callable[[Path], tuple[str, str]]:
    from sglang.srt.mem_cache.latent_cache_analyzer import main

    def run(tmp: Path):
        return _cli(main, [a.replace("<tmp>", str(tmp)) for a in argv])

    return run


def _replay_main():
    sys.path.insert(0, str(REPO / "benchmark" / "mla_eviction"))
    import replay

    return replay.main


GOOD_LINE = {
    "timestamp": 0,
    "input_length": 600,
    "output_length": 8,
    "hash_ids": [1, 2],
}


def replay(*argv: str, trace=(GOOD_LINE,)) -> Callable[[Path], tuple[str, str]]:
    """``replay.py`` on a trace file written from ``trace`` (lines as dicts or raw
    bytes), or ``--trace``/``--workload`` as ``argv`` gives them."""

    def run(tmp: Path):
        args = [a.replace("<tmp>", str(tmp)) for a in argv]
        if "--trace" not in args and "--workload" not in args:
            path = tmp / "trace.jsonl"
            lines = [
                t if isinstance(t, bytes) else json.dumps(t).encode() for t in trace
            ]
            path.write_bytes(b"".join(line + b"\n" for line in lines))
            args = ["--trace", str(path), *args]
        return _cli(_replay_main(), ["--no-progress", "--jobs", "1", *args])

    return run


def trace_lines(*lines) -> Callable[[Path], tuple[str, str]]:
    return replay("--policies", "lru", "--capacity", "50%", trace=lines)


_HOOKED = False


def server(*argv: str) -> Callable[[Path], tuple[str, str]]:
    def run(tmp: Path):
        global _HOOKED
        from sglang.srt.server_args import prepare_server_args

        if not _HOOKED:  # what launch_server does before parsing
            from sglang.srt.mem_cache.mla_eviction_plugin import register
            from sglang.srt.plugins import load_plugins
            from sglang.srt.plugins.hook_registry import HookRegistry

            load_plugins()
            register()
            HookRegistry.apply_hooks()
            _HOOKED = True
        args = ["--model-path", "dummy", *(a.replace("<tmp>", str(tmp)) for a in argv)]
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                with contextlib.redirect_stderr(err):
                    prepare_server_args(args)
        except SystemExit as e:
            return f"exit {e.code}", err.getvalue().strip().splitlines()[-1]
        except Exception as e:
            return f"{type(e).__name__} at argument parsing", str(e)
        return _raises_at_cache_build(args)  # parsed: the scheduler builds the cache

    return run


def _raises_at_cache_build(args: list[str]) -> tuple[str, str]:
    """The scheduler's ``create_tree_cache`` for parsed ``args`` (a DeepSeek-V3 config,
    a small CPU pool): its outcome, marked as happening at cache build."""
    from types import SimpleNamespace

    import torch
    from transformers import PretrainedConfig

    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.mla_cost_model import PRESETS
    from sglang.srt.runtime_context import publish, reset_context
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(args)
    server_args.device = "cpu"
    reset_context()
    publish(server_args, role="scheduler")
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=TokenToKVPoolAllocator(
            64, torch.bfloat16, "cpu", None, need_sort=False
        ),
        page_size=1,
        eviction_policy=server_args.radix_eviction_policy,
        eviction_policy_config=server_args.radix_eviction_policy_config,
    )
    ctx = registry.TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=SimpleNamespace(
            hf_config=PretrainedConfig(**PRESETS["deepseek-v3"])
        ),
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    try:
        outcome, message = _raises(lambda: registry.create_tree_cache(ctx))
    finally:
        reset_context()
    return f"parsed; {outcome} at cache build", message


# ---- the cases ------------------------------------------------------------------------


def _config_file(config) -> Callable[[Path], Path]:
    def write(tmp: Path) -> Path:
        path = tmp / "config.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        return path

    return write


def cases() -> list[Case]:
    from sglang.srt.mem_cache.mla_cost_model import PRESETS

    v3, llama = dict(PRESETS["deepseek-v3"]), dict(PRESETS["llama-3-8b"])
    no_latent = {k: v for k, v in v3.items() if k != "kv_lora_rank"}
    fit = {"prefill_s_per_token": 1e-6, "prefill_s_per_token_per_position": 1e-9}
    good_fit = dict(fit, h2d_s_per_token_per_layer=2e-8)
    flag, cfg = "--mla-aware-eviction", "--radix-eviction-policy-config"
    P, M, C = "policy config", "cost model", "calibration file"
    A, R, T, S = "analyzer CLI", "replay.py CLI", "trace file", "server args"
    E2, PCE, MCE = "exit 2", "PolicyConfigError", "ModelConfigError"
    AP = " at argument parsing"
    gpu = ("--model", "deepseek-v3", "--gpu-memory", "80GB")
    return [
        Case(P, "`[1]`", policy([1]), PCE, ("must be a JSON object", "list")),
        Case(
            P,
            '`{"hit_exponent": 1}`',
            policy({"hit_exponent": 1}),
            PCE,
            ("'hit_exponent'", "known keys"),
        ),
        Case(
            P,
            '`{"learn_factor": 1}`',
            policy({"learn_factor": 1}),
            PCE,
            ("'learn_factor'", "true or false"),
        ),
        Case(
            P,
            '`{"calibration": true}`',
            policy({"calibration": True}),
            PCE,
            ("'calibration'", "a string"),
        ),
        Case(
            M,
            "unknown preset `llama-9000`",
            model("llama-9000"),
            MCE,
            ("llama-9000", "not a preset"),
        ),
        Case(M, "`42` (neither path nor dict)", model(42), MCE, ("path or a dict",)),
        Case(
            M,
            "DeepSeek-V3 without `kv_lora_rank`",
            model(no_latent),
            MCE,
            ("'kv_lora_rank'",),
        ),
        Case(
            M,
            "`num_hidden_layers: 0`",
            model(dict(v3, num_hidden_layers=0)),
            MCE,
            ("'num_hidden_layers'", ">= 1"),
        ),
        Case(
            M,
            '`architectures: "LlamaForCausalLM"` (a string)',
            model(dict(v3, architectures="LlamaForCausalLM")),
            MCE,
            ("'architectures'", "list of strings"),
        ),
        Case(
            M,
            'Llama-3-8B with `architectures: ["BertModel"]`',
            model(dict(llama, architectures=["BertModel"])),
            MCE,
            ("no causal LM",),
        ),
        Case(
            M,
            "`first_k_dense_replace: 62` (61 layers)",
            model(dict(v3, first_k_dense_replace=62)),
            MCE,
            ("'first_k_dense_replace'", "61"),
        ),
        Case(
            M,
            '`torch_dtype: "float64"`, dtype auto',
            model(dict(v3, torch_dtype="float64")),
            MCE,
            ("'torch_dtype'", "float64"),
        ),
        Case(
            M,
            '`kv_cache_dtype="int3"`',
            model(v3, kv_cache_dtype="int3"),
            MCE,
            ("'kv_cache_dtype'", "int3"),
        ),
        Case(M, "`tp_size=0`", model(v3, tp_size=0), MCE, ("'tp_size'",)),
        Case(M, "`page_size=2.0`", model(v3, page_size=2.0), MCE, ("'page_size'",)),
        Case(
            M,
            "`gpu_flops_per_s=nan`",
            model(v3, gpu_flops_per_s=float("nan")),
            MCE,
            ("'gpu_flops_per_s'", "finite"),
        ),
        Case(
            M,
            "config.json that is not JSON",
            model(_config_file("{not json")),
            MCE,
            ("<tmp>/config.json", "not a readable JSON"),
        ),
        Case(
            M,
            "config.json holding a list",
            model(_config_file("[1, 2]")),
            MCE,
            ("<tmp>/config.json", "JSON object"),
        ),
        Case(C, "missing file", calibration(None), MCE, ("<tmp>/calibration.json",)),
        Case(
            C,
            "`fit` without `h2d_s_per_token_per_layer`",
            calibration(json.dumps({"gpu_name": "H200", "fit": fit})),
            MCE,
            ("'h2d_s_per_token_per_layer'",),
        ),
        Case(
            C,
            "`prefill_s_per_token: 0`",
            calibration(
                json.dumps(
                    {"gpu_name": "H200", "fit": dict(good_fit, prefill_s_per_token=0)}
                )
            ),
            MCE,
            ("'prefill_s_per_token'", "> 0"),
        ),
        Case(
            A,
            "`--gpu-memory 80GX`",
            analyzer(*gpu[:3], "80GX", "--weights", "40GB"),
            E2,
            ("'80GX'",),
        ),
        Case(
            A,
            "`--weights 75GB` (more than 0.9 x 80 GB)",
            analyzer(*gpu, "--weights", "75GB"),
            E2,
            ("no room for a KV cache",),
        ),
        Case(
            A,
            "`--tp 0`",
            analyzer(*gpu, "--weights", "40GB", "--tp", "0"),
            E2,
            ("'tp_size'",),
        ),
        Case(
            A,
            "`--tp two`",
            analyzer(*gpu, "--weights", "40GB", "--tp", "two"),
            E2,
            ("--tp",),
        ),
        Case(
            A,
            "`--mem-fraction-static nan`",
            analyzer(*gpu, "--weights", "40GB", "--mem-fraction-static", "nan"),
            E2,
            ("mem_fraction_static",),
        ),
        Case(
            A,
            "`--kv-cache-dtype int3`",
            analyzer(*gpu, "--weights", "40GB", "--kv-cache-dtype", "int3"),
            E2,
            ("'kv_cache_dtype'", "int3"),
        ),
        Case(
            A,
            "`--model nope`",
            analyzer("--model", "nope", "--gpu-memory", "80GB", "--weights", "4GB"),
            E2,
            ("nope",),
        ),
        Case(A, "no `--weights`", analyzer(*gpu), E2, ("--weights",)),
        Case(R, "`--capacity 0%`", replay("--capacity", "0%"), E2, ("--capacity",)),
        Case(
            R,
            "`--capacity lots`",
            replay("--capacity", "lots"),
            E2,
            ("--capacity", "'lots'"),
        ),
        Case(
            R,
            "`--capacity 1KB` (less than a page)",
            replay("--capacity", "1KB"),
            E2,
            ("--capacity", "one page"),
        ),
        Case(
            R,
            "`--policies nope`",
            replay("--policies", "nope"),
            E2,
            ("--policies", "'nope'"),
        ),
        Case(
            R,
            "`--page-size 3`",
            replay("--page-size", "3"),
            E2,
            ("--page-size 3", "--block-size"),
        ),
        Case(R, "`--tp 0`", replay("--tp", "0"), E2, ("--tp",)),
        Case(
            R,
            "`--gpu-tflops nan`",
            replay("--gpu-tflops", "nan"),
            E2,
            ("--gpu-tflops",),
        ),
        Case(
            R,
            "`--decode-ms-per-token -1`",
            replay("--decode-ms-per-token=-1"),
            E2,
            ("--decode-ms-per-token",),
        ),
        Case(
            R,
            "`--policy-config notjson`",
            replay("--policy-config", "notjson"),
            E2,
            ("--policy-config", "not JSON"),
        ),
        Case(
            R,
            "`--policy-config '{\"bogus\": 1}'`",
            replay("--policy-config", '{"bogus": 1}'),
            E2,
            ("--policy-config", "'bogus'"),
        ),
        Case(
            R,
            "`--model gpt-17`",
            replay("--model", "gpt-17"),
            E2,
            ("--model", "gpt-17"),
        ),
        Case(
            R,
            "`--kv-cache-dtype int3`",
            replay("--kv-cache-dtype", "int3"),
            E2,
            ("'kv_cache_dtype'",),
        ),
        Case(
            R,
            "`--json` into a missing directory",
            replay("--json", "<tmp>/no/such/r.json"),
            E2,
            ("--json",),
        ),
        Case(R, "`--workload nope`", replay("--workload", "nope"), E2, ("'nope'",)),
        Case(
            R,
            "`--workload-param x`",
            replay("--workload", "chat", "--workload-param", "x"),
            E2,
            ("--workload-param", "'x'"),
        ),
        Case(
            R,
            "`--trace` of a missing file",
            replay("--trace", "<tmp>/absent.jsonl"),
            E2,
            ("<tmp>/absent.jsonl", "no such file"),
        ),
        Case(T, "empty file", trace_lines(), E2, ("empty trace",)),
        Case(
            T,
            "malformed JSON on line 2",
            trace_lines(GOOD_LINE, b'{"timestamp": 0,'),
            E2,
            ("trace.jsonl:2", "malformed JSON"),
        ),
        Case(
            T,
            "a line that is a list",
            trace_lines(b"[1, 2]"),
            E2,
            ("trace.jsonl:1", "JSON object"),
        ),
        Case(
            T,
            "not UTF-8",
            trace_lines(b'{"timestamp": 0\xff}'),
            E2,
            ("trace.jsonl:1", "UTF-8"),
        ),
        Case(
            T,
            "no `output_length`",
            trace_lines({k: v for k, v in GOOD_LINE.items() if k != "output_length"}),
            E2,
            ("trace.jsonl:1", "'output_length'", "missing"),
        ),
        Case(
            T,
            "`input_length: -5`",
            trace_lines(dict(GOOD_LINE, input_length=-5)),
            E2,
            ("trace.jsonl:1", "'input_length'"),
        ),
        Case(
            T,
            "`input_length: true`",
            trace_lines(dict(GOOD_LINE, input_length=True)),
            E2,
            ("'input_length'", "boolean"),
        ),
        Case(
            T,
            "`timestamp: NaN`",
            trace_lines(
                b'{"timestamp": NaN, '
                b'"input_length": 600, '
                b'"output_length": 8, '
                b'"hash_ids": [1, 2]}'
            ),
            E2,
            ("'timestamp'", "finite"),
        ),
        Case(
            T,
            "a timestamp before the previous line's",
            trace_lines(dict(GOOD_LINE, timestamp=9), dict(GOOD_LINE, timestamp=3)),
            E2,
            ("trace.jsonl:2", "'timestamp'", "line 1"),
        ),
        Case(
            T,
            "3 ids for 600 tokens of 512-token blocks",
            trace_lines(dict(GOOD_LINE, hash_ids=[1, 2, 3])),
            E2,
            ("'hash_ids'", "ceil(600 / 512) = 2"),
        ),
        Case(
            T,
            "an id after another predecessor than before",
            trace_lines(GOOD_LINE, dict(GOOD_LINE, hash_ids=[3, 2])),
            E2,
            ("trace.jsonl:2", "'hash_ids'", "form a tree"),
        ),
        Case(
            S,
            f"`{flag} --radix-eviction-policy lfu`",
            server(flag, "--radix-eviction-policy", "lfu"),
            "ValueError" + AP,
            (flag, "lfu"),
        ),
        Case(
            S,
            f"`{flag} {cfg} '{{\"hit_exponent\": 2}}'`",
            server(flag, cfg, '{"hit_exponent": 2}'),
            PCE + AP,
            ("'hit_exponent'",),
        ),
        Case(
            S,
            f"`--radix-eviction-policy mla_aware {cfg} '[1]'`",
            server("--radix-eviction-policy", "mla_aware", cfg, "[1]"),
            PCE + AP,
            ("JSON object",),
        ),
        Case(
            S,
            f"`{flag} {cfg} notjson`",
            server(flag, cfg, "notjson"),
            E2,
            (cfg, "'notjson'"),
        ),
        Case(
            S,
            f"`{flag} --radix-cache-backend lmcache`",
            server(flag, "--radix-cache-backend", "lmcache"),
            "ValueError" + AP,
            ("--radix-cache-backend lmcache",),
        ),
        Case(
            S,
            f"`{flag} --radix-eviction-policy nope`",
            server(flag, "--radix-eviction-policy", "nope"),
            E2,
            ("'nope'",),
        ),
        Case(
            S,
            f'`{flag} {cfg} \'{{"calibration": "<tmp>/absent.json"}}\'`',
            server(flag, cfg, '{"calibration": "<tmp>/absent.json"}'),
            f"parsed; {MCE} at cache build",
            ("<tmp>/absent.json",),
        ),
    ]


def collect() -> list[tuple[Case, str, str]]:
    """(case, outcome, message) for every case, temp paths shown as ``<tmp>``."""
    rows = []
    for case in cases():
        with tempfile.TemporaryDirectory() as tmp:
            outcome, message = case.run(Path(tmp))
        rows.append((case, outcome, message.replace(tmp, "<tmp>")))
    return rows


def problems(rows) -> list[str]:
    """Rows whose outcome is not the expected one, whose message does not name what
    is at fault, or that printed more than one line or a traceback."""
    out = []
    for case, outcome, message in rows:
        where = f"{case.surface} / {case.shown}"
        if outcome != case.expect:
            out.append(f"{where}: {outcome!r}, expected {case.expect!r}")
        missing = [name for name in case.names if name not in message]
        if missing:
            out.append(f"{where}: message {message!r} does not name {missing}")
        if "\n" in message or "Traceback" in message:
            out.append(f"{where}: message of several lines")
    return out


def markdown(rows) -> str:
    lines = [
        "| surface | bad input | outcome | message |",
        "|---|---|---|---|",
    ]
    for case, outcome, message in rows:
        shown = message.replace("|", "\\|").replace("`", "'")
        lines.append(f"| {case.surface} | {case.shown} | {outcome} | `{shown}` |")
    return "\n".join(lines)


def documented() -> str:
    """The table between the markers in docs/reliability.md ('' if none)."""
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        return ""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str]) -> int:
    import warnings

    warnings.simplefilter("ignore")
    rows = collect()
    table = markdown(rows)
    if argv == ["--check"]:
        for problem in problems(rows):
            print(problem, file=sys.stderr)
        if problems(rows) or documented() != table:
            print(f"{DOC} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
