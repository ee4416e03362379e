"""Lesson 01, online softmax: every world size (1 and odd included) and ragged shapes PASS, each
planted bug FAILs, bad input is one `error:` line with exit 2, and the dumps and traces are checked
by independent code (numpy, the trace checker)."""
import pytest

L01 = "01_online_softmax"


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_default_demo(lesson, np):
    lesson(L01, np, "--reps", 3).ok()


def test_cols_not_divisible_ragged_blocks(lesson):
    # P=3, cols 1001, block 7
    lesson(L01, 3, "--rows", 5, "--cols", 1001, "--block", 7, "--keys", 100, "--dim", 8, "--reps", 2).ok()


def test_more_ranks_than_columns_empty_ranks_are_the_merge_identity(lesson):
    lesson(L01, 4, "--rows", 3, "--cols", 3, "--block", 1, "--keys", 2, "--dim", 4, "--reps", 2).ok()


def test_block_1_and_block_larger_than_the_row(lesson):
    lesson(L01, 2, "--block", 1, "--cols", 50, "--reps", 2).ok()
    lesson(L01, 2, "--block", 5000, "--cols", 300, "--reps", 2).ok()


def test_one_row_one_column(lesson):
    lesson(L01, 1, "--rows", 1, "--cols", 1, "--keys", 1, "--dim", 1, "--reps", 1).ok()


@pytest.mark.parametrize("bug, np", [("no-rescale", 3),     # forgetting l * exp(m_old - m_new)
                                     ("no-inf-guard", 2)])  # NaN from -inf - -inf
def test_planted_bug_fails_the_check(lesson, bug, np):
    lesson(L01, np, "--bug", bug, "--reps", 1).fails()


def test_help_lists_every_flag_with_its_default(lesson):
    run = lesson(L01, 2, "--help")
    assert run.rc == 0, run.why("--help exits 0")
    run.has(r"--block N .*\(default: 64\)")


def test_dump_numpy_recomputes_softmax_and_attention(lesson, script, tmp_path):
    d = tmp_path / "d01"
    lesson(L01, 3, "--dump", d, "--reps", 1).ok()
    script("tests/check_dump_01.py", d, 3).has("^dump ok")


def test_trace_spans_nest_and_the_checks_traffic_on_its_own_track(lesson, script, tmp_path):
    trace = tmp_path / "t01.json"
    lesson(L01, 3, "--reps", 2, "--trace", trace).ok()
    assert '"check"' in trace.read_text(), "the check's traffic has its own category"
    script("scripts/check-trace.py", trace, "-", 3).has("^trace ok: 3 ranks")


@pytest.mark.parametrize("args", [["--cols", "0"], ["--block", "-1"], ["--rows", "abc"], ["--cols"],
                                  ["--colz", "5"], ["--bug", "rescale"]],
                         ids=["cols-0", "block-negative", "rows-abc", "missing-value", "unknown-flag", "bug-typo"])
def test_bad_input(lesson, args):
    lesson(L01, 3, *args).usage_error()


@pytest.mark.parametrize("np", [1, 3])
def test_device_sim_runs_the_cu_kernels_under_the_emulator(lesson, np):
    lesson(L01, np, "--device", "sim", "--reps", 1, "--cols", 777, "--keys", 300).ok()


def test_device_cuda(lesson, has_cuda):
    if has_cuda:
        lesson(L01, 2, "--device", "cuda", "--reps", 1).ok()
    else:  # without a GPU, one error line naming what is available
        lesson(L01, 3, "--device", "cuda").usage_error()
