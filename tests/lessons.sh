# Lesson tests, sourced by scripts/run-tests.sh (uses its check / usage_error helpers).
# Each lesson runs under mpirun at several world sizes (1 and odd sizes included) and
# shapes; its own printed check must PASS, a planted bug must make it FAIL, and bad input
# must give one error line and exit 2 on every rank.

section "lesson 01: online softmax"
pytest_step "01 online softmax: every world size and shape, planted bugs, bad input, dumps and traces" tests/lessons/test_01_online_softmax.py

L02=$B/02_ring_attention
section "lesson 02: ring attention"
# every world size x mask x order, each layout in turn (one check line per combination)
for np in 1 2 3 4; do
  for order in evenodd async; do
    for mode in "--causal" ""; do
      check "02 P=$np, $order, ${mode:-non-causal}: contiguous, zigzag, striped all PASS" 0 '^check: PASS' \
        bash -c "for l in contiguous zigzag striped; do $MPIRUN -np $np $L02 --order $order $mode --layout \$l || exit 1; done"
    done
  done
done
check "02 S not divisible by P or 2P: uneven blocks (P=3, S=50, every layout, causal)" 0 '^check: PASS' \
  bash -c "for l in contiguous zigzag striped; do $MPIRUN -np 3 $L02 --causal --seq 50 --dim 8 --layout \$l --order async || exit 1; done"
check "02 batch, heads, odd head dim, S = 2P exactly (P=4, zigzag)" 0 '^check: PASS' \
  $MPIRUN -np 4 $L02 --causal --batch 2 --heads 3 --seq 8 --dim 5 --layout zigzag
check "02 balance: zigzag and striped give max/mean <= 1.05, contiguous does not (P=4, S=256)" 0 \
  '^\* zigzag .* max/mean 1\.0[0-5]' \
  bash -c "out=\$($MPIRUN -np 4 $L02 --causal --seq 256 --layout zigzag) || exit 1; echo \"\$out\" | sed 's/^ *//'; \
           echo \"\$out\" | grep -Eq '^ +striped .* max/mean 1\.0[0-5]' && echo \"\$out\" | grep -Eq '^ +contiguous .* max/mean 1\.[3-9]'"
check "02 --order naive: Ssend to r+1 first on every rank deadlocks; the watchdog names it" 1 \
  'error: rank [0-9]: no progress for 2 s in ssend with peer [0-9] \(tag 0, [0-9]+ bytes\) — likely deadlock' \
  timeout 20 $MPIRUN -np 3 $L02 --order naive --timeout 2
check "02 --order naive on one rank: nothing to send, no deadlock" 0 '^check: PASS' \
  $MPIRUN -np 1 $L02 --order naive --causal
check "02 planted bug: dK/dV accumulated where computed, not travelling (P=3)" 1 \
  'dK .*FAIL' $MPIRUN -np 3 $L02 --causal --bug dkv-local --seq 48
check "02 planted bug: delta term dropped from dS = P (dP - delta)" 1 'dQ .*FAIL' \
  $MPIRUN -np 2 $L02 --bug no-delta
check "02 planted bug: P recomputed from m instead of lse" 1 'dV .*FAIL' \
  $MPIRUN -np 2 $L02 --causal --bug lse-no-log
check "02 --mask local: causal mask from local indices leaks future tokens" 1 'o   = .*FAIL' \
  $MPIRUN -np 4 $L02 --causal --mask local
check "02 --dump: numpy recomputes attention forward and backward from the dump (P=3, zigzag)" 0 '^dump ok' \
  bash -c "rm -rf $LOG/d02 && $MPIRUN -np 3 $L02 --causal --layout zigzag --seq 30 --dump $LOG/d02 >/dev/null && $PYTHON tests/check_dump_02.py $LOG/d02 3"
check "02 --trace: one track per rank, spans nest, messages in flight as async events (async order)" 0 '^trace ok: 4 ranks, [0-9]+ spans, [1-9][0-9]* flights' \
  bash -c "$MPIRUN -np 4 $L02 --order async --causal --trace $LOG/t02.json >/dev/null && $PYTHON scripts/check-trace.py $LOG/t02.json - 4"
check "02 --trace, evenodd order: spans nest on every track" 0 '^trace ok: 3 ranks' \
  bash -c "$MPIRUN -np 3 $L02 --causal --trace $LOG/t02e.json >/dev/null && $PYTHON scripts/check-trace.py $LOG/t02e.json - 3"
check "02 --help lists every flag with its default" 0 '--layout .*\(default: contiguous\)' $MPIRUN -np 2 $L02 --help
usage_error "02 bad input: --seq shorter than P" $MPIRUN -np 4 $L02 --seq 3
usage_error "02 bad input: zigzag needs 2P tokens" $MPIRUN -np 4 $L02 --layout zigzag --seq 7
usage_error "02 bad input: --order typo" $MPIRUN -np 2 $L02 --order ring
usage_error "02 bad input: --bug dkv-local with unequal blocks" $MPIRUN -np 3 $L02 --bug dkv-local --seq 50
usage_error "02 bad input: --dim over the kernels' 128 on sim" $MPIRUN -np 2 $L02 --device sim --dim 200
for np in 2 3; do
  check "02 --device sim: attention.cu kernels under the emulator, P=$np, causal zigzag async, S=40" 0 '^check: PASS' \
    $MPIRUN -np $np $L02 --device sim --causal --layout zigzag --order async --seq 40
done
if $T/device_query | grep -qw cuda; then
  check "02 --device cuda: attention.cu kernels on the GPU (P=2)" 0 '^check: PASS' \
    $MPIRUN -np 2 $L02 --device cuda --causal --layout striped
fi

L03=$B/03_smoe
section "lesson 03: sparse MoE"
for gate in softmax-topk topk-softmax; do
  check "03 $gate: default demo, loop == grouped, backward == autograd" 0 '^check: PASS' $MPIRUN -np 1 $L03 --gate $gate
  check "03 $gate: k = 1, k = N, one expert, odd sizes" 0 '^check: PASS' \
    bash -c "$MPIRUN -np 1 $L03 --gate $gate --topk 1 && $MPIRUN -np 1 $L03 --gate $gate --topk 8 --alpha 1 && \
             $MPIRUN -np 1 $L03 --gate $gate --experts 1 --topk 1 && $MPIRUN -np 1 $L03 --gate $gate --batch 3 --tokens 7 --dim 5 --ffn 3 --experts 5 --topk 3"
  check "03 $gate: starved experts get no tokens and exactly zero gradient" 0 'dW exactly 0 +PASS' \
    $MPIRUN -np 1 $L03 --gate $gate --starve 3 --alpha 1
done
check "03 planted bug: gate weight applied twice in the expert backward" 1 'd experts_w2 .*FAIL' \
  $MPIRUN -np 1 $L03 --bug gate-twice
check "03 planted bug: SiLU' without the upstream gradient" 1 'd experts_w1 .*FAIL' \
  $MPIRUN -np 1 $L03 --bug silu-no-upstream
check "03 planted bug: router path missing from dx" 1 'dx .*FAIL' \
  $MPIRUN -np 1 $L03 --bug no-router-path --gate topk-softmax
check "03 --trace: spans nest, the check on its own track" 0 '^trace ok: 1 ranks' \
  bash -c "$MPIRUN -np 1 $L03 --trace $LOG/t03.json >/dev/null && $PYTHON scripts/check-trace.py $LOG/t03.json - 1"
check "03 --dump: numpy recomputes the layer and its gradients" 0 '^dump ok' \
  bash -c "rm -rf $LOG/d03 && $MPIRUN -np 1 $L03 --gate topk-softmax --starve 2 --alpha 0.5 --dump $LOG/d03 >/dev/null && $PYTHON tests/check_dump_03.py $LOG/d03"
check "03 --help lists every flag with its default" 0 '--gate .*\(default: softmax-topk\)' $MPIRUN -np 1 $L03 --help
usage_error "03 bad input: more than one rank" $MPIRUN -np 2 $L03
usage_error "03 bad input: --topk larger than --experts" $MPIRUN -np 1 $L03 --experts 4 --topk 5
usage_error "03 bad input: --starve leaves fewer than k experts" $MPIRUN -np 1 $L03 --experts 4 --topk 2 --starve 3
usage_error "03 bad input: --gate typo" $MPIRUN -np 1 $L03 --gate softmax
check "03 --device sim: router top-k, permute, grouped GEMM and combine kernels under the emulator" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 1 $L03 --device sim && $MPIRUN -np 1 $L03 --device sim --gate topk-softmax --starve 2 --tokens 9"
if $T/device_query | grep -qw cuda; then
  check "03 --device cuda" 0 '^check: PASS' $MPIRUN -np 1 $L03 --device cuda
fi

L04=$B/04_gshard
section "lesson 04: GShard expert parallelism"
for np in 1 2 3 4; do
  check "04 P=$np, N=12: ordered, async, library all PASS (exact dispatch/combine, grads == one process)" 0 '^check: PASS' \
    bash -c "for a in ordered async library; do $MPIRUN -np $np $L04 --experts 12 --a2a \$a || exit 1; done"
done
check "04 starved experts: zero-size messages, both gates (P=3, N=6, 3 starved)" 0 '^check: PASS' \
  bash -c "for a in ordered async library; do for g in softmax-topk topk-softmax; do $MPIRUN -np 3 $L04 --experts 6 --starve 3 --gate \$g --a2a \$a || exit 1; done; done"
check "04 k = N (every token to every rank), P=4" 0 '^check: PASS' $MPIRUN -np 4 $L04 --experts 4 --topk 4 --alpha 1
check "04 ordered with synchronous sends at P=3 and P=4, odd sizes" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 3 $L04 --a2a ordered --experts 3 --topk 1 --tokens 7 --dim 5 && $MPIRUN -np 4 $L04 --a2a ordered --experts 8 --batch 3 --tokens 5"
check "04 the three all-to-alls give bitwise-identical y, dx and gradients (P=3)" 0 '^identical' \
  bash -c "for a in ordered async library; do rm -rf $LOG/d04\$a; $MPIRUN -np 3 $L04 --experts 6 --starve 2 --a2a \$a --dump $LOG/d04\$a >/dev/null || exit 1; done; \
           for f in y dx aux_loss d_router_w d_router_b d_experts_w1 d_experts_w2 d_experts_w3 topk_idx; do \
             cmp $LOG/d04ordered/\$f.npy $LOG/d04async/\$f.npy && cmp $LOG/d04ordered/\$f.npy $LOG/d04library/\$f.npy || exit 1; done; echo identical"
check "04 --trace: the all-to-all's spans nest on every track (P=4, async)" 0 '^trace ok: 4 ranks, [0-9]+ spans, [1-9][0-9]* flights' \
  bash -c "$MPIRUN -np 4 $L04 --a2a async --trace $LOG/t04.json >/dev/null && $PYTHON scripts/check-trace.py $LOG/t04.json - 4"
