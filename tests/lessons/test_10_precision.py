"""Lesson 10, precision: bf16 rounding, the bf16 matmul and DeepSeek-V3's FP8 GEMM checked against every
device's kernels and float64, on 1 to 3 ranks (the sweep's table the same on any); the emulated CUDA
kernels; mixed-precision training on 1 to 4 ranks at ZeRO-0, -1 and -2 against one process, its memory
per parameter computed here from the parameter counts, the bytes a bf16 gradient sum saves; each
planted bug FAILs the check that names it; the CSV the figures read; bad input is one `error:` line
with exit 2."""
import csv
import math
import os
import re

import pytest

L10 = "10_precision"
ROW = re.compile(r"^  (\d+) +(\S+) +(\S+) +(\S+) +([\d.]+)x +(\S+) +\| +(\S+) +(\S+)$", re.M)


def table(run):
    """The FP8 sweep's rows: K -> (recipe, /bound, never, fp32, per tile, per tensor)."""
    rows = {int(m[0]): tuple(float(v) for v in (m[1], m[2], m[3], m[5], m[6], m[7])) for m in ROW.findall(run.out)}
    assert rows, run.why("the FP8 table")
    return rows


@pytest.mark.parametrize("np_", [1, 2, 3], ids=["P1", "P2", "P3"])
def test_every_check_passes_and_the_table_is_the_same_on_any_number_of_ranks(lesson, np_):
    run = lesson(L10, np_, "--batch", 6 if np_ == 3 else 8).ok()
    run.has(r"bf16: cpu's conversion = round_to_bf16, bit for bit   PASS")
    run.has(r"FP8: cpu's quantization and GEMM = formats.cpp's loops, bit for bit   PASS")
    run.has(r"training: AdamW \(float32 masters\) = one process's on the same mean gradients, bit for bit   PASS")
    one = table(lesson(L10, 1, "--part", "formats").ok()) if np_ != 1 else None
    rows = table(run)
    assert sorted(rows) == [128, 256, 512, 1024, 2048, 4096], run.why("K from 128 to 4096")
    if one is not None:
        assert rows == one, run.why("the same table as one rank's")


def test_the_claims_the_recipe_flat_in_k_never_promoted_growing(lesson):
    rows = table(lesson(L10, 2, "--part", "formats", "--k-max", 8192).ok())
    ks = sorted(rows)
    recipe = [rows[k][0] for k in ks]
    never = [rows[k][2] for k in ks]
    fp32 = [rows[k][3] for k in ks]
    assert max(recipe) < 2 * min(recipe), f"the promoted GEMM's error flat in K: {recipe}"
    # the narrow accumulator's error about doubles with each doubling of K
    assert all(b > 1.5 * a for a, b in zip(never[2:], never[3:])), f"never promoted grows with K: {never}"
    assert max(fp32) < min(recipe) / 100, f"a float32 accumulator's error is far below 14 bits': {fp32} {recipe}"
    assert all(rows[k][1] <= 1 for k in ks), "every K within the bound"


def test_device_sim_runs_the_cuda_kernels_through_the_emulator_bit_for_bit(lesson):
    # (training under the emulator: the smallest batch, 2 steps)
    run = lesson(L10, 2, "--device", "sim", "--k-max", 1024, "--bf16-k", 256, "--train", 2, "--seq", 8, "--batch", 2).ok()
    run.has(r"bf16: sim's conversion = round_to_bf16, bit for bit   PASS")
    run.has(r"FP8: sim's quantization and GEMM = formats.cpp's loops, bit for bit   PASS")
    run.has(r"training: AdamW \(float32 masters\) = one process's on the same mean gradients, bit for bit   PASS")


def test_tiles_promotion_and_accumulator_as_flags(lesson):
    run = lesson(L10, 3, "--part", "formats", "--tile", 64, "--promote", 32, "--k-max", 1000, "--acc-bits", 12).ok()
    assert sorted(table(run)) == [64, 128, 256, 512], run.why("K from the tile, doubling up to --k-max")
    run.has(r"FP8 GEMM at K = 512: never promoted .*PASS")
    # a float32-wide accumulator: nothing for promotion to fix; said, not checked
    wide = lesson(L10, 1, "--part", "formats", "--acc-bits", 23, "--k-max", 1024).ok()
    wide.has(r"note: --acc-bits 23: never promoted")


