# What a cluster changes, tried on one machine; sourced by scripts/run-tests.sh (its check
# helper). Between nodes without a fast fabric Open MPI moves messages over TCP; and when a
# node or a process dies, the job must end, not hang.
section "transports and failures"
# (pml ob1: the point-to-point layer that uses the btls; the Makefile's MPIRUN names it already)
tcp_only="--mca btl tcp,self$([[ $MPIRUN == *"pml ob1"* ]] || echo ' --mca pml ob1')"
check "TCP only ($tcp_only): lessons 02, 04 and 07 pass their checks over the loopback network (P=4)" 0 '^tcp ok' \
  bash -c "$MPIRUN $tcp_only -np 4 $B/02_ring_attention --causal --layout zigzag | grep -q '^check: PASS' && \
           $MPIRUN $tcp_only -np 4 $B/04_gshard | grep -q '^check: PASS' && \
           $MPIRUN $tcp_only -np 4 $B/07_dualpipe | grep -q '^check: PASS' && echo 'tcp ok'"
check "the transport flags bind: with --mca btl self alone two ranks have no way to talk, and the run fails" 0 '^no transport, no run' \
  bash -c "! $MPIRUN --mca btl self -np 2 $B/02_ring_attention >/dev/null 2>&1 && echo 'no transport, no run'"
# A rank killed with SIGKILL (a node lost): mpirun must end the job, every other rank with it,
# within the watchdog's timeout (--timeout 10) plus a few seconds, with a non-zero status.
check "a rank killed with SIGKILL ends the whole job: non-zero exit within the watchdog timeout + 5 s, no rank left" 0 '^killed: job ended' \
  bash -c "$MPIRUN -np 4 $B/08_mesh --tp 1 --train 100000 --timeout 10 >$LOG/killed.out 2>&1 & job=\$!; \
           for i in \$(seq 100); do grep -q '^   10 ' $LOG/killed.out && break; sleep 0.1; done; \
           victim=\$(pgrep -f '^$B/08_mesh --tp 1 --train 100000 --timeout 10' | sort -n | tail -n 1); \
           [ -n \"\$victim\" ] || { echo 'no rank to kill'; exit 1; }; start=\$(date +%s%N); kill -9 \$victim; \
           ( sleep 15; kill -9 \$job 2>/dev/null ) & guard=\$!; wait \$job; rc=\$?; kill \$guard 2>/dev/null; wait \$guard 2>/dev/null; \
           ms=\$(( (\$(date +%s%N) - start) / 1000000 )); left=\$(pgrep -fc '^$B/08_mesh --tp 1 --train 100000 --timeout 10'); \
           echo \"exit \$rc after \$ms ms, \$left ranks left\"; \
           [ \$rc -ne 0 ] && [ \$ms -le 15000 ] && [ \$left = 0 ] && echo \"killed: job ended (exit \$rc, \$ms ms)\""
