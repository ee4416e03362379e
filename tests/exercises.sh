# The exercises (scripts/exercise.py), sourced by scripts/run-tests.sh: for every lesson, the
# student's copy builds and stops at its first unwritten exercise with one error line and exit
# 2; each exercise's stub does so alone; the solutions pass the lesson's check; each planted
# mistake fails it. One grading job per lesson, so that two run at a time.
section "exercises (make grade)"
check "the grader can fail: a planted 'mistake' that changes nothing is reported" 0 '^self-test ok' \
  $PYTHON scripts/exercise.py grade --self-test
for dir in lessons/[0-9][0-9]_*/; do
  nn=$(basename "$dir" | cut -c1-2)
  n=$($PYTHON scripts/exercise.py list "$nn" | wc -l)
  [ "$n" -gt 0 ] || continue
  check "lesson $nn's $n exercises: the student's copy stops at its first stub; each stub alone stops the run; the solutions pass; each planted mistake fails" 0 '^grade ok: 1 lessons' \
    $PYTHON scripts/exercise.py grade "$nn"
done
check "make exercise L=01 writes the student's copy, make run L=01 EX=1 stops at its first stub (make grade L=01 EX=1 says FAIL), an edited copy is kept (FORCE=1 starts over)" 0 '^exercise flow ok' \
  bash -c "d=$LOG/ex; rm -rf \$d; make -s --no-print-directory exercise L=01 EXERCISES=\$d >/dev/null && [ -f \$d/01_online_softmax/main.cpp ] && \
           out=\$(make -s --no-print-directory run L=01 EX=1 EXERCISES=\$d 2>&1); \
           [ \$(echo \"\$out\" | grep -c '^error: ') = 1 ] && echo \"\$out\" | grep -q '^error: exercise merge is not written yet' && \
           { g=\$(make -s --no-print-directory grade L=01 EX=1 EXERCISES=\$d 2>&1); [ \$? != 0 ]; } && \
           echo \"\$g\" | grep -q '^  FAIL  make run L=01 EX=1 the default run: error: exercise merge is not written yet' && \
           echo \"\$g\" | grep -q '^your exercises of lesson 01: 0 of 1 runs pass' && \
           echo '// mine' >> \$d/01_online_softmax/main.cpp && \
           ! make -s --no-print-directory exercise L=01 EXERCISES=\$d >/dev/null 2>&1 && grep -q '// mine' \$d/01_online_softmax/main.cpp && \
           make -s --no-print-directory exercise L=01 EXERCISES=\$d FORCE=1 >/dev/null && ! grep -q '// mine' \$d/01_online_softmax/main.cpp && \
           echo 'exercise flow ok'"
