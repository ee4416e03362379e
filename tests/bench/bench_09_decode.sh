#!/usr/bin/env bash
# make bench: lesson 09's decode speed as seed 002 measures it — tokens/s at batch 1 and 8, and
# the memory bandwidth a step uses (weights and caches read per step / step time) against the
# bandwidth this machine reads memory at (measured by the lesson). A model large enough that its
# weights (about 170 MB in float32) live in memory, not in the caches: d 512, 4 blocks (1 dense),
# 16 experts of 512, 8 heads, r_kv 128. Float32, then int8 weights.
# usage: bench_09_decode.sh LESSON_BINARY   (MPIRUN from the environment)
set -euo pipefail
bin=$1
model="--dim 512 --heads 8 --kv-lora 128 --q-lora 128 --ffn 2048 --experts 16 --moe-ffn 512 --layers 4"
for weights in "" "--int8"; do
  out=$($MPIRUN -np 1 "$bin" $model $weights --cache absorbed --new 32 --speed 1,8) || { echo "$out"; exit 1; }
  echo "  ${weights:-float32} weights:"
  echo "$out" | sed -n '/^decode speed (one process/,/^check:/p' | grep -v '^check:' | sed 's/^/  /'
done
