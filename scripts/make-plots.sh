#!/usr/bin/env bash
# make plots [NN ...] — runs the lessons that have figures and draws them into plots/out/:
# every lesson's, or those of the lessons named (make plots PLOTS="02 05"; make slides draws
# the figures its decks lack so).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=plots/out; DATA=$BUILD/plot-data
mkdir -p "$OUT" "$DATA"

# Lesson 01: the (m, l) recurrence of one row, and chain vs allreduce merge time against P.
plots_01() {
  rm -f "$DATA/01_merge.csv"
  for np in 1 2 3 4 5 6 7 8; do
    echo "+ lesson 01 at P=$np"
    $MPIRUN -np $np "$BUILD/bin/01_online_softmax" --reps 200 --csv "$DATA/01_merge.csv" >/dev/null
  done
  $PYTHON plots/01_online_softmax.py "$DATA/01_merge.csv" "$OUT"
}

# Lesson 02: per-rank causal work for the three layouts; ring timelines, evenodd vs async.
plots_02() {
  echo "+ lesson 02 at P=4"
  L02="$BUILD/bin/02_ring_attention"
  rm -f "$DATA/02_work.csv"
  $MPIRUN -np 4 "$L02" --causal --seq 256 --csv "$DATA/02_work.csv" >/dev/null
  for order in evenodd async; do
    $MPIRUN -np 4 "$L02" --seq 1024 --dim 64 --order $order --trace "$DATA/02_$order.json" >/dev/null
  done
  $PYTHON plots/02_ring_attention.py "$DATA/02_work.csv" "$DATA/02_evenodd.json" "$DATA/02_async.json" "$OUT"
}

# Lesson 03: tokens per expert and the permute -> grouped GEMM -> unpermute picture.
plots_03() {
  echo "+ lesson 03"
  rm -f "$DATA/03_smoe.csv"
  $MPIRUN -np 1 "$BUILD/bin/03_smoe" --csv "$DATA/03_smoe.csv" >/dev/null
  $PYTHON plots/03_smoe.py "$DATA/03_smoe.csv" "$OUT"
}

# Lesson 04: the dispatch traffic matrix, and the all-to-all timings at P = 2 and 4.
plots_04() {
  echo "+ lesson 04 at P=4"
  rm -f "$DATA/04_traffic.csv" "$DATA/04_a2a.csv"
  $MPIRUN -np 4 "$BUILD/bin/04_gshard" --csv "$DATA/04_traffic.csv" >/dev/null
  for np in 2 4; do
    $MPIRUN -np $np "$BUILD/bin/04_gshard" --bench --reps 20 --csv "$DATA/04_a2a.csv" >/dev/null
  done
  $PYTHON plots/04_gshard.py "$DATA/04_traffic.csv" "$DATA/04_a2a.csv" "$OUT"
}

# Lesson 05: routing with and without the node limit, bytes per link class, and the expert
# loads over 300 training steps for each balancing scheme and planted bug.
plots_05() {
  echo "+ lesson 05 at P=8"
  L05="$BUILD/bin/05_deepseek_moe"
  rm -f "$DATA/05_layer.csv" "$DATA/05_train.csv"
  for m in 2 4; do $MPIRUN -np 8 "$L05" --topk-groups $m --csv "$DATA/05_layer.csv" >/dev/null; done
  for b in none aux bias; do
    $MPIRUN -np 8 "$L05" --train 300 --balance $b --csv "$DATA/05_train.csv" >/dev/null
  done
  for bug in ema-zero-init bias-peek; do
    $MPIRUN -np 8 "$L05" --train 300 --balance bias --bug $bug --csv "$DATA/05_train.csv" >/dev/null
  done
  $PYTHON plots/05_deepseek_moe.py "$DATA/05_layer.csv" "$DATA/05_train.csv" "$OUT"
}

# Lesson 06: the timelines of the sequential and the overlapped 1F1B run, the hidden fraction
# against the inter-node bandwidth (intra-node 3.2x, DeepSeek-V3's ratio), the progress modes.
plots_06() {
  echo "+ lesson 06 at P=4"
  L06="$BUILD/bin/06_overlap"
  rm -f "$DATA/06_sweep.csv" "$DATA/06_progress.csv"
  for m in sequential overlapped; do
    $MPIRUN -np 4 "$L06" --reps 1 --mode $m --trace "$DATA/06_$m.json" >/dev/null
  done
  for bw in 1 2 3 5 8 13; do
    $MPIRUN -np 4 "$L06" --reps 2 --link "intra=$(awk -v b=$bw 'BEGIN { print 3.2 * b }')MB/s,inter=${bw}MB/s,latency=20us" \
      --csv "$DATA/06_sweep.csv" >/dev/null
  done
  for p in none test thread; do $MPIRUN -np 4 "$L06" --reps 2 --progress $p --csv "$DATA/06_progress.csv" >/dev/null; done
  $PYTHON plots/06_overlap.py "$DATA/06_sequential.json" "$DATA/06_overlapped.json" "$DATA/06_sweep.csv" \
    "$DATA/06_progress.csv" "$OUT"
}