check "04 --dump: numpy recomputes the layer on all ranks' tokens (lesson 03's check)" 0 '^dump ok' \
  bash -c "rm -rf $LOG/d04 && $MPIRUN -np 3 $L04 --experts 6 --starve 2 --a2a async --dump $LOG/d04 >/dev/null && \
           $PYTHON tests/check_dump_03.py $LOG/d04"
check "04 --bench: the three all-to-alls timed, as ratios to MPI_Alltoallv" 0 'ordered/lib' \
  $MPIRUN -np 3 $L04 --bench --reps 2
usage_error "04 bad input: N not a multiple of P" $MPIRUN -np 4 $L04 --experts 6
usage_error "04 bad input: --a2a typo" $MPIRUN -np 2 $L04 --a2a ring
usage_error "04 bad input: --topk larger than --experts" $MPIRUN -np 2 $L04 --experts 4 --topk 6
check "04 --device sim: MoE kernels under the emulator (P=2)" 0 '^check: PASS' \
  $MPIRUN -np 2 $L04 --device sim --starve 1 --a2a async
if $T/device_query | grep -qw cuda; then
  check "04 --device cuda (P=2)" 0 '^check: PASS' $MPIRUN -np 2 $L04 --device cuda
fi

L05=$B/05_deepseek_moe
section "lesson 05: DeepSeek-V3 MoE"
for np in 1 2 4 8; do
  check "05 P=$np: sigmoid gate, groups, shared expert, hierarchical and flat both PASS" 0 '^check: PASS' \
    bash -c "for a in hierarchical flat; do $MPIRUN -np $np $L05 --a2a \$a || exit 1; done"
done
check "05 odd P=3 with R=1 (3 nodes of one rank), N=12, both all-to-alls" 0 '^check: PASS' \
  bash -c "for a in hierarchical flat; do $MPIRUN -np 3 $L05 --ranks-per-node 1 --experts 12 --a2a \$a || exit 1; done"
check "05 softmax gate; no groups (G=1); S=0 with K=1 (softmax); S=2 (P=4)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 4 $L05 --gate softmax && $MPIRUN -np 4 $L05 --groups 1 --topk-groups 1 && \
           $MPIRUN -np 4 $L05 --shared 0 --topk 1 --gate softmax && $MPIRUN -np 4 $L05 --shared 2 --route-scale 1"
check "05 capacity: drop and next-best, hierarchical and flat (P=8, C=0.6)" 0 '^check: PASS' \
  bash -c "for o in drop next-best; do for a in hierarchical flat; do $MPIRUN -np 8 $L05 --capacity-factor 0.6 --overflow \$o --a2a \$a || exit 1; done; done"
check "05 capacity table: overflow dropped, or moved and nothing dropped when room is left (P=4)" 0 '^next-best dropped 0$' \
  bash -c "$MPIRUN -np 4 $L05 --capacity-factor 0.8 | grep -Eq '^ +[0-9]+ +[0-9]+ +[0-9]+ +[1-9][0-9]* +[1-9]' || exit 1; \
           $MPIRUN -np 4 $L05 --capacity-factor 1.2 --overflow next-best | awk '/^ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+$/ {d += \$5; m += \$6} END {if (m == 0) exit 1; print \"next-best dropped \" d}'"
check "05 flat and hierarchical dumps: routing and expert rows byte-identical, y/dx/grads within tolerance (P=8)" 0 '^dumps ok' \
  bash -c "for a in flat hierarchical; do rm -rf $LOG/d05\$a; $MPIRUN -np 8 $L05 --capacity-factor 0.8 --overflow next-best --a2a \$a --dump $LOG/d05\$a >/dev/null || exit 1; done; \
           for f in x dy topk_idx kept gates router_w bias experts_w1 experts_w2 experts_w3 shared_w1 shared_w2 shared_w3; do cmp $LOG/d05flat/\$f.npy $LOG/d05hierarchical/\$f.npy || exit 1; done; \
           $PYTHON tests/check_dump_05.py $LOG/d05flat $LOG/d05hierarchical"
check "05 --aux-count selected: the balance loss counts the layer's selection, numpy recomputes the dump, and it differs from the report's count (P=4)" 0 '^aux counts differ' \
  bash -c "rm -rf $LOG/d05sel && $MPIRUN -np 4 $L05 --aux-count selected --dump $LOG/d05sel >/dev/null && $PYTHON tests/check_dump_05.py $LOG/d05sel >/dev/null && \
           a=\$($MPIRUN -np 4 $L05 | grep 'balance loss') && b=\$($MPIRUN -np 4 $L05 --aux-count selected | grep 'balance loss') && \
           [ \"\$a\" != \"\$b\" ] && echo aux counts differ"
check "05 --train 20 on 8 ranks equals one process over the same global batch (loss every step, parameters), one bias everywhere" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 8 $L05 --train 20 --log-every 5 > $LOG/train05.txt; rc=\$?; cat $LOG/train05.txt; grep -q 'the bias is the same on every rank  *PASS' $LOG/train05.txt && exit \$rc"
check "05 --train with --balance aux (softmax gate, flat all-to-all) and none equal one process (P=4)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 4 $L05 --train 20 --balance aux --a2a flat && $MPIRUN -np 4 $L05 --train 20 --balance none"
check "05 --train planted bias-update bugs run and are named (ema-zero-init, bias-peek, P=2)" 0 'planted: bias-peek' \
  bash -c "$MPIRUN -np 2 $L05 --train 20 --bug ema-zero-init | grep -q 'planted: ema-zero-init' && $MPIRUN -np 2 $L05 --train 20 --bug bias-peek"
check "05 --train --balance bias is DeepSeek-V3's: the sequence-wise loss (alpha 0.0001) beside the bias, the bias alone with --seq-alpha 0; both equal one process (P=4)" 0 '^both ok' \
  bash -c "a=\$($MPIRUN -np 4 $L05 --train 3 --log-every 1) && b=\$($MPIRUN -np 4 $L05 --train 3 --log-every 1 --seq-alpha 0) && \
           echo \"\$a\" | grep -q 'balance bias + sequence-wise loss (alpha 0.0001)' && echo \"\$a\" | grep -qE '^ +0 +[0-9.]+ +0\.000[1-9]' && \
           echo \"\$b\" | grep -qE '^ +0 +[0-9.]+ +0\.00000 ' && [ \$(echo \"\$a\$b\" | grep -c '^check: PASS') = 2 ] && echo both ok"
usage_error "05 bad input: --seq-alpha without --balance bias" $MPIRUN -np 2 $L05 --train 5 --balance aux --seq-alpha 0.01
usage_error "05 bad input: --seq-alpha without --train" $MPIRUN -np 2 $L05 --seq-alpha 0.01
usage_error "05 bad input: --aux-count in a run with no balance loss" $MPIRUN -np 2 $L05 --aux-count selected --alpha 0
usage_error "05 bad input: --data that cannot be read" $MPIRUN -np 2 $L05 --train 5 --data /nonexistent/text.txt
usage_error "05 bad input: a backward bug with --train" $MPIRUN -np 2 $L05 --train 5 --bug no-renorm
for bug in bias-grad no-renorm no-shared-grad; do
  check "05 planted bug --bug $bug fails the check (P=4)" 1 '^check: FAIL' $MPIRUN -np 4 $L05 --bug $bug
done
check "05 --help lists every flag with its default" 0 '--ranks-per-node N .*\(default: 2\)' $MPIRUN -np 1 $L05 --help
check "05 --trace: spans nest on every track (P=4, hierarchical)" 0 '^trace ok: 4 ranks' \
  bash -c "$MPIRUN -np 4 $L05 --trace $LOG/t05.json >/dev/null && $PYTHON scripts/check-trace.py $LOG/t05.json - 4"
usage_error "05 bad input: N not a multiple of P" $MPIRUN -np 4 $L05 --experts 6
usage_error "05 bad input: K more than the experts of M groups" $MPIRUN -np 4 $L05 --experts 8 --topk 5 --topk-groups 1
usage_error "05 bad input: M more than G" $MPIRUN -np 4 $L05 --topk-groups 3
usage_error "05 bad input: G not dividing N" $MPIRUN -np 4 $L05 --experts 8 --groups 3
usage_error "05 bad input: R not dividing P" $MPIRUN -np 4 $L05 --ranks-per-node 3
usage_error "05 bad input: --capacity-factor 0" $MPIRUN -np 2 $L05 --capacity-factor 0
usage_error "05 bad input: --capacity-factor -1" $MPIRUN -np 2 $L05 --capacity-factor -1
usage_error "05 bad input: --a2a typo" $MPIRUN -np 2 $L05 --a2a ring
check "05 --link: bytes counted by Comm equal the routing map's, flat and hierarchical timed under the model (P=8)" 0 'hierarchical / flat = [0-9.]+ \(modelled' \
  $MPIRUN -np 8 $L05 --link intra=2GB/s,inter=500MB/s,latency=5us --reps 2
usage_error "05 bad input: malformed --link" $MPIRUN -np 2 $L05 --link inter=fast
usage_error "05 bad input: --link with an unknown key" $MPIRUN -np 2 $L05 --link intra=1GB/s,wan=1
usage_error "05 bad input: training bug without --train" $MPIRUN -np 2 $L05 --bug ema-zero-init
check "05 --device sim: the layer's kernels under the emulator (P=2, capacity next-best)" 0 '^check: PASS' \
  $MPIRUN -np 2 $L05 --device sim --capacity-factor 0.8 --overflow next-best --batch 1
if $T/device_query | grep -qw cuda; then
  check "05 --device cuda (P=2)" 0 '^check: PASS' $MPIRUN -np 2 $L05 --device cuda
fi

L06=$B/06_overlap
section "lesson 06: 1F1B compute/communication overlap"
for np in 1 2 3 4; do
  check "06 P=$np: overlapped (W inline, W in waits) == sequential bit for bit, sequential == one process" 0 '^check: PASS' \
    $MPIRUN -np $np $L06 --reps 1 --experts $((2 * np))
done
check "06 M = 1, 2, 4 and 7 micro-batches (P=2; M=1 has no F&B step)" 0 '^check: PASS' \
  bash -c "for m in 1 2 4 7; do $MPIRUN -np 2 $L06 --reps 1 --microbatches \$m || exit 1; done"
for p in none test thread; do
  check "06 --progress $p (P=4): the same checks" 0 '^check: PASS' $MPIRUN -np 4 $L06 --reps 1 --progress $p
done
check "06 --prefill: two forwards interleaved == sequential == one process (P=3, M=3 and P=4)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 3 $L06 --prefill --microbatches 3 --experts 6 --reps 1 && $MPIRUN -np 4 $L06 --prefill --reps 1"
check "06 sequential and overlapped dumps are byte-identical: every y, dx and gradient of every rank (P=4, M=5)" 0 '^dumps identical: [1-9][0-9]* files' \
  bash -c "rm -rf $LOG/d06s $LOG/d06o; for m in sequential overlapped; do $MPIRUN -np 4 $L06 --reps 1 --microbatches 5 --mode \$m --dump $LOG/d06\${m:0:1} >/dev/null || exit 1; done; \
           n=0; for f in $LOG/d06s/*.npy; do cmp \$f $LOG/d06o/\$(basename \$f) || exit 1; n=\$((n + 1)); done; \
           [ \$n = \$(ls $LOG/d06o/*.npy | wc -l) ] && echo \"dumps identical: \$n files\""
