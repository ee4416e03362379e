# Lesson tests, sourced by scripts/run-tests.sh (uses its check / usage_error helpers).
# Each lesson runs under mpirun at several world sizes (1 and odd sizes included) and
# shapes; its own printed check must PASS, a planted bug must make it FAIL, and bad input
# must give one error line and exit 2 on every rank.

L01=$B/01_online_softmax
echo "== lesson 01: online softmax"
for np in 1 2 3 4; do
  check "01 default demo, $np rank(s)" 0 '^check: PASS' $MPIRUN -np $np $L01 --reps 3
done
check "01 cols not divisible by P, ragged blocks (P=3, cols 1001, block 7)" 0 '^check: PASS' \
  $MPIRUN -np 3 $L01 --rows 5 --cols 1001 --block 7 --keys 100 --dim 8 --reps 2
check "01 more ranks than columns: empty ranks are the merge identity (P=4, cols 3)" 0 '^check: PASS' \
  $MPIRUN -np 4 $L01 --rows 3 --cols 3 --block 1 --keys 2 --dim 4 --reps 2
check "01 block 1 and block larger than the row (P=2)" 0 '^check: PASS' \
  bash -c "$MPIRUN -np 2 $L01 --block 1 --cols 50 --reps 2 && $MPIRUN -np 2 $L01 --block 5000 --cols 300 --reps 2"
check "01 one row, one column (P=1)" 0 '^check: PASS' $MPIRUN -np 1 $L01 --rows 1 --cols 1 --keys 1 --dim 1 --reps 1
check "01 planted bug: forgetting l*exp(m_old-m_new) fails the check" 1 '^check: FAIL' \
  $MPIRUN -np 3 $L01 --bug no-rescale --reps 1
check "01 planted bug: no -inf guard (NaN from -inf - -inf) fails the check" 1 '^check: FAIL' \
  $MPIRUN -np 2 $L01 --bug no-inf-guard --reps 1
check "01 --help lists every flag with its default" 0 '--block N .*\(default: 64\)' \
  $MPIRUN -np 2 $L01 --help
check "01 --dump: numpy recomputes softmax and attention from the dumped inputs" 0 '^dump ok' \
  bash -c "rm -rf $LOG/d01 && $MPIRUN -np 3 $L01 --dump $LOG/d01 --reps 1 >/dev/null && $PYTHON tests/check_dump_01.py $LOG/d01 3"
usage_error "01 bad input: --cols 0" $MPIRUN -np 3 $L01 --cols 0
usage_error "01 bad input: --block -1" $MPIRUN -np 3 $L01 --block -1
usage_error "01 bad input: --rows abc" $MPIRUN -np 3 $L01 --rows abc
usage_error "01 bad input: missing value" $MPIRUN -np 3 $L01 --cols
usage_error "01 bad input: unknown flag" $MPIRUN -np 3 $L01 --colz 5
usage_error "01 bad input: --bug typo" $MPIRUN -np 3 $L01 --bug rescale
for np in 1 3; do
  check "01 --device sim: online_softmax.cu kernels under the emulator, $np rank(s)" 0 '^check: PASS' \
    $MPIRUN -np $np $L01 --device sim --reps 1 --cols 777 --keys 300
done
if $T/device_query | grep -qw cuda; then
  check "01 --device cuda: online_softmax.cu kernels on the GPU (P=2)" 0 '^check: PASS' \
    $MPIRUN -np 2 $L01 --device cuda --reps 1
else
  usage_error "01 --device cuda without a GPU names what is available" $MPIRUN -np 3 $L01 --device cuda
fi

L02=$B/02_ring_attention
echo "== lesson 02: ring attention"
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
check "02 --trace: Chrome JSON with one track per rank (async order)" 0 '^trace ok: 4 ranks' \
  bash -c "$MPIRUN -np 4 $L02 --order async --causal --trace $LOG/t02.json >/dev/null && $PYTHON scripts/check-trace.py $LOG/t02.json - 4"
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
echo "== lesson 03: sparse MoE"
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
echo "== lesson 04: GShard expert parallelism"
for np in 1 2 3 4; do
  check "04 P=$np, N=12: ordered, async, library all PASS (exact dispatch/combine, grads == lesson 03)" 0 '^check: PASS' \
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
check "04 --dump: numpy recomputes the layer on all ranks' tokens (lesson 03's check)" 0 '^dump ok' \
  $PYTHON tests/check_dump_03.py $LOG/d04async
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
