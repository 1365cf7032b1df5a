# One virtual environment with pinned CPU dependencies; every target uses it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SITE = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

.PHONY: bench test analyze clean

$(STAMP): requirements/cpu.txt requirements/constraints.txt pyproject.toml tools/cpu_env/sglang_cpu_shims.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check --no-deps sglang==0.5.23
	$(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -r requirements/cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	cp tools/cpu_env/sglang_cpu_shims.py $(SITE)/
	echo "import sglang_cpu_shims" > $(SITE)/sglang_cpu_shims.pth
	touch $(STAMP)

## make bench: set up on first use, then compare the eviction policies on the shipped trace
bench: $(STAMP)
	$(PY) -m sglang.srt.mem_cache.latent_cache_analyzer --model deepseek-v3 --gpu-memory 80GB --weights 40GB --tp 8

## make test: every test, on CPU
test: $(STAMP)
	$(PY) -m pytest -q test

analyze: $(STAMP)
	$(PY) -m sglang.srt.mem_cache.latent_cache_analyzer $(ARGS)

clean:
	rm -rf $(VENV)
