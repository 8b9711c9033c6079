#!/usr/bin/env bash
# Every GPU check of the project in one device call (results under $OUT, or ./gpu_out):
#   PYTHONPATH=. bash benchmarks/gpu_suite.sh
# 1. the CUDA tests (pytest -m cuda; torchao from .whl/ when present, else its test skips),
# 2. the ref-8L activation benchmark, 3. the MoE fused-wgrad benchmark,
# 4. examples/hf_llama.py --size 1b, 5. the weight offloading benchmark and example.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"; } | tee "$OUT/gpu.txt"
timeout 420 python3 -m pytest -q -m cuda -p no:cacheprovider -rs tests 2>&1 | tee "$OUT/pytest_cuda.log" | tail -30
timeout 240 python3 benchmarks/bench_activations.py --double-buffering-compare \
  --out "$OUT/bench_activations.json" 2>&1 | tee "$OUT/bench_activations.log"
timeout 120 python3 benchmarks/bench_moe_wgrad.py --out "$OUT/bench_moe_wgrad.json" 2>&1 \
  | tee "$OUT/bench_moe_wgrad.log" | tail -15
timeout 180 python3 examples/hf_llama.py --size 1b --out "$OUT/hf_llama_1b.json" 2>&1 \
  | tee "$OUT/hf_llama_1b.log" | tail -12
timeout 240 python3 benchmarks/bench_weights.py --out "$OUT/bench_weights.json" 2>&1 \
  | tee "$OUT/bench_weights.log" | tail -25
timeout 180 python3 examples/weights.py 2>&1 | tee "$OUT/weights_example.log" | tail -12
