"""Lesson 02, ring attention: every world size x mask x order x layout PASSes, uneven blocks and odd
shapes too; zigzag and striped balance the causal work; the naive send order deadlocks and the
watchdog names it; each planted bug FAILs the gradient it breaks; dumps and traces are checked by
independent code; bad input is one `error:` line with exit 2."""

import pytest

L02 = "02_ring_attention"
LAYOUTS = ["contiguous", "zigzag", "striped"]


@pytest.mark.parametrize("np", [1, 2, 3, 4])
@pytest.mark.parametrize("order", ["evenodd", "async"])
@pytest.mark.parametrize("mask", ["causal", "non-causal"])
def test_every_layout_passes(lesson, np, order, mask):
    causal = ["--causal"] if mask == "causal" else []
    for layout in LAYOUTS:
        lesson(L02, np, "--order", order, *causal, "--layout", layout).ok()


def test_s_not_divisible_by_p_or_2p_uneven_blocks(lesson):
    for layout in LAYOUTS:  # P=3, S=50, causal
        lesson(L02, 3, "--causal", "--seq", 50, "--dim", 8, "--layout", layout, "--order", "async").ok()


def test_batch_heads_odd_head_dim_s_equal_2p(lesson):
    lesson(L02, 4, "--causal", "--batch", 2, "--heads", 3, "--seq", 8, "--dim", 5, "--layout", "zigzag").ok()


def test_balance_zigzag_and_striped_within_5_percent_contiguous_not(lesson):
    # the balance table on stdout: the layout run is starred, every layout's max/mean of the causal work
    run = lesson(L02, 4, "--causal", "--seq", 256, "--layout", "zigzag", separate=True).ok()
    run.stdout_has(r"^ *\* zigzag .* max/mean 1\.0[0-5]")
    run.stdout_has(r"^ +striped .* max/mean 1\.0[0-5]")
    run.stdout_has(r"^ +contiguous .* max/mean 1\.[3-9]")


def test_order_naive_deadlocks_and_the_watchdog_names_it(lesson):
    run = lesson(L02, 3, "--order", "naive", "--timeout", 2, timeout=20)
    assert run.rc == 1, run.why("the watchdog ends the deadlock with exit 1")
    run.has(r"error: rank [0-9]: no progress for 2 s in ssend with peer [0-9] \(tag 0, [0-9]+ bytes\) — likely deadlock")


def test_order_naive_on_one_rank_has_nothing_to_send(lesson):
    lesson(L02, 1, "--order", "naive", "--causal").ok()


@pytest.mark.parametrize("np, args, broken", [
    (3, ["--causal", "--bug", "dkv-local", "--seq", 48], "dK"),  # dK/dV accumulated where computed, not travelling
    (2, ["--bug", "no-delta"], "dQ"),                             # delta dropped from dS = P (dP - delta)
    (2, ["--causal", "--bug", "lse-no-log"], "dV"),               # P recomputed from m instead of lse
    (4, ["--causal", "--mask", "local"], "o   ="),                # the causal mask from local indices
], ids=["dkv-local", "no-delta", "lse-no-log", "mask-local"])
def test_planted_bug_fails_what_it_breaks(lesson, np, args, broken):
    lesson(L02, np, *args).fails().has(rf"{broken} .*FAIL")


def test_dump_numpy_recomputes_forward_and_backward(lesson, script, tmp_path):
    d = tmp_path / "d02"
    lesson(L02, 3, "--causal", "--layout", "zigzag", "--seq", 30, "--dump", d).ok()
    script("tests/check_dump_02.py", d, 3).succeeds("^dump ok")


@pytest.mark.parametrize("np, order, want", [
    (4, ["--order", "async"], r"^trace ok: 4 ranks, [0-9]+ spans, [1-9][0-9]* flights"),  # messages in flight
    (3, [], r"^trace ok: 3 ranks"),                                                        # the default, evenodd
], ids=["async", "evenodd"])
def test_trace_one_track_per_rank_spans_nest(lesson, script, tmp_path, np, order, want):
    trace = tmp_path / "t02.json"
    lesson(L02, np, *order, "--causal", "--trace", trace).ok()
    script("scripts/check-trace.py", trace, "-", np).succeeds(want)


def test_help_lists_every_flag_with_its_default(lesson):
    lesson(L02, 2, "--help").succeeds(r"--layout .*\(default: contiguous\)")


@pytest.mark.parametrize("np, args", [
    (4, ["--seq", "3"]),                               # shorter than P
    (4, ["--layout", "zigzag", "--seq", "7"]),         # zigzag needs 2P tokens
    (2, ["--order", "ring"]),                          # a typo
    (3, ["--bug", "dkv-local", "--seq", "50"]),        # dkv-local with unequal blocks
    (2, ["--device", "sim", "--dim", "200"]),          # over the kernels' 128 on sim
], ids=["seq-shorter-than-p", "zigzag-needs-2p", "order-typo", "dkv-local-unequal-blocks", "sim-dim-over-128"])
def test_bad_input(lesson, np, args):
    lesson(L02, np, *args, timeout=60).usage_error()


@pytest.mark.parametrize("np", [2, 3])
def test_device_sim_runs_attention_cu_under_the_emulator(lesson, np):
    lesson(L02, np, "--device", "sim", "--causal", "--layout", "zigzag", "--order", "async", "--seq", 40).ok()


def test_device_cuda(lesson, has_cuda):
    if not has_cuda:
        pytest.skip("no GPU here")
    lesson(L02, 2, "--device", "cuda", "--causal", "--layout", "striped").ok()
