#!/usr/bin/env bash
# make bench: lesson 08's paired F&B steps overlapped at their all-to-alls against one after
# the other, under the link model (dualpipev on 4 ranks, every stage an MoE block, links at
# 8 MB/s so that the all-to-alls cost about what the compute does). Runs the two in turn,
# REPS times each, and prints each one's ms per step (the lesson's own timing, the check
# excluded) as min / median / max and the ratio of the medians: below 1 means time hidden.
# usage: bench_08_overlap.sh LESSON_BINARY [REPS]   (MPIRUN from the environment)
set -euo pipefail
bin=$1; reps=${2:-5}
args="--tp 1 --pp 2 --ep 2 --schedule dualpipev --layers 4 --dense-layers 0 --batch 16 --microbatches 8
      --train 6 --check-every 100 --ranks-per-node 4 --link intra=8MB/s,latency=50us"
declare -A ms=([on]="" [off]="")
for ((i = 0; i < reps; i++)); do
  for ov in on off; do
    out=$($MPIRUN -np 4 "$bin" $args --overlap $ov) || { echo "$out"; exit 1; }
    ms[$ov]+="$(echo "$out" | sed -n 's/^training: \([0-9.]*\) ms per step.*/\1/p') "
  done
done
stats() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR]=$1} END {printf "%.1f %.1f %.1f", v[1], v[int((NR+1)/2)], v[NR]}'; }
read -r on_min on_med on_max <<<"$(stats "${ms[on]}")"
read -r off_min off_med off_max <<<"$(stats "${ms[off]}")"
echo "  --overlap on:  $on_med ms per step (min $on_min, max $on_max, $reps runs)"
echo "  --overlap off: $off_med ms per step (min $off_min, max $off_max, $reps runs)"
awk -v a="$on_med" -v b="$off_med" 'BEGIN { printf "  on / off: %.3f (below 1: the pairs hide part of their all-to-alls)\n", a / b }'
