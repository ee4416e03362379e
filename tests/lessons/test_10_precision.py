"""Lesson 10, precision: bf16 rounding, the bf16 matmul and DeepSeek-V3's FP8 GEMM checked against every
device's kernels and float64, on 1 to 3 ranks (the sweep's table the same on any); the emulated CUDA
kernels; each planted bug FAILs the check that names it; the CSV the figure reads; bad input is one
`error:` line with exit 2."""
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
    run = lesson(L10, np_).ok()
    run.has(r"bf16: cpu's conversion = round_to_bf16, bit for bit   PASS")
    run.has(r"FP8: cpu's quantization and GEMM = formats.cpp's loops, bit for bit   PASS")
    one = table(lesson(L10, 1).ok()) if np_ != 1 else None
    rows = table(run)
    assert sorted(rows) == [128, 256, 512, 1024, 2048, 4096], run.why("K from 128 to 4096")
    if one is not None:
        assert rows == one, run.why("the same table as one rank's")


def test_the_claims_the_recipe_flat_in_k_never_promoted_growing(lesson):
    rows = table(lesson(L10, 2, "--k-max", 8192).ok())
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
    run = lesson(L10, 2, "--device", "sim", "--k-max", 1024, "--bf16-k", 256).ok()
    run.has(r"bf16: sim's conversion = round_to_bf16, bit for bit   PASS")
    run.has(r"FP8: sim's quantization and GEMM = formats.cpp's loops, bit for bit   PASS")


def test_tiles_promotion_and_accumulator_as_flags(lesson):
    run = lesson(L10, 3, "--tile", 64, "--promote", 32, "--k-max", 1000, "--acc-bits", 12).ok()
    assert sorted(table(run)) == [64, 128, 256, 512], run.why("K from the tile, doubling up to --k-max")
    run.has(r"FP8 GEMM at K = 512: never promoted .*PASS")
    # a float32-wide accumulator: nothing for promotion to fix; said, not checked
    wide = lesson(L10, 1, "--acc-bits", 23, "--k-max", 1024).ok()
    wide.has(r"note: --acc-bits 23: never promoted")


@pytest.mark.parametrize("bug, failing", [
    ("bf16-truncate", [r"bf16: cpu's conversion = round_to_bf16, bit for bit   FAIL",
                       r"within half a bf16 step \(2\^-8 relative\)   FAIL"]),
    ("no-promotion", [r"never promoted .* \(at least 10x\)   FAIL"]),
    ("per-tensor", [r"outlier channels: per-tile scales (\S+), per tensor \1 .*FAIL"]),
])
def test_planted_bug_fails_the_check_that_names_it(lesson, bug, failing):
    run = lesson(L10, 2, "--bug", bug).fails()
    for pattern in failing:
        run.has(pattern)
    fails = re.findall(r"   FAIL$", run.out, re.M)
    assert len(fails) <= 2, run.why("only the checks the bug breaks fail")


def test_csv_holds_the_table_for_the_figure(lesson, tmp_path):
    path = tmp_path / "fp8.csv"
    run = lesson(L10, 2, "--k-max", 1024, "--csv", str(path)).ok()
    rows = list(csv.DictReader(open(path)))
    printed = table(run)
    assert [int(r["k"]) for r in rows] == sorted(printed)
    for r in rows:
        want = printed[int(r["k"])]
        for key, shown in zip(["recipe", "recipe_ratio", "never", "fp32_acc", "fine", "per_tensor"], want):
            assert math.isclose(float(r[key]), shown, rel_tol=6e-3), f"{key} at K {r['k']}: {r[key]} vs {shown}"
        assert (int(r["promote"]), int(r["acc_bits"]), int(r["m"]), int(r["n"])) == (128, 14, 8, 128)


@pytest.mark.parametrize("args, says", [
    (["--promote", 3], "--promote 3 must divide --tile 128"),
    (["--k-max", 64], "--k-max 64 must be at least --tile 128"),
    (["--m", 4096, "--n", 4096, "--k-max", 1 << 20], "at most 4e9"),
    (["--acc-bits", 0], "--acc-bits"),
    (["--bug", "nope"], "--bug"),
], ids=["promote-not-dividing-tile", "k-below-tile", "too-big", "acc-bits-0", "unknown-bug"])
def test_bad_input_is_one_error_line_and_exit_2(lesson, args, says):
    lesson(L10, 2, *args).usage_error(says)
