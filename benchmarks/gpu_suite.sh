#!/usr/bin/env bash
# GPU checks and benchmarks in one device call. Each part writes the results file of the
# table it feeds, under the name it has in benchmarks/results/ (see benchmarks/README.md):
#   PYTHONPATH=. bash benchmarks/gpu_suite.sh [part ...]           # results under ./gpu_out
#   OUT=benchmarks/results PYTHONPATH=. bash benchmarks/gpu_suite.sh headline   # overwrite
# Parts (default: tests):
#   tests      the CUDA tests (pytest -m cuda; torchao from .whl/ when present); WORKERS=n
#              runs the files whose outcome does not depend on timing or on the device's
#              free memory in n processes at once (pytest-xdist), then the others alone
#   longctx    long_context.json: bench_long_context.py, Llama-3-8B shape with LoRA at 16k
#              and 32k tokens, ours against HF checkpointing and unsloth_zoo (peers from
#              .whl/, see the script)
#   longctx2   more rows of the same file: Llama ~1.1B at 16k, the 8B shape at 64k
#   longctxpeers  more rows of the same file: DeepSpeed, TRL, transformers' offload=True,
#              ours without tiles at 32k, Llama ~1.1B at 32k
#   longctxlong   the 8B shape at 128k tokens: ours, unsloth_zoo, DeepSpeed's tiling
#   ref8l      activations_ref8l.json: ref-8L, k = 1, 2, 4, 7, auto, fp8 k = 4, 7, save_on_cpu,
#              checkpointing
#   others     others_ref8l.json: torch.compile's memory budget, torchtune, TransformerEngine
#   planner    planner.json: offload.plan on ref-8L, four budgets
#   plannerllama  planner_llama.json, planner_ref8l.json, planner_llama_16k.json: offload.plan
#              on HF Llama ~1.1B (seq 4096, 16384) and ref-8L against no lever and the best
#              single lever (REPEATS runs of each case, default 1)
#   headline   ref8l, planner and others: docs/performance.md's ref-8L comparison (the README's headline is longctx)
#   tiny48     activations_tiny48.json (interleaved rounds)
#   dbuf       activations_double_buffering.json (k = 7 with and without double buffering)
#   auto       auto.json ("auto" against every k, ref-8L and an HF Llama ~1B)
#   hooks      hooks.json (host microseconds per saved tensor)
#   versions   versions.json and versions_inproc.json: this tree against the one in .old/
#              (made with: mkdir -p .old && git archive <commit> offload | tar -x -C .old)
#   profile    profile_ref8l_k4.json (python -m offload profile, k = 4; the timeline figure)
#   weights    weights.json and weights_example.log (examples/weights.py)
#   moe        moe_wgrad.json (fused fp32 weight-gradient accumulation of MoE experts)
#   hfllama    hf_llama_1b.json (examples/hf_llama.py --size 1b)
#   ckpt       checkpoint.json, recompute_host.json and checkpoint_hf.json
#   codec      codec.json (the fp8 codec alone) and codec_share.json (its share of a step)
#   compress   compress_accuracy_ref8l.json and compress_accuracy.json (fp8 accuracy)
#   graphs     tests/activations/test_graphs_cuda.py, then graphs_tiny48.json and graphs_ref8l.json
#   multigpu   multigpu_memcpy.json, then bench_multigpu.py under torchrun on every GPU
#   diagnostics  diagnostics/*.json and logs (feed no table)
#   extra      any command in $EXTRA
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
B=benchmarks
# long_context SECONDS PER_CONFIG WARMUP "model seq methods" ...: rows of long_context.json
# (bench_long_context.py --append: a configuration measured again replaces its row),
# each "model seq methods" in at most SECONDS, each configuration in PER_CONFIG, timed
# steps: $STEPS (default 2)
long_context() {
  local total=$1 each=$2 warmup=$3 run
  shift 3
  for run in "$@"; do
    set -- $run
    timeout "$total" python3 $B/longctx/bench_long_context.py --append --timeout "$each" \
      --warmup "$warmup" --steps "${STEPS:-2}" --out "$OUT/long_context.json" \
      --models "$1" --seqs "$2" --methods "$3" 2>&1 | grep -v "^|"
  done
}
parts=${*:-tests}
parts=${parts//headline/ref8l planner others}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"; } | tee "$OUT/gpu.txt"
for part in $parts; do
  echo "=== $part $(date +%T)"
  case $part in
    tests) if [ "${WORKERS:-1}" -gt 1 ]; then
             alone="tests/activations/auto/test_auto_cuda.py tests/activations/test_first_layer_cuda.py tests/planner tests/profiling"
             timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider -rs -n "$WORKERS" \
               --dist loadfile $(for f in $alone; do echo --ignore=$f; done) tests \
               2>&1 | tee "$OUT/pytest_cuda.log" | tail -12
             timeout 270 python3 -m pytest -q -m cuda -p no:cacheprovider -rs $alone \
               2>&1 | tee "$OUT/pytest_cuda_alone.log" | tail -12
           else timeout 420 python3 -m pytest -q -m cuda -p no:cacheprovider -rs tests \
             2>&1 | tee "$OUT/pytest_cuda.log" | tail -25; fi ;;
    longctx) timeout 40 python3 $B/longctx/check_peers.py 2>&1 | tail -8
             # most telling first: a run cut short keeps what it finished
             STEPS=6 long_context 250 90 1 "llama-8b-lora 16384 hf-ckpt,ours-ckpt-head,ours-ckpt-head-liger,unsloth-zoo"
             STEPS=4 long_context 300 100 1 \
                 "llama-8b-lora 32768 hf-ckpt,ours-ckpt-head,ours-ckpt-head-tile,unsloth-zoo" ;;
    longctx2) STEPS=4 long_context 400 150 1 "llama-1b 16384 none,hf-ckpt,ours-ckpt-head,unsloth-zoo,ours-plan"
             long_context 200 100 1 "llama-8b-lora 65536 ours-ckpt-head-tile,unsloth-zoo" ;;
    longctxpeers) long_context 330 110 1 \
                 "llama-8b-lora 16384 hf-ckpt,deepspeed-ckpt-offload,deepspeed-ckpt-offload-tiled,trl-offload-ckpt,hf-ckpt-offload" \
                 "llama-8b-lora 32768 ours-ckpt-head,deepspeed-ckpt-offload-tiled,trl-offload-ckpt" \
                 "llama-1b 16384 hf-ckpt,ours-default,ours-ckpt,trl-offload,trl-offload-ckpt,deepspeed-ckpt-offload" \
                 "llama-1b 32768 none,hf-ckpt,ours-ckpt-head,unsloth-zoo,ours-plan" ;;
    longctxlong) long_context 580 230 1 \
                 "llama-8b-lora 131072 ours-ckpt-head-tile,unsloth-zoo,deepspeed-ckpt-offload-tiled" ;;
    ref8l) timeout 300 python3 $B/activations/bench_activations.py --compress-ks 4,7 \
             --out "$OUT/activations_ref8l.json" 2>&1 | tail -16 ;;
    others) timeout 500 python3 $B/activations/bench_others.py \
             --out "$OUT/others_ref8l.json" 2>&1 | tail -16 ;;
    planner) timeout 400 python3 $B/planner/bench_planner.py --out "$OUT/planner.json" \
             2>&1 | tail -40 ;;
    plannerllama) R=${REPEATS:-1}
             timeout $((250 * R)) python3 $B/planner/bench_planner_models.py --cases llama-4k \
             --repeats $R --out "$OUT/planner_llama.json" 2>&1 | grep -E "^  |written"
             timeout $((250 * R)) python3 $B/planner/bench_planner_models.py \
             --cases ref-8L,ref-8L-fp8 --repeats $R --out "$OUT/planner_ref8l.json" 2>&1 | grep -E "^  |written"
             timeout $((200 * R)) python3 $B/planner/bench_planner_models.py --cases llama-16k \
             --repeats $R --out "$OUT/planner_llama_16k.json" 2>&1 | grep -E "^  |written" ;;
    tiny48) timeout 240 python3 $B/activations/bench_activations.py --preset tiny48 \
             --interleave 15 --out "$OUT/activations_tiny48.json" 2>&1 | tail -24 ;;
    dbuf) timeout 240 python3 $B/activations/bench_activations.py --ks 7 --methods offload \
             --double-buffering-compare --out "$OUT/activations_double_buffering.json" 2>&1 | tail -10 ;;
    auto) timeout 300 python3 $B/activations/bench_auto.py --out "$OUT/auto.json" 2>&1 | tail -30 ;;
    hooks) timeout 120 python3 $B/activations/bench_hooks.py --out "$OUT/hooks.json" 2>&1 | tail -30 ;;
    versions) if [ ! -f .old/offload/__init__.py ]; then echo "versions: no .old/offload (see above)"; else
             timeout 500 python3 $B/activations/bench_versions.py --old .old --new . \
             --out "$OUT/versions.json" 2>&1 | tail -40
             timeout 300 python3 $B/activations/bench_versions_inproc.py --old .old \
             --out "$OUT/versions_inproc.json" 2>&1 | tail -6; fi ;;
    profile) timeout 200 python3 -m offload profile --offload-layers 4 --steps 5 \
             --json "$OUT/profile_ref8l_k4.json" 2>&1 | tail -30 ;;
    weights) timeout 240 python3 $B/weights/bench_weights.py --out "$OUT/weights.json" 2>&1 | tail -25
             timeout 180 python3 examples/weights.py 2>&1 | tee "$OUT/weights_example.log" | tail -12 ;;
    moe) timeout 120 python3 $B/weights/bench_moe_wgrad.py --out "$OUT/moe_wgrad.json" 2>&1 | tail -12 ;;
    hfllama) timeout 300 python3 examples/hf_llama.py --size 1b --out "$OUT/hf_llama_1b.json" \
             2>&1 | tail -12 ;;
    ckpt) timeout 300 python3 $B/checkpoint/bench_checkpoint.py --out "$OUT/checkpoint.json" \
             2>&1 | tail -25
          timeout 200 python3 $B/diagnostics/recompute_host.py --out "$OUT/recompute_host.json" \
             2>&1 | tail -7
          timeout 300 python3 $B/checkpoint/bench_checkpoint_hf.py --out "$OUT/checkpoint_hf.json" \
             2>&1 | tail -12 ;;
    codec) timeout 120 python3 $B/compress/bench_codec.py --out "$OUT/codec.json" 2>&1 | tail -20
           timeout 120 python3 $B/compress/trace_compress.py --ks 4,7 \
             --out "$OUT/codec_share.json" 2>&1 | tail -20 ;;
    compress) timeout 200 python3 $B/compress/bench_compress_accuracy.py --parts ref \
             --out "$OUT/compress_accuracy_ref8l.json" 2>&1 | tail -25
             timeout 300 python3 $B/compress/bench_compress_accuracy.py --compress-fp32 \
             --out "$OUT/compress_accuracy.json" 2>&1 | tail -40 ;;
    graphs) timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/activations/test_graphs_cuda.py \
             2>&1 | tee "$OUT/pytest_graphs.log" | tail -25
            timeout 200 python3 $B/graphs/bench_graphs.py --preset tiny48 \
             --out "$OUT/graphs_tiny48.json" 2>&1 | tail -15
            timeout 200 python3 $B/graphs/bench_graphs.py --preset ref-8L --ks 1,2 \
             --out "$OUT/graphs_ref8l.json" 2>&1 | tail -15 ;;
    multigpu) timeout 180 python3 $B/distributed/bench_multigpu_memcpy.py \
             --out "$OUT/multigpu_memcpy.json" 2>&1 | tail -8
             timeout 400 torchrun --nproc_per_node $(python3 -c 'import torch;print(torch.cuda.device_count())') \
             $B/distributed/bench_multigpu.py --out "$OUT/multigpu.json" 2>&1 | tail -30 ;;
    diagnostics) mkdir -p "$OUT/diagnostics"
             timeout 120 python3 $B/diagnostics/trace_layers.py \
             --out "$OUT/diagnostics/trace_layers.json" 2>&1 | tail -6
             timeout 120 python3 $B/diagnostics/host_calls.py \
             --out "$OUT/diagnostics/host_calls.json" 2>&1 | grep -E "first layer|pack |d2h"
             timeout 120 python3 $B/diagnostics/trace_plan.py \
             --out "$OUT/diagnostics/trace_plan.json" 2>&1 | tail -12
             timeout 200 python3 $B/diagnostics/one_layer.py \
             --out "$OUT/diagnostics/one_layer.json" 2>&1 | tail -9
             timeout 150 python3 $B/diagnostics/new_lengths.py \
             --out "$OUT/diagnostics/new_lengths.json" 2>&1 | tail -22
             for sel in 0 all; do timeout 90 python3 $B/diagnostics/hostprof.py \
             --offload-layers $sel --top 22 2>&1 | tee "$OUT/diagnostics/hostprof_$sel.log" | head -34; done ;;
    extra) bash -c "${EXTRA:-true}" ;;
    *) echo "unknown part: $part" ;;
  esac
done
echo "=== done $(date +%T)"
