#!/usr/bin/env bash
# Profile one short generation with Nsight Systems (nsys) on a GPU machine.
#
#   bash benchmarks/profile_nsys.sh [METHOD] [MODEL] [OUT_DIR]
#     METHOD  ar | eagle | lantern | vvs ... (default vvs)
#     MODEL   zoo | GPT-XL | GPT-7B | GPT-B  (default GPT-XL, random weights; zoo = the shipped model)
#     OUT_DIR default benchmarks/results/nsys
#
# What it does: builds the engine, runs one untimed generation (CUDA-graph capture, Triton
# autotuning), then profiles exactly one more generation between cudaProfilerStart/Stop
# (--capture-range=cudaProfilerApi), so the report holds steady-state rounds only.
#
# What to look at in the report (nsys-ui OUT_DIR/vvs_<method>.nsys-rep, or the text summaries
# written next to it):
#   * NVTX ranges (nvtx_sum): prefill, draft, verify, accept, skip, decode (AR), vq_decode. Their
#     share of the wall time says where a round goes; verify should dominate at LlamaGen-XL size.
#   * Graph launches (cuda_api_sum: cudaGraphLaunch): one per verify / extend / build / AR step. With
#     --cuda-graph-trace=node the kernels inside each graph are listed one by one (cuda_gpu_kern_sum);
#     switch to =graph to see each replay as a single block.
#   * Gaps between kernels on the GPU row = host overhead: the GPU waits for Python. In steady state the
#     CUDA API row should run ahead of the GPU row; a gap that follows a cudaStreamSynchronize /
#     cudaMemcpy DtoH (cuda_api_sum) is a host sync the loop should not have (the one expected read
#     is the pinned, one-round-late committed count: cudaEventSynchronize on an event already passed).
#   * accept + draft between two verify graphs is eager glue: its launches are the next thing to fuse.
set -euo pipefail
METHOD=${1:-vvs}
MODEL=${2:-GPT-XL}
OUT_DIR=${3:-benchmarks/results/nsys}
mkdir -p "$OUT_DIR"
REP="$OUT_DIR/vvs_${METHOD}"

nsys profile \
  --trace=cuda,nvtx,osrt \
  --cuda-graph-trace=node \
  --capture-range=cudaProfilerApi --capture-range-end=stop \
  --sample=none --cpuctxsw=none \
  --force-overwrite=true \
  --output="$REP" \
  python - "$METHOD" "$MODEL" <<'PY'
import sys
import torch
from vvs_engine.evaluation.bench import lantern_k, load_model

method, model = sys.argv[1], sys.argv[2]
eng, desc = load_model(model, "cuda", "bf16", quick=False)
opts = {} if method == "ar" else ({"lantern_k": lantern_k(eng)} if eng.vq is None else {})
kw = dict(class_labels=[1], method=method, temperature=1.0, cfg_scale=4.0, decode_images=eng.vq is not None, **opts)
eng.generate(seed=0, **kw)  # warm-up: graph capture and autotuning stay out of the report
torch.cuda.synchronize()
torch.cuda.profiler.start()
out = eng.generate(seed=1, **kw)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print(f"{desc}: {method} tpf {out.stats['tpf']:.2f} wall {out.stats['wall_time_s'] * 1e3:.1f} ms")
PY

nsys stats --report nvtx_sum,cuda_api_sum,cuda_gpu_kern_sum --format csv --output "$REP" "$REP.nsys-rep" || true
echo "report: $REP.nsys-rep (summaries: ${REP}_*.csv)"