# Lesson 07: Gantt charts of the executed schedules, and the bubble against M at P = 8
# (simulator lines, executed markers). --compute sleep makes each op last its cost x 5 ms, so
# the timelines hold on an oversubscribed machine.
plots_07() {
  echo "+ lesson 07 at P=4 and P=8"
  L07="$BUILD/bin/07_dualpipe"; R07="$DATA/07_runs"
  rm -rf "$R07"; mkdir -p "$R07"
  $MPIRUN -np 1 "$L07" --simulate --csv "$DATA/07_sim.csv" >/dev/null
  run07() {  # run07 SCHEDULE P M
    $MPIRUN -np $2 "$L07" --schedule $1 --microbatches $3 --compute sleep --unit-ms 5 \
      --csv "$R07/07_$1_P$2_M$3.csv" >/dev/null
  }
  for s in gpipe 1f1b zb-h1 zb-h2 dualpipe dualpipev; do
    run07 $s 4 8
    for m in 16 24 32; do run07 $s 8 $m; done
  done
  $PYTHON plots/07_dualpipe.py "$DATA/07_sim.csv" "$R07" "$OUT"
}

# Lesson 08: the loss of one process and of four DP x TP meshes over 200 steps (the mesh against one
# process from the same weights every 50), rank 0's memory against DP for ZeRO-0 to ZeRO-3, and
# the bytes per step on each mesh axis.
plots_08() {
  echo "+ lesson 08 at P=1, 2 and 4"
  L08="$BUILD/bin/08_mesh"
  rm -f "$DATA/08_loss.csv" "$DATA/08_memory.csv"
  run08() {  # run08 NP ARGS...: 200 training steps, one process's check every 50
    local np=$1; shift
    $MPIRUN -np $np "$L08" --train 200 --check-every 50 --log-every 50 "$@" --csv "$DATA/08_loss.csv" >/dev/null
  }
  run08 1 --tp 1 --zero 0
  run08 2 --tp 1
  run08 2 --tp 2
  run08 4 --tp 2
  run08 4 --tp 4
  for z in 0 1 2 3; do
    for dp in 1 2 4; do
      $MPIRUN -np $dp "$L08" --tp 1 --zero $z --train 1 --batch 8 --csv "$DATA/08_memory.csv" >/dev/null
    done
  done
  $PYTHON plots/08_mesh.py "$DATA/08_loss.csv" "$DATA/08_memory.csv" "$OUT"
  # checkpoints: 100 steps on DP 2 x TP 2; the same stopped after 50 with --save; resumed on one process
  rm -rf "$DATA/08_ck" "$DATA"/08_ck_*.csv
  ck08() { local np=$1 csv=$2; shift 2; $MPIRUN -np $np "$L08" --check-every 25 --csv "$DATA/$csv" "$@" >/dev/null; }
  ck08 4 08_ck_whole.csv --train 100
  ck08 4 08_ck_first.csv --train 50 --save "$DATA/08_ck"
  ck08 1 08_ck_resumed.csv --train 100 --resume "$DATA/08_ck"
  $PYTHON plots/08_checkpoint.py "$DATA/08_ck_whole.csv" "$DATA/08_ck_first.csv" "$DATA/08_ck_resumed.csv" "$OUT"

  # Lesson 08 part 2: the default 32-rank 5D mesh (dp 4 x pp 2 x cp 2 x tp 2, ep 2 folded): its groups
  # on every axis, its loss against one process's over 50 steps (two runs from the same seed; the
  # mesh's default model has 3 layers), every rank's bytes per axis in one step against the formula,
  # and a Gantt chart of one step from a 3-step trace. 50 steps: the mesh checks every step against
  # one process (gathering the weights and gradients), about half a second a step with 32 ranks on
  # two cores.
  echo "+ lesson 08 part 2 at P=1 and 32"
  rm -f "$DATA/08_5d_loss.csv"
  $MPIRUN -np 32 "$L08" --print-mesh >"$DATA/08_5d_mesh.txt"
  run08_5d() {  # run08_5d NP ARGS...: 50 training steps, the loss from the same weights every 10, the log kept
    local np=$1; shift
    $MPIRUN -np $np "$L08" --train 50 --check-every 10 --log-every 10 "$@" --csv "$DATA/08_5d_loss.csv" \
      >"$DATA/08_5d_P$np.log"
  }
  run08_5d 1 --layers 3
  run08_5d 32
  m1=$(grep -o '^model:.* parameters,' "$DATA/08_5d_P1.log")  # the model, without rank 0's share
  m32=$(grep -o '^model:.* parameters,' "$DATA/08_5d_P32.log")
  if [ "$m1" != "$m32" ]; then
    printf 'error: lesson 08 part 2: one process and the mesh train different models:\n%s\n%s\n' \
      "$m1" "$m32" >&2
    exit 1
  fi
  $MPIRUN -np 32 "$L08" --train 3 --check-every 50 --log-every 50 --trace "$DATA/08_5d.json" >/dev/null
  $PYTHON plots/08_mesh_5d.py "$DATA/08_5d_mesh.txt" "$DATA/08_5d_loss.csv" "$DATA/08_5d.json" "$OUT"
}

