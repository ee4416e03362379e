"""Lesson 03, sparse MoE on one process: both gates, the loop and the grouped forms equal, the
hand-written backward equal to autograd at every k and shape (starved experts: exactly zero
gradient); each planted bug FAILs the gradient it breaks; dumps and traces are checked by
independent code; bad input is one `error:` line with exit 2."""
import pytest

L03 = "03_smoe"
GATES = ["softmax-topk", "topk-softmax"]


@pytest.mark.parametrize("gate", GATES)
def test_default_demo_loop_equals_grouped_backward_equals_autograd(lesson, gate):
    lesson(L03, 1, "--gate", gate).ok()


@pytest.mark.parametrize("gate", GATES)
def test_k_1_k_n_one_expert_odd_sizes(lesson, gate):
    lesson(L03, 1, "--gate", gate, "--topk", 1).ok()
    lesson(L03, 1, "--gate", gate, "--topk", 8, "--alpha", 1).ok()
    lesson(L03, 1, "--gate", gate, "--experts", 1, "--topk", 1).ok()
    lesson(L03, 1, "--gate", gate, "--batch", 3, "--tokens", 7, "--dim", 5, "--ffn", 3, "--experts", 5, "--topk", 3).ok()


@pytest.mark.parametrize("gate", GATES)
def test_starved_experts_get_no_tokens_and_exactly_zero_gradient(lesson, gate):
    lesson(L03, 1, "--gate", gate, "--starve", 3, "--alpha", 1).ok().has(r"dW exactly 0 +PASS")


@pytest.mark.parametrize("args, broken", [
    (["--bug", "gate-twice"], "d experts_w2"),                          # the gate weight applied twice
    (["--bug", "silu-no-upstream"], "d experts_w1"),                    # SiLU' without the upstream gradient
    (["--bug", "no-router-path", "--gate", "topk-softmax"], "dx"),      # the router's path missing from dx
], ids=["gate-twice", "silu-no-upstream", "no-router-path"])
def test_planted_bug_fails_what_it_breaks(lesson, args, broken):
    lesson(L03, 1, *args).fails().has(rf"{broken} .*FAIL")


def test_trace_spans_nest_the_check_on_its_own_track(lesson, script, tmp_path):
    trace = tmp_path / "t03.json"
    lesson(L03, 1, "--trace", trace).ok()
    script("scripts/check-trace.py", trace, "-", 1).succeeds("^trace ok: 1 ranks")


def test_dump_numpy_recomputes_the_layer_and_its_gradients(lesson, script, tmp_path):
    d = tmp_path / "d03"
    lesson(L03, 1, "--gate", "topk-softmax", "--starve", 2, "--alpha", 0.5, "--dump", d).ok()
    script("tests/check_dump_03.py", d).succeeds("^dump ok")


def test_help_lists_every_flag_with_its_default(lesson):
    lesson(L03, 1, "--help").succeeds(r"--gate .*\(default: softmax-topk\)")


@pytest.mark.parametrize("np, args", [
    (2, []),                                                  # more than one rank
    (1, ["--experts", "4", "--topk", "5"]),                   # --topk larger than --experts
    (1, ["--experts", "4", "--topk", "2", "--starve", "3"]),  # --starve leaves fewer than k experts
    (1, ["--gate", "softmax"]),                               # a typo
], ids=["two-ranks", "topk-over-experts", "starve-below-k", "gate-typo"])
def test_bad_input(lesson, np, args):
    lesson(L03, np, *args, timeout=60).usage_error()


def test_device_sim_runs_the_moe_kernels_under_the_emulator(lesson):
    lesson(L03, 1, "--device", "sim").ok()
    lesson(L03, 1, "--device", "sim", "--gate", "topk-softmax", "--starve", 2, "--tokens", 9).ok()


def test_device_cuda(lesson, has_cuda):
    if not has_cuda:
        pytest.skip("no GPU here")
    lesson(L03, 1, "--device", "cuda").ok()
