"""Lesson 07, pipeline schedules: every schedule at every world size and every micro-batch count
it allows runs and equals one process (and the ones it does not allow are refused); DualPipe and
DualPipeV with several blocks per stage; each planted bug FAILs; --print-schedule, --simulate
(Table 2's bubble formulas), dumps and traces are checked by independent code; bad input is one
`error:` line with exit 2."""
import re

import pytest

L07 = "07_dualpipe"
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zb-h2", "dualpipe", "dualpipev"]


# The micro-batch counts of {2P, P, 2P+2, 7} each schedule allows at P stages (0: the default, 2P).
# The four schedules on a line (gpipe, 1f1b, zb-h1, zb-h2) take every M; dualpipe needs P even and
# M even >= 2P, dualpipev M >= 2P:
#   P=1: 16 + dualpipev at M = 2, 4, 7                                  = 19
#   P=2: 16 + dualpipe at M = 4, 6 + dualpipev at M = 4, 6, 7           = 21
#   P=3: 16 + dualpipev at M = 6, 8, 7                                  = 19
#   P=4: 16 + dualpipe at M = 8, 10 + dualpipev at M = 8, 10            = 20
RUNS_PER_P = {1: 19, 2: 21, 3: 19, 4: 20}


def candidate_m(p):
    return [0, p, 2 * p + 2, 7]


def allowed_m(schedule, p):
    out = []
    for m in candidate_m(p):
        real = m or 2 * p
        if schedule == "dualpipe" and not (p % 2 == 0 and real % 2 == 0 and real >= 2 * p):
            continue
        if schedule == "dualpipev" and real < 2 * p:
            continue
        out.append(m)
    return out


# the table above, counted: the sweep below runs exactly these many runs per world size
assert {p: sum(len(allowed_m(s, p)) for s in SCHEDULES) for p in RUNS_PER_P} == RUNS_PER_P


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("np", [1, 2, 3, 4], ids=lambda p: f"P{p}")
def test_every_allowed_micro_batch_count_runs_and_equals_one_process(lesson, np, schedule):
    # The program's own --print-schedule says which M it allows (a usage error otherwise): it must
    # allow exactly the table's, so that a schedule skipped by mistake, or run where it should not,
    # fails. Each allowed M then runs on P ranks; loss and gradients == one process.
    want = allowed_m(schedule, np)
    allowed = [m for m in candidate_m(np)
               if lesson(L07, 1, "--print-schedule", "--schedule", schedule, "--stages", np, "--microbatches", m).rc == 0]
    assert allowed == want, f"{schedule} at P={np} allows M in {allowed}, want {want} (0: the default 2P)"
    for m in allowed:
        lesson(L07, np, "--schedule", schedule, "--microbatches", m, "--compute", "real").ok()


def test_default_demo_dualpipe_p4_m8_timed_by_compute_sleep(lesson):
    lesson(L07, 4).ok()


def test_dualpipe_and_dualpipev_with_several_blocks_per_stage_width_17_three_rows(lesson):
    lesson(L07, 4, "--schedule", "dualpipe", "--layers", 16, "--dim", 17, "--rows", 3, "--compute", "real").ok()
    lesson(L07, 4, "--schedule", "dualpipev", "--layers", 32, "--dim", 17, "--rows", 3, "--compute", "real").ok()


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "dualpipev"])
def test_planted_bug_a_skipped_deferred_w_fails_the_check(lesson, schedule):
    lesson(L07, 4, "--schedule", schedule, "--compute", "real", "--bug", "drop-w").fails().has(r"d w[12] .*FAIL")


def test_planted_bug_dualpipes_two_copies_not_summed_fails_the_check(lesson):
    lesson(L07, 4, "--schedule", "dualpipe", "--compute", "real", "--bug", "no-copy-sum").fails().has(r"first stage .*FAIL")


def test_print_schedule_1f1b_is_warm_up_one_forward_one_backward_cool_down(lesson):
    run = lesson(L07, 1, "--print-schedule", "--schedule", "1f1b", "--stages", 2, "--microbatches", 3, separate=True)
    assert run.rc == 0, run.why("exit 0")
    # stdout alone, line for line
    assert run.stdout.rstrip("\n").split("\n") == ["rank 0: F0(0) F0(1) B0(0) F0(2) B0(1) B0(2)",
                                                   "rank 1: F0(0) B0(0) F0(1) B0(1) F0(2) B0(2)"], \
        run.why("1F1B's program for P=2, M=3")


