#!/usr/bin/env bash
# make plots — runs the lessons that have figures and draws them into plots/out/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=plots/out; DATA=$BUILD/plot-data
mkdir -p "$OUT" "$DATA"

# Lesson 01: the (m, l) recurrence of one row, and chain vs allreduce merge time against P.
rm -f "$DATA/01_merge.csv"
for np in 1 2 3 4 5 6 7 8; do
  echo "+ lesson 01 at P=$np"
  $MPIRUN -np $np "$BUILD/bin/01_online_softmax" --reps 200 --csv "$DATA/01_merge.csv" >/dev/null
done
$PYTHON plots/01_online_softmax.py "$DATA/01_merge.csv" "$OUT/01_online_softmax.png"
# Lesson 02: per-rank causal work for the three layouts; ring timelines, evenodd vs async.
echo "+ lesson 02 at P=4"
L02="$BUILD/bin/02_ring_attention"
rm -f "$DATA/02_work.csv"
$MPIRUN -np 4 "$L02" --causal --seq 256 --csv "$DATA/02_work.csv" >/dev/null
for order in evenodd async; do
  $MPIRUN -np 4 "$L02" --seq 1024 --dim 64 --order $order --trace "$DATA/02_$order.json" >/dev/null
done
$PYTHON plots/02_ring_attention.py "$DATA/02_work.csv" "$DATA/02_evenodd.json" "$DATA/02_async.json" "$OUT"

# Lesson 03: tokens per expert and the permute -> grouped GEMM -> unpermute picture.
echo "+ lesson 03"
rm -f "$DATA/03_smoe.csv"
$MPIRUN -np 1 "$BUILD/bin/03_smoe" --csv "$DATA/03_smoe.csv" >/dev/null
$PYTHON plots/03_smoe.py "$DATA/03_smoe.csv" "$OUT"

# Lesson 04: the dispatch traffic matrix, and the all-to-all timings at P = 2 and 4.
echo "+ lesson 04 at P=4"
rm -f "$DATA/04_traffic.csv" "$DATA/04_a2a.csv"
$MPIRUN -np 4 "$BUILD/bin/04_gshard" --csv "$DATA/04_traffic.csv" >/dev/null
for np in 2 4; do
  $MPIRUN -np $np "$BUILD/bin/04_gshard" --bench --reps 20 --csv "$DATA/04_a2a.csv" >/dev/null
done
$PYTHON plots/04_gshard.py "$DATA/04_traffic.csv" "$DATA/04_a2a.csv" "$OUT"

echo "figures in $OUT/:"; ls -1 "$OUT"
