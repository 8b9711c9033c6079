#!/usr/bin/env bash
# Every GPU check of the core runtime in one device call:
#   PYTHONPATH=. bash benchmarks/gpu_suite.sh            (results under $OUT, or ./gpu_out)
# Runs the CUDA tests of the activation offloader, then the ref-8L benchmark.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider "${@:-tests/test_activations_cuda.py}" 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
timeout 240 python3 benchmarks/bench_activations.py --double-buffering-compare --out "$OUT/bench_activations.json" 2>&1 | tee "$OUT/bench_activations.log"
