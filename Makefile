# One virtual environment with pinned CPU dependencies; every target uses it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Site-packages of the venv, read when the recipe line runs (after the venv exists).
SITE = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

.PHONY: bench bench-conversation bar-check test analyze clean

$(STAMP): requirements/cpu.txt requirements/constraints.txt pyproject.toml tools/cpu_env/sglang_cpu_shims.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q --disable-pip-version-check --no-deps sglang==0.5.23
	$(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -r requirements/cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	cp tools/cpu_env/sglang_cpu_shims.py "$(SITE)/"
	echo "import sglang_cpu_shims" > "$(SITE)/sglang_cpu_shims.pth"
	touch $(STAMP)

TRACE ?= ../shared/traces/mooncake_synthetic_trace.jsonl
CONVERSATION ?= ../shared/traces/mooncake_conversation_trace.jsonl
RESULTS := docs/results

## make bench: set up on first use, then compare the eviction policies on the shipped trace
## (one replay at a time, so that the cache CPU column is measured on an otherwise idle core)
bench: $(STAMP)
	$(PY) -m sglang.srt.mem_cache.latent_cache_analyzer --model deepseek-v3 --gpu-memory 80GB --weights 40GB --tp 8
	$(PY) benchmark/mla_eviction/replay.py --trace $(TRACE) --jobs 1 \
		--json $(RESULTS)/mooncake_timed.json --markdown $(RESULTS)/mooncake_timed.md \
		--plot $(RESULTS)/mooncake_timed.png

## make bench-conversation: the same on Mooncake's conversation trace (real chat sessions)
bench-conversation: $(STAMP)
	$(PY) benchmark/mla_eviction/replay.py --trace $(CONVERSATION) --jobs 1 \
		--json $(RESULTS)/conversation.json --markdown $(RESULTS)/conversation.md \
		--plot $(RESULTS)/conversation.png

## make bar-check: the acceptance checks, with run-to-run spread and the ablation (long)
bar-check: $(STAMP)
	$(PY) benchmark/mla_eviction/bar_check.py \
		--variant no-factor='{"learn_factor": false}' --variant no-weight='{"learn_weight": false}'

## make test: every test, on CPU
test: $(STAMP)
	$(PY) -m pytest -q test

analyze: $(STAMP)
	$(PY) -m sglang.srt.mem_cache.latent_cache_analyzer $(ARGS)

clean:
	rm -rf $(VENV)

# ---- Upstream PR export ------------------------------------------------------
# TORCH_INDEX_URL (default empty): where the venv's torch comes from, e.g.
# https://download.pytorch.org/whl/cpu on a machine whose default index serves CUDA torch.
OUT ?= out/upstream-patch

.PHONY: upstream-patch upstream-check

## make upstream-patch OUT=dir: the project as a git format-patch series against sglang 0.5.23
upstream-patch: $(STAMP)
	$(PY) tools/upstream_patch.py export --out $(OUT)

## make upstream-check: apply that series to a fresh sglang 0.5.23 tree and run its tests there
upstream-check: $(STAMP)
	$(PY) tools/upstream_patch.py check
