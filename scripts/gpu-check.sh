#!/usr/bin/env bash
# make gpu-check — what only a GPU can check, in one command and one report
# (build/gpu-check.txt): the CUDA kernels against their cpu twins on the GPU, make bench, and
# every lesson with --device cuda at its default rank count and at 1 and 2 ranks (more when
# the machine has more GPUs; ranks on a node share its GPUs by node-local rank) on the MPI
# backend, and, when the build has NCCL, the NCCL tests of Comm, its watchdog, and every lesson
# on --backend nccl at 1 rank and up to one rank per GPU. Every line of the report is also
# printed. Without a GPU it says so and exits 0, running nothing.
# Exit 1 if any kernel test or lesson check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
devices=$("$BUILD/tests/device_query")
nccl=$(sed -n 's/^backends:.* nccl //p' <<<"$devices")
if ! grep -qw cuda <<<"$devices"; then
  echo "gpu-check: no GPU here ($(head -n 1 <<<"$devices"), $(tail -n 1 <<<"$devices")): nothing to check."
  echo "On a machine with an NVIDIA GPU and the CUDA toolkit, make gpu-check runs the cuda kernel"
  echo "tests, make bench and every lesson with --device cuda (on MPI, and on NCCL when the build"
  echo "has it), and writes build/gpu-check.txt."
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

# run_lessons BACKEND MAX_RANKS: every lesson with --device cuda --backend BACKEND at 1, 2, its
# default rank count and the GPU count, those up to MAX_RANKS
run_lessons() {
  local backend=$1 max=$2 dir name np sizes p start secs rc
  for dir in lessons/[0-9][0-9]_*/; do
    dir=${dir%/}; name=$(basename "$dir"); np=$(lesson_np "$dir")
    sizes=$(printf '%s\n' 1 2 "$np" "$ngpu" | sort -nu | tr '\n' ' ')
    for p in $sizes; do
      [ "$p" -ge 1 ] && [ "$p" -le "$max" ] || continue
      start=$(date +%s%N)
      $MPIRUN -np "$p" "$BUILD/bin/$name" --device cuda --backend "$backend" >"$tmp/run.log" 2>&1; rc=$?
      secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
      if [ $rc = 0 ] && grep -q '^check: PASS' "$tmp/run.log"; then
        say "$(printf '%-20s -np %-3s %-4s PASS  %6s s' "$name" "$p" "$backend" "$secs")"
      elif [ $rc = 2 ] && [ "$(grep -c . "$tmp/run.log")" = 1 ]; then
        say "$(printf '%-20s -np %-3s %-4s not at this size: %s' "$name" "$p" "$backend" "$(head -n 1 "$tmp/run.log")")"
      else
        failed=$((failed + 1))
        say "$(printf '%-20s -np %-3s %-4s FAIL (exit %s)' "$name" "$p" "$backend" "$rc")"
        tail -n 25 "$tmp/run.log" | sed 's/^/    | /' | tee -a "$report.tmp"
      fi
    done
  done
}

say ""
say "## every lesson with --device cuda (the MPI backend: tensors staged through the host)"
run_lessons mpi 1000000

say ""
if [ -z "$nccl" ]; then
  say "## NCCL: not in this build (make says why: ✗ no nccl), so not checked"
else
  say "## NCCL $nccl: Comm's calls on cuda buffers, one rank per GPU"
  if $MPIRUN -np "$ngpu" "$BUILD/tests/mpi_tests" -tc='nccl on cuda*' >"$tmp/nccl.log" 2>&1 &&
     ! grep -q 'skipped: needs' "$tmp/nccl.log"; then
    say "ok: $(grep -a '\[doctest\] assertions:' "$tmp/nccl.log" | tail -n 1)"
  else
    failed=$((failed + 1)); say "FAIL (or skipped):"; tail -n 40 "$tmp/nccl.log" | tee -a "$report.tmp"
  fi
  if [ "$ngpu" -ge 2 ]; then
    timeout 8 $MPIRUN -np 2 "$BUILD/tests/ssend_deadlock" --nccl cuda --timeout 3 >"$tmp/dl.log" 2>&1
    if grep -q 'no progress for 3 s in recv with peer' "$tmp/dl.log"; then
      say "ok: the watchdog ends an NCCL deadlock: $(grep -m1 '^error:' "$tmp/dl.log")"
    else
      failed=$((failed + 1)); say "FAIL: no watchdog line for an NCCL deadlock:"; tail -n 20 "$tmp/dl.log" | tee -a "$report.tmp"
    fi
  fi
  say ""
  say "## every lesson with --device cuda --backend nccl (at most one rank per GPU)"
  run_lessons nccl "$ngpu"
fi
say ""
say "gpu-check: $failed failed"
mv "$report.tmp" "$report"
echo "wrote $report"
[ $failed = 0 ]
