#!/usr/bin/env bash
# make lessons — every lesson in order at its default rank count, then a summary table.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
summary=()
failed=0
for dir in lessons/[0-9][0-9]_*/; do
  dir=${dir%/}
  name=$(basename "$dir"); np=$(lesson_np "$dir")
  echo "================ $name (mpirun -np $np)"
  start=$(date +%s%N)
  $MPIRUN -np "$np" "$BUILD/bin/$name"
  rc=$?
  secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  if [ $rc -eq 0 ]; then result=PASS; else result="FAIL (exit $rc)"; failed=$((failed + 1)); fi
  summary+=("$(printf '%-24s %5s   %-14s %7.1f' "$name" "$np" "$result" "$secs")")
done
echo
printf '%-24s %5s   %-14s %7s\n' lesson ranks check seconds
printf '%s\n' "${summary[@]}"
exit $((failed > 0))
