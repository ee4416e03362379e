"""Lesson 05, DeepSeek-V3's MoE over expert parallelism: every world size (odd too) with both
all-to-alls (hierarchical and flat), the gates, groups, shared experts and capacity PASS; the two
all-to-alls agree (routing bytes identical, numbers within tolerance); training equals one process;
planted bugs FAIL or are named; the link model's bytes equal the routing map's; bad input is one
`error:` line with exit 2."""
import re

import pytest

L05 = "05_deepseek_moe"
A2AS = ["hierarchical", "flat"]
# a row of the capacity table: expert, capacity, demand, overflow, dropped, moved out, moved in, load
TABLE_ROW = re.compile(r"^ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+$", re.M)



@pytest.mark.parametrize("np", [1, 2, 4, 8])
def test_both_all_to_alls_pass(lesson, np):
    for a2a in A2AS:  # sigmoid gate, groups, shared expert
        lesson(L05, np, "--a2a", a2a).ok()


def test_odd_p_3_with_one_rank_per_node(lesson):
    for a2a in A2AS:  # N=12
        lesson(L05, 3, "--ranks-per-node", 1, "--experts", 12, "--a2a", a2a).ok()


def test_softmax_gate_no_groups_no_shared_expert_two_shared(lesson):
    lesson(L05, 4, "--gate", "softmax").ok()
    lesson(L05, 4, "--groups", 1, "--topk-groups", 1).ok()
    lesson(L05, 4, "--shared", 0, "--topk", 1, "--gate", "softmax").ok()
    lesson(L05, 4, "--shared", 2, "--route-scale", 1).ok()


def test_capacity_drop_and_next_best(lesson):
    for overflow in ["drop", "next-best"]:  # P=8, C=0.6
        for a2a in A2AS:
            lesson(L05, 8, "--capacity-factor", 0.6, "--overflow", overflow, "--a2a", a2a).ok()


def test_capacity_table_overflow_dropped_or_moved(lesson):
    # capacity 0.8 (overflow drop): some expert overflows and drops (its overflow and dropped columns non-zero)
    run = lesson(L05, 4, "--capacity-factor", 0.8, separate=True).ok()
    run.stdout_has(r"^ +[0-9]+ +[0-9]+ +[0-9]+ +[1-9][0-9]* +[1-9]")
    # capacity 1.2 with next-best: tokens moved, none dropped
    run = lesson(L05, 4, "--capacity-factor", 1.2, "--overflow", "next-best", separate=True).ok()
    rows = [list(map(int, m.group(0).split())) for m in TABLE_ROW.finditer(run.stdout)]
    assert rows, run.why("the capacity table")
    assert sum(r[5] for r in rows) > 0, run.why("tokens moved to their next-best expert")
    assert sum(r[4] for r in rows) == 0, run.why("nothing dropped while room is left")


def test_flat_and_hierarchical_dumps_agree(lesson, script, tmp_path):
    for a2a in ["flat", "hierarchical"]:  # P=8
        lesson(L05, 8, "--capacity-factor", 0.8, "--overflow", "next-best", "--a2a", a2a, "--dump", tmp_path / a2a).ok()
    for f in ["x", "dy", "topk_idx", "kept", "gates", "router_w", "bias", "experts_w1", "experts_w2", "experts_w3",
              "shared_w1", "shared_w2", "shared_w3"]:
        flat, hier = tmp_path / "flat" / f"{f}.npy", tmp_path / "hierarchical" / f"{f}.npy"
        assert flat.is_file() and hier.is_file(), f"{f}.npy dumped by both all-to-alls"
        assert flat.read_bytes() == hier.read_bytes(), f"{f}.npy: the routing and expert rows byte-identical"
    script("tests/check_dump_05.py", tmp_path / "flat", tmp_path / "hierarchical").succeeds("^dumps ok")


def test_aux_count_selected_counts_the_layers_selection(lesson, script, tmp_path):
    d = tmp_path / "d05sel"
    lesson(L05, 4, "--aux-count", "selected", "--dump", d).ok()
    run = script("tests/check_dump_05.py", d)
    assert run.rc == 0, run.why("numpy recomputes the dump")
    # every `balance loss` line on stdout, without and with --aux-count selected: some, and not the same
    lines = []
    for args in ([], ["--aux-count", "selected"]):
        run = lesson(L05, 4, *args, separate=True).ok()
        lines.append([x for x in run.stdout.splitlines() if "balance loss" in x])
        assert lines[-1], run.why("a `balance loss` line on stdout")
    assert lines[0] != lines[1], f"the selected count differs from the report's: {lines[0]!r}"


def test_train_on_8_ranks_equals_one_process(lesson):
    run = lesson(L05, 8, "--train", 20, "--log-every", 5, separate=True).ok()
    run.stdout_has(r"the bias is the same on every rank  *PASS")