check "06 --trace: compute overlaps the messages on every rank when overlapped, never when sequential (P=4)" 0 '^overlap ok: 4 ranks, overlapped' \
  bash -c "for m in sequential overlapped; do $MPIRUN -np 4 $L06 --reps 1 --mode \$m --trace $LOG/t06\$m.json >/dev/null && \
           $PYTHON scripts/check-trace.py $LOG/t06\$m.json - 4 && $PYTHON tests/check_trace_06.py $LOG/t06\$m.json 4 \$m || exit 1; done"
check "06 prints the hidden fraction and DualPipe's bubble from the measured costs (P=4)" 0 "simulator, P=8, M=20: dualpipe +bubble" \
  bash -c "out=\$($MPIRUN -np 4 $L06 --reps 1) || exit 1; echo \"\$out\"; echo \"\$out\" | grep -Eq '^hidden fraction \(the worst rank\): -?[0-9]+%'"
check "06 planted bug: the experts read the dispatched rows before their wait (NaN until the finish), P=4" 1 \
  '^    y +max abs err nan .*FAIL' $MPIRUN -np 4 $L06 --reps 1 --mode overlapped --bug early-read
check "06 planted bug early-read with --mode both: overlapped != sequential" 1 \
  'W in waits == sequential +FAIL' $MPIRUN -np 2 $L06 --reps 1 --bug early-read
check "06 --help lists every flag with its default" 0 '--progress \{none\|test\|thread\} .*\(default: test\)' $MPIRUN -np 1 $L06 --help
usage_error "06 bad input: N not a multiple of P" $MPIRUN -np 3 $L06 --experts 8
usage_error "06 bad input: heads not dividing dim" $MPIRUN -np 2 $L06 --heads 5
usage_error "06 bad input: K more than N" $MPIRUN -np 2 $L06 --topk 9
usage_error "06 bad input: R not dividing P" $MPIRUN -np 4 $L06 --ranks-per-node 3
usage_error "06 bad input: --progress typo" $MPIRUN -np 2 $L06 --progress poll
usage_error "06 bad input: --mode typo" $MPIRUN -np 2 $L06 --mode overlap
usage_error "06 bad input: malformed --link" $MPIRUN -np 2 $L06 --link inter=0GB/s
usage_error "06 bad input: --bug early-read with --mode sequential" $MPIRUN -np 2 $L06 --mode sequential --bug early-read
usage_error "06 bad input: --microbatches 0" $MPIRUN -np 2 $L06 --microbatches 0
check "06 --device sim: the block's kernels under the emulator (P=2, small shape)" 0 '^check: PASS' \
  $MPIRUN -np 2 $L06 --device sim --reps 1 --tokens 16 --dim 32 --ffn 32 --microbatches 3
if $T/device_query | grep -qw cuda; then
  check "06 --device cuda (P=2)" 0 '^check: PASS' $MPIRUN -np 2 $L06 --device cuda --reps 1
fi

L07=$B/07_dualpipe
section "lesson 07: pipeline schedules"
# every schedule at every world size, M = 2P (the default), P, 2P+2 and 7, where the schedule
# allows them (the program's own --print-schedule says which, with its usage error). The runs
# are counted, so a schedule skipped by mistake (or run where it should not) fails: the four
# schedules on a line (gpipe, 1f1b, zb-h1, zb-h2) take every M; dualpipe needs P even and
# M even >= 2P, dualpipev M >= 2P:
#   P=1: 16 + dualpipev at M = 2, 4, 7                                  = 19
#   P=2: 16 + dualpipe at M = 4, 6 + dualpipev at M = 4, 6, 7           = 21
#   P=3: 16 + dualpipev at M = 6, 8, 7                                  = 19
#   P=4: 16 + dualpipe at M = 8, 10 + dualpipev at M = 8, 10            = 20
runs07=(- 19 21 19 20)
for np in 1 2 3 4; do
  want07=${runs07[$np]}
  first check "07 P=$np: the $want07 runs of every schedule that allows P, M in {2P, P, 2P+2, 7}, loss and grads == one process" \
    0 "^ran $want07 of $want07 runs: check: PASS" \
    bash -c "n=0; for s in gpipe 1f1b zb-h1 zb-h2 dualpipe dualpipev; do for m in 0 $np $((2 * np + 2)) 7; do \
               $MPIRUN -np 1 $L07 --print-schedule --schedule \$s --stages $np --microbatches \$m >/dev/null 2>&1 || continue; \
               $MPIRUN -np $np $L07 --schedule \$s --microbatches \$m --compute real | grep -q '^check: PASS' || { echo \"\$s M=\$m FAILED\"; exit 1; }; \
               n=\$((n + 1)); echo \"\$s M=\$m\"; done; done; \
             [ \$n = $want07 ] || { echo \"ran \$n runs, want $want07\"; exit 1; }; echo \"ran \$n of $want07 runs: check: PASS\""
done
check "07 default demo: DualPipe P=4, M=8, timed by --compute sleep" 0 '^check: PASS' $MPIRUN -np 4 $L07
check "07 DualPipe P=4 M=8 and DualPipeV P=4 M=8 with 4 blocks per stage, width 17, 3 rows" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 4 $L07 --schedule dualpipe --layers 16 --dim 17 --rows 3 --compute real && \
           $MPIRUN -np 4 $L07 --schedule dualpipev --layers 32 --dim 17 --rows 3 --compute real"
check "07 planted bug: a skipped deferred W fails the check (zb-h1)" 1 'd w[12] .*FAIL' \
  $MPIRUN -np 4 $L07 --schedule zb-h1 --compute real --bug drop-w
check "07 planted bug: a skipped deferred W fails the check (zb-h2)" 1 'd w[12] .*FAIL' \
  $MPIRUN -np 4 $L07 --schedule zb-h2 --compute real --bug drop-w
check "07 planted bug: a skipped deferred W fails the check (dualpipev)" 1 'd w[12] .*FAIL' \
  $MPIRUN -np 4 $L07 --schedule dualpipev --compute real --bug drop-w
check "07 planted bug: DualPipe's two copies not summed fails the check" 1 'first stage .*FAIL' \
  $MPIRUN -np 4 $L07 --schedule dualpipe --compute real --bug no-copy-sum
check "07 --print-schedule: 1f1b P=2 M=3 is warm-up, one-forward-one-backward, cool-down" 0 '^same' \
  bash -c "out=\$($MPIRUN -np 1 $L07 --print-schedule --schedule 1f1b --stages 2 --microbatches 3) || exit 1; \
           want=\$(printf 'rank 0: F0(0) F0(1) B0(0) F0(2) B0(1) B0(2)\nrank 1: F0(0) B0(0) F0(1) B0(1) F0(2) B0(2)'); \
           [ \"\$out\" = \"\$want\" ] && echo same || { echo \"\$out\"; exit 1; }"
check "07 --print-schedule without the ranks: dualpipe P=8, M=20 from one process, 8 lines 'rank R: op ...'" 0 '^8 lines' \
  bash -c "out=\$($MPIRUN -np 1 $L07 --print-schedule --schedule dualpipe --stages 8 --microbatches 20) || exit 1; \
           echo \"\$out\" | grep -Evq '^rank [0-7]:( [FBIW][01]\([0-9]+\)(&B[01]\([0-9]+\))?)+$' && { echo \"\$out\"; exit 1; }; \
           echo \"\$(echo \"\$out\" | wc -l) lines\""
# 6 rows (P = 4, 8 x M = 2P, 20, 64) per schedule. ZB-H2's formula (Qi et al.) counts
# iterations run back to back; one iteration on its own adds the slant, (P-1)F = P-1 here.
check "07 --simulate: the simulated bubble equals Table 2's formula on every row (zb-h2's plus P-1)" 0 '^30 rows agree of 30, 6 zb-h2 rows of 6' \
  bash -c "$MPIRUN -np 1 $L07 --simulate | awk 'NF >= 9 && \$7 ~ /^\\(P/ { \
             if (\$1 == \"zb-h2\") { z++; if (\$5 == \$6 + \$2 - 1) zok++; else print } \
             else { n++; if (\$5 == \$6) ok++; else print } } \
           END { printf \"%d rows agree of %d, %d zb-h2 rows of %d\n\", ok, n, zok, z; \
                 exit !(n == 30 && ok == n && z == 6 && zok == z) }'"
check "07 --dump: numpy recomputes the loss and every layer's gradient (dualpipe, P=4)" 0 '^dump ok' \
  bash -c "rm -rf $LOG/d07 && $MPIRUN -np 4 $L07 --compute real --dump $LOG/d07 >/dev/null && $PYTHON tests/check_dump_07.py $LOG/d07"
check "07 --dump check fails on DualPipe's unsummed copies" 1 'MISMATCH' \
  bash -c "rm -rf $LOG/d07b && $MPIRUN -np 4 $L07 --compute real --bug no-copy-sum --dump $LOG/d07b >/dev/null; $PYTHON tests/check_dump_07.py $LOG/d07b"
check "07 --trace and --csv: one track per rank, op spans from every rank" 0 '^trace ok' \
  bash -c "$MPIRUN -np 4 $L07 --schedule zb-h1 --unit-ms 1 --trace $LOG/t07.json --csv $LOG/t07.csv >/dev/null && $PYTHON scripts/check-trace.py $LOG/t07.json $LOG/t07.csv 4"
check "07 --help lists every flag with its default" 0 '--schedule .*\(default: dualpipe\)' $MPIRUN -np 1 $L07 --help
usage_error "07 bad input: dualpipe with an odd number of ranks" $MPIRUN -np 3 $L07 --schedule dualpipe
usage_error "07 bad input: dualpipe with M odd" $MPIRUN -np 4 $L07 --schedule dualpipe --microbatches 9
usage_error "07 bad input: dualpipev with M < 2P" $MPIRUN -np 4 $L07 --schedule dualpipev --microbatches 7
usage_error "07 bad input: --stages not the world size when executing" $MPIRUN -np 2 $L07 --schedule 1f1b --stages 4
usage_error "07 bad input: --layers not a multiple of the stages" $MPIRUN -np 3 $L07 --schedule 1f1b --layers 4
usage_error "07 bad input: --cost with an unknown key" $MPIRUN -np 2 $L07 --cost F=1,X=2
usage_error "07 bad input: --cost W larger than B" $MPIRUN -np 2 $L07 --cost B=1,W=2
usage_error "07 bad input: --schedule typo" $MPIRUN -np 2 $L07 --schedule 1F1B
check "07 --device sim: the blocks' kernels under the emulator (dualpipe, P=2)" 0 '^check: PASS' \
  $MPIRUN -np 2 $L07 --device sim --compute real
if $T/device_query | grep -qw cuda; then
  check "07 --device cuda (zb-h1, P=2)" 0 '^check: PASS' $MPIRUN -np 2 $L07 --device cuda --schedule zb-h1 --compute real
fi

