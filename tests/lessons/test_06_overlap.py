"""Lesson 06, compute/communication overlap: the overlapped step (W inline and W in the waits)
equals the sequential one bit for bit and the sequential one equals one process, at every world
size, micro-batch count and progress mode; the dumps of the two modes are byte-identical; the
trace shows compute over the messages only when overlapped; the planted early read FAILs; bad
input is one `error:` line with exit 2."""
import filecmp

import pytest

L06 = "06_overlap"


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_overlapped_equals_sequential_bit_for_bit_and_sequential_equals_one_process(lesson, np):
    lesson(L06, np, "--reps", 1, "--experts", 2 * np).ok()


def test_microbatches_1_2_4_and_7(lesson):
    for m in (1, 2, 4, 7):  # P=2; M=1 has no F&B step
        lesson(L06, 2, "--reps", 1, "--microbatches", m).ok()


@pytest.mark.parametrize("progress", ["none", "test", "thread"])
def test_progress_mode_gives_the_same_checks(lesson, progress):
    lesson(L06, 4, "--reps", 1, "--progress", progress).ok()


def test_prefill_two_forwards_interleaved_equal_sequential_and_one_process(lesson):
    lesson(L06, 3, "--prefill", "--microbatches", 3, "--experts", 6, "--reps", 1).ok()
    lesson(L06, 4, "--prefill", "--reps", 1).ok()


def test_sequential_and_overlapped_dumps_are_byte_identical(lesson, tmp_path):
    # every y, dx and gradient of every rank (P=4, M=5)
    dirs = {m: tmp_path / f"d06{m[0]}" for m in ("sequential", "overlapped")}
    for mode, d in dirs.items():
        lesson(L06, 4, "--reps", 1, "--microbatches", 5, "--mode", mode, "--dump", d).ok()
    seq = sorted(p.name for p in dirs["sequential"].glob("*.npy"))
    ovl = sorted(p.name for p in dirs["overlapped"].glob("*.npy"))
    assert seq and seq == ovl, f"the two modes dumped different files: {seq} vs {ovl}"
    differ = [n for n in seq if not filecmp.cmp(dirs["sequential"] / n, dirs["overlapped"] / n, shallow=False)]
    assert not differ, f"dumps that differ between the modes: {differ}"


def test_trace_compute_overlaps_the_messages_on_every_rank_only_when_overlapped(lesson, script, tmp_path):
    # P=4: a valid trace in both modes; compute while a message is in flight on every rank when
    # overlapped, on none when sequential (tests/check_trace_06.py)
    for mode in ("sequential", "overlapped"):
        trace = tmp_path / f"t06{mode}.json"
        lesson(L06, 4, "--reps", 1, "--mode", mode, "--trace", trace).ok()
        script("scripts/check-trace.py", trace, "-", 4).succeeds("^trace ok: 4 ranks")
        script("tests/check_trace_06.py", trace, 4, mode).succeeds(rf"^overlap ok: 4 ranks, {mode}")


def test_prints_the_hidden_fraction_and_dualpipes_bubble_from_the_measured_costs(lesson):
    run = lesson(L06, 4, "--reps", 1).ok()
    run.has(r"simulator, P=8, M=20: dualpipe +bubble")
    run.has(r"^hidden fraction \(the worst rank\): -?[0-9]+%")


def test_planted_bug_early_read_gives_nan_until_the_finish(lesson):
    lesson(L06, 4, "--reps", 1, "--mode", "overlapped", "--bug", "early-read").fails().has(r"^    y +max abs err nan .*FAIL")


def test_planted_bug_early_read_with_mode_both_overlapped_differs_from_sequential(lesson):
    lesson(L06, 2, "--reps", 1, "--bug", "early-read").fails().has(r"W in waits == sequential +FAIL")


def test_help_lists_every_flag_with_its_default(lesson):
    lesson(L06, 1, "--help").succeeds(r"--progress \{none\|test\|thread\} .*\(default: test\)")


@pytest.mark.parametrize("np, args", [
    (3, ["--experts", 8]),                                 # N not a multiple of P
    (2, ["--heads", 5]),                                   # heads not dividing dim
    (2, ["--topk", 9]),                                    # K more than N
    (4, ["--ranks-per-node", 3]),                          # R not dividing P
    (2, ["--progress", "poll"]),
    (2, ["--mode", "overlap"]),
    (2, ["--link", "inter=0GB/s"]),                        # malformed --link
    (2, ["--mode", "sequential", "--bug", "early-read"]),  # the bug needs the overlapped mode
    (2, ["--microbatches", 0]),
], ids=["experts-not-multiple-of-P", "heads-not-dividing-dim", "topk-over-experts", "ranks-per-node-not-dividing-P",
        "progress-typo", "mode-typo", "link-malformed", "early-read-with-sequential", "microbatches-0"])
def test_bad_input(lesson, np, args):
    lesson(L06, np, *args).usage_error()


def test_device_sim_runs_the_blocks_kernels_under_the_emulator(lesson):
    lesson(L06, 2, "--device", "sim", "--reps", 1, "--tokens", 16, "--dim", 32, "--ffn", 32, "--microbatches", 3).ok()


def test_device_cuda(lesson, has_cuda):
    if not has_cuda:
        pytest.skip("no GPU here")
    lesson(L06, 2, "--device", "cuda", "--reps", 1).ok()
