#!/usr/bin/env bash
# make gpu-check — what only a GPU can check, in one command and one report
# (build/gpu-check.txt): the CUDA kernels against their cpu twins on the GPU, make bench, and
# every lesson with --device cuda at its default rank count and at 1 and 2 ranks (more when
# the machine has more GPUs; ranks on a node share its GPUs by node-local rank). Every line
# of the report is also printed. Without a GPU it says so and exits 0, running nothing.
# Exit 1 if any kernel test or lesson check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
MPIRUN=${MPIRUN:-mpirun --oversubscribe -q --mca odls_base_sigkill_timeout 0 $( [ "$(id -u)" = 0 ] && echo --allow-run-as-root )}
devices=$("$BUILD/tests/device_query")
if ! grep -qw cuda <<<"$devices"; then
  echo "gpu-check: no GPU here ($devices): nothing to check. On a machine with an NVIDIA GPU"
  echo "and the CUDA toolkit, make gpu-check runs the cuda kernel tests, make bench and every"
  echo "lesson with --device cuda, and writes build/gpu-check.txt."
  exit 0
fi
report=$BUILD/gpu-check.txt
tmp=$(mktemp -d /tmp/fivefold-gpu-check.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
failed=0
say() { echo "$*" | tee -a "$report.tmp"; }
: > "$report.tmp"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
say "# fivefold gpu-check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "# $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1) ($ngpu GPU(s))"

say ""
say "## kernel tests, cuda against cpu"
if env FF_TEST_DEVICE=cuda "$BUILD/tests/unit_tests" --test-suite=kernels >"$tmp/kernels.log" 2>&1; then
  say "ok: $(grep -a '\[doctest\] test cases:' "$tmp/kernels.log" | tail -n 1)"
else
  failed=$((failed + 1)); say "FAIL:"; tail -n 40 "$tmp/kernels.log" | tee -a "$report.tmp"
fi

say ""
say "## make bench"
if make --no-print-directory bench >"$tmp/bench.log" 2>&1; then
  grep -v '^make\|^mpicxx\|^nvcc' "$tmp/bench.log" | tee -a "$report.tmp" >/dev/null
  grep -v '^make\|^mpicxx\|^nvcc' "$tmp/bench.log"
else
  failed=$((failed + 1)); say "FAIL:"; tail -n 40 "$tmp/bench.log" | tee -a "$report.tmp"
fi

say ""
say "## every lesson with --device cuda (the MPI backend)"
for dir in lessons/[0-9][0-9]_*/; do
  dir=${dir%/}; name=$(basename "$dir"); np=$(lesson_np "$dir")
  sizes=$(printf '%s\n' 1 2 "$np" "$ngpu" | sort -nu | tr '\n' ' ')
  for p in $sizes; do
    [ "$p" -ge 1 ] || continue
    start=$(date +%s%N)
    $MPIRUN -np "$p" "$BUILD/bin/$name" --device cuda >"$tmp/run.log" 2>&1; rc=$?
    secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
    if [ $rc = 0 ] && grep -q '^check: PASS' "$tmp/run.log"; then
      say "$(printf '%-20s -np %-3s PASS  %6s s' "$name" "$p" "$secs")"
    elif [ $rc = 2 ] && [ "$(grep -c . "$tmp/run.log")" = 1 ]; then
      say "$(printf '%-20s -np %-3s not at this size: %s' "$name" "$p" "$(head -n 1 "$tmp/run.log")")"
    else
      failed=$((failed + 1))
      say "$(printf '%-20s -np %-3s FAIL (exit %s)' "$name" "$p" "$rc")"
      tail -n 25 "$tmp/run.log" | sed 's/^/    | /' | tee -a "$report.tmp"
    fi
  done
done
say ""
say "gpu-check: $failed failed"
mv "$report.tmp" "$report"
echo "wrote $report"
[ $failed = 0 ]
