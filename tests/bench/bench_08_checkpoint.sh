#!/usr/bin/env bash
# make bench: lesson 08's checkpoint write and read throughput against a plain copy of the same
# bytes on this disk. A model of d 256 and 4 blocks on DP 2 x TP 2: --save after one step (every
# rank writing its slices in place, each flushing its files, the manifest with every file's
# CRC-32 last, the rename), then --resume with no step (every CRC-32 checked on rank 0, every
# rank reading its slices), each timed by the lesson; against `cp -r` of the checkpoint followed
# by `sync` of its file system (the write), and `cat` of its files (the read), REPS times each,
# medians. The lesson's bytes per second count the files' bytes once.
# usage: bench_08_checkpoint.sh LESSON_BINARY [REPS]   (MPIRUN from the environment)
set -euo pipefail
bin=$1; reps=${2:-3}
dir=$(mktemp -d /tmp/fivefold-bench-ck.XXXXXX)
trap 'rm -rf "$dir"' EXIT
args="--dim 256 --layers 4 --ffn 512 --moe-ffn 128"
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR]=$1} END {printf "%.1f", v[int((NR+1)/2)]}'; }
save=""; load=""; cpw=""; cpr=""
for ((i = 0; i < reps; i++)); do
  rm -rf "$dir/ck" "$dir/copy"
  out=$($MPIRUN -np 4 "$bin" $args --train 1 --save "$dir/ck") || { echo "$out"; exit 1; }
  save+="$(echo "$out" | sed -n 's/^checkpoint after 1 steps: .* in \([0-9.]*\) ms.*/\1/p') "
  out=$($MPIRUN -np 4 "$bin" $args --train 0 --resume "$dir/ck") || { echo "$out"; exit 1; }
  load+="$(echo "$out" | sed -n 's/^resumed from .* read in \([0-9.]*\) ms.*/\1/p') "
  t0=$(date +%s%N); cp -r "$dir/ck/step-000001" "$dir/copy"; sync -f "$dir/copy"; t1=$(date +%s%N)
  cpw+="$(awk -v a=$t0 -v b=$t1 'BEGIN { printf "%.1f", (b - a) / 1e6 }') "
  t0=$(date +%s%N); cat "$dir"/copy/*.npy >/dev/null; t1=$(date +%s%N)
  cpr+="$(awk -v a=$t0 -v b=$t1 'BEGIN { printf "%.1f", (b - a) / 1e6 }') "
done
bytes=$(du -sb "$dir/ck/step-000001" | cut -f1)
for what in "write:$save:$cpw" "read:$load:$cpr"; do
  IFS=: read -r name lesson plain <<<"$what"
  l=$(median "$lesson"); p=$(median "$plain")
  awk -v n="$name" -v l="$l" -v p="$p" -v b="$bytes" 'BEGIN {
    printf "  %-5s lesson 08 %7.1f ms (%6.0f MB/s), plain copy %7.1f ms (%6.0f MB/s): %.2fx the copy'"'"'s time\n",
           n, l, b / l / 1e3, p, b / p / 1e3, l / p }'
done
echo "  ($bytes bytes, $reps runs each, medians; the lesson's read checks every CRC-32 and reads on 4 ranks)"
