"""What every lesson stands on, run as a user runs it: device sim keeps host code out of device
memory as a GPU does (kernels/sim_memory.h), the watchdog turns a deadlock into one error line
naming the ranks and the operation (on MPI and on NCCL emulated on sim), the trace is Chrome's
JSON with a track per rank, and a bad FF_ variable is refused like a bad flag."""
import os

import pytest

HOST_TOUCH = r"^error: host code touched device memory of .sim. at 0x[0-9a-f]+, outside a kernel or a device copy"


@pytest.fixture(scope="session")
def tests_bin(build):
    return os.path.join(build, "tests")


@pytest.mark.parametrize("how", ["read", "write", "freed"])
def test_sim_host_code_touching_device_memory_fails_as_on_a_gpu(command, tests_bin, how):
    run = command([os.path.join(tests_bin, "sim_host_access"), how])
    assert run.rc == 1, run.why("host code through a device pointer: exit 1")
    run.has(HOST_TOUCH)


def test_sim_copying_to_the_host_first_is_the_way(command, tests_bin):
    command([os.path.join(tests_bin, "sim_host_access"), "copy"]).succeeds(r"^copied to the host: 2\.5$")


def test_sim_a_kernel_writing_beyond_every_allocation_fails(command, tests_bin):
    run = command([os.path.join(tests_bin, "sim_host_access"), "kernel-wild"])
    assert run.rc == 1, run.why("a wild kernel write: exit 1")
    run.has(r"^error: a kernel or device copy on .sim. touched device memory at 0x[0-9a-f]+, outside every allocation")


def test_watchdog_turns_a_two_rank_ssend_deadlock_into_one_error_line(command, mpirun, tests_bin):
    # it must fire within its timeout + 5 s
    run = command(mpirun + ["-np", 2, os.path.join(tests_bin, "ssend_deadlock"), "--timeout", 3], timeout=8)
    assert run.rc == 1, run.why("the watchdog ends the job with exit 1 within 8 s")
    run.has(r"error: rank [01]: no progress for 3 s in ssend with peer [01] \(tag [0-9]+, [0-9]+ bytes\) — likely deadlock")


def test_watchdog_on_nccl_emulated_on_sim_two_ranks_that_both_receive_first(command, mpirun, tests_bin):
    run = command(mpirun + ["-np", 2, os.path.join(tests_bin, "ssend_deadlock"), "--nccl", "sim", "--timeout", 3],
                  timeout=8)
    assert run.rc == 1, run.why("the watchdog ends the job with exit 1 within 8 s")
    run.has(r"error: rank [01]: no progress for 3 s in recv with peer [01] \(tag 7, 16 bytes\) — likely deadlock")


def test_nccl_emulated_a_receive_of_the_wrong_size_names_both_sizes(command, mpirun, tests_bin):
    run = command(mpirun + ["-np", 2, os.path.join(tests_bin, "ssend_deadlock"), "--nccl", "sim", "--mismatch"],
                  timeout=20)
    assert run.rc == 1, run.why("exit 1")
    run.has(r"^error: rank 1: NCCL failed in recv with peer 0 \(16 bytes\): "
            r"a receive of 16 bytes from rank 0 got a message of 12$")


def test_watchdog_on_nccl_with_gpus_aborts_the_communicator(command, mpirun, tests_bin, two_gpus_with_nccl):
    if not two_gpus_with_nccl:
        pytest.skip("no two GPUs with NCCL here")
    run = command(mpirun + ["-np", 2, os.path.join(tests_bin, "ssend_deadlock"), "--nccl", "cuda", "--timeout", 3],
                  timeout=8)
    assert run.rc == 1, run.why("the watchdog ends the job with exit 1 within 8 s")
    run.has(r"error: rank [01]: no progress for 3 s in recv with peer [01] \(tag 7, 16 bytes\) — likely deadlock")


def test_trace_is_chrome_json_with_one_track_per_rank_and_csv(command, mpirun, tests_bin, python, tmp_path):
    trace, csv = tmp_path / "trace.json", tmp_path / "trace.csv"
    command(mpirun + ["-np", 3, os.path.join(tests_bin, "trace_demo"), trace, csv]).succeeds("")
    command([python, "scripts/check-trace.py", trace, csv, 3]).succeeds("^trace ok: 3 ranks")


def test_ff_wait_bogus_is_refused(command, mpirun, tests_bin):
    command(mpirun + ["-np", 2, os.path.join(tests_bin, "trace_demo"), "/dev/null", "/dev/null"],
            env={"FF_WAIT": "bogus"}).usage_error()


@pytest.mark.lesson("01")
def test_ff_cpu_isa_not_best_avx2_or_portable_is_refused_by_a_lesson(lesson):
    lesson("01_online_softmax", 2, env={"FF_CPU_ISA": "avx3"}).usage_error()
