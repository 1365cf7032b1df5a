"""A fork server that makes mutmut's test command cheap: pytest without re-importing
torch and SGLang for every mutant.

    python tools/reliability/forkrun.py serve SOCKET SOURCE_ROOT   # once, in the background
    python tools/reliability/forkrun.py run SOCKET -- PYTEST_ARGS  # mutmut's --runner

``serve`` (run it with the project's venv python) imports the heavy modules the tests
use, then for each ``run`` forks a child that imports the project's modules afresh from
``SOURCE_ROOT`` (the mutated copy, not the editable install) and runs ``pytest.main``;
``run`` exits 0 if pytest passed and 1 otherwise. A child is killed after
``CHILD_TIMEOUT_S`` seconds. ``run`` imports only the standard library.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import signal
import socket
import sys
from pathlib import Path

CHILD_TIMEOUT_S = 120
# The project's modules (pyproject.toml's py-modules): never imported by the server.
PROJECT_MODULES = (
    "sglang.srt.mem_cache.mla_cost_model",
    "sglang.srt.mem_cache.mla_aware_policy",
    "sglang.srt.mem_cache.mla_eviction_plugin",
    "sglang.srt.mem_cache.latent_cache_analyzer",
)
PREIMPORT = (
    "torch",
    "numpy",
    "pytest",
    "hypothesis",
    "transformers",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.kv_cache_configurator",
    "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.mem_cache.unified_cache.components.full",
    "sglang.srt.runtime_context",
    "sglang.srt.server_args",
    "sglang.test.test_utils",
    "sglang.test.ci.ci_register",
)


class _FromSource(importlib.machinery.SourceFileLoader):
    """Compiles from the source every time: a cached .pyc of an earlier mutant with
    the same size and mtime second would otherwise be run instead of this one."""

    def get_code(self, fullname):
        return compile(self.get_data(self.path), self.path, "exec", dont_inherit=True)


class _SourceRoot(importlib.abc.MetaPathFinder):
    """Finds the project's modules under ``root`` ahead of the editable install."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name not in PROJECT_MODULES:
            return None
        file = str(self.root / (name.replace(".", "/") + ".py"))
        loader = _FromSource(name, file)
        return importlib.util.spec_from_file_location(name, file, loader=loader)


def serve(sock_path: str, source_root: str) -> None:
    import importlib

    for name in PREIMPORT:
        importlib.import_module(name)
    leaked = [m for m in PROJECT_MODULES if m in sys.modules]
    if leaked:
        raise SystemExit(f"forkrun: the pre-imports loaded {leaked}")
    # pytest's unraisable-exception hook runs gc.collect() at exit, which otherwise
    # walks every torch and SGLang object (seconds per mutant): freeze them.
    gc.collect()
    gc.freeze()
    sys.meta_path.insert(0, _SourceRoot(Path(source_root).resolve()))
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(1)
    print(f"forkrun: serving on {sock_path}", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                server.close()
                _child(request)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            conn.sendall(f"{124 if code == -signal.SIGALRM else code}\n".encode())


def _child(request: dict) -> None:
    code = 1
    try:
        signal.alarm(CHILD_TIMEOUT_S)
        os.chdir(request["cwd"])
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        import pytest

        code = int(pytest.main(request["args"]))
    finally:
        os._exit(code)


def run(sock_path: str, args: list[str]) -> int:
    """0 if pytest passed, else 1: mutmut 2.5.1 counts only status 1 as failing
    tests (``tests_pass``: ``returncode != 1``), and pytest exits 2 when a mutant
    breaks the import of a test module (the policy's tests build a cost model at
    import), which the test command, run plainly, reports as a failure."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(sock_path)
    client.sendall((json.dumps({"cwd": os.getcwd(), "args": args}) + "\n").encode())
    reply = client.makefile().readline().strip()
    return 0 if reply == "0" else 1


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "serve":
        serve(argv[1], argv[2])
        return 0
    if len(argv) >= 3 and argv[0] == "run" and argv[2] == "--":
        return run(argv[1], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
