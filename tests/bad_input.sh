# The bad-input table, sourced by scripts/run-tests.sh: every lesson binary, every way a user
# (new or hostile) gets its input wrong. Each job must answer before any work: exit 2 on every
# rank, exactly one line on stderr and it starts with "error:", nothing on stdout (no
# backtrace, no "MPI_ABORT was invoked" banner, no narration), no output file left behind,
# and at -np 1 about as fast as --help (through MPI_Finalize, not an abort's grace period). A write
# that fails during the run (/dev/full) is one "error: cannot write ..." line and exit 1.
# Jobs run two at a time, alone (an inline block of scripts/run-tests.sh, so that the speed of
# a usage error is measured against --help on a machine doing nothing else); each counts as one
# test.

bad_input_block() {
  local BI L np bin d job id name want env out cmd rc ms why line running t t0 bi_jobs bi_help_ms \
        bi_fast_ms bi_start bi_slowest
  BI=$LOG/bad_input
  mkdir -p "$BI"
  : > "$BI/plain_file"   # a regular file, to put paths under

  # lesson binary, world size, and flags whose sizes pass every range check but not memory
  declare -A bi_np=([01_online_softmax]=3 [02_ring_attention]=3 [03_smoe]=1 [04_gshard]=2 [05_deepseek_moe]=2 [06_overlap]=2 [07_dualpipe]=2 [08_mesh]=2)
  declare -A bi_huge=(
    [01_online_softmax]="--rows 4096 --cols 4194304"
    [02_ring_attention]="--seq 65536 --dim 1024"
    [03_smoe]="--batch 4096 --tokens 65536 --dim 4096"
    [04_gshard]="--batch 4096 --tokens 65536 --dim 4096"
    [05_deepseek_moe]="--batch 4096 --tokens 65536 --dim 4096"
    [06_overlap]="--tokens 16384 --dim 4096 --ffn 16384"
    [07_dualpipe]="--layers 4096 --dim 4096 --rows 65536"
    [08_mesh]="--dim 4096 --layers 64 --batch 4096 --seq 1024")

  # bad_input_job ID WANT_RC NP ENV OUTFILE BIN ARGS... — runs one job, writes ID.res
  bad_input_job() {
    local id=$1 want=$2 np=$3 env=$4 out=$5; shift 5
    local start; start=$(date +%s%N)
    env $env timeout 60 $MPIRUN -np "$np" "$@" >"$BI/$id.out" 2>"$BI/$id.err"; local rc=$?
    sed -Ei "/$MPIRUN_NOISE/d" "$BI/$id.err"  # mpirun's libevent race at exit (run-tests.sh)
    local ms=$(( ($(date +%s%N) - start) / 1000000 ))
    local why=""
    local errs; errs=$(grep -c . "$BI/$id.err")
    [ "$rc" = "$want" ] || why="exit $rc, want $want"
    [ -z "$why" ] && { [ "$errs" = 1 ] && grep -q '^error: ' "$BI/$id.err" || why="stderr has $errs lines, want one error: line"; }
    if [ -z "$why" ] && [ "$want" = 2 ] && [ -s "$BI/$id.out" ]; then why="stdout not empty"; fi
    if [ -z "$why" ] && grep -Eqi 'MPI_ABORT|backtrace|terminate called|core dumped' "$BI/$id.out" "$BI/$id.err"; then
      why="an abort banner or backtrace"
    fi
    if [ -z "$why" ] && [ -n "$out" ] && [ "$out" != /dev/full ] && [ -e "$out" ] && [ ! -d "$out" ]; then
      why="left the output file $out"
    fi
    if [ -z "$why" ] && [ -n "$out" ] && ls -a "$(dirname "$out")" 2>/dev/null | grep -q '\.tmp-'; then
      why="left a temporary file in $(dirname "$out")"
    fi
    if [ -z "$why" ] && [ "$np" = 1 ] && [ "$want" = 2 ] && [ "$ms" -gt "$bi_fast_ms" ]; then
      why="took $ms ms at -np 1, more than $bi_fast_ms ms (a usage error leaves as fast as --help)"
    fi
    echo "$rc|$ms|${why}|$(head -c 160 "$BI/$id.err" | head -n 1)" > "$BI/$id.res"
  }

  bi_jobs=()   # "ID|NAME|WANT|NP|ENV|OUTFILE|BIN ARGS..."
  bi_add() {  # (make test L=NN: lesson NN's only)
    if [ -n "${FF_TEST_LESSON:-}" ] && [[ $1 != "$FF_TEST_LESSON"[_\ ]* ]]; then return 0; fi
    bi_jobs+=("${#bi_jobs[@]}|$1|$2|$3|$4|$5|$6")
  }
  for L in 01_online_softmax 02_ring_attention 03_smoe 04_gshard 05_deepseek_moe 06_overlap 07_dualpipe 08_mesh; do
    np=${bi_np[$L]}; bin="$B/$L"; d="$BI/$L"; mkdir -p "$d"
    bi_add "$L --csv DIR (a directory given as a FILE)"        2 "$np" "" ""               "$bin --csv $d"
    bi_add "$L --trace DIR"                                     2 "$np" "" ""               "$bin --trace $d"
    bi_add "$L --trace --seed 3 (a flag taken for the FILE)"    2 "$np" "" "./--seed"       "$bin --trace --seed 3"
    bi_add "$L --csv FILE (missing at the end)"                 2 "$np" "" ""               "$bin --csv"
    bi_add "$L --dump under a regular file"                     2 "$np" "" ""               "$bin --dump $BI/plain_file/dump"
    bi_add "$L --csv under a regular file"                      2 "$np" "" ""               "$bin --csv $BI/plain_file/x.csv"
    bi_add "$L --dump an existing regular file"                 2 "$np" "" ""               "$bin --dump $BI/plain_file"
    bi_add "$L --trace where nothing can be created (/proc)"    2 "$np" "" ""               "$bin --trace /proc/fivefold/t.json"
    bi_add "$L --trace and --csv the same file"                 2 "$np" "" "$d/same"        "$bin --trace $d/same --csv $d/same"
    bi_add "$L --device nope"                                   2 "$np" "" ""               "$bin --device nope"
    bi_add "$L --backend gloo"                                 2 "$np" "" ""               "$bin --backend gloo"
    bi_add "$L --backend nccl with the tensors on cpu"          2 "$np" "" ""               "$bin --backend nccl --device cpu"
    bi_add "$L --seed -1"                                       2 "$np" "" ""               "$bin --seed -1"
    bi_add "$L --timeout 0"                                     2 "$np" "" ""               "$bin --timeout 0"
    bi_add "$L --max-memory -1"                                 2 "$np" "" ""               "$bin --max-memory -1"
    bi_add "$L --seed 1e3 (not an integer)"                     2 "$np" "" ""               "$bin --seed 1e3"
    bi_add "$L unknown flag"                                    2 "$np" "" ""               "$bin --nope"
    bi_add "$L --seed= (an empty value)"                        2 "$np" "" ""               "$bin --seed="
    bi_add "$L SIMT_SEED=abc"                                   2 "$np" "SIMT_SEED=abc" ""  "$bin"
    bi_add "$L SIMT_RACECHECK=yes"                              2 "$np" "SIMT_RACECHECK=yes" "" "$bin --device sim"
    bi_add "$L sizes within the flags' ranges, beyond memory"   2 "$np" "" "$d/huge.csv"    "$bin ${bi_huge[$L]} --csv $d/huge.csv"
    bi_add "$L usage error at -np 1 leaves as fast as --help" 2 1     "" ""               "$bin --device nope"
  done
  bi_add "07_dualpipe --simulate --csv DIR"                     2 1 "" ""                  "$B/07_dualpipe --simulate --csv $BI"
  bi_add "07_dualpipe --cost F=1, (trailing comma)"             2 1 "" ""                  "$B/07_dualpipe --simulate --cost F=1,"
  bi_add "07_dualpipe --cost F=inf"                             2 1 "" ""                  "$B/07_dualpipe --simulate --cost F=inf"
  bi_add "07_dualpipe --cost B=nan"                             2 1 "" ""                  "$B/07_dualpipe --simulate --cost B=nan"
  bi_add "07_dualpipe --cost x --unit-ms beyond a minute"       2 2 "" ""                  "$B/07_dualpipe --cost F=100 --unit-ms 1000"
  # a write that fails during the run: one line naming the file, exit 1 on every rank
  bi_add "01 --csv /dev/full: the lost write is an error"       1 3 "" /dev/full           "$B/01_online_softmax --csv /dev/full --reps 1"
  bi_add "02 --trace /dev/full"                                 1 2 "" /dev/full           "$B/02_ring_attention --trace /dev/full"
  bi_add "03 --csv /dev/full" 1 1 "" /dev/full  "$B/03_smoe --csv /dev/full"
  bi_add "04 --bench --csv /dev/full"                           1 2 "" /dev/full           "$B/04_gshard --bench --reps 1 --csv /dev/full"
  bi_add "06 --csv /dev/full"                                   1 2 "" /dev/full           "$B/06_overlap --reps 1 --microbatches 2 --csv /dev/full"
  bi_add "06 --gflops so low a phase outlasts the watchdog"      2 2 "" ""                  "$B/06_overlap --gflops 0.001"
  bi_add "07 --simulate --csv /dev/full"                        1 1 "" /dev/full           "$B/07_dualpipe --simulate --csv /dev/full"
  bi_add "08 --csv /dev/full"                                   1 2 "" /dev/full           "$B/08_mesh --train 1 --csv /dev/full"
  bi_add "08 --data a missing file"                             2 2 "" ""                  "$B/08_mesh --data $BI/no_such_text.txt"

  # How fast a usage error must leave, relative to this machine and build (ASan is slow): a clean
  # `--help` exit at -np 1, doubled (two jobs run at once), plus half a second. Open MPI's kill
  # timer on a non-zero exit (2 s here, without --mca odls_base_sigkill_timeout 0) exceeds it.
  bi_help_ms=0
  for L in "${!bi_np[@]}"; do
    t0=$(date +%s%N); $MPIRUN -np 1 "$B/$L" --help >/dev/null 2>&1
    t=$(( ($(date +%s%N) - t0) / 1000000 )); [ "$t" -gt "$bi_help_ms" ] && bi_help_ms=$t
  done
  bi_fast_ms=$((2 * bi_help_ms + 500))
  echo "== bad input: every lesson, ${#bi_jobs[@]} invocations (exit 2, one error: line, nothing else)"
  bi_start=$(date +%s%N)
  running=0
  for job in "${bi_jobs[@]}"; do
    IFS='|' read -r id name want np env out cmd <<< "$job"
    bad_input_job "$id" "$want" "$np" "$env" "$out" $cmd &
    running=$((running + 1))
    if [ $running -ge 2 ]; then wait -n; running=$((running - 1)); fi
  done
  wait
  bi_slowest=0
  for job in "${bi_jobs[@]}"; do
    IFS='|' read -r id name want np env out cmd <<< "$job"
    n=$((n + 1))
    IFS='|' read -r rc ms why line < "$BI/$id.res"
    [ "$np" = 1 ] && [ "$want" = 2 ] && [ "$ms" -gt "$bi_slowest" ] && bi_slowest=$ms
    if [ -z "$why" ]; then
      passed=$((passed + 1)); printf '  ok    %5sms  %-58s %s\n' "$ms" "$name" "$line"
    else
      failed=$((failed + 1)); printf '  FAIL  %5sms  %s: %s\n' "$ms" "$name" "$why"
      sed 's/^/        | out: /' "$BI/$id.out" | head -n 5; sed 's/^/        | err: /' "$BI/$id.err" | head -n 5
    fi
  done
  printf '  (%d jobs in %s; slowest usage error at -np 1: %d ms, --help: %d ms, limit %d ms)\n' \
    "${#bi_jobs[@]}" "$(elapsed $bi_start)" "$bi_slowest" "$bi_help_ms" "$bi_fast_ms"
}
inline bad_input_block