@pytest.mark.parametrize("bug, failing", [
    ("bf16-truncate", [r"bf16: cpu's conversion = round_to_bf16, bit for bit   FAIL",
                       r"within half a bf16 step \(2\^-8 relative\)   FAIL"]),
    ("no-promotion", [r"never promoted .* \(at least 10x\)   FAIL",
                      r"outlier channels: per-tile scales .* \(per tile the closer\)   FAIL"]),
    ("per-tensor", [r"outlier channels: per-tile scales (\S+), per tensor \1 .*FAIL"]),
    ("fp8-dgrad-untransposed", [r"FP8 linear layer: Fprop, Dgrad and Wgrad = formats.cpp's recipe .*   FAIL",
                                r"FP8 linear layer: each GEMM within its bound .*   FAIL"]),
])
def test_planted_bug_fails_the_check_that_names_it(lesson, bug, failing):
    run = lesson(L10, 2, "--part", "formats", "--bug", bug).fails()
    for pattern in failing:
        run.has(pattern)
    fails = re.findall(r"   FAIL$", run.out, re.M)
    assert len(fails) == len(failing), run.why(f"only the {len(failing)} checks the bug breaks fail")


def test_fp8_linear_layer_its_three_gemms_about_fp8s_error_bf16s_ten_times_less(lesson):
    run = lesson(L10, 1, "--part", "formats", "--k-max", 512).ok()
    rows = re.findall(r"^    (Fprop|Dgrad|Wgrad) .* (\S+) against float64 \(bf16: (\S+)\), (\S+) of its bound$", run.out, re.M)
    assert [r[0] for r in rows] == ["Fprop", "Dgrad", "Wgrad"], run.why("the layer's three GEMMs")
    for name, fp8, bf16, ratio in rows:
        # e4m3's 3 mantissa bits: each value within 2^-4, a sum of many about 2^-4 / sqrt(3) of its size
        assert 0.01 < float(fp8) < 0.06, (name, fp8)
        assert float(bf16) < float(fp8) / 10, (name, bf16, fp8)
        assert 0 < float(ratio) <= 1, (name, ratio)
    # a smaller tile and promotion (a model narrower than 128 needs it): the layer still checks
    lesson(L10, 2, "--part", "formats", "--tile", 32, "--promote", 16, "--k-max", 256).ok().has(
        r"x \(64, 64\), W \(64, 64\)")


def test_dp_3_float32_checks_the_whole_batch_in_one_piece(lesson):
    run = lesson(L10, 3, "--part", "train", "--precision", "fp32", "--batch", 6, "--train", 4).ok()
    run.has(r"training: mean gradients = one process's on the whole batch, max\|diff\| <= 4 n eps max\|want\|")


def test_csv_holds_the_table_and_the_training_for_the_figures(lesson, tmp_path):
    path = tmp_path / "10.csv"
    run = lesson(L10, 2, "--k-max", 1024, "--train", 6, "--check-every", 2, "--csv", str(path)).ok()
    rows = list(csv.DictReader(open(path)))
    fp8 = [r for r in rows if r["kind"] == "fp8"]
    printed = table(run)
    assert [int(r["k"]) for r in fp8] == sorted(printed)
    for r in fp8:
        want = printed[int(r["k"])]
        for key, shown in zip(["recipe", "recipe_ratio", "never", "fp32_acc", "fine", "per_tensor"], want):
            assert math.isclose(float(r[key]), shown, rel_tol=6e-3), f"{key} at K {r['k']}: {r[key]} vs {shown}"
        assert (int(r["promote"]), int(r["acc_bits"]), int(r["m"]), int(r["n"])) == (128, 14, 8, 128)
    train = [r for r in rows if r["kind"] == "train"]
    assert [int(r["step"]) for r in train] == list(range(6))
    steps = {int(m[0]): float(m[1]) for m in re.findall(r"^  (\d+) +(\d+\.\d+) ", run.out, re.M)}
    for r in train:
        assert (r["precision"], r["zero"], r["grad_reduce"], r["dp"], float(r["lr"]), r["moments"]) == \
            ("bf16", "1", "fp32", "2", 3e-3, "fp32")
        assert math.isnan(float(r["loss_ref"])) == (int(r["step"]) % 2 == 1 and int(r["step"]) != 5)
        if int(r["step"]) in steps:
            assert math.isclose(float(r["loss"]), steps[int(r["step"])], abs_tol=1e-6)


