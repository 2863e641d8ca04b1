#!/usr/bin/env bash
# The GPU suite: ONE prepared script for a GPU machine (H200; torch 2.11, triton 3.6, Python 3.12,
# no internet), within 8 minutes. Run from the repository root:
#
#   OUT=/some/dir bash benchmarks/gpu_suite.sh            # OUT defaults to benchmarks/results/gpu_suite
#   GPU_SUITE_DRY_RUN=1 bash benchmarks/gpu_suite.sh      # every step on the CPU, tiny sizes, ~3 minutes
#
# Every step runs under its own time limit and all of them under SUITE_BUDGET_S (440 s): a step gets
# at most the time left, is skipped (and recorded as such) when under 10 s remain, and a step that
# fails or times out is recorded while the suite goes on. Tables first, in order of importance:
#   build   the CUDA extension (vvs_engine._C, nvcc, sm_90a) compiles IN THE BACKGROUND from the start,
#           with few jobs, and the tests wait for it; whether it built is in the summary
#   1. ar_graph    AR step, LlamaGen-XL shape, bf16, CFG batch 2, ar_step as a CUDA graph (target <= 0.5 ms)
#   2. ar_eager    the same step eagerly (benchmarks/ar_decode.py)
#   3. tree_attention  Triton vs SDPA with a mask (flash-attn / FlashInfer where they import)
#   4. draft_topk  fused sampling vs torch's sort-based path, V = 16384 first
#   5. e2e_zoo     methods on the Zoo model: latency, TPF, speed-up / TPF (records the acceptance trace)
#   6. e2e_replay_xl  LANTERN and VVS replayed on a random LlamaGen-XL-shaped target; round_replay: each
#      round kind's replay time per method at XL shape (benchmarks/round_replay.py); gpu_launches: kernels
#      per compiled-round replay on the Zoo, counted by the profiler (benchmarks/gpu_launches.py)
#   7. tests       the GPU tests, one process per file (a device-side assert cannot poison the others)
#   8. the other kernel microbenchmarks (--quick), quantized weights vs bf16 (benchmarks/quantize_gpu.py),
#      then the GPT-7B replay if time is left
# Every table carries its command and date. What comes back ($OUT, at most 8 files): suite.log,
# summary.md (every table, concatenated) and results.tar.gz (everything under $RES, test logs included).
set -uo pipefail
DRY=${GPU_SUITE_DRY_RUN:-0}
if [ "$DRY" = 1 ]; then
  OUT=${OUT:-/tmp/gpu_suite_dry}
  RES=${RES:-$OUT/results}
  BUDGET=${SUITE_BUDGET_S:-300}
  DEV=cpu; DTYPE=fp32; AR_SHAPE=tiny; AR_MODEL="--gpt-model GPT-B --image-size 128 --dtype fp32 --steps 4 --warmup 1 --no-e2e"
  E2E_FLAGS="--quick --device cpu"; REPLAY_XL=tiny; REPLAY_7B=tiny; REPEATS=1; ATTN_FLAGS=--quick; RR_TOKENS=64
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES=""
else
  OUT=${OUT:-benchmarks/results/gpu_suite}
  RES=${RES:-benchmarks/results/gpu_run}
  BUDGET=${SUITE_BUDGET_S:-440}
  DEV=cuda; DTYPE=bf16; AR_SHAPE=GPT-XL; AR_MODEL="--gpt-model GPT-XL --image-size 384 --dtype bf16 --steps 32 --warmup 4"
  E2E_FLAGS="--device cuda"; REPLAY_XL=GPT-XL; REPLAY_7B=GPT-7B:576; REPEATS=2; ATTN_FLAGS=""; RR_TOKENS=256
