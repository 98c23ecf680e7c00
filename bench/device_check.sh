#!/usr/bin/env bash
# The GPU checks, in one call of the device tool (a lent H200; CI never runs this):
#   1. the decoder's runner and engine on CUDA vs transformers and peft there (tests/decoder/lora/cuda_check.py),
#   2. the BGMV/SGMV Triton kernels vs their torch refs on CUDA, then timed (bench/lora_kernels.py).
# The device image has its own torch/triton/transformers/peft; the decoder imports xgrammar, which it
# lacks, so wheels for it (cp312) may be carried in .devwheels/ (see docs/benchmarks.md). Logs go to $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if compgen -G ".devwheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-deps --target /tmp/devwheels .devwheels/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/devwheels"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c 'import torch, triton, transformers, peft; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
rc=0
python3 -m tests.decoder.lora.cuda_check 2>&1 | grep -vE "Loading weights|Writing model|warn" | tee "$OUT/decoder_cuda_h200.txt"
rc=$((rc | PIPESTATUS[0]))
python3 bench/lora_kernels.py 2>&1 | tee "$OUT/lora_kernels_h200.txt"
rc=$((rc | PIPESTATUS[0]))
exit $rc