# ---- [4] mixed-precision training


def counts(run):
    """The parameters: (bf16 ones, float32 ones) as the run prints them."""
    m = re.search(r"\((\d+) parameters: (\d+) bf16 in its matmuls, (\d+) float32", run.out)
    if m:
        assert int(m[1]) == int(m[2]) + int(m[3])
        return int(m[2]), int(m[3])
    m = re.search(r"\((\d+) parameters, all float32\)", run.out)
    assert m, run.why("the parameter counts")
    return 0, int(m[1])


def per_parameter(run):
    m = re.search(r"^    total +\S+ KiB +\S+ KiB +(\S+) B   seed 001, all (\S+): (\S+) B$", run.out, re.M)
    assert m, run.why("the memory's total line")
    return float(m[1]), float(m[3])


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("precision", ["bf16", "fp32", "fp8"])
def test_training_equals_one_process_and_memory_is_the_formula_computed_here(lesson, zero, precision):
    np_ = 2
    run = lesson(L10, np_, "--part", "train", "--zero", zero, "--precision", precision, "--train", 4).ok()
    if precision == "fp8":  # float32 weights and AdamW: fp32's memory
        run.has(r"float32 weights, the linear layers' GEMMs in FP8 \(1 x 128 and 128 x 128 scales, promoted every 128")
        precision = "fp32"
    run.has(r"AdamW.* = one process's on the same mean gradients, bit for bit   PASS")
    run.has(r"every rank holds the same weights, bit for bit   PASS")
    n16, n32 = counts(run)
    assert (n16 > 0) == (precision == "bf16")
    n = n16 + n32
    shard = -(-n // np_)
    held = 2 * n16 + 4 * n32
    grads = 4 * shard if zero == 2 else held
    optimizer = (12 * n16 + 8 * n32 if zero == 0 else 12 * shard) if precision == "bf16" else (8 * n if zero == 0 else 8 * shard)
    got, seed = per_parameter(run)
    assert got == pytest.approx((held + grads + optimizer) / n, abs=0.006)
    # seed 001's bytes per parameter, all in one precision
    want_seed = {("bf16", 0): 16, ("bf16", 1): 4 + 12 / np_, ("bf16", 2): 2 + 14 / np_,
                 ("fp32", 0): 16, ("fp32", 1): 8 + 8 / np_, ("fp32", 2): 4 + 12 / np_}[(precision, zero)]
    assert seed == pytest.approx(want_seed, abs=0.006)
    if precision == "fp32" or zero == 0:
        assert got == pytest.approx(seed, abs=0.006)  # nothing held apart: the seed's formula itself
    else:
        # the float32 parameters (2 + 2 bytes more each; ZeRO-2: its float32 gradient shard) above the seed's all-bf16 bytes
        assert seed < got < seed + 4 * n32 / n + (2 / np_ if zero == 2 else 0) + 0.006


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_bf16_moments_take_two_bytes_each_and_train_as_float32_moments_do(lesson, tmp_path, zero):
    np_ = 2
    args = ["--part", "train", "--zero", zero, "--train", 20, "--check-every", 10, "--log-every", 19]
    path = tmp_path / "10.csv"
    narrow = lesson(L10, np_, *args, "--moments", "bf16", "--csv", str(path)).ok()
    narrow.has(r"AdamW lr 0\.003, its m and v in bf16")
    narrow.has(r"AdamW \(float32 masters\) = one process's on the same mean gradients, bit for bit   PASS")
    wide = lesson(L10, np_, *args).ok()
    n16, n32 = counts(narrow)
    n = n16 + n32
    shard = -(-n // np_)
    held = 2 * n16 + 4 * n32
    grads = 4 * shard if zero == 2 else held
    optimizer = 8 * n16 + 4 * n32 if zero == 0 else 8 * shard  # the master, and m and v of 2 bytes
    assert per_parameter(narrow)[0] == pytest.approx((held + grads + optimizer) / n, abs=0.006)
    for r in csv.DictReader(open(path)):  # the csv says which moments
        assert (r["kind"], r["moments"]) == ("train", "bf16")
    # 4 bytes less per parameter than float32 moments (ZeRO-0), 4/dp (ZeRO-1, -2)
    assert per_parameter(wide)[0] - per_parameter(narrow)[0] == pytest.approx(4 if zero == 0 else 4 / np_, abs=0.006)
    a, b = losses(wide)[-1], losses(narrow)[-1]
    assert a != b and abs(a - b) < 0.01 * a, (a, b)


@pytest.mark.parametrize("np_, args", [
    (1, []), (3, ["--batch", 6, "--zero", 2]), (4, ["--zero", 2, "--grad-reduce", "bf16"]), (4, ["--zero", 0]),
    (3, ["--batch", 12, "--zero", 2, "--grad-reduce", "bf16", "--train", 30]),
    (3, ["--batch", 3, "--seq", 16, "--train", 60]),
    (3, ["--batch", 6, "--precision", "fp8", "--train", 2]), (4, ["--zero", 2, "--precision", "fp8", "--train", 2]),
    (3, ["--batch", 6, "--precision", "fp8", "--fp8-experts", "on", "--train", 2]),
], ids=["P1", "P3-zero2", "P4-zero2-bf16-sums", "P4-zero0", "P3-30-steps-bf16-sums", "P3-60-steps-one-sequence-each",
        "P3-fp8", "P4-zero2-fp8", "P3-fp8-experts"])
def test_training_on_any_number_of_ranks(lesson, np_, args):
    run = lesson(L10, np_, "--part", "train", "--train", 4, *args, "--log-every", 100).ok()
    run.has(r"training: mean gradients = one process's mean of the same shares', .*PASS")
    # two and three ranks add their shares in rank order, as one process does: bit for bit
    if np_ <= 3:
        run.has(r"the worst gradient against its bound: none off, every mean gradient bit for bit")


def losses(run):
    return [float(x) for x in re.findall(r"^  \d+ +(\d+\.\d+) ", run.out, re.M)]


def test_fp8_trains_through_its_own_gemms_near_float32(lesson):
    # the FP8 GEMMs are in the forward and backward: every step's loss differs from float32's
    # (the first step's weights are the same, but its forward already quantizes), and stays close
    args = ["--part", "train", "--train", 12, "--log-every", 1, "--check-every", 6]
    fp32 = losses(lesson(L10, 2, *args, "--precision", "fp32").ok())
    fp8 = losses(lesson(L10, 2, *args, "--precision", "fp8").ok())
    assert len(fp32) == len(fp8) == 12
    assert all(a != b for a, b in zip(fp32, fp8)), (fp32, fp8)
    assert all(abs(a - b) < 0.01 * a for a, b in zip(fp32, fp8)), (fp32, fp8)


def dp_bytes(run):
    values = set(re.findall(r"^  \d+ .* (\d+\.\d) KiB$", run.out, re.M))
    assert len(values) == 1, run.why("one DP byte count on every step line")
    return float(values.pop())


def test_bf16_gradient_sums_move_three_quarters_of_the_bytes(lesson):
    # reduce-scatter in bf16 (2 bytes) and all-gather in float32 (4): 6 of 8
    full = lesson(L10, 2, "--part", "train", "--train", 2).ok()
    half = lesson(L10, 2, "--part", "train", "--train", 2, "--grad-reduce", "bf16").ok()
    n16, n32 = counts(full)
    # Comm counts what a reduce-scatter reduces and what an all-gather gathers: 4 bytes a parameter each
    assert dp_bytes(full) == pytest.approx(8 * (n16 + n32) / 1024, abs=0.06)
    assert dp_bytes(half) == pytest.approx(0.75 * dp_bytes(full), abs=0.06)


def test_planted_bug_no_master_fails_adamw_and_the_model_stalls(lesson):
    bug = lesson(L10, 2, "--part", "train", "--bug", "no-master", "--train", 4).fails()
    bug.has(r"AdamW \(float32 masters\) = one process's on the same mean gradients, bit for bit: not from .*, "
            r"step [1-3]   FAIL")
    # at lr 1e-4 most updates are under half a bf16 step: without masters they round away
    args = ["--part", "train", "--lr", "1e-4", "--train", 60, "--check-every", 30, "--log-every", 59]
    good = lesson(L10, 2, *args).ok()
    stuck = lesson(L10, 2, *args, "--bug", "no-master").fails()

    def last(run):
        m = re.findall(r"^  59 +(\S+) .* (\S+)%", run.out, re.M)
        assert m, run.why("step 59's line")
        return float(m[0][0]), float(m[0][1])
    (loss_good, moved_good), (loss_stuck, moved_stuck) = last(good), last(stuck)
    assert loss_stuck > loss_good + 0.05, (loss_good, loss_stuck)
    assert moved_stuck < moved_good, (moved_good, moved_stuck)


@pytest.mark.parametrize("args, says", [
    (["--promote", 3], "--promote 3 must divide --tile 128"),
    (["--k-max", 64], "--k-max 64 must be at least --tile 128"),
    (["--m", 4096, "--n", 4096, "--k-max", 1 << 20], "about 8 GEMMs each: at most 5e9"),
    (["--m", 1, "--n", 3800, "--k-max", 1 << 20], "GiB per rank"),
    (["--tile", 2048, "--promote", 2048, "--k-max", 2048], "--tile 2048: at most 1024"),
    (["--batch", 4096, "--seq", 1024], "at most 65536"),
    (["--dump", "/tmp/fivefold-10-dump"], "--dump: lesson 10 writes no tensors"),
    (["--acc-bits", 0], "--acc-bits"),
    (["--bug", "nope"], "--bug"),
    (["--batch", 7], "--batch 7 must be a multiple of the 2 ranks"),
    (["--bug", "no-master", "--precision", "fp32"], "--bug no-master needs --precision bf16"),
    (["--grad-reduce", "bf16", "--precision", "fp32"], "--grad-reduce bf16 needs --precision bf16"),
    (["--zero", 3], "--zero"),
    (["--moments", "fp16"], "--moments"),
    (["--part", "train", "--precision", "fp8", "--tile", 100, "--promote", 30], "--promote 30 must divide --tile 100"),
    (["--part", "train", "--precision", "fp8", "--tile", 2048, "--promote", 2048], "--tile 2048: at most 1024"),
    (["--grad-reduce", "bf16", "--precision", "fp8"], "--grad-reduce bf16 needs --precision bf16"),
    (["--fp8-experts", "on"], "--fp8-experts on needs --precision fp8"),
    (["--part", "train", "--bug", "per-tensor"], "plants a mistake in the formats"),
    (["--part", "formats", "--bug", "no-master"], "plants it in the training"),
    (["--data", "/nonexistent/text"], "--data"),
], ids=["promote-not-dividing-tile", "k-below-tile", "too-big", "beyond-memory", "tile-too-big", "batch-too-big",
        "dump", "acc-bits-0", "unknown-bug", "batch-not-multiple",
        "no-master-fp32", "bf16-sums-fp32", "zero-3", "moments-fp16", "fp8-promote-not-dividing-tile", "fp8-tile-too-big",
        "bf16-sums-fp8", "fp8-experts-without-fp8", "formats-bug-in-train", "train-bug-in-formats", "no-data"])
def test_bad_input_is_one_error_line_and_exit_2(lesson, args, says):
    lesson(L10, 2, *args).usage_error(says)