fi
mkdir -p "$OUT"
rm -rf "$RES"; mkdir -p "$RES/kernels" "$RES/tests"
LOG="$OUT/suite.log"
SUMMARY="$OUT/summary.md"
STEPS="$RES/steps.md"
: > "$LOG"; : > "$SUMMARY"; : > "$STEPS"
export PYTHONUNBUFFERED=1 VVS_CUDA_ARCHS=${VVS_CUDA_ARCHS:-90a}
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

step() {  # step NAME LIMIT_S COMMAND...: run under min(LIMIT_S, budget left); never stops the suite
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  local left=$(( BUDGET - (t0 - START) ))
  if [ "$left" -lt 10 ]; then
    echo "=== [$name] skipped: suite budget spent" | tee -a "$LOG"
    echo "- $name: skipped (budget of ${BUDGET} s spent)" >> "$STEPS"
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== [$name] (limit ${limit}s, at $(elapsed)s) $*" | tee -a "$LOG"
  timeout --signal=INT --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - t0 ))
  local what="rc=$rc"
  [ "$rc" = 124 ] && what="TIMED OUT (rc=124)"
  echo "=== [$name] $what in ${took}s" | tee -a "$LOG"
  echo "- $name: $what, ${took} s" >> "$STEPS"
  return 0
}

{ echo "dry run: $DRY   device: $DEV   budget: ${BUDGET}s   $(date -u +%FT%TZ)"
  git log -1 --format='commit %H %s' 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python - <<'PY'
import torch, vvs_engine.kernels as k
from vvs_engine.kernels import flash
dev = "cuda" if torch.cuda.is_available() else "cpu"
print("kernels:", k.describe(dev))
print("attention:", flash.describe(dev, torch.bfloat16, 64, False))
for name in ("flash_attn", "flashinfer"):
    try:
        print(name, __import__(name).__version__)
    except Exception as err:
        print(name, "not available:", err)
PY
} >> "$LOG" 2>&1

# --- the CUDA extension, in the background ------------------------------------------------------
BUILD_LOG="$RES/build.log"
BUILD_PID=""
if [ "$DRY" = 1 ]; then
  echo "dry run: extension build not attempted (no CUDA torch on this machine)" > "$BUILD_LOG"
else
  (
    export MAX_JOBS=${MAX_JOBS:-4}  # few jobs: the timed steps run meanwhile
    if ! command -v nvcc >/dev/null; then
      for d in /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-12; do
        [ -x "$d/bin/nvcc" ] && { export CUDA_HOME=$d PATH="$d/bin:$PATH"; break; }
      done
    fi
    echo "nvcc: $(command -v nvcc) ($(nvcc --version 2>/dev/null | tail -1))"
    python -c "from torch.utils.cpp_extension import CUDA_HOME; import torch; print('CUDA_HOME', CUDA_HOME, 'torch cuda', torch.version.cuda)"
    t0=$(date +%s)
    timeout 300 python setup.py -q build_ext --inplace
    echo "build_ext rc=$? in $(( $(date +%s) - t0 )) s"
  ) > "$BUILD_LOG" 2>&1 &
  BUILD_PID=$!
fi

# --- 1-4: the headline tables -----------------------------------------------------------------------
step ar_graph 45 python benchmarks/ar_graph_step.py --shape "$AR_SHAPE" --device "$DEV" --dtype "$DTYPE" \
  --repeats $(( REPEATS + 1 )) --out "$RES/ar_graph_step.json"
step ar_eager 40 python benchmarks/ar_decode.py $AR_MODEL --batch 2 --device "$DEV" --threads 4 \
  --out "$RES/ar_decode_eager.json"
step tree_attention 70 python benchmarks/kernels/bench_tree_attention.py $ATTN_FLAGS --no-plot --out "$RES/kernels"
step draft_topk 45 python benchmarks/kernels/bench_draft_topk.py --quick --no-plot --out "$RES/kernels"

