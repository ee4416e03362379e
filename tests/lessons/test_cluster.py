"""What a cluster changes, tried on one machine. Between nodes without a fast fabric Open MPI moves
messages over TCP; and when a node or a process dies, the job must end, not hang."""
import os
import re
import signal
import subprocess
import time

import pytest


def binary(build, name):
    return os.path.join(build, "bin", name)


@pytest.mark.lesson("02", "04", "07")
def test_tcp_only_lessons_02_04_07_pass_their_checks_over_the_loopback_network(command, mpirun, build):
    # pml ob1: the point-to-point layer that uses the btls (the Makefile's MPIRUN names it already)
    tcp_only = ["--mca", "btl", "tcp,self"] + ([] if "ob1" in mpirun else ["--mca", "pml", "ob1"])
    for name, args in [("02_ring_attention", ["--causal", "--layout", "zigzag"]), ("04_gshard", []), ("07_dualpipe", [])]:
        command(mpirun + tcp_only + ["-np", "4", binary(build, name)] + args).ok()


@pytest.mark.lesson("02")
def test_the_transport_flags_bind_with_btl_self_alone_two_ranks_cannot_talk_and_the_run_fails(command, mpirun, build):
    run = command(mpirun + ["--mca", "btl", "self", "-np", "2", binary(build, "02_ring_attention")])
    assert run.rc != 0, run.why("two ranks with no transport between them: a non-zero exit")


def ranks_running(argv, session=None):
    """The pids of the live processes whose command line is argv (the ranks, not mpirun); with
    session, only those of that session (mpirun's, which its ranks share)."""
    want = ("\0".join(argv) + "\0").encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except OSError:
            continue
        if cmdline == want and stat[0] != "Z" and session in (None, int(stat[3])):
            pids.append(int(pid))
    return pids


@pytest.mark.lesson("08")
def test_a_rank_killed_with_sigkill_ends_the_whole_job_within_the_watchdog_timeout(mpirun, build, tmp_path):
    # a node lost: mpirun must end the job, every other rank with it, within the watchdog's timeout
    # (--timeout 10) plus 5 s, with a non-zero status
    rank = [binary(build, "08_mesh"), "--tp", "1", "--train", "100000", "--timeout", "10"]
    log = tmp_path / "killed.out"
    with open(log, "w") as out:
        job = subprocess.Popen(mpirun + ["-np", "4"] + rank, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        for _ in range(100):  # until the 10th step's line (10 s at most), then the kill in any case
            if re.search(r"^   10 ", log.read_text(), re.M):
                break
            time.sleep(0.1)
        ranks = ranks_running(rank)
        assert ranks, f"no rank to kill; the job printed:\n{log.read_text()[-2000:]}"
        start = time.monotonic()
        os.kill(max(ranks), signal.SIGKILL)  # the newest rank
        try:
            rc = job.wait(timeout=15)
        except subprocess.TimeoutExpired:
            job.kill()
            rc = job.wait()
        took = time.monotonic() - start
        left = ranks_running(rank)
        assert rc != 0 and took <= 15 and not left, \
            (f"after the kill: exit {rc} after {took:.1f} s, {len(left)} ranks left (want a non-zero exit within "
             f"15 s, no rank left); the job printed:\n{log.read_text()[-2000:]}")
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        for pid in ranks_running(rank, session=job.pid):  # no rank of this test outlives it
            os.kill(pid, signal.SIGKILL)