L08=$B/08_mesh
section "lesson 08: the 5D mesh (DP x PP x CP x TP x EP), ZeRO-1, sequence parallelism"
# every mesh: each step's loss and mean gradients == one process's within 4 n eps, AdamW bit for
# bit, replicas equal, communication == its formula, memory == seed 001's fp32 formula
check "08 one process (P=1: tp 1, dp 1)" 0 '^check: PASS' $MPIRUN -np 1 $L08 --train 6
check "08 dp2 ZeRO-0 and ZeRO-1 (P=2, --tp 1)" 0 '^check: PASS' \
  bash -c "for z in 0 1; do $MPIRUN -np 2 $L08 --tp 1 --zero \$z --train 6 || exit 1; done"
check "08 tp2 without SP, and tp2 + SP (P=2)" 0 '^check: PASS' \
  bash -c "for s in off on; do $MPIRUN -np 2 $L08 --tp 2 --sp \$s --train 6 || exit 1; done"
check "08 dp2 x tp2: + SP + ZeRO-1 (the default), no SP + ZeRO-0, SP + ZeRO-0 (P=4)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 4 $L08 --train 6 && $MPIRUN -np 4 $L08 --sp off --zero 0 --train 6 && \
           $MPIRUN -np 4 $L08 --zero 0 --train 6"
check "08 tp4 + SP, uneven vocabulary split 65 = 17+16+16+16 (P=4)" 0 '^check: PASS' $MPIRUN -np 4 $L08 --tp 4 --train 6
check "08 dp3 (P=3, ZeRO-1 padding: N not a multiple of 3) and dp4" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 3 $L08 --batch 6 --train 6 && $MPIRUN -np 4 $L08 --tp 1 --train 4"
check "08 three MoE layers, no dense one, no shared expert; a dense-only model (P=4, dp2 x tp2)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 4 $L08 --layers 3 --dense-layers 0 --shared 0 --train 4 && \
           $MPIRUN -np 4 $L08 --layers 2 --dense-layers 2 --train 4"
check "08 cp2 (ring attention over MLA, zigzag), cp2 x tp2 + SP, cp2 x tp2 no SP + ZeRO-0 (P=2, 4)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 2 $L08 --tp 1 --cp 2 --train 4 && $MPIRUN -np 4 $L08 --cp 2 --train 4 && \
           $MPIRUN -np 4 $L08 --cp 2 --sp off --zero 0 --train 4"
check "08 cp2 x dp2, cp4, and cp3 (odd: 6 chunks of a 30-token sequence)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 4 $L08 --tp 1 --cp 2 --train 3 && $MPIRUN -np 4 $L08 --tp 1 --cp 4 --train 3 && \
           $MPIRUN -np 3 $L08 --tp 1 --cp 3 --seq 30 --batch 3 --train 3"
check "08 planted bug: the causal mask from local indices under CP (no error, no NaN: wrong loss)" 1 \
  'loss of the mesh = one process.s .*FAIL' $MPIRUN -np 2 $L08 --tp 1 --cp 2 --bug local-causal-mask --train 2
check "08 planted bug: RoPE from local positions under CP" 1 'mean gradient of every weight .*FAIL' \
  $MPIRUN -np 2 $L08 --tp 1 --cp 2 --bug local-rope-positions --train 2
check "08 ep2 folded over dp (P=2, tp 1), over tp (P=4, dp2 x tp2 + SP), ZeRO-0 and ZeRO-1" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 2 $L08 --tp 1 --ep 2 --train 4 && $MPIRUN -np 4 $L08 --ep 2 --train 4 && \
           $MPIRUN -np 4 $L08 --ep 2 --zero 0 --train 3"
check "08 ep4 over tp x dp (expert-DP 1), hierarchical 2 nodes x 2 and 4 x 1, ep2 x cp2 (P=4)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 4 $L08 --ep 4 --train 3 && $MPIRUN -np 4 $L08 --ep 4 --a2a hierarchical --train 3 && \
           $MPIRUN -np 4 $L08 --tp 1 --ep 4 --a2a hierarchical --ranks-per-node 1 --train 3 && \
           $MPIRUN -np 4 $L08 --tp 1 --cp 2 --ep 2 --train 3"
check "08 ep3 over dp3 (odd), 6 experts (P=3)" 0 '^check: PASS' \
  $MPIRUN -np 3 $L08 --tp 1 --ep 3 --experts 6 --batch 6 --train 3
check "08 planted bug: expert gradients averaged over expert-DP instead of DP x CP (ep2, tp 1)" 1 \
  'mean gradient of every weight .*experts.*FAIL' $MPIRUN -np 2 $L08 --tp 1 --ep 2 --bug ep-grad-mean --train 2
check "08 pp2 with 1f1b, zb-h1 (weight gradients deferred to W) and dualpipev (a V, 4 stages) (P=2)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 2 $L08 --tp 1 --pp 2 --train 3 && $MPIRUN -np 2 $L08 --tp 1 --pp 2 --schedule zb-h1 --train 3 && \
           $MPIRUN -np 2 $L08 --tp 1 --pp 2 --schedule dualpipev --layers 4 --train 3"
check "08 pp x dp, pp x tp + SP, pp x cp, pp x ep (P=4)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 4 $L08 --tp 1 --pp 2 --train 3 && $MPIRUN -np 4 $L08 --pp 2 --schedule zb-h1 --train 3 && \
           $MPIRUN -np 4 $L08 --tp 1 --pp 2 --cp 2 --train 3 && $MPIRUN -np 4 $L08 --tp 1 --pp 2 --ep 2 --layers 3 --train 3"
check "08 pp3 (odd), uneven stages 2+1 and --layers-per-stage 1,2; gradient accumulation (pp 1, 4 micro-batches)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 3 $L08 --tp 1 --pp 3 --layers 3 --batch 6 --train 3 && \
           $MPIRUN -np 2 $L08 --tp 1 --pp 2 --layers 3 --train 3 && \
           $MPIRUN -np 2 $L08 --tp 1 --pp 2 --layers 3 --layers-per-stage 1,2 --schedule zb-h1 --train 3 && \
           $MPIRUN -np 1 $L08 --microbatches 4 --train 3"
check "08 dualpipe: every stage on two ranks, their gradients summed over the pair (pp2; pp4 x tp2 + SP with ep2; pp4 x cp2, ep2 hierarchical)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 2 $L08 --tp 1 --pp 2 --schedule dualpipe --train 3 && \
           $MPIRUN -np 8 $L08 --tp 2 --pp 4 --schedule dualpipe --ep 2 --batch 16 --train 2 && \
           $MPIRUN -np 8 $L08 --tp 1 --cp 2 --pp 4 --schedule dualpipe --ep 2 --a2a hierarchical --batch 16 --train 2"
check "08 dualpipev and dualpipe with EP: F&B pairs overlapped at the all-to-alls give the sequential run's bits (identical dumps)" 0 '^overlap ok' \
  bash -c "for s in dualpipev dualpipe; do for ov in on off; do rm -rf $LOG/d08ov_\$s\$ov; \
             out=\$($MPIRUN -np 4 $L08 --tp 1 --pp 2 --ep 2 --schedule \$s --layers 4 --train 2 --overlap \$ov --dump $LOG/d08ov_\$s\$ov) || exit 1; \
             [ \$ov = off ] || echo \"\$out\" | grep -Eq '^  overlap: [1-9][0-9]* hand-overs' || exit 1; done; \
           diff -r $LOG/d08ov_\${s}on $LOG/d08ov_\${s}off >/dev/null || exit 1; done; echo overlap ok"
check "08 the cpu matmul's kernels for each instruction set (FF_CPU_ISA: this CPU's best, avx2, portable) give the same bits: identical dumps after 3 steps (P=2)" 0 '^isa ok' \
  bash -c "for isa in best avx2 portable; do rm -rf $LOG/d08isa_\$isa; \
             FF_CPU_ISA=\$isa $MPIRUN -x FF_CPU_ISA -np 2 $L08 --train 3 --dump $LOG/d08isa_\$isa >/dev/null || exit 1; done; \
           for isa in avx2 portable; do diff -r $LOG/d08isa_best $LOG/d08isa_\$isa >/dev/null || exit 1; done; \
           n=\$(ls $LOG/d08isa_best/*.npy | wc -l); [ \$n -gt 100 ] && echo \"isa ok: \$n files\""
check "08 --link: the network modelled (lesson 05's model) on the 16-rank mesh and under dualpipev with EP; the same checks" 0 '^check: PASS' \
  bash -c "out=\$($MPIRUN -np 16 $L08 --train 2 --link intra=1GB/s,inter=200MB/s) && echo \"\$out\" | grep -q '^modelled links: intra-node 1 GB/s, inter-node 200 MB/s' && \
           echo \"\$out\" | grep -q 'links modelled' && $MPIRUN -np 4 $L08 --tp 1 --pp 2 --ep 2 --schedule dualpipev --layers 4 --train 2 --link inter=100MB/s"
check "08 planted bug: dualpipe without the pair's gradient sum (each copy steps on half the batch)" 1 \
  'mean gradient of every weight .*FAIL' $MPIRUN -np 2 $L08 --tp 1 --pp 2 --schedule dualpipe --bug dualpipe-no-pair-sum --train 2
check "08 planted bug: the micro-batches' losses summed, not averaged (pp2)" 1 'mean gradient of every weight .*FAIL' \
  $MPIRUN -np 2 $L08 --tp 1 --pp 2 --bug pp-mb-sum --train 2
check "08 the 5D mesh on 16 ranks: the default with no axis given is dp2 x pp2 x cp2 x tp2, ep2 folded; the same by flags" 0 '^check: PASS' \
  bash -c "out=\$($MPIRUN -np 16 $L08 --train 3) && echo \"\$out\" | grep -q '^mesh .*: dp 2 x pp 2 x cp 2 x tp 2 = 16 ranks, ep 2 folded' && \
           echo \"\$out\" | grep -q '^model: .* 3 layers (1 dense, 2 MoE' && echo \"\$out\" | grep -q '^  ep: ' && \
           $MPIRUN -np 16 $L08 --dp 2 --pp 2 --cp 2 --tp 2 --ep 2 --train 3"
check "08 the 5D mesh on 32 ranks: dp4 x pp2 x cp2 x tp2, ep2 folded; dualpipev with ep4, hierarchical" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 32 $L08 --dp 4 --pp 2 --cp 2 --tp 2 --ep 2 --train 3 && \
           $MPIRUN -np 32 $L08 --dp 4 --pp 2 --cp 2 --tp 2 --ep 4 --a2a hierarchical --schedule dualpipev --layers 4 --batch 16 --train 2"
check "08 the communication counted per axis equals the formula, printed next to it (P=4)" 0 '^formula ok: tp and dp' \
  bash -c "out=\$($MPIRUN -np 4 $L08 --train 2) || exit 1; echo \"\$out\" | grep -A1 '^  tp: ' | sed 's/^ *\(tp:\|formula:\) *//' | uniq | wc -l | grep -qx 1 && \
           echo \"\$out\" | grep -A1 '^  dp: ' | sed 's/^ *\(dp:\|formula:\) *//' | uniq | wc -l | grep -qx 1 && echo 'formula ok: tp and dp'"