# --- 5-6: end to end --------------------------------------------------------------------------------
SETTINGS="eagle;lantern:lantern_delta=0.2;vvs:skip_interval=2;vvs:skip_policy=dynamic"
step e2e_zoo 50 python benchmarks/e2e.py --model zoo $E2E_FLAGS --repeats $REPEATS --settings "$SETTINGS" \
  --out "$RES" --tag zoo --record "$RES/trace_zoo.json" --no-plot
# A trace recorded on a tiny random model (no Zoo checkpoint) has meaningless acceptance: replay the
# built-in synthetic profile instead (the report says which).
TRACE="$RES/trace_zoo.json"
grep -q '"model": "zoo"' "$TRACE" 2>/dev/null || TRACE=synthetic
echo "replaying trace: $TRACE" >> "$LOG"
REPLAYED="lantern:lantern_delta=0.2;vvs:skip_interval=2"
step e2e_replay_xl 60 python benchmarks/e2e.py --replay "$TRACE" $E2E_FLAGS --repeats $REPEATS --settings "$REPLAYED" \
  --replay-models "$REPLAY_XL" --out "$RES" --tag replay_xl --no-plot

step round_replay 45 python benchmarks/round_replay.py --shape "$AR_SHAPE" --tokens "$RR_TOKENS" --device "$DEV" \
  --dtype "$DTYPE" --out "$RES/round_replay.md"
# kernel launches per compiled-round replay (profiler), beside the CPU's GPU-style counts
GL_METHODS="--methods ar,eagle,vvs,sjd --max-replays 4"; [ "$DRY" = 1 ] && GL_METHODS="--methods eagle --max-replays 2"
step gpu_launches 90 python benchmarks/gpu_launches.py --device "$DEV" $GL_METHODS --out "$RES/gpu_launches.md"

# --- 7: GPU tests, one process per file -------------------------------------------------------------
if [ -n "$BUILD_PID" ]; then
  left=$(( BUDGET - $(elapsed) - 150 ))
  [ "$left" -lt 1 ] && left=1
  echo "=== waiting for the extension build (at most ${left}s)" | tee -a "$LOG"
  for _ in $(seq "$left"); do kill -0 "$BUILD_PID" 2>/dev/null || break; sleep 1; done
  kill -0 "$BUILD_PID" 2>/dev/null && { echo "build still running: tests go on without it" | tee -a "$LOG"; }
fi
BUILT=$(python -c "import vvs_engine._C; print('yes')" 2>/dev/null || echo no)
echo "- CUDA extension built: $BUILT (see build.log in results.tar.gz)" >> "$STEPS"
python -c "import torch, vvs_engine.kernels as k; print('kernels after the build:', k.describe('cuda' if torch.cuda.is_available() else 'cpu'))" >> "$LOG" 2>&1
cat "$BUILD_LOG" >> "$LOG" 2>/dev/null
TEST_FILES="$(ls tests/kernels/test_*.py) tests/test_loop.py tests/test_batched_speculative.py tests/test_jacobi_batch.py"
# The dry run keeps the CPU-cheap files (CI runs the rest on the CPU anyway).
[ "$DRY" = 1 ] && TEST_FILES="tests/kernels/test_bounds.py tests/test_loop.py tests/test_batched_speculative.py tests/test_jacobi_batch.py"
step tests 150 env TEST_JOBS=${TEST_JOBS:-6} bash benchmarks/gpu_tests.sh "$RES/tests" 140 $TEST_FILES
cat "$RES/tests/summary.txt" >> "$LOG" 2>/dev/null

# --- 8: the rest, while time is left ----------------------------------------------------------------
for b in bench_tree_verify bench_relaxed_acceptance bench_tree_ops bench_kv_compact; do
  step "$b" 20 python "benchmarks/kernels/$b.py" --quick --no-plot --out "$RES/kernels"