def test_train_balance_aux_and_none_equal_one_process(lesson):
    lesson(L05, 4, "--train", 20, "--balance", "aux", "--a2a", "flat").ok()
    lesson(L05, 4, "--train", 20, "--balance", "none").ok()


def test_train_planted_bias_update_bugs_run_and_are_named(lesson):
    for bug in ["ema-zero-init", "bias-peek"]:
        run = lesson(L05, 2, "--train", 20, "--bug", bug, separate=True)
        assert run.rc == 0, run.why("a training bug runs to the end")
        run.stdout_has(f"planted: {bug}")


def test_train_balance_bias_is_deepseek_v3s(lesson):
    # the default: the bias and the sequence-wise loss (alpha 0.0001, its step-0 value in the log);
    # --seq-alpha 0: the bias alone (the loss 0); each equals one process (one `check: PASS` each)
    a = lesson(L05, 4, "--train", 3, "--log-every", 1, separate=True).ok()
    assert "balance bias + sequence-wise loss (alpha 0.0001)" in a.stdout, a.why("the balance named on stdout")
    a.stdout_has(r"^ +0 +[0-9.]+ +0\.000[1-9]")
    b = lesson(L05, 4, "--train", 3, "--log-every", 1, "--seq-alpha", 0, separate=True).ok()
    b.stdout_has(r"^ +0 +[0-9.]+ +0\.00000 ")
    for run in (a, b):
        assert len(re.findall(r"^check: PASS", run.stdout, re.M)) == 1, run.why("exactly one `check: PASS` line")


@pytest.mark.parametrize("bug", ["bias-grad", "no-renorm", "no-shared-grad"])
def test_planted_bug_fails_the_check(lesson, bug):
    lesson(L05, 4, "--bug", bug).fails()


def test_help_lists_every_flag_with_its_default(lesson):
    lesson(L05, 1, "--help").succeeds(r"--ranks-per-node N .*\(default: 2\)")


def test_trace_spans_nest_on_every_track(lesson, script, tmp_path):
    trace = tmp_path / "t05.json"
    lesson(L05, 4, "--trace", trace).ok()
    script("scripts/check-trace.py", trace, "-", 4).succeeds("^trace ok: 4 ranks")


def test_link_bytes_equal_the_routing_maps_both_timed_under_the_model(lesson):
    lesson(L05, 8, "--link", "intra=2GB/s,inter=500MB/s,latency=5us", "--reps", 2).ok().has(
        r"hierarchical / flat = [0-9.]+ \(modelled")


@pytest.mark.parametrize("np, args", [
    (2, ["--train", "5", "--balance", "aux", "--seq-alpha", "0.01"]),   # --seq-alpha without --balance bias
    (2, ["--seq-alpha", "0.01"]),                                       # --seq-alpha without --train
    (2, ["--aux-count", "selected", "--alpha", "0"]),                   # --aux-count with no balance loss
    (2, ["--train", "5", "--data", "/nonexistent/text.txt"]),           # --data that cannot be read
    (2, ["--train", "5", "--bug", "no-renorm"]),                        # a backward bug with --train
    (4, ["--experts", "6"]),                                            # N not a multiple of P
    (4, ["--experts", "8", "--topk", "5", "--topk-groups", "1"]),       # K more than M groups' experts
    (4, ["--topk-groups", "3"]),                                        # M more than G
    (4, ["--experts", "8", "--groups", "3"]),                           # G not dividing N
    (4, ["--ranks-per-node", "3"]),                                     # R not dividing P
    (2, ["--capacity-factor", "0"]),
    (2, ["--capacity-factor", "-1"]),
    (2, ["--a2a", "ring"]),                                             # a typo
    (2, ["--link", "inter=fast"]),                                      # malformed --link
    (2, ["--link", "intra=1GB/s,wan=1"]),                               # --link with an unknown key
    (2, ["--bug", "ema-zero-init"]),                                    # a training bug without --train
], ids=["seq-alpha-without-bias", "seq-alpha-without-train", "aux-count-without-loss", "data-unreadable",
        "backward-bug-with-train", "n-not-multiple-of-p", "k-over-m-groups", "m-over-g", "g-not-dividing-n",
        "r-not-dividing-p", "capacity-0", "capacity-negative", "a2a-typo", "link-malformed", "link-unknown-key",
        "training-bug-without-train"])
def test_bad_input(lesson, np, args):
    lesson(L05, np, *args, timeout=60).usage_error()


def test_device_sim_runs_the_layers_kernels_under_the_emulator(lesson):
    lesson(L05, 2, "--device", "sim", "--capacity-factor", 0.8, "--overflow", "next-best", "--batch", 1).ok()


def test_device_cuda(lesson, has_cuda):
    if not has_cuda:
        pytest.skip("no GPU here")
    lesson(L05, 2, "--device", "cuda").ok()
