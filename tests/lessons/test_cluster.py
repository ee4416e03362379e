"""What a cluster changes, tried on one machine. Between nodes without a fast fabric Open MPI moves
messages over TCP; and when a node or a process dies, the job must end, not hang."""
import os
import subprocess
import time

import pytest


@pytest.fixture(scope="session")
def tcp_only(mpirun):
    # pml ob1: the point-to-point layer that uses the btls (the Makefile's MPIRUN names it already)
    return ["--mca", "btl", "tcp,self"] + ([] if "ob1" in mpirun else ["--mca", "pml", "ob1"])


@pytest.mark.parametrize("name, args", [
    pytest.param("02_ring_attention", ["--causal", "--layout", "zigzag"], marks=pytest.mark.lesson("02")),
    pytest.param("04_gshard", [], marks=pytest.mark.lesson("04")),
    pytest.param("07_dualpipe", [], marks=pytest.mark.lesson("07")),
])
def test_tcp_only_the_lesson_passes_its_check_over_the_loopback_network(command, mpirun, build, tcp_only, name, args):
    command(mpirun + tcp_only + ["-np", 4, os.path.join(build, "bin", name)] + args).ok()


@pytest.mark.lesson("02")
def test_the_transport_flags_bind_with_btl_self_alone_the_run_fails(command, mpirun, build):
    run = command(mpirun + ["--mca", "btl", "self", "-np", 2, os.path.join(build, "bin", "02_ring_attention")], timeout=60)
    assert run.rc != 0, run.why("two ranks with no way to talk: the run must fail")


@pytest.mark.lesson("08")
def test_a_rank_killed_with_sigkill_ends_the_whole_job(mpirun, build, tmp_path):
    # a node lost: mpirun must end the job, every other rank with it, within the watchdog's timeout
    # (--timeout 10) plus a few seconds, with a non-zero status
    binary = os.path.join(build, "bin", "08_mesh")
    args = ["--tp", "1", "--train", "100000", "--timeout", "10"]
    log = tmp_path / "killed.out"
    with open(log, "w") as out:
        job = subprocess.Popen(mpirun + ["-np", "4", binary] + args, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        for _ in range(100):  # until step 10 is printed (10 s at most)
            if any(line.startswith("   10 ") for line in log.read_text().splitlines()):
                break
            time.sleep(0.1)
        ranks = subprocess.run(["pgrep", "-f", f"^{binary} {' '.join(args)}"], stdout=subprocess.PIPE, text=True).stdout.split()
        assert ranks, f"no rank to kill; the job printed:\n{log.read_text()[-2000:]}"
        start = time.monotonic()
        os.kill(max(int(r) for r in ranks), 9)
        try:
            rc = job.wait(timeout=15)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - start
        left = subprocess.run(["pgrep", "-f", f"^{binary} {' '.join(args)}"], stdout=subprocess.PIPE, text=True).stdout.split()
        assert rc not in (None, 0) and took <= 15 and not left, \
            f"after the kill: exit {rc} after {took:.1f} s, {len(left)} ranks left (want non-zero within 15 s, none left)"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()
