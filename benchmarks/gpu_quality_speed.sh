#!/usr/bin/env bash
# The quality-versus-speed table on a GPU, in ONE call of the device tool (its own script: the GPU
# suite's 8 minutes are taken). Every setting at 640 images (40 per class) on the Zoo model, written in
# the same files as the CPU table but tagged with the device:
#
#   OUT=/some/dir bash benchmarks/gpu_quality_speed.sh     # default OUT=benchmarks/results/gpu/quality_speed
#   QS_BUDGET_S=300 ...                                    # start no new setting after this (default 420 s)
#
# Settings run in the order of benchmarks/quality_speed.py --settings all (AR first); the time budget
# stops before a setting that would start late, and the report covers what finished and lists the
# rest. What comes back ($OUT, 5 files): quality_speed_<device>.{md,json}, quality_speed_<device>.png,
# quality_speed_<device>_tokens.tar.gz (the token cache: unpack it under benchmarks/results/ to grow
# the table in a later call) and log.txt.
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu/quality_speed}
BUDGET=${QS_BUDGET_S:-420}
DEVICE=${QS_DEVICE:-cuda}
TAG=$(python -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo gpu)
PREFIX="$OUT/quality_speed_$TAG"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  echo "date: $(date -u +%FT%TZ)   device: $DEVICE ($TAG)   budget: ${BUDGET}s"
  git log -1 --format='commit %H %s' 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  # a token cache carried from an earlier call continues the table
  [ -f "$PREFIX"_tokens.tar.gz ] && tar -xzf "$PREFIX"_tokens.tar.gz -C "$OUT" && echo "resumed from the carried cache"
  timeout --signal=INT --kill-after=20 $(( BUDGET + 120 )) \
    python benchmarks/quality_speed.py --device "$DEVICE" --images-per-class 40 --settings all --threads 8 \
      --time-budget "$BUDGET" --out "$PREFIX" --plot "$PREFIX.png"
  echo "quality_speed rc=$?"
} > "$OUT/log.txt" 2>&1
tar -czf "$PREFIX"_tokens.tar.gz -C "$OUT" "$(basename "$PREFIX")_tokens" 2>> "$OUT/log.txt"
rm -rf "$PREFIX"_tokens "$PREFIX"_work
tail -5 "$OUT/log.txt"