def test_print_schedule_without_the_ranks_dualpipe_p8_m20_from_one_process(lesson):
    run = lesson(L07, 1, "--print-schedule", "--schedule", "dualpipe", "--stages", 8, "--microbatches", 20, separate=True)
    assert run.rc == 0, run.why("exit 0")
    op = re.compile(r"^rank [0-7]:( [FBIW][01]\([0-9]+\)(&B[01]\([0-9]+\))?)+$")
    lines = run.stdout.rstrip("\n").split("\n")
    bad = [x for x in lines if not op.match(x)]
    assert not bad and len(lines) == 8, run.why(f"8 lines 'rank R: op ...' on stdout; these are not: {bad[:3]}")


def test_simulate_the_bubble_equals_table_2s_formula_on_every_row(lesson):
    # 6 rows (P = 4, 8 x M = 2P, 20, 64) per schedule. ZB-H2's formula (Qi et al.) counts iterations
    # run back to back; one iteration on its own adds the slant, (P-1)F = P-1 here.
    run = lesson(L07, 1, "--simulate", separate=True)
    assert run.rc == 0, run.why("exit 0")
    # the table's rows: nine or more fields, the seventh the formula "(P..."
    rows = [x.split() for x in run.stdout.splitlines()]
    rows = [r for r in rows if len(r) >= 9 and r[6].startswith("(P")]
    zb = [r for r in rows if r[0] == "zb-h2"]
    others = [r for r in rows if r[0] != "zb-h2"]
    assert len(others) == 30 and len(zb) == 6, run.why(f"30 rows and 6 zb-h2 rows, got {len(others)} and {len(zb)}")
    wrong = [r for r in others if float(r[4]) != float(r[5])]
    wrong += [r for r in zb if float(r[4]) != float(r[5]) + float(r[1]) - 1]
    assert not wrong, run.why(f"rows whose simulated bubble differs from the formula: {wrong}")


def test_dump_numpy_recomputes_the_loss_and_every_layers_gradient(lesson, script, tmp_path):
    lesson(L07, 4, "--compute", "real", "--dump", tmp_path / "d07").ok()
    script("tests/check_dump_07.py", tmp_path / "d07").succeeds("^dump ok")


def test_dump_check_fails_on_dualpipes_unsummed_copies(lesson, script, tmp_path):
    lesson(L07, 4, "--compute", "real", "--bug", "no-copy-sum", "--dump", tmp_path / "d07b")
    run = script("tests/check_dump_07.py", tmp_path / "d07b")
    assert run.rc == 1, run.why("the dump checker exits 1 on the unsummed copies")
    run.has("MISMATCH")


def test_trace_and_csv_one_track_per_rank_op_spans_from_every_rank(lesson, script, tmp_path):
    trace, csv = tmp_path / "t07.json", tmp_path / "t07.csv"
    lesson(L07, 4, "--schedule", "zb-h1", "--unit-ms", 1, "--trace", trace, "--csv", csv).ok()
    script("scripts/check-trace.py", trace, csv, 4).succeeds("^trace ok")


def test_help_lists_every_flag_with_its_default(lesson):
    lesson(L07, 1, "--help").succeeds(r"--schedule .*\(default: dualpipe\)")


@pytest.mark.parametrize("np, args", [
    (3, ["--schedule", "dualpipe"]),                       # an odd number of ranks
    (4, ["--schedule", "dualpipe", "--microbatches", 9]),  # M odd
    (4, ["--schedule", "dualpipev", "--microbatches", 7]), # M < 2P
    (2, ["--schedule", "1f1b", "--stages", 4]),            # --stages not the world size when executing
    (3, ["--schedule", "1f1b", "--layers", 4]),            # --layers not a multiple of the stages
    (2, ["--cost", "F=1,X=2"]),                            # an unknown key
    (2, ["--cost", "B=1,W=2"]),                            # W larger than B
    (2, ["--schedule", "1F1B"]),
], ids=["dualpipe-odd-ranks", "dualpipe-m-odd", "dualpipev-m-under-2p", "stages-not-world", "layers-not-multiple",
        "cost-unknown-key", "cost-w-over-b", "schedule-typo"])
def test_bad_input(lesson, np, args):
    lesson(L07, np, *args).usage_error()


def test_device_sim_runs_the_blocks_kernels_under_the_emulator(lesson):
    lesson(L07, 2, "--device", "sim", "--compute", "real").ok()


def test_device_cuda(lesson, has_cuda):
    if not has_cuda:
        pytest.skip("no GPU here")
    lesson(L07, 2, "--device", "cuda", "--schedule", "zb-h1", "--compute", "real").ok()
