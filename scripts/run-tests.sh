#!/usr/bin/env bash
# make test — the whole suite. Each step is a doctest binary (its test cases count) or one
# command with an expected exit code and output (counts as one test). Ends with
# "N passed, N failed" and a non-zero exit on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
LOG=$(mktemp -d /tmp/fivefold-tests.XXXXXX)
rm -rf "$BUILD/test-results" && mkdir -p "$BUILD/test-results"  # the pytest files' JUnit XML
trap 'rm -rf "$LOG"' EXIT
passed=0; failed=0; n=0
if [ "${SANITIZE:-0}" = 1 ]; then
  # Address, undefined-behaviour and leak errors fail the step. Open MPI keeps allocations
  # for the life of the process (scripts/lsan.supp names its libraries); the slow unwinder
  # is needed so that frames inside its dlopen'ed components can be matched by name.
  export ASAN_OPTIONS=halt_on_error=1:fast_unwind_on_malloc=0
  export LSAN_OPTIONS=suppressions=$PWD/scripts/lsan.supp:print_suppressions=0
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
fi

elapsed() { awk -v a="$1" -v b="$(date +%s%N)" 'BEGIN { printf "%6.1fs", (b - a) / 1e9 }'; }

# ---- the runner: the test files register their tests (check, usage_error, doctest_step,
# section, inline); run_registered then runs them JOBS at a time (default: one per core;
# FF_TEST_JOBS=N to choose) and prints each one's lines in the order they were registered, as
# it finishes. A test job writes what it prints to $LOG/ID.txt and its counts ("passed failed")
# to $LOG/ID.res, last; the parent adds them up. No test reads another's files.
JOBS=${FF_TEST_JOBS:-$(nproc 2>/dev/null || echo 2)}
items=()        # "KIND CMD": KIND is job, text or inline; CMD a quoted command line
early=()        # the ids of the jobs to start first (registered with `first`)
# make test L=NN (FF_TEST_LESSON): only lesson NN's tests, those whose name starts with "NN " or
# "lesson NN", or says "L=NN" (its pytest file, its checks, its bad input, its exercises); make test K=TEXT
# (FF_TEST_K): only tests whose name contains TEXT (any case; pytest files get it as -k).
selected() {  # selected NAME: whether the test NAME runs under L= and K=
  local name=$1
  if [ -n "${FF_TEST_LESSON:-}" ] && [[ $name != "$FF_TEST_LESSON "* && $name != "lesson $FF_TEST_LESSON"* &&
                                       $name != *"L=$FF_TEST_LESSON"* ]]; then return 1; fi
  if [ -n "${FF_TEST_K:-}" ] && [[ ${name,,} != *"${FF_TEST_K,,}"* ]]; then return 1; fi
  return 0
}
filtered() { [ -n "${FF_TEST_LESSON:-}${FF_TEST_K:-}" ]; }
register() {
  local kind=$1; shift
  if [ "$kind" = job ] && ! selected "$2"; then return 0; fi
  if [ "$kind" = text ] && filtered; then return 0; fi
  if [ "$kind" = inline ] && [ -n "${FF_TEST_K:-}" ]; then return 0; fi  # (the bad-input table: L= filters it)
  items+=("$kind $(printf '%q ' "$@")")
}
# first check|doctest_step ...: a long job (tens of seconds), started before the others so that
# it does not run alone at the end; it is still printed in its place
first() { local at=${#items[@]}; "$@"; [ ${#items[@]} -gt "$at" ] && early+=("$at"); return 0; }
section() { register text "== $*"; }
note() { register text "$*"; }   # a line printed as it is, in its place
# inline FUNC: runs FUNC in this shell once every test before it has finished, alone (the
# bad-input table, which times its usage errors against --help and runs its own jobs); it
# prints its lines and adds to passed / failed itself
inline() { register inline "$@"; }
check() { register job run_check "$@"; }
usage_error() { register job run_usage_error "$@"; }
doctest_step() { register job run_doctest_step "$@"; }
# pytest_step NAME FILE: a pytest file (tests/lessons/test_NN_*.py), its tests counted one by one;
# under K=TEXT (and not L=) it runs those of its tests pytest's -k TEXT selects
pytest_step() {
  if [ -n "${FF_TEST_K:-}" ] && [ -z "${FF_TEST_LESSON:-}" ]; then
    local args=("$@") i k="$FF_TEST_K"
    for ((i = 2; i < ${#args[@]}; i++)); do  # a step's own -k X becomes -k "(X) and (K)"
      if [ "${args[i]}" = -k ]; then k="(${args[i + 1]}) and ($FF_TEST_K)"; unset 'args[i]' 'args[i + 1]'; i=$((i + 1)); fi
    done
    items+=("job $(printf '%q ' run_pytest_step "${args[@]}" -k "$k")")
  else
    register job run_pytest_step "$@"
  fi
}

# result ID PASSED FAILED: the job's counts, written last (the parent waits for this file)
result() { echo "$2 $3" > "$LOG/$1.res.tmp" && mv "$LOG/$1.res.tmp" "$LOG/$1.res"; }

# run_doctest_step ID NAME CMD... — counts the binary's test cases
run_doctest_step() {
  local id=$1 name=$2; shift 2
  local log=$LOG/$id.log start; start=$(date +%s%N)
  timeout 600 "$@" >"$log" 2>&1; local rc=$?
  local line; line=$(grep -a '\[doctest\] test cases:' "$log" | tail -n 1)
  local p f
  p=$(echo "$line" | sed -n 's/.*| *\([0-9]*\) passed.*/\1/p')
  f=$(echo "$line" | sed -n 's/.*| *\([0-9]*\) failed.*/\1/p')
  if [ -z "$p" ]; then p=0; f=1; fi
  if [ $rc -ne 0 ] && [ "$f" = 0 ]; then f=1; fi
  if [ $rc -eq 0 ] && [ "$f" = 0 ]; then
    printf '  ok    %s  %-52s %s test cases\n' "$(elapsed $start)" "$name" "$p"
  else
    printf '  FAIL  %s  %-52s (exit %s)\n' "$(elapsed $start)" "$name" "$rc"; tail -n 60 "$log" | sed 's/^/        | /'
  fi > "$LOG/$id.txt"
  result "$id" "$p" "$f"
}

# run_pytest_step ID NAME FILE [PYTEST ARGS...] — counts the file's tests (pytest's summary line);
# a failure prints pytest's own report of it (the command, what differed, the output's tail)
run_pytest_step() {
  local id=$1 name=$2 file=$3; shift 3
  local log=$LOG/$id.log start; start=$(date +%s%N)
  timeout 900 "$PYTHON" -m pytest "$file" -q -p no:cacheprovider -o junit_family=xunit2 \
    --junitxml="$BUILD/test-results/$id.xml" "$@" >"$log" 2>&1; local rc=$?
  local line p f  # pytest's last line: "1 failed, 21 passed in 6.1s" and the like
  line=$(grep -aE '[0-9]+ (passed|failed|errors?|deselected)' "$log" | tail -n 1)
  p=$(echo "$line" | grep -oE '[0-9]+ passed' | awk '{ s += $1 } END { print s + 0 }')
  f=$(echo "$line" | grep -oE '[0-9]+ (failed|errors?)' | awk '{ s += $1 } END { print s + 0 }')
  if [ $rc -ne 0 ] && [ "$f" = 0 ] && [ $rc -ne 5 ]; then f=1; fi  # 5: every test deselected by -k
  if [ $rc -eq 0 ] || [ $rc -eq 5 ]; then
    printf '  ok    %s  %-52s %s tests\n' "$(elapsed $start)" "$name" "$p"
  else
    printf '  FAIL  %s  %-52s (exit %s)\n' "$(elapsed $start)" "$name" "$rc"; tail -n 80 "$log" | sed 's/^/        | /'
  fi > "$LOG/$id.txt"
  result "$id" "$p" "$f"
}

# run_check ID NAME EXPECTED_RC PATTERN CMD... — one test: exit code and an extended regex the
# output must match
run_check() {
  local id=$1 name=$2 want=$3 pattern=$4; shift 4
  local log=$LOG/$id.log start; start=$(date +%s%N)
  timeout 300 "$@" >"$log" 2>&1; local rc=$?
  if [ "$rc" = "$want" ] && grep -Eq -- "$pattern" "$log"; then
    printf '  ok    %s  %s\n' "$(elapsed $start)" "$name" > "$LOG/$id.txt"; result "$id" 1 0
  else
    { printf '  FAIL  %s  %s (exit %s, want %s; output must match /%s/)\n' "$(elapsed $start)" "$name" "$rc" "$want" "$pattern"
      tail -n 40 "$log" | sed 's/^/        | /'; } > "$LOG/$id.txt"
    result "$id" 0 1
  fi
}

# run_usage_error ID NAME CMD... — bad input: exit 2, exactly one line, starting "error:", nothing else
# mpirun's own libevent sometimes warns as ranks exit ("[warn] Epoll MOD(1) on fd N failed ...:
# Bad file descriptor", a race in Open MPI's event loop at shutdown: open-mpi/ompi#2004) on a
# loaded machine. It is not the program's output; the error contract's count leaves it out.
MPIRUN_NOISE='^\[warn\] Epoll [A-Z]+\([0-9]+\) on fd [0-9]+ failed'
run_usage_error() {
  local id=$1 name=$2; shift 2
  local log=$LOG/$id.log start; start=$(date +%s%N)
  timeout 60 "$@" >"$log" 2>&1; local rc=$?
  sed -Ei "/$MPIRUN_NOISE/d" "$log"
  local lines; lines=$(grep -c . "$log")
  if [ "$rc" = 2 ] && [ "$lines" = 1 ] && grep -q '^error: ' "$log"; then
    printf '  ok    %s  %-52s %s\n' "$(elapsed $start)" "$name" "$(cat "$log")" > "$LOG/$id.txt"; result "$id" 1 0
  else
    { printf '  FAIL  %s  %s (exit %s, %s lines; want exit 2 and one error: line)\n' "$(elapsed $start)" "$name" "$rc" "$lines"
      sed 's/^/        | /' "$log" | head -n 20; } > "$LOG/$id.txt"
    result "$id" 0 1
  fi
}

# prints the finished tests that are next in order, and counts them
shown=0
flush() {
  while [ $shown -lt ${#items[@]} ] && [ -e "$LOG/$shown.res" ]; do
    cat "$LOG/$shown.txt"
    local p f; read -r p f < "$LOG/$shown.res"
    passed=$((passed + p)); failed=$((failed + f)); shown=$((shown + 1))
  done
}
# start_job ID: runs job ID in the background once fewer than JOBS jobs run
start_job() {
  local cmd=${items[$1]#* }
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; flush; done
  eval "${cmd%% *} $1 ${cmd#* }" </dev/null >/dev/null 2>&1 &
  n=$((n + 1))
}
run_registered() {
  local _id _kind _cmd
  for _id in "${early[@]}"; do start_job "$_id"; done
  for _id in "${!items[@]}"; do
    _kind=${items[$_id]%% *}; _cmd=${items[$_id]#* }
    case $_kind in
      text) eval "printf '%s\n' $_cmd" > "$LOG/$_id.txt"; result "$_id" 0 0 ;;
      inline)
        wait; flush
        eval "$_cmd"; : > "$LOG/$_id.txt"; result "$_id" 0 0 ;;
      job) [[ " ${early[*]} " == *" $_id "* ]] || start_job "$_id" ;;
    esac
    flush
  done
  wait; flush
  # a test that never reported (its job died before writing its result) is a failure
  if [ $shown -lt ${#items[@]} ]; then
    echo "  FAIL  test $shown of ${#items[@]} never reported a result: ${items[$shown]}"
    failed=$((failed + 1))
  fi
}

B=$BUILD/bin; T=$BUILD/tests
section "the build (make -n: what each target would run)"
# (env -u: a make of its own, not a part of the one that runs this suite)
if [ "${SANITIZE:-0}" != 1 ]; then  # make sanitize builds with other flags than plain make's
  check "after the build a second make has nothing to compile or link" 0 '^nothing to rebuild' \
    bash -c "out=\$(env -u MAKEFLAGS -u MAKELEVEL make -n --no-print-directory build V=1 2>&1) || { echo \"\$out\"; exit 1; }; \
             n=\$(echo \"\$out\" | grep -Ec ' -c | -o '); \
             [ \$n = 0 ] && echo 'nothing to rebuild' || { echo \"\$out\" | grep -E ' -c | -o ' | head; exit 1; }"
fi
check "make lessons on an empty build directory compiles the library and the lessons, and no test" 0 '^lessons build ok' \
  bash -c "out=\$(env -u MAKEFLAGS -u MAKELEVEL make -n --no-print-directory lessons BUILD=$LOG/empty-build V=1 2>&1) || exit 1; \
           echo \"\$out\" | grep -q ' -c lessons/08_mesh/main.cpp' && echo \"\$out\" | grep -q ' -c common/core/tensor.cpp' || { echo \"\$out\" | tail; exit 1; }; \
           echo \"\$out\" | grep -E ' -c tests/|FIVEFOLD_WITH_SLIDES' && exit 1; echo 'lessons build ok'"
# install-deps.sh in a copy of the tree without slides/node_modules, with an npm that only says it
# was called: make's and make lessons' call runs no npm, the slides' call (make test, make slides) does
check "make lessons' dependencies fetch no npm package; the slides' do" 0 '^npm only for the slides' \
  bash -c "d=$LOG/deps-tree; mkdir -p \$d/scripts \$d/slides \$d/bin && cp scripts/install-deps.sh \$d/scripts/ && \
           cp slides/package.json slides/package-lock.json \$d/slides/ && \
           printf '#!/bin/sh\necho npm \"\$*\" >> %s/npm-called; exit 1\n' \$d > \$d/bin/npm && chmod +x \$d/bin/npm && \
           PATH=\$d/bin:\$PATH bash \$d/scripts/install-deps.sh && [ ! -e \$d/npm-called ] && \
           ! PATH=\$d/bin:\$PATH FIVEFOLD_WITH_SLIDES=1 bash \$d/scripts/install-deps.sh 2>/dev/null && [ -e \$d/npm-called ] && \
           echo 'npm only for the slides'"
section "core (single process)"
doctest_step "unit tests: tensor, RNG, ops, autograd, cli, npy, goldens" $T/unit_tests --test-suite-exclude=kernels

section "kernels: every CUDA kernel against its cpu twin"
first doctest_step "kernel tests, sim vs cpu (SIMT emulator)" env FF_TEST_DEVICE=sim $T/unit_tests --test-suite=kernels
skipped=0
if $T/device_query | grep -qw cuda; then
  doctest_step "kernel tests, cuda vs cpu (GPU)" env FF_TEST_DEVICE=cuda $T/unit_tests --test-suite=kernels
else
  skipped=$($T/unit_tests --test-suite=kernels --count | sed -n 's/.*unskipped test cases passing the current filters: *\([0-9]*\).*/\1/p')
  note "$(printf '  skip            %-52s %s test cases: %s' "kernel tests, cuda vs cpu" "${skipped:-?}" "no GPU here")"
fi

# Device memory of sim is kept from the host as a GPU's is (kernels/sim_memory.h).
host_touch='^error: host code touched device memory of .sim. at 0x[0-9a-f]+, outside a kernel or a device copy'
check "sim: host code reading a device pointer fails, as on a GPU" 1 "$host_touch" $T/sim_host_access read
check "sim: host code writing through a device pointer fails" 1 "$host_touch" $T/sim_host_access write
check "sim: copying to the host first is the way (and works)" 0 '^copied to the host: 2.5$' $T/sim_host_access copy
check "sim: host code reading freed device memory fails" 1 "$host_touch" $T/sim_host_access freed
check "sim: a kernel writing far beyond every allocation fails" 1 \
  "^error: a kernel or device copy on .sim. touched device memory at 0x[0-9a-f]+, outside every allocation" \
  $T/sim_host_access kernel-wild

section "communication (mpirun, odd sizes included)"
for np in 1 2 3 4; do
  doctest_step "comm tests, $np rank(s)" $MPIRUN -np $np $T/mpi_tests
done
check "watchdog turns a two-rank Ssend deadlock into one error line" 1 \
  'error: rank [01]: no progress for 3 s in ssend with peer [01] \(tag [0-9]+, [0-9]+ bytes\) — likely deadlock' \
  timeout 8 $MPIRUN -np 2 $T/ssend_deadlock --timeout 3   # must fire within timeout + 5 s
check "watchdog on NCCL (emulated on sim): two ranks that both receive first, one error line" 1 \
  'error: rank [01]: no progress for 3 s in recv with peer [01] \(tag 7, 16 bytes\) — likely deadlock' \
  timeout 8 $MPIRUN -np 2 $T/ssend_deadlock --nccl sim --timeout 3
check "NCCL (emulated on sim): a receive of the wrong size is one error line naming both sizes" 1 \
  '^error: rank 1: NCCL failed in recv with peer 0 \(16 bytes\): a receive of 16 bytes from rank 0 got a message of 12$' \
  timeout 20 $MPIRUN -np 2 $T/ssend_deadlock --nccl sim --mismatch
if $T/device_query | grep -q '^backends:.* nccl' && [ "$($T/device_query | sed -n 's/^gpus: //p')" -ge 2 ]; then
  check "watchdog on NCCL: two ranks that both receive first, one error line, the communicator aborted" 1 \
    'error: rank [01]: no progress for 3 s in recv with peer [01] \(tag 7, 16 bytes\) — likely deadlock' \
    timeout 8 $MPIRUN -np 2 $T/ssend_deadlock --nccl cuda --timeout 3
fi
check "trace: Chrome JSON with one track per rank, and CSV" 0 '^trace ok: 3 ranks' \
  bash -c "$MPIRUN -np 3 $T/trace_demo $LOG/trace.json $LOG/trace.csv && $PYTHON scripts/check-trace.py $LOG/trace.json $LOG/trace.csv 3"

usage_error "FF_WAIT=bogus is refused: one error line, exit 2" env FF_WAIT=bogus $MPIRUN -np 2 $T/trace_demo /dev/null /dev/null
usage_error "FF_CPU_ISA=avx3 (not best, avx2 or portable) is refused by a lesson: one error line, exit 2" env FF_CPU_ISA=avx3 $MPIRUN -x FF_CPU_ISA -np 2 $B/01_online_softmax
source tests/lessons.sh
source tests/bad_input.sh
source tests/cluster.sh
source tests/exercises.sh
section "slides"
check "every deck builds to HTML; its code markers, figures and runs exist (bad ones are caught)" 0 '^slides ok: [0-9]+ decks build to HTML' \
  $PYTHON scripts/slides.py check
section "the lessons' shape and layers"
check "no lesson main.cpp over 550 lines, no function in lessons/ over 200, but those being cut down, which may not grow (an oversized one is caught)" 0 '^shape ok' \
  bash -c "$PYTHON tests/check_shape.py --self-test && $PYTHON tests/check_shape.py"
check "every include in common/, kernels/ and lessons/ goes down a layer or sideways: util, kernels, core, comm, layers, lesson, then a lesson its own and earlier lessons' headers, never a main.cpp (one going up is caught)" 0 '^layers ok' \
  bash -c "$PYTHON tests/check_layers.py --self-test && $PYTHON tests/check_layers.py"
section "READMEs"; first check "every output a README shows equals a real run (and a changed line is caught)" 0 '^readme ok: [0-9]+ blocks' bash -c "$PYTHON tests/check_readme.py --self-test && $PYTHON tests/check_readme.py"

suite_start=$(date +%s%N)
run_registered
echo
echo "($n steps, $JOBS at a time:$(elapsed $suite_start))"
filtered && skipped=0
[ "$skipped" != 0 ] && echo "($skipped kernel test cases not run on cuda: no GPU; they ran on sim)"
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
