#!/usr/bin/env bash
# make bench: lesson 08's paired F&B steps overlapped at their all-to-alls against one after
# the other, under the link model (dualpipev on 4 ranks, every stage an MoE block, links at
# 8 MB/s so that the all-to-alls cost about what the compute does). Runs the two in turn,
# REPS times each, and prints each one's ms per step (the lesson's own timing, the check
# excluded) as min / median / max and the ratio of the medians: below 1 means time hidden.
# Then the hidden fraction as lesson 06 defines it, (T_seq - T_ovl) / min(T_compute, T_comm),
# from the medians of whole steps: T_seq and T_ovl the two runs above, T_compute the
# sequential run without the link model (the messages then cost next to nothing), T_comm =
# T_seq - T_compute. Whole steps include DualPipeV's warm-up and cool-down, whose all-to-alls
# no pair can hide, so this is a lower bound on what the pairs themselves hide.
# usage: bench_08_overlap.sh LESSON_BINARY [REPS]   (MPIRUN from the environment)
set -euo pipefail
bin=$1; reps=${2:-5}
args="--tp 1 --pp 2 --ep 2 --schedule dualpipev --layers 4 --dense-layers 0 --batch 16 --microbatches 8
      --train 6 --check-every 100 --ranks-per-node 4"
declare -A ms=([on]="" [off]="" [compute]="")
step_ms() { sed -n 's/^training: \([0-9.]*\) ms per step.*/\1/p'; }
for ((i = 0; i < reps; i++)); do
  for ov in on off; do
    out=$($MPIRUN -np 4 "$bin" $args --link intra=8MB/s,latency=50us --overlap $ov) || { echo "$out"; exit 1; }
    ms[$ov]+="$(echo "$out" | step_ms) "
  done
  out=$($MPIRUN -np 4 "$bin" $args --overlap off) || { echo "$out"; exit 1; }
  ms[compute]+="$(echo "$out" | step_ms) "
done
stats() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR]=$1} END {printf "%.1f %.1f %.1f", v[1], v[int((NR+1)/2)], v[NR]}'; }
read -r on_min on_med on_max <<<"$(stats "${ms[on]}")"
read -r off_min off_med off_max <<<"$(stats "${ms[off]}")"
echo "  --overlap on:  $on_med ms per step (min $on_min, max $on_max, $reps runs)"
echo "  --overlap off: $off_med ms per step (min $off_min, max $off_max, $reps runs)"
awk -v a="$on_med" -v b="$off_med" 'BEGIN { printf "  on / off: %.3f (below 1: the pairs hide part of their all-to-alls)\n", a / b }'
read -r c_min c_med c_max <<<"$(stats "${ms[compute]}")"
echo "  no link model, --overlap off: $c_med ms per step (min $c_min, max $c_max): the compute"
awk -v ovl="$on_med" -v seq="$off_med" -v comp="$c_med" 'BEGIN {
  comm = seq - comp; hideable = comm < comp ? comm : comp
  if (hideable <= 0) { print "  hidden fraction: n/a (the modelled messages cost nothing measurable)"; exit }
  printf "  hidden fraction (T_seq - T_ovl) / min(T_compute, T_comm) = (%.1f - %.1f) / min(%.1f, %.1f) = %.2f (lesson 06 reaches 0.83)\n",
         seq, ovl, comp, comm, (seq - ovl) / hideable }'