# Lesson 09: what each cache keeps per token; decode tokens/s against the batch size under the
# memory roofline (a model of about 170 MB, one process); the MoE's communication per decode
# step, all-to-all against all-reduce, at 4 ranks under the link model.
plots_09() {
  echo "+ lesson 09"
  L09="$BUILD/bin/09_inference"
  rm -f "$DATA/09_cache.csv" "$DATA/09_speed.csv" "$DATA/09_moe.csv"
  $MPIRUN -np 1 "$L09" --new 8 --csv "$DATA/09_cache.csv" >/dev/null
  big="--dim 512 --heads 8 --kv-lora 128 --q-lora 128 --ffn 2048 --experts 16 --moe-ffn 512 --layers 4 --cache absorbed --new 16"
  for w in "" "--int8"; do
    $MPIRUN -np 1 "$L09" $big $w --speed 1,2,4,8,16,32 --csv "$DATA/09_speed.csv" >/dev/null
  done
  for how in alltoall allreduce; do
    for b in 1 2 4 8 16; do
      $MPIRUN -np 4 "$L09" --moe-comm $how --batch $b --new 24 --cache absorbed --link latency=20us \
        --ranks-per-node 2 --csv "$DATA/09_moe.csv" >/dev/null
    done
  done
  $PYTHON plots/09_inference.py "$DATA/09_cache.csv" "$DATA/09_speed.csv" "$DATA/09_moe.csv" "$OUT"
}

# Lesson 10: the FP8 GEMM's relative error against K = 128 .. 16384: DeepSeek-V3's recipe (1 x 128
# and 128 x 128 tiles, promoted every 128 products), never promoted, a float32 accumulator, each
# with a tensor-core accumulator of 14 bits (the H800's, the lesson's default), 13 and 15; and on
# activations with outlier channels, per-tile scales against one scale per tensor (--part formats,
# about 5 s a run on two cores). Then [4], mixed-precision training on 2 data-parallel ranks, 500
# steps (about 8 s a run; FP8's scalar GEMMs about 2 min): float32, bf16 with float32 masters, bf16
# gradient sums, FP8 linear layers; and at lr 1e-4 bf16 with and without masters (the planted bug
# no-master, whose check fails: exit 1). Every run appends to one csv, its rows told apart by their
# kind column (fp8, train).
plots_10() {
  echo "+ lesson 10 at P=2"
  L10="$BUILD/bin/10_precision"; C10="$DATA/10_precision.csv"
  rm -f "$C10"
  for bits in 14 13 15; do
    $MPIRUN -np 2 "$L10" --part formats --k-max 16384 --acc-bits $bits --csv "$C10" >/dev/null
  done
  run10() {  # run10 ARGS...: 500 training steps, one process's loss and gradients every 50
    $MPIRUN -np 2 "$L10" --part train --train 500 --check-every 50 --log-every 100 "$@" --csv "$C10" >/dev/null
  }
  run10 --precision fp32
  run10 --precision bf16
  run10 --precision bf16 --grad-reduce bf16
  run10 --precision fp8
  run10 --precision bf16 --lr 1e-4
  # the planted bug: its check FAILs, exit 1 (the rows are written first); any other status is an error
  local rc=0
  run10 --precision bf16 --lr 1e-4 --bug no-master || rc=$?
  if [ "$rc" -ne 1 ]; then
    echo "error: lesson 10 --bug no-master exited $rc, expected 1 (its check fails on the planted bug)" >&2
    exit 1
  fi
  $PYTHON plots/10_precision.py "$C10" "$OUT"
}

with_figures=$(declare -F | sed -n 's/^declare -f plots_//p' | tr '\n' ' ')
lessons=("$@")
[ ${#lessons[@]} -gt 0 ] || lessons=($with_figures)
for nn in "${lessons[@]}"; do
  declare -F "plots_$nn" >/dev/null ||
    { echo "error: lesson $nn has no figures (lessons with figures: $with_figures)" >&2; exit 2; }
done
for nn in "${lessons[@]}"; do "plots_$nn"; done
echo "figures in $OUT/:"; ls -1 "$OUT"