check "08 planted bug: every head its own W_kr copy: step 0 unchanged, the copies' gradients and weights differ" 1 \
  'every head.s copy of W_kr stays equal .*FAIL' $MPIRUN -np 2 $L08 --tp 1 --bug kpe-per-head --train 3
check "08 planted bug: kpe-per-head leaves the forward of step 0 unchanged" 1 'the forward is unchanged.*PASS' \
  $MPIRUN -np 1 $L08 --bug kpe-per-head --train 2
check "08 planted bug: SP without the all-reduce of the RMSNorm weights' gradients (P=2)" 1 \
  'mean gradient of every weight .*norm.*FAIL' $MPIRUN -np 2 $L08 --bug sp-norm-grad --train 2
check "08 planted bug: f's backward all-reduce missing (tp2, no SP)" 1 'mean gradient of every weight .*FAIL' \
  $MPIRUN -np 2 $L08 --sp off --bug f-no-allreduce --train 2
check "08 planted bug: the vocabulary-parallel cross-entropy's backward with the local softmax (tp2)" 1 \
  'mean gradient of every weight .*FAIL' $MPIRUN -np 2 $L08 --bug ce-local-softmax --train 2
check "08 planted bug: ZeRO-1 uses the sum as the mean (dp2)" 1 'mean gradient of every weight .*FAIL' \
  $MPIRUN -np 2 $L08 --tp 1 --bug zero-no-divide --train 2
check "08 planted bug: ZeRO-1 all-gathers a stale shard (dp2)" 1 'AdamW step .*first differs.*FAIL' \
  $MPIRUN -np 2 $L08 --tp 1 --bug zero-stale-shard --train 2
check "08 ZeRO-2, and DP's gradients in buckets posted during the backward, ZeRO-0/1/2 (P=4: dp4; dp2 x pp2, zb-h1; ep2)" 0 '^check: PASS' \
  bash -c "for z in 0 1 2; do $MPIRUN -np 4 $L08 --tp 1 --zero \$z --bucket-mb 0.02 --train 3 || exit 1; done && \
           $MPIRUN -np 4 $L08 --tp 1 --pp 2 --schedule zb-h1 --zero 2 --bucket-mb 0.02 --train 3 && \
           $MPIRUN -np 4 $L08 --tp 1 --ep 2 --zero 2 --bucket-mb 0.01 --train 3 && $MPIRUN -np 2 $L08 --tp 1 --zero 2 --train 3"
check "08 buckets under the link model: every bucket goes during the backward, the hidden fraction printed" 0 \
  'hidden fraction .* = [01]\.[0-9][0-9] \(rank 0\), worst' \
  bash -c "out=\$($MPIRUN -np 2 $L08 --tp 1 --zero 2 --bucket-mb 0.02 --train 3 --link intra=400MB/s,latency=20us) || exit 1; \
           echo \"\$out\"; echo \"\$out\" | grep -q '13 per step, 13.0 of them posted during the backward'"
check "08 buckets under SP (the replicated weights' reductions summed over TP after DP's), ZeRO-0/1/2 on dp2 x tp2, and the 16-rank mesh" 0 '^check: PASS' \
  bash -c "for z in 0 1 2; do out=\$($MPIRUN -np 4 $L08 --zero \$z --bucket-mb 0.02 --train 3) || exit 1; \
           echo \"\$out\" | grep -q ', 10.0 of them posted during the backward' || exit 1; done && \
           $MPIRUN -np 16 $L08 --zero 2 --bucket-mb 0.02 --train 2"
check "08 buckets where they must wait for the backward (dualpipev: two stages per rank) say why" 0 \
  'all after the backward here: --schedule dualpipev holds two stages per rank' \
  $MPIRUN -np 4 $L08 --tp 1 --pp 2 --schedule dualpipev --bucket-mb 0.02 --train 2
check "08 planted bug: a bucket reduced before its last gradient is in (dp2 ZeRO-1, dp2 ZeRO-2, dp2 x tp2 SP ZeRO-0)" 1 'mean gradient of every weight .*FAIL' \
  bash -c "out=\$($MPIRUN -np 2 $L08 --tp 1 --zero 2 --bucket-mb 0.02 --bug bucket-early --train 2); \
           echo \"\$out\" | grep -q 'gradient of every weight .*FAIL' || exit 0; \
           out=\$($MPIRUN -np 4 $L08 --zero 0 --bucket-mb 0.02 --bug bucket-early --train 2); \
           echo \"\$out\" | grep -q 'gradient of every weight .*FAIL' || exit 0; \
           $MPIRUN -np 2 $L08 --tp 1 --zero 1 --bucket-mb 0.02 --bug bucket-early --train 2"
check "08 planted bug: ZeRO-2 all-gathers a stale shard (dp2)" 1 'AdamW step .*first differs.*FAIL' \
  $MPIRUN -np 2 $L08 --tp 1 --zero 2 --bug zero-stale-shard --train 2
check "08 ZeRO-3: dp2, dp4 with pp2 and 4 micro-batches, the 16-rank mesh (SP: replicated shards summed over TP), dp2 x ep2" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 2 $L08 --tp 1 --zero 3 --train 3 && $MPIRUN -np 4 $L08 --tp 1 --pp 2 --microbatches 4 --zero 3 --train 3 && \
           $MPIRUN -np 16 $L08 --zero 3 --train 2 && $MPIRUN -np 4 $L08 --tp 1 --ep 2 --zero 3 --train 3"
check "08 ZeRO-3's memory at dp4: parameters, gradients, m and v each sharded (measured = formula), the peak gathered printed" 0 \
  'memory: parameters 4 sum ceil\(N_u/dp\), gradients 4 sum ceil\(N_u/dp\).*PASS' \
  bash -c "out=\$($MPIRUN -np 4 $L08 --tp 1 --zero 3 --train 2) || exit 1; echo \"\$out\"; \
           echo \"\$out\" | grep -q 'between steps ZeRO-3 holds no whole weight; during one, at most'"
check "08 planted bug: ZeRO-3's backward runs on freed weights, not gathered again (dp2)" 1 'mean gradient of every weight .*FAIL' \
  $MPIRUN -np 2 $L08 --tp 1 --zero 3 --bug zero3-stale-gather --train 2
check "08 --overlap compare: the pairs one after the other and overlapped give the same gradients, the hidden fraction per rank" 0 \
  'overlapped pairs. gradients = one after the other.s, bit for bit, every step   PASS' \
  bash -c "out=\$($MPIRUN -np 4 $L08 --tp 1 --pp 2 --ep 2 --schedule dualpipev --layers 4 --dense-layers 0 --train 2 \
           --ranks-per-node 4 --link intra=50MB/s,latency=50us --overlap compare) || exit 1; echo \"\$out\"; \
           echo \"\$out\" | grep -Eq '^hidden fraction of the paired steps: (worst -?[0-9.]+, mean|n/a)'"
# checkpoints: saved on one mesh, resumed on the same one (every dumped number the same bits as
# the run never stopped), on others (the check passes), after a rank killed mid-save
check "08 checkpoint: saved after 3 steps on dp2 x tp2 and resumed, every step's loss and the dump equal an uninterrupted 6-step run's bit for bit" 0 '^same bits: [0-9]+ files, 6 steps' \
  bash -c "d=$LOG/ck08a; rm -rf \$d; mkdir -p \$d; $MPIRUN -np 4 $L08 --train 6 --dump \$d/whole --csv \$d/whole.csv >/dev/null && \
           $MPIRUN -np 4 $L08 --train 3 --save \$d/ck --csv \$d/parts.csv >/dev/null && \
           $MPIRUN -np 4 $L08 --train 6 --resume \$d/ck --dump \$d/resumed --csv \$d/parts.csv | grep 'resumed from .*step-000003: 3 steps done' >/dev/null && \
           grep '^step,' \$d/whole.csv | cut -d, -f6-8 > \$d/whole.steps && grep '^step,' \$d/parts.csv | cut -d, -f6-8 > \$d/parts.steps && \
           cmp \$d/whole.steps \$d/parts.steps && \
           n=0 && for f in \$d/whole/*.npy; do cmp \$f \$d/resumed/\$(basename \$f) || exit 1; n=\$((n + 1)); done && \
           echo \"same bits: \$n files, \$(wc -l < \$d/whole.steps) steps\""
check "08 checkpoint: saved on 16 ranks (ZeRO-2, buckets), resumed on 4 (dp2 x tp2), 1, and 4 (pp2, zb-h1): the check passes" 0 '^resharded ok' \
  bash -c "d=$LOG/ck08b; rm -rf \$d; $MPIRUN -np 16 $L08 --layers 3 --zero 2 --bucket-mb 0.02 --train 2 --save \$d >/dev/null && \
           $MPIRUN -np 4 $L08 --layers 3 --train 4 --resume \$d | grep '^check: PASS' >/dev/null && \
           $MPIRUN -np 1 $L08 --layers 3 --train 4 --resume \$d | grep '^check: PASS' >/dev/null && \
           $MPIRUN -np 4 $L08 --layers 3 --tp 1 --pp 2 --schedule zb-h1 --zero 0 --train 4 --resume \$d | grep '^check: PASS' >/dev/null && echo 'resharded ok'"
check "08 checkpoint under ZeRO-3: resumed on the same mesh bit for bit, and on 16 ranks (ZeRO-3, SP) and on one process" 0 '^same bits: [0-9]+ files' \
  bash -c "d=$LOG/ck08z; rm -rf \$d; $MPIRUN -np 4 $L08 --zero 3 --train 4 --dump \$d/whole >/dev/null && \
           $MPIRUN -np 4 $L08 --zero 3 --train 2 --save \$d/ck >/dev/null && \
           $MPIRUN -np 16 $L08 --layers 2 --zero 3 --train 4 --resume \$d/ck | grep '^check: PASS' >/dev/null && \
           $MPIRUN -np 1 $L08 --train 4 --resume \$d/ck | grep '^check: PASS' >/dev/null && \
           $MPIRUN -np 4 $L08 --zero 3 --train 4 --resume \$d/ck --dump \$d/resumed >/dev/null && \
           n=0 && for f in \$d/whole/*.npy; do cmp \$f \$d/resumed/\$(basename \$f) || exit 1; n=\$((n + 1)); done && echo \"same bits: \$n files\""
check "08 checkpoint: a rank killed with SIGKILL during a save leaves the previous checkpoint, and resuming from it equals the uninterrupted run" 0 '^same bits: [0-9]+ files' \
  bash -c "d=$LOG/ck08c; rm -rf \$d; $MPIRUN -np 4 $L08 --train 5 --dump \$d/whole >/dev/null && \
           { FF_TEST_KILL_IN_SAVE=1:4 $MPIRUN -x FF_TEST_KILL_IN_SAVE -np 4 $L08 --train 5 --save-every 2 --save \$d/ck >/dev/null 2>&1; test \$? -ne 0; } && \
           test -d \$d/ck/step-000002 && test ! -e \$d/ck/step-000004 && \
           $MPIRUN -np 4 $L08 --train 5 --resume \$d/ck --dump \$d/resumed | grep 'step-000002: 2 steps done' >/dev/null && \
           n=0 && for f in \$d/whole/*.npy; do cmp \$f \$d/resumed/\$(basename \$f) || exit 1; n=\$((n + 1)); done && echo \"same bits: \$n files\""
