#!/usr/bin/env bash
# GPU tests, one pytest process per file (a CUDA device-side assert poisons only its own process),
# TEST_JOBS files at a time. Files outside tests/kernels and tests/test_loop.py run only their GPU
# tests (-k gpu): their CPU tests are CI's job. Used by benchmarks/gpu_suite.sh.
#
#   bash benchmarks/gpu_tests.sh OUT_DIR PER_FILE_LIMIT_S FILE...
#
# Writes OUT_DIR/<file>.log and OUT_DIR/summary.txt (one line per file: rc and pytest's last line);
# exits 0 only if every file passed. PYTHON names the interpreter (default: python).
set -uo pipefail
out=$1 per_file=$2; shift 2
mkdir -p "$out"

one() {
  local f=$1 name rc last
  local select=()
  name=$(basename "$f" .py)
  case "$f" in *tests/kernels/*|*tests/test_loop.py) ;; *) select=(-k gpu) ;; esac
  timeout --signal=INT --kill-after=5 "$per_file" "${PYTHON:-python}" -m pytest -q -rs -p no:cacheprovider "${select[@]}" "$f" \
    > "$out/$name.log" 2>&1
  rc=$?
  last=$(grep -E "[0-9]+ (passed|failed|skipped|deselected|errors?)" "$out/$name.log" | tail -1)
  echo "$f rc=$rc ${last:-no pytest summary (timed out?)}"
}
export -f one
export out per_file

printf '%s\n' "$@" | xargs -P "${TEST_JOBS:-4}" -I{} bash -c 'one "$1"' _ {} | sort > "$out/summary.txt"
cat "$out/summary.txt"
! grep -qv " rc=0 " "$out/summary.txt"