done
# batch-invariant mode (issue 53): its Triton kernels against cuBLAS / tree_attention, then its cost per method (on / off)
step bench_invariant 30 python benchmarks/kernels/bench_invariant.py --quick --no-plot --out "$RES/kernels"
IC_FLAGS="--methods ar,sjd,eagle,vvs --settings 1:1,8:8 --repeats 1"; [ "$DRY" = 1 ] && IC_FLAGS="--methods ar --settings 1:1 --repeats 1"
step invariance_cost 90 python benchmarks/batch_invariance_cost.py --device "$DEV" --dtypes "$DTYPE" $IC_FLAGS --out "$RES/batch_invariance_cost_gpu"
# quantized weights (torchao) vs bf16: AR decode time at the GPT-XL shape, each mode compiled (needs torchao)
QG_FLAGS="--gpt-model GPT-XL --image-size 384 --images 1 --device $DEV --dtype bf16"
[ "$DRY" = 1 ] && QG_FLAGS="--gpt-model GPT-B --image-size 32 --images 1 --device cpu --dtype fp32 --modes none,int8"
step quantize_gpu 120 python benchmarks/quantize_gpu.py $QG_FLAGS --out "$RES/quantize_gpu"
step e2e_replay_7b 60 python benchmarks/e2e.py --replay "$TRACE" $E2E_FLAGS --repeats 1 --settings "$REPLAYED" \
  --replay-models "$REPLAY_7B" --out "$RES" --tag replay_7b --no-plot
[ -n "$BUILD_PID" ] && kill "$BUILD_PID" 2>/dev/null

# --- summary ----------------------------------------------------------------------------------------
{
  echo "# GPU suite $(date -u +%FT%TZ) ($(elapsed) s$( [ "$DRY" = 1 ] && echo ', DRY RUN on the CPU: no figure here is a GPU figure'))"
  echo; echo "Command: \`OUT=$OUT GPU_SUITE_DRY_RUN=$DRY SUITE_BUDGET_S=$BUDGET bash benchmarks/gpu_suite.sh\`"
  echo "$(git log -1 --format='Commit %h: %s' 2>/dev/null)"; echo
  cat "$STEPS"; echo
  echo "## tests (one process per file)"; echo '```'; cat "$RES/tests/summary.txt" 2>/dev/null; echo '```'
  for f in "$RES"/ar_graph_step.md "$RES"/round_replay.md "$RES"/gpu_launches.md "$RES"/quantize_gpu.md; do [ -f "$f" ] && { echo; cat "$f"; }; done
  [ -f "$RES/batch_invariance_cost_gpu.md" ] && { echo; cat "$RES/batch_invariance_cost_gpu.md"; }
  for f in "$RES"/ar_decode_eager.json; do
    [ -f "$f" ] && { echo; echo "## AR step, eager ($(basename "$f"))"; echo '```'
      python -c "import json,sys; r=json.load(open(sys.argv[1])); print('\n'.join(f'{k}: {r[k]}' for k in ('command','gpt_model','dtype','device_name','batch_rows','step_ms_median','step_ms_p10','step_ms_p90','achieved_gbps','fraction_of_peak','e2e_generate','timestamp') if k in r))" "$f"
      echo '```'; }
  done
  for f in "$RES"/kernels/tree_attention.csv "$RES"/kernels/draft_topk.csv; do
    [ -f "$f" ] && { echo; echo "## $(basename "$f")"; echo '```'; cat "$f"; echo '```'; }
  done
  for f in "$RES"/e2e_*.md; do [ -f "$f" ] && { echo; cat "$f"; }; done
  for f in "$RES"/kernels/*.csv; do
    case "$f" in *tree_attention.csv|*draft_topk.csv) continue;; esac
    [ -f "$f" ] && { echo; echo "## $(basename "$f")"; echo '```'; cat "$f"; echo '```'; }
  done
} >> "$SUMMARY"
tar -czf "$OUT/results.tar.gz" -C "$(dirname "$RES")" "$(basename "$RES")" 2>> "$LOG"
echo "suite done in $(elapsed) s; files in $OUT" | tee -a "$LOG"