check "08 checkpoint: a full disk during a save (a rank's writes failing with ENOSPC) is one error naming the file, exit 2; the previous checkpoint resumes" 0 '^previous intact' \
  bash -c "d=$LOG/ck08f; rm -rf \$d; out=\$(FF_TEST_FULL_DISK_IN_SAVE=1:4 $MPIRUN -x FF_TEST_FULL_DISK_IN_SAVE -np 4 $L08 --train 4 --save-every 2 --save \$d 2>&1); \
           test \$? -eq 2 || exit 1; echo \"\$out\" | tail -n 1 | grep -E '^error: --save: cannot write .*/\\.tmp-step-000004/.*\\.npy: No space left on device' || exit 1; \
           test ! -e \$d/step-000004 && $MPIRUN -np 4 $L08 --train 4 --resume \$d | grep '^check: PASS' >/dev/null && echo 'previous intact'"
check "08 checkpoint: --keep 2 keeps the newest two, --train 0 samples a resumed model" 0 '^kept: step-000004 step-000006' \
  bash -c "d=$LOG/ck08d; rm -rf \$d; $MPIRUN -np 2 $L08 --tp 1 --train 6 --save-every 2 --keep 2 --save \$d >/dev/null && \
           $MPIRUN -np 2 $L08 --tp 1 --train 0 --resume \$d --sample 20 | grep '^training: no step in this run' >/dev/null && \
           echo kept: \$(ls \$d)"
check "08 checkpoint into PyTorch: tests/reference/model.py loaded from a checkpoint gives lesson 08's validation loss" 0 \
  '^validation batch 0: PyTorch .*: ok' \
  bash -c "d=$LOG/ck08p; rm -rf \$d; $MPIRUN -np 4 $L08 --train 3 --save \$d/ck >/dev/null && \
           $MPIRUN -np 2 $L08 --tp 1 --train 0 --resume \$d/ck --dump \$d/dump >/dev/null && \
           $PYTHON tests/reference/load_checkpoint.py \$d/ck/step-000003 \$d/dump"
# checkpoints against what a user and a crash do (tests/lessons/test_08_checkpoint.py): a rank
# killed at each point of a save that replaces a step and prunes; another run's directory; a
# resumed run without its flags; every manifest field fuzzed in lessons 08 and 09; longer .npy headers
first pytest_step "08 checkpoint: a rank killed at each point of a save: the newest complete checkpoint resumes to the uninterrupted run's bits" \
  tests/lessons/test_08_checkpoint.py -k crash
first pytest_step "08 checkpoint: another run's directory, --keep's lineage, a resumed run's flags, every manifest field fuzzed (08 and 09), longer .npy headers" \
  tests/lessons/test_08_checkpoint.py -k "not crash"
check "08 --print-mesh: dp2 x tp2 groups (tp [0 1] [2 3], dp [0 2] [1 3]) and every rank's name" 0 'rank 3: DP\(2\)-PP\(1\)-CP\(1\)-TP\(2\)-EP\(1\)-Rank\(3\)' \
  bash -c "out=\$($MPIRUN -np 4 $L08 --print-mesh) || exit 1; echo \"\$out\"; \
           echo \"\$out\" | grep -q 'tp groups: \[0 1\] \[2 3\]' && echo \"\$out\" | grep -q 'dp groups: \[0 2\] \[1 3\]'"
check "08 --estimate deepseek-v3: 671B parameters, the ZeRO table, the 5D model, PP vs ZeRO-3, TP vs FSDP" 0 '^  total  *671,026,404,352' \
  bash -c "out=\$($MPIRUN -np 1 $L08 --estimate deepseek-v3) || exit 1; echo \"\$out\"; \
           for s in 'ZeRO, seed 001' '5D memory model' 'PP vs ZeRO-3' 'TP vs FSDP' 'incomplete'; do echo \"\$out\" | grep -q \"\$s\" || exit 1; done"
check "08 --estimate run: the tiny model's estimate next to the measured bytes (P=4)" 0 '^check: PASS' \
  bash -c "out=\$($MPIRUN -np 4 $L08 --train 2 --estimate run) || exit 1; echo \"\$out\"; echo \"\$out\" | grep -q 'measured'"
check "08 --sample: the same seed gives the same text, another seed another (P=2)" 0 '^sampling ok' \
  bash -c "a=\$($MPIRUN -np 2 $L08 --train 2 --sample 80) && b=\$($MPIRUN -np 2 $L08 --train 2 --sample 80) && \
           c=\$($MPIRUN -np 2 $L08 --train 2 --sample 80 --seed 7) || exit 1; \
           sa=\$(echo \"\$a\" | sed -n '/^sample/,/^    /p'); sb=\$(echo \"\$b\" | sed -n '/^sample/,/^    /p'); \
           sc=\$(echo \"\$c\" | sed -n '/^sample/,/^    /p'); echo \"\$sa\"; \
           [ -n \"\$sa\" ] && [ \"\$sa\" = \"\$sb\" ] && [ \"\$sa\" != \"\$sc\" ] && echo 'sampling ok'"
check "08 --dump: numpy recomputes the losses and checks the last step's gradients by central differences (P=4; cp2)" 0 '^dump ok' \
  bash -c "rm -rf $LOG/d08 $LOG/d08c && $MPIRUN -np 4 $L08 --train 3 --dump $LOG/d08 >/dev/null && $PYTHON tests/check_dump_08.py $LOG/d08 && \
           $MPIRUN -np 2 $L08 --tp 1 --cp 2 --train 2 --dump $LOG/d08c >/dev/null && $PYTHON tests/check_dump_08.py $LOG/d08c"
check "08 --trace: spans nest on every track, the check's traffic on its own track (P=4)" 0 '^trace ok: 4 ranks' \
  bash -c "$MPIRUN -np 4 $L08 --train 2 --trace $LOG/t08.json >/dev/null && grep -q '\"check\"' $LOG/t08.json && $PYTHON scripts/check-trace.py $LOG/t08.json - 4"
check "08 --trace of the 32-rank mesh: one track per rank, every communication span named by its axis, all six axes there" 0 '^trace axes ok' \
  bash -c "$MPIRUN -np 32 $L08 --train 2 --trace $LOG/t08x32.json >/dev/null && $PYTHON scripts/check-trace.py $LOG/t08x32.json - 32 && \
           $PYTHON tests/check_trace_08.py $LOG/t08x32.json tp cp ep dp-cp edp pp"
check "08 --help lists every flag with its default" 0 '--zero N .*\(default: 1\)' $MPIRUN -np 1 $L08 --help
usage_error "08 bad input: tp x dp is not the world (tp 2, dp 3 on 4 ranks)" $MPIRUN -np 4 $L08 --tp 2 --dp 3
usage_error "08 bad input: --tp not dividing the world (tp 3 on 4 ranks)" $MPIRUN -np 4 $L08 --tp 3
usage_error "08 bad input: heads not a multiple of tp" $MPIRUN -np 3 $L08 --tp 3 --batch 3
usage_error "08 bad input: batch not a multiple of dp" $MPIRUN -np 2 $L08 --tp 1 --batch 7
usage_error "08 bad input: --zero 4" $MPIRUN -np 2 $L08 --tp 1 --zero 4
usage_error "08 bad input: --bucket-mb negative" $MPIRUN -np 2 $L08 --tp 1 --bucket-mb -1
usage_error "08 bad input: --bug bucket-early without buckets" $MPIRUN -np 2 $L08 --tp 1 --bug bucket-early
usage_error "08 bad input: --bug bucket-early where the buckets wait for the backward (dualpipev)" $MPIRUN -np 4 $L08 --tp 1 --pp 2 --schedule dualpipev --bucket-mb 0.02 --bug bucket-early
usage_error "08 bad input: --zero 3 with a split backward (zb-h1)" $MPIRUN -np 2 $L08 --tp 1 --pp 2 --schedule zb-h1 --zero 3
usage_error "08 bad input: --zero 3 with --bucket-mb" $MPIRUN -np 2 $L08 --tp 1 --zero 3 --bucket-mb 1
usage_error "08 bad input: --bug zero3-stale-gather without --zero 3" $MPIRUN -np 2 $L08 --tp 1 --bug zero3-stale-gather
usage_error "08 bad input: --overlap compare without paired steps (1f1b)" $MPIRUN -np 2 $L08 --tp 1 --overlap compare
usage_error "08 bad input: --resume of a directory with no checkpoint" $MPIRUN -np 2 $L08 --tp 1 --resume $LOG/no-such-checkpoint
usage_error "08 bad input: --save into a path that cannot be a directory" $MPIRUN -np 2 $L08 --tp 1 --save /proc/no-such-dir
usage_error "08 bad input: --train 0 without --resume" $MPIRUN -np 2 $L08 --tp 1 --train 0
usage_error "08 bad input: --resume of a checkpoint missing a file (named)" \
  bash -c "$MPIRUN -np 2 $L08 --tp 1 --train 1 --save $LOG/ck08e1 >/dev/null && c=$LOG/ck08e1/step-000001 && rm \$c/head.exp_avg.npy && $MPIRUN -np 2 $L08 --tp 1 --train 2 --resume \$c"
usage_error "08 bad input: --resume of a truncated file (named)" \
  bash -c "$MPIRUN -np 2 $L08 --tp 1 --train 1 --save $LOG/ck08e2 >/dev/null && c=$LOG/ck08e2/step-000001 && truncate -s -4 \$c/embed.npy && $MPIRUN -np 2 $L08 --tp 1 --train 2 --resume \$c"
usage_error "08 bad input: --resume of a file whose CRC-32 differs from the manifest (named)" \
  bash -c "$MPIRUN -np 2 $L08 --tp 1 --train 1 --save $LOG/ck08e3 >/dev/null && c=$LOG/ck08e3/step-000001 && printf \'\\\\001\' | dd of=\$c/norm.npy bs=1 seek=200 conv=notrunc 2>/dev/null && $MPIRUN -np 2 $L08 --tp 1 --train 2 --resume \$c"
usage_error "08 bad input: --resume of a manifest of another format version" \
  bash -c "$MPIRUN -np 2 $L08 --tp 1 --train 1 --save $LOG/ck08e4 >/dev/null && c=$LOG/ck08e4/step-000001 && sed -i 's/\"version\": 2/\"version\": 3/' \$c/manifest.json && $MPIRUN -np 2 $L08 --tp 1 --train 2 --resume \$c"
usage_error "08 bad input: --resume with another model (--dim 32: the field named)" \
  bash -c "$MPIRUN -np 2 $L08 --tp 1 --train 1 --save $LOG/ck08e5 >/dev/null && c=$LOG/ck08e5/step-000001 && $MPIRUN -np 2 $L08 --tp 1 --dim 32 --train 2 --resume \$c"
