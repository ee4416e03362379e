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
