#!/usr/bin/env bash
# make bench: lesson 08's paired F&B steps overlapped at their all-to-alls, under the link model
# (dualpipev on 4 ranks, every stage an MoE block, links at 8 MB/s so that the all-to-alls cost
# about what the compute does). Each run is the lesson's own --overlap compare: every step's
# paired steps one after the other without the link model (T_compute) and with it (T_seq), then
# overlapped (T_ovl, the run trained with), and lesson 06's hidden fraction
# (T_seq - T_ovl) / min(T_compute, T_comm), T_comm = T_seq - T_compute, per rank. Prints each
# run's worst and mean over the ranks, and the medians over REPS runs.
# usage: bench_08_overlap.sh LESSON_BINARY [REPS]   (MPIRUN from the environment)
set -euo pipefail
bin=$1; reps=${2:-5}
args="--tp 1 --pp 2 --ep 2 --schedule dualpipev --layers 4 --dense-layers 0 --batch 16 --microbatches 8
      --train 6 --check-every 100 --ranks-per-node 4 --link intra=8MB/s,latency=50us --overlap compare"
worst=""; mean=""
for ((i = 0; i < reps; i++)); do
  out=$($MPIRUN -np 4 "$bin" $args) || { echo "$out"; exit 1; }
  line=$(echo "$out" | grep '^hidden fraction of the paired steps')
  echo "  run $((i + 1)): ${line#hidden fraction of the paired steps: }"
  worst+="$(echo "$line" | sed -n 's/.*worst \([0-9.]*\),.*/\1/p') "
  mean+="$(echo "$line" | sed -n 's/.*mean \([0-9.]*\) .*/\1/p') "
done
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR]=$1} END {printf "%.2f", v[int((NR+1)/2)]}'; }
echo "  hidden fraction of the paired steps, median of $reps runs: worst rank $(median "$worst"), mean $(median "$mean") (target >= 0.70; lesson 06 reaches 0.83)"