usage_error "08 bad input: --bug sp-norm-grad with --bucket-mb (the bug is not planted there)" $MPIRUN -np 4 $L08 --bucket-mb 0.02 --bug sp-norm-grad
usage_error "08 bad input: --sp on with tp 1" $MPIRUN -np 2 $L08 --tp 1 --sp on
usage_error "08 bad input: SP with tokens not a multiple of tp" $MPIRUN -np 4 $L08 --tp 4 --batch 1 --seq 31
usage_error "08 bad input: --seq not a multiple of 2 x cp" $MPIRUN -np 2 $L08 --tp 1 --cp 2 --seq 30
usage_error "08 bad input: tp x cp not dividing the world" $MPIRUN -np 4 $L08 --tp 2 --cp 3
usage_error "08 bad input: --ep not dividing the ranks it folds over (ep 3 on 4)" $MPIRUN -np 4 $L08 --ep 3
usage_error "08 bad input: --experts not a multiple of --ep" $MPIRUN -np 4 $L08 --ep 4 --experts 6
usage_error "08 bad input: --ep over TP ranks without SP" $MPIRUN -np 2 $L08 --ep 2 --sp off
usage_error "08 bad input: --a2a without --ep" $MPIRUN -np 2 $L08 --a2a hierarchical
usage_error "08 bad input: --ranks-per-node not dividing --ep" $MPIRUN -np 4 $L08 --ep 4 --a2a hierarchical --ranks-per-node 3
usage_error "08 bad input: --bug ep-grad-mean with ep = tp (the mistake is right by accident)" $MPIRUN -np 4 $L08 --ep 2 --bug ep-grad-mean
usage_error "08 bad input: fewer layers than pipeline stages (dualpipev on pp 2: 4 stages, 2 layers)" $MPIRUN -np 2 $L08 --tp 1 --pp 2 --schedule dualpipev --layers 2
usage_error "08 bad input: --layers-per-stage not summing to --layers" $MPIRUN -np 2 $L08 --tp 1 --pp 2 --layers 2 --layers-per-stage 1,2
usage_error "08 bad input: dualpipev with fewer than 2 pp micro-batches" $MPIRUN -np 2 $L08 --tp 1 --pp 2 --layers 4 --schedule dualpipev --microbatches 2
usage_error "08 bad input: dualpipe on an odd pipeline (pp 3)" $MPIRUN -np 3 $L08 --tp 1 --pp 3 --batch 6 --schedule dualpipe
usage_error "08 bad input: micro-batches not dividing a DP rank's sequences" $MPIRUN -np 2 $L08 --tp 1 --pp 2 --microbatches 3
usage_error "08 bad input: ep counted as ranks (dp2 x pp2 x cp2 x tp2 on 32)" $MPIRUN -np 32 $L08 --dp 2 --pp 2 --cp 2 --tp 2 --ep 2
usage_error "08 bad input: malformed --link" $MPIRUN -np 2 $L08 --link inter=0GB/s
usage_error "08 bad input: --link with --ranks-per-node not dividing the world" $MPIRUN -np 4 $L08 --link intra=1GB/s --ranks-per-node 3
usage_error "08 bad input: --bug local-causal-mask without CP" $MPIRUN -np 2 $L08 --bug local-causal-mask
usage_error "08 bad input: --topk above --experts" $MPIRUN -np 2 $L08 --topk 9
usage_error "08 bad input: odd --d-rope" $MPIRUN -np 2 $L08 --d-rope 7
usage_error "08 bad input: --bug f-no-allreduce under SP" $MPIRUN -np 2 $L08 --bug f-no-allreduce
usage_error "08 bad input: --bug kpe-per-head with tp 2" $MPIRUN -np 2 $L08 --bug kpe-per-head
usage_error "08 bad input: --prompt with a byte not in the text" $MPIRUN -np 2 $L08 --sample 5 --prompt "é"
usage_error "08 bad input: --seq longer than the validation text" $MPIRUN -np 1 $L08 --seq 1000 --data tests/unit/main.cpp
check "08 --device sim: the model's kernels under the emulator (tp2 + SP; cp2: the ring's attention.cu kernels; ep2; pp2)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 2 $L08 --device sim --train 2 --dim 32 --ffn 32 --batch 2 --seq 16 && \
           $MPIRUN -np 2 $L08 --device sim --tp 1 --cp 2 --train 2 --dim 32 --ffn 32 --batch 2 --seq 16 && \
           $MPIRUN -np 2 $L08 --device sim --tp 1 --ep 2 --train 2 --dim 32 --ffn 32 --batch 2 --seq 16 && \
           $MPIRUN -np 2 $L08 --device sim --tp 1 --pp 2 --schedule zb-h1 --train 2 --dim 32 --ffn 32 --batch 2 --seq 16"
check "08 --device sim --sp off: the TP ranks' copies of the embedding and the norms stay equal bit for bit (deterministic index_add and norm dw)" 0 '^check: PASS' \
  $MPIRUN -np 2 $L08 --device sim --tp 2 --sp off --train 2 --dim 32 --ffn 32 --batch 8 --seq 32
if $T/device_query | grep -qw cuda; then
  check "08 --device cuda (P=2)" 0 '^check: PASS' $MPIRUN -np 2 $L08 --device cuda --train 4
fi

