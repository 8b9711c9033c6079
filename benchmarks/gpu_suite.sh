#!/usr/bin/env bash
# Every GPU check of the project in one device call (results under $OUT, or ./gpu_out):
#   PYTHONPATH=. bash benchmarks/gpu_suite.sh [part ...]
# Parts (default: all, in this order):
#   tests     the CUDA tests (pytest -m cuda; torchao from .whl/ when present)
#   hooks     benchmarks/bench_hooks.py (host us per saved tensor)
#   tiny48    benchmarks/bench_activations.py --preset tiny48 (with save_on_cpu)
#   ref8l     benchmarks/bench_activations.py (ref-8L: k = 1, 2, 4, 7, auto, save_on_cpu)
#   profile   python -m offload profile on ref-8L with k = 4 (JSON for the timeline PNG)
#   auto      benchmarks/bench_auto.py (auto vs every k, ref-8L and an HF Llama ~1B)
#   planner   benchmarks/bench_planner.py (offload.plan on ref-8L: its plans for 4 budgets vs every
#             single-lever configuration, predicted and measured)
#   weights   benchmarks/bench_weights.py and examples/weights.py
#   ckpt      benchmarks/bench_checkpoint.py
#   hostprof  benchmarks/hostprof.py (cProfile of tiny48 steps, k=0 and all)
#   traces    benchmarks/trace_layers.py (per-layer CUDA events of a few plans against no
#             lever) and benchmarks/host_calls.py (host time per call in ref-8L's forward)
#   codec     benchmarks/bench_codec.py (fp8 quantize / dequantize GB/s, Triton vs eager)
#   compress  benchmarks/bench_compress_accuracy.py (compress="fp8": gradient error on ref-8L,
#             char-level GPT loss curves with and without) and its --compress-fp32 ref part
#   multigpu  benchmarks/bench_multigpu_memcpy.py (pinned memcpy, N concurrent copiers), then
#             benchmarks/bench_multigpu.py under torchrun on every GPU (FSDP2 ref-8L, k = 0,
#             2, 4, 7, bitwise check); for a machine with several GPUs, not in the default list
#   graphs    tests/test_graphs_cuda.py, then benchmarks/bench_graphs.py on tiny48 (auto, all)
#             and ref-8L (k = 1, 2): eager vs CUDA-graphed steps, with and without offloading
#   extra     any benchmark named in $EXTRA (a shell command), for work in progress
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
parts=${*:-tests hooks tiny48 ref8l profile auto}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"; } | tee "$OUT/gpu.txt"
for part in $parts; do
  echo "=== $part $(date +%T)"
  case $part in
    tests) timeout 420 python3 -m pytest -q -m cuda -p no:cacheprovider -rs tests \
             2>&1 | tee "$OUT/pytest_cuda.log" | tail -25 ;;
    graphs) timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_graphs_cuda.py \
             2>&1 | tee "$OUT/pytest_graphs.log" | tail -25
            timeout 200 python3 benchmarks/bench_graphs.py --preset tiny48 \
             --out "$OUT/bench_graphs_tiny48.json" 2>&1 | tail -15
            timeout 200 python3 benchmarks/bench_graphs.py --preset ref-8L --ks 1,2 \
             --out "$OUT/bench_graphs_ref8l.json" 2>&1 | tail -15 ;;
    hooks) timeout 120 python3 benchmarks/bench_hooks.py --out "$OUT/bench_hooks.json" \
             2>&1 | tail -30 ;;
    tiny48) timeout 240 python3 benchmarks/bench_activations.py --preset tiny48 --interleave 15 \
             --out "$OUT/bench_tiny48.json" 2>&1 | tail -24 ;;
    codec) timeout 120 python3 benchmarks/bench_codec.py --out "$OUT/bench_codec.json" 2>&1 | tail -20 ;;
    compress) timeout 300 python3 benchmarks/bench_compress_accuracy.py \
             --out "$OUT/bench_compress_accuracy.json" 2>&1 | tee "$OUT/bench_compress_accuracy.log" | tail -40
             timeout 120 python3 benchmarks/bench_compress_accuracy.py --parts ref --compress-fp32 \
             --out "$OUT/bench_compress_accuracy_fp32too.json" 2>&1 | tail -25 ;;
    ref8l) timeout 300 python3 benchmarks/bench_activations.py --compress-ks ${COMPRESS_KS:-2,4,7} \
             --out "$OUT/bench_ref8l.json" 2>&1 | tail -16 ;;
    profile) OFFLOAD_PROFILE_JSON="$OUT/profile_cuda_test.json" timeout 200 python3 -m offload \
             profile --offload-layers 4 --steps 5 --json "$OUT/profile_ref8l_k4.json" 2>&1 | tail -30 ;;
    auto) timeout 300 python3 benchmarks/bench_auto.py --out "$OUT/bench_auto.json" 2>&1 | tail -30 ;;
    planner) timeout 400 python3 benchmarks/bench_planner.py --out "$OUT/bench_planner.json" \
             2>&1 | tee "$OUT/bench_planner.log" | tail -40 ;;
    traces) timeout 120 python3 benchmarks/trace_layers.py --out "$OUT/trace_layers.json" \
             2>&1 | tail -6
            timeout 120 python3 benchmarks/host_calls.py --out "$OUT/host_calls.json" \
             2>&1 | grep -E "first layer|pack |d2h" ;;
    hostprof) for sel in 0 all; do timeout 90 python3 benchmarks/hostprof.py \
             --offload-layers $sel --top 22 2>&1 | tee "$OUT/hostprof_$sel.log" | head -34; done ;;
    weights) timeout 240 python3 benchmarks/bench_weights.py --out "$OUT/bench_weights.json" 2>&1 \
             | tee "$OUT/bench_weights.log" | tail -25
             timeout 180 python3 examples/weights.py 2>&1 | tee "$OUT/weights_example.log" | tail -12 ;;
    ckpt) timeout 300 python3 benchmarks/bench_checkpoint.py --out "$OUT/bench_checkpoint.json" \
             2>&1 | tee "$OUT/bench_checkpoint.log" | tail -25 ;;
    multigpu) timeout 180 python3 benchmarks/bench_multigpu_memcpy.py \
             --out "$OUT/multigpu_memcpy.json" 2>&1 | tee "$OUT/multigpu_memcpy.log" | tail -8
             timeout 400 torchrun --nproc_per_node $(python3 -c 'import torch;print(torch.cuda.device_count())') \
             benchmarks/bench_multigpu.py --out "$OUT/bench_multigpu.json" 2>&1 \
             | tee "$OUT/bench_multigpu.log" | tail -30 ;;
    extra) bash -c "${EXTRA:-true}" ;;
  esac
done
echo "=== done $(date +%T)"
