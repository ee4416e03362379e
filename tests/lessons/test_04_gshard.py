"""Lesson 04, GShard expert parallelism: at every world size the three all-to-alls (ordered by hand,
async by hand, MPI_Alltoallv) PASS with exact dispatch and combine and the gradients of one
process; zero-size messages, k = N and synchronous sends too; the three give the same bits; traces
and dumps are checked by independent code; bad input is one `error:` line with exit 2."""
import pytest

L04 = "04_gshard"
A2AS = ["ordered", "async", "library"]


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_every_all_to_all_passes(lesson, np):
    for a2a in A2AS:  # N = 12
        lesson(L04, np, "--experts", 12, "--a2a", a2a).ok()


def test_starved_experts_zero_size_messages_both_gates(lesson):
    for a2a in A2AS:  # P=3, N=6, 3 starved
        for gate in ["softmax-topk", "topk-softmax"]:
            lesson(L04, 3, "--experts", 6, "--starve", 3, "--gate", gate, "--a2a", a2a).ok()


def test_k_equal_n_every_token_to_every_rank(lesson):
    lesson(L04, 4, "--experts", 4, "--topk", 4, "--alpha", 1).ok()


def test_ordered_with_synchronous_sends_odd_sizes(lesson):
    lesson(L04, 3, "--a2a", "ordered", "--experts", 3, "--topk", 1, "--tokens", 7, "--dim", 5).ok()
    lesson(L04, 4, "--a2a", "ordered", "--experts", 8, "--batch", 3, "--tokens", 5).ok()


def test_the_three_all_to_alls_give_the_same_bits(lesson, tmp_path):
    for a2a in A2AS:  # P=3
        lesson(L04, 3, "--experts", 6, "--starve", 2, "--a2a", a2a, "--dump", tmp_path / a2a).ok()
    for f in ["y", "dx", "aux_loss", "d_router_w", "d_router_b", "d_experts_w1", "d_experts_w2", "d_experts_w3",
              "topk_idx"]:
        files = {a2a: tmp_path / a2a / f"{f}.npy" for a2a in A2AS}
        missing = [str(x) for x in files.values() if not x.is_file()]
        assert not missing, f"dumped by every all-to-all: {missing}"
        want = files["ordered"].read_bytes()
        for a2a in ["async", "library"]:
            assert files[a2a].read_bytes() == want, f"{f}.npy: {a2a} differs from ordered"


def test_trace_the_all_to_alls_spans_nest(lesson, script, tmp_path):
    trace = tmp_path / "t04.json"
    lesson(L04, 4, "--a2a", "async", "--trace", trace).ok()
    script("scripts/check-trace.py", trace, "-", 4).succeeds(r"^trace ok: 4 ranks, [0-9]+ spans, [1-9][0-9]* flights")


def test_dump_numpy_recomputes_the_layer_on_all_ranks_tokens(lesson, script, tmp_path):
    d = tmp_path / "d04"
    lesson(L04, 3, "--experts", 6, "--starve", 2, "--a2a", "async", "--dump", d).ok()
    script("tests/check_dump_03.py", d).succeeds("^dump ok")  # lesson 03's check


def test_bench_times_the_three_as_ratios_to_mpi_alltoallv(lesson):
    lesson(L04, 3, "--bench", "--reps", 2).succeeds("ordered/lib")


@pytest.mark.parametrize("np, args", [
    (4, ["--experts", "6"]),                  # N not a multiple of P
    (2, ["--a2a", "ring"]),                   # a typo
    (2, ["--experts", "4", "--topk", "6"]),   # --topk larger than --experts
], ids=["n-not-multiple-of-p", "a2a-typo", "topk-over-experts"])
def test_bad_input(lesson, np, args):
    lesson(L04, np, *args, timeout=60).usage_error()


def test_device_sim_runs_the_moe_kernels_under_the_emulator(lesson):
    lesson(L04, 2, "--device", "sim", "--starve", 1, "--a2a", "async").ok()


def test_device_cuda(lesson, has_cuda):
    if not has_cuda:
        pytest.skip("no GPU here")
    lesson(L04, 2, "--device", "cuda").ok()
