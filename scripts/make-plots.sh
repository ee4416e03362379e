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
echo "figures in $OUT/:"; ls -1 "$OUT"