L09=$B/09_inference
section "lesson 09: inference (three caches, TP and EP decode, int8)"
# every position's logits of the three caches against the training forward, their greedy bytes
# against its argmax and each other: one process, 2 and 4 ranks (heads and experts split; the MoE's
# all-to-all and all-reduce), 3 ranks (odd: 6 heads, 6 experts), fewer rows than ranks
for run in "1|" "2|" "2|--moe-comm allreduce" "4|" "4|--moe-comm allreduce" "3|--heads 6 --experts 6" "4|--batch 1 --new 8"; do
  np=${run%%|*}; args=${run#*|}
  check "09 P=$np ${args:-default}: kv, latent and absorbed caches = the training forward, every position" 0 '^check: PASS' \
    $MPIRUN -np $np $L09 $args
done
check "09 batch 8 of prompts of 6 to 17 bytes, 24 new tokens, each cache alone (P=2)" 0 '^check: PASS' \
  bash -c "for c in kv latent absorbed; do $MPIRUN -np 2 $L09 --batch 8 --new 24 --cache \$c || exit 1; done"
check "09 the caches' bytes per token per layer, measured: kv H (d_n + d_r + d_v), latent and absorbed r_kv + d_r; a kv cache splits with the heads, a latent one does not (P=2)" 0 '^sizes ok' \
  bash -c "one=\$($MPIRUN -np 1 $L09 --new 4) && two=\$($MPIRUN -np 2 $L09 --new 4) || exit 1; \
           echo \"\$one\" | grep -Eq '^  kv +160 floats = +640 B +640 B +40960 ' && echo \"\$one\" | grep -Eq '^  latent +40 floats = +160 B +160 B +576 ' && \
           echo \"\$two\" | grep -Eq '^  kv +80 floats = +320 B +320 B' && echo \"\$two\" | grep -Eq '^  absorbed +40 floats = +160 B +160 B' && echo sizes ok"
check "09 planted bug: RoPE one position ahead in decode fails every cache's check" 1 'logits, kv cache .*FAIL' \
  $MPIRUN -np 2 $L09 --bug rope-off-by-one --new 8
for np in 1 4; do
  check "09 planted bug: each head's absorbed W_uk^T made by a reshape, not a transpose, fails the absorbed cache only (P=$np: $((4 / np)) head(s) per rank)" 1 '^absorbed only' \
    bash -c "out=\$($MPIRUN -np $np $L09 --bug absorb-transposed --new 8); echo \"\$out\" | grep -q '^check: FAIL' || exit 0; \
             echo \"\$out\" | grep -Eq 'logits, absorbed cache .*FAIL' && echo \"\$out\" | grep -Eq 'logits, kv cache .*PASS' && echo 'absorbed only'; exit 1"
done
check "09 planted bug: the last layer's cache not updated in decode fails the check (P=2)" 1 'logits, latent cache .*FAIL' \
  $MPIRUN -np 2 $L09 --bug cache-skip-layer --new 8
check "09 --int8: a quarter of the weights' bytes (plus scales), logits and perplexity against float32, the check still PASSes" 0 '^int8 ok' \
  bash -c "out=\$($MPIRUN -np 2 $L09 --int8 --new 16) || exit 1; echo \"\$out\" | grep -Eq 'int8 weights \(per-channel scales\): .* 0\.2[5-9][0-9]x' && \
           echo \"\$out\" | grep -q 'validation perplexity' && echo \"\$out\" | grep -q '^check: PASS' && echo 'int8 ok'"
check "09 --int8 on one process: the decode steps' FFNs and experts read int8 (int8_matmul), every cache still = the training forward; --speed counts their int8 bytes" 0 '^int8 read ok' \
  bash -c "out=\$($MPIRUN -np 1 $L09 --int8 --new 16 --speed 1) || exit 1; echo \"\$out\" | grep -q 'decode steps read the FFNs. and experts. int8 numbers' && \
           echo \"\$out\" | grep -q 'the FFNs and experts read int8' && echo \"\$out\" | grep -q '^check: PASS' && echo 'int8 read ok'"
check "09 planted bug int8-per-tensor: no check fails, the weights' relative error grows (> 1.3x per-channel's)" 0 '^per-tensor worse' \
  bash -c "a=\$($MPIRUN -np 1 $L09 --int8 --new 4 | sed -n 's/.*relative error .*: //p') && \
           b=\$($MPIRUN -np 1 $L09 --int8 --new 4 --bug int8-per-tensor | tee /dev/stderr | sed -n 's/.*relative error .*: //p') || exit 1; \
           echo \"per-channel \$a per-tensor \$b\"; awk -v a=\"\$a\" -v b=\"\$b\" 'BEGIN { exit !(b > 1.3 * a) }' && echo 'per-tensor worse'"
check "09 lesson 08 -> checkpoint -> lesson 09: the trained weights served on 1 and 2 ranks, every check PASSes" 0 '^served ok' \
  bash -c "rm -rf $LOG/ck09 && $MPIRUN -np 2 $B/08_mesh --train 4 --dim 32 --ffn 32 --seq 16 --batch 4 --save $LOG/ck09 >/dev/null && \
           $MPIRUN -np 1 $L09 --checkpoint $LOG/ck09 --new 8 | grep -q 'lesson 08.s checkpoint' && \
           $MPIRUN -np 2 $L09 --checkpoint $LOG/ck09 --new 8 --int8 | grep -q '^check: PASS' && echo 'served ok'"
check "09 --speed 1,3: tokens/s, the bytes a step reads and the bandwidth it uses, per batch size (P=1)" 0 '^ +3 +[0-9.]+ +[0-9]+ +[0-9.]+ MB +[0-9.]+ MB +[0-9.]+ +[0-9.]+%' \
  $MPIRUN -np 1 $L09 --speed 1,3 --new 8
check "09 --link on 4 ranks, nodes of 2, both MoE exchanges: the decode under the link model PASSes, the MoE's share of a step printed" 0 '^link ok' \
  bash -c "for m in alltoall allreduce; do out=\$($MPIRUN -np 4 $L09 --moe-comm \$m --batch 2 --new 8 --cache absorbed --link latency=20us --ranks-per-node 2) || exit 1; \
             echo \"\$out\" | grep -Eq '^  absorbed .* tokens/s, MoE [0-9.]+ ms \([0-9]+%\)' || exit 1; done; echo 'link ok'"
check "09 --dump: numpy reads every cache's tokens, logits and reference logits; each generated token is the reference's argmax" 0 '^dump ok' \
  bash -c "rm -rf $LOG/d09 && $MPIRUN -np 2 $L09 --new 8 --dump $LOG/d09 >/dev/null && $PYTHON -c \"
import numpy as np, sys
d = sys.argv[1]; n = 0
for cache in ('kv', 'latent', 'absorbed'):
    for b, p in enumerate((6, 7, 14, 17)):  # the default prompts' lengths
        t = np.load(f'{d}/tokens.{cache}.seq{b}.npy'); z = np.load(f'{d}/logits.{cache}.seq{b}.npy'); r = np.load(f'{d}/reference.{cache}.seq{b}.npy')
        assert z.shape == r.shape == (len(t) - 1, 65) and len(t) == p + 8, (cache, b)
        assert np.abs(z - r).max() < 1e-3 and (t[p:] == r[p - 1:].argmax(1)).all(), (cache, b); n += 1
print('dump ok:', n, 'sequences')\" $LOG/d09"
check "09 --trace: spans nest on every track (P=2)" 0 '^trace ok: 2 ranks' \
  bash -c "$MPIRUN -np 2 $L09 --new 4 --trace $LOG/t09.json >/dev/null && $PYTHON scripts/check-trace.py $LOG/t09.json - 2"
check "09 --device sim: the decode under the emulator (P=1, small)" 0 '^check: PASS' \
  $MPIRUN -np 1 $L09 --device sim --batch 2 --new 4 --dim 32 --ffn 32
check "09 --device sim --int8: int8_matmul is the cpu's, so every weight is dequantized there; the check PASSes" 0 '^sim int8 ok' \
  bash -c "out=\$($MPIRUN -np 1 $L09 --device sim --int8 --batch 2 --new 4 --dim 32 --ffn 32 --val-batches 1) || exit 1; \
           echo \"\$out\" | grep -q 'every weight dequantized at load' && echo \"\$out\" | grep -q '^check: PASS' && echo 'sim int8 ok'"
check "09 --help lists every flag with its default" 0 '--cache \{kv\|latent\|absorbed\|all\} .*\(default: all\)' $MPIRUN -np 1 $L09 --help
usage_error "09 bad input: a prompt byte outside the vocabulary" $MPIRUN -np 2 $L09 --prompts 'ROMEO@'
usage_error "09 bad input: an empty prompt" $MPIRUN -np 2 $L09 --prompts 'a||b'
usage_error "09 bad input: 3 ranks for 4 heads" $MPIRUN -np 3 $L09
usage_error "09 bad input: 3 ranks for 8 experts" $MPIRUN -np 3 $L09 --heads 6
usage_error "09 bad input: sizes beyond memory" $MPIRUN -np 2 $L09 --batch 256 --new 4096 --max-memory 0.01
usage_error "09 bad input: --checkpoint of a directory with none" $MPIRUN -np 2 $L09 --checkpoint $LOG/no-such-checkpoint
usage_error "09 bad input: --checkpoint of another model (--dim 64 given, the checkpoint's is 32)" \
  bash -c "rm -rf $LOG/ck09m && $MPIRUN -np 1 $B/08_mesh --train 1 --dim 32 --ffn 32 --seq 16 --batch 4 --save $LOG/ck09m >/dev/null && \
           $MPIRUN -np 2 $L09 --checkpoint $LOG/ck09m --dim 64"
usage_error "09 bad input: --checkpoint with a damaged file (its CRC-32 named)" \
  bash -c "rm -rf $LOG/ck09d && $MPIRUN -np 1 $B/08_mesh --train 1 --dim 32 --ffn 32 --seq 16 --batch 4 --save $LOG/ck09d >/dev/null && \
           f=\$(ls -d $LOG/ck09d/step-*)/norm.npy && printf 'X' | dd of=\$f bs=1 seek=200 conv=notrunc 2>/dev/null && \
           $MPIRUN -np 2 $L09 --checkpoint $LOG/ck09d"
usage_error "09 bad input: --ranks-per-node without --link" $MPIRUN -np 2 $L09 --ranks-per-node 1
usage_error "09 bad input: --link with a bad bandwidth" $MPIRUN -np 2 $L09 --link intra=fast
usage_error "09 bad input: a decode bug with --new 1 (no decode step to plant it in)" $MPIRUN -np 1 $L09 --bug rope-off-by-one --new 1
usage_error "09 bad input: --speed on 2 ranks" $MPIRUN -np 2 $L09 --speed 1
usage_error "09 bad input: --speed with a batch of 0" $MPIRUN -np 1 $L09 --speed 1,0
usage_error "09 bad input: --bug int8-per-tensor without --int8" $MPIRUN -np 1 $L09 --bug int8-per-tensor
usage_error "09 bad input: --bug absorb-transposed with --cache kv" $MPIRUN -np 1 $L09 --bug absorb-transposed --cache kv
if $T/device_query | grep -qw cuda; then
  check "09 --device cuda (P=1)" 0 '^check: PASS' $MPIRUN -np 1 $L09 --device cuda
fi

section "NCCL (--backend nccl): emulated on device sim; on cuda where there is a GPU per rank"
# nccl_run NAME ARGS...: the run PASSes on --backend nccl and NCCL ran at least one launch on every
# rank (the tensors' collectives went to it, not to MPI)
nccl_ran='NCCL (\(emulated\)|[0-9.]+) ran [1-9][0-9]* to [0-9]+ launches per rank'
check "04 --device sim --backend nccl: the router's gradient all-reduces on (emulated) NCCL, the check PASSes (P=3, P=2)" 0 "$nccl_ran" \
  bash -c "$MPIRUN -np 3 $L04 --device sim --backend nccl --experts 6 | grep -q '^check: PASS' && \
           $MPIRUN -np 2 $L04 --device sim --backend nccl | tee /dev/stderr | grep -q '^check: PASS'"
check "05 --device sim --backend nccl: the gradient all-reduces on (emulated) NCCL, the check PASSes (P=3, P=2)" 0 "$nccl_ran" \
  bash -c "$MPIRUN -np 3 $L05 --device sim --backend nccl --batch 1 --experts 6 | grep -q '^check: PASS' && \
           $MPIRUN -np 2 $L05 --device sim --backend nccl --batch 1 | tee /dev/stderr | grep -q '^check: PASS'"
check "06 --device sim --backend nccl: the block's gradient all-reduces on (emulated) NCCL (P=2)" 0 "$nccl_ran" \
  bash -c "$MPIRUN -np 2 $L06 --device sim --backend nccl --reps 1 --tokens 16 --dim 32 --ffn 32 --microbatches 3 | tee /dev/stderr | grep -q '^check: PASS'"
for run in "2|--tp 2" "2|--tp 2 --ep 2" "4|--tp 2 --cp 2" "4|--tp 2 --pp 2 --layers 2" "4|--tp 2 --pp 2 --layers 2 --schedule dualpipe"; do
  np=${run%%|*}; mesh=${run#*|}
  check "08 --device sim --backend nccl $mesh: TP's all-reduces, gathers and scatters on (emulated) NCCL, every check PASSes (P=$np)" 0 "$nccl_ran" \
    bash -c "$MPIRUN -np $np $L08 --device sim --backend nccl $mesh --train 2 --dim 32 --ffn 32 --batch 4 --seq 16 | tee /dev/stderr | grep -q '^check: PASS'"
done
check "08 --backend nccl and mpi on sim dump the same bits (tp2 + SP, ep2: NCCL's path changes no number)" 0 '^same bits' \
  bash -c "rm -rf $LOG/d08n $LOG/d08m && \
           $MPIRUN -np 2 $L08 --device sim --backend nccl --ep 2 --train 2 --dim 32 --ffn 32 --batch 4 --seq 16 --dump $LOG/d08n >/dev/null && \
           $MPIRUN -np 2 $L08 --device sim --backend mpi --ep 2 --train 2 --dim 32 --ffn 32 --batch 4 --seq 16 --dump $LOG/d08m >/dev/null && \
           diff -r $LOG/d08n $LOG/d08m && echo same bits"
for L in 01_online_softmax 02_ring_attention 07_dualpipe; do
  check "$L --device sim --backend nccl: PASSes; its messages are on host buffers, so MPI's (0 NCCL launches)" 0 'NCCL \(emulated\) ran 0 to 0 launches' \
    bash -c "$MPIRUN -np 2 $B/$L --device sim --backend nccl | tee /dev/stderr | grep -q '^check: PASS'"
done
if $T/device_query | grep -q '^backends:.* nccl' && [ "$($T/device_query | sed -n 's/^gpus: //p')" -ge 2 ]; then
  for L in 04_gshard 05_deepseek_moe 06_overlap 08_mesh; do
    check "$L --device cuda --backend nccl (P=2, a GPU each)" 0 "$nccl_ran" \
      bash -c "$MPIRUN -np 2 $B/$L --device cuda --backend nccl | tee /dev/stderr | grep -q '^check: PASS'"
  done
fi

section "every lesson from any directory: the course's data found from the executable"
# Each lesson's default run (its NP file), started from / with the binary's full path: lessons
# 05 (--train) and 08 read data/tinyshakespeare.txt by default, found from the executable's
# directory upward (common/util/files.h: course_data_file)
ABS_B=$(cd "$B" && pwd -P); ROOT=$(pwd -P)
check "every lesson's default demo PASSes when started from / with the binary's full path (05 with --train 2)" 0 '^9 lessons PASS from /' \
  bash -c "cd / && n=0; for d in $ROOT/lessons/[0-9][0-9]_*; do L=\$(basename \$d); a=; [ \$L = 05_deepseek_moe ] && a='--train 2'; \
             $MPIRUN -np \$(cat \$d/NP) $ABS_B/\$L \$a | grep -q '^check: PASS' || { echo \"\$L failed\"; exit 1; }; n=\$((n + 1)); done; \
           echo \"\$n lessons PASS from /\""
# A binary copied out of the tree finds the data in the tree it was built from; --help names the file
check "08 copied out of the tree, run from /tmp: the data of the tree it was built from; --help shows the path" 0 '^copied ok' \
  bash -c "mkdir -p $LOG/elsewhere && cp $ABS_B/08_mesh $LOG/elsewhere/ && cd /tmp && \
           $MPIRUN -np 1 $LOG/elsewhere/08_mesh --help | grep -F -- '(default: $ROOT/data/tinyshakespeare.txt)' && \
           $MPIRUN -np 2 $LOG/elsewhere/08_mesh --train 2 | grep -q '^check: PASS' && echo 'copied ok'"
