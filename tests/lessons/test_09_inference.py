"""Lesson 09, inference: the kv, latent and absorbed caches give the training forward's logits at every
position and its argmax bytes, on one process and with heads and experts split over 2, 3 and 4
ranks; each planted bug FAILs the cache it breaks; int8 weights are a quarter of the bytes and keep
the check; bf16 weights are half and keep it within a bf16 bound; lesson 08's checkpoints are served;
--speed, --link, dumps and traces; bad input is one `error:` line with exit 2."""
import re

import numpy as np
import pytest

L08, L09 = "08_mesh", "09_inference"
# lesson 08 trained small enough to serve in a fraction of a second
SMALL_08 = ["--dim", "32", "--ffn", "32", "--seq", "16", "--batch", "4"]


@pytest.mark.parametrize("np_, args", [
    (1, []), (2, []), (2, ["--moe-comm", "allreduce"]), (4, []), (4, ["--moe-comm", "allreduce"]),
    (3, ["--heads", "6", "--experts", "6"]),  # odd: 6 heads, 6 experts
    (4, ["--batch", "1", "--new", "8"]),      # fewer rows than ranks
], ids=["P1", "P2", "P2-moe-allreduce", "P4", "P4-moe-allreduce", "P3-6-heads-6-experts", "P4-batch-1"])
def test_every_cache_equals_the_training_forward_at_every_position(lesson, np_, args):
    # every position's logits of the three caches against the training forward, their greedy
    # bytes against its argmax and each other (heads and experts split; the MoE's all-to-all or all-reduce)
    lesson(L09, np_, *args).ok()


def test_batch_8_prompts_of_6_to_17_bytes_24_new_tokens_each_cache_alone(lesson):
    for cache in ["kv", "latent", "absorbed"]:
        lesson(L09, 2, "--batch", 8, "--new", 24, "--cache", cache).ok()


def test_cache_bytes_per_token_kv_splits_with_the_heads_latent_does_not(lesson):
    # kv: H (d_n + d_r + d_v) floats per token per layer, latent and absorbed: r_kv + d_r; measured
    one = lesson(L09, 1, "--new", 4)
    two = lesson(L09, 2, "--new", 4)
    assert one.rc == 0, one.why("exit 0")
    assert two.rc == 0, two.why("exit 0")
    one.has(r"^  kv +160 floats = +640 B +640 B +40960 ")
    one.has(r"^  latent +40 floats = +160 B +160 B +576 ")
    two.has(r"^  kv +80 floats = +320 B +320 B")        # half the heads on each rank
    two.has(r"^  absorbed +40 floats = +160 B +160 B")  # the latent is every head's


def test_planted_bug_rope_one_position_ahead_in_decode_fails(lesson):
    lesson(L09, 2, "--bug", "rope-off-by-one", "--new", 8).fails().has(r"logits, kv cache .*FAIL")


@pytest.mark.parametrize("np_", [1, 4], ids=["P1-4-heads-per-rank", "P4-1-head-per-rank"])
def test_planted_bug_absorbed_w_uk_reshaped_not_transposed_fails_the_absorbed_cache_only(lesson, np_):
    run = lesson(L09, np_, "--bug", "absorb-transposed", "--new", 8).fails()
    run.has(r"logits, absorbed cache .*FAIL")
    run.has(r"logits, kv cache .*PASS")


def test_planted_bug_last_layers_cache_not_updated_in_decode_fails(lesson):
    lesson(L09, 2, "--bug", "cache-skip-layer", "--new", 8).fails().has(r"logits, latent cache .*FAIL")


def test_int8_a_quarter_of_the_bytes_and_the_check_still_passes(lesson):
    run = lesson(L09, 2, "--int8", "--new", 16).ok()
    run.has(r"int8 weights \(per-channel scales\): .* 0\.2[5-9][0-9]x")  # plus the scales
    run.has(r"validation perplexity")


def test_int8_on_one_process_the_decode_reads_int8_ffns_and_experts(lesson):
    run = lesson(L09, 1, "--int8", "--new", 16, "--speed", 1).ok()
    run.has(r"decode steps read the FFNs. and experts. int8 numbers")
    run.has(r"the FFNs and experts read int8")  # --speed counts their int8 bytes


def relative_error(run):
    values = re.findall(r"relative error .*: (\S+)$", run.out, re.M)
    assert len(values) == 1, run.why("one line with the weights' relative error")
    return float(values[0])


def test_planted_bug_int8_per_tensor_no_check_fails_the_error_grows(lesson):
    per_channel = relative_error(lesson(L09, 1, "--int8", "--new", 4).ok())
    bug = lesson(L09, 1, "--int8", "--new", 4, "--bug", "int8-per-tensor").ok()
    per_tensor = relative_error(bug)
    assert per_tensor > 1.3 * per_channel, \
        bug.why(f"per-tensor scales' error {per_tensor} > 1.3 x per-channel's {per_channel}")


@pytest.mark.parametrize("np_", [1, 2, 4], ids=["P1", "P2", "P4"])
def test_bf16_half_the_bytes_every_cache_within_the_bf16_bound(lesson, np_):
    run = lesson(L09, np_, "--bf16", "--new", 16).ok()
    run.has(r"bf16 weights \(the matmuls', .*: 0\.500x")
    err = relative_error(run)
    assert 0 < err <= 2 ** -8, run.why(f"bf16 keeps every weight within 2^-8: {err}")
    # the bound: float32's plus layers 2^-7 max|z| (3 layers); the latent cache on one process
    # makes the training forward's own operations: float32's bound alone would hold
    tols = [float(t) for t in re.findall(r"every position: max\|diff\| \S+ <= (\S+)   PASS", run.out)]
    assert len(tols) == 3 and all(t > 3 * 2 ** -7 for t in tols), run.why("three caches within a bf16 bound")


def test_bf16_speed_counts_two_bytes_a_weight(lesson):
    runs = [lesson(L09, 1, *args, "--speed", 1, "--new", 8, "--cache", "absorbed").ok() for args in ([], ["--bf16"])]
    weights = []
    for run in runs:
        m = re.search(r"^ +1 +[0-9.]+ +[0-9]+ +([0-9.]+) MB", run.out, re.M)
        assert m, run.why("the batch-1 speed row")
        weights.append(float(m[1]))
    runs[1].has(r"every matmul reads its bf16 weights, 2 bytes each")
    # the matmul weights halve; the norms and the router (read every step) stay float32
    assert 0.5 * weights[0] - 0.006 <= weights[1] < 0.55 * weights[0], (weights, runs[1].why("about half the bytes"))


@pytest.mark.parametrize("bug", ["rope-off-by-one", "absorb-transposed", "cache-skip-layer"])
def test_bf16_planted_bugs_still_fail(lesson, bug):
    lesson(L09, 2, "--bf16", "--bug", bug, "--new", 8).fails().has(r"logits, .* cache .*FAIL")


def test_lesson_08_checkpoint_served_on_1_and_2_ranks(lesson, tmp_path):
    ck = tmp_path / "ck09"
    lesson(L08, 2, "--train", 4, *SMALL_08, "--save", ck).ok()
    lesson(L09, 1, "--checkpoint", ck, "--new", 8).ok().has(r"lesson 08.s checkpoint")
    lesson(L09, 2, "--checkpoint", ck, "--new", 8, "--int8").ok()
    lesson(L09, 2, "--checkpoint", ck, "--new", 8, "--bf16").ok().has(r"bf16 weights")


def test_speed_tokens_per_s_bytes_and_bandwidth_per_batch_size(lesson):
    # batch, ms/step, tokens/s, weights/step, cache/step, GB/s, util
    lesson(L09, 1, "--speed", "1,3", "--new", 8).succeeds(
        r"^ +3 +[0-9.]+ +[0-9]+ +[0-9.]+ MB +[0-9.]+ MB +[0-9.]+ +[0-9.]+%")


def test_link_on_4_ranks_nodes_of_2_both_moe_exchanges_print_the_moes_share(lesson):
    for moe_comm in ["alltoall", "allreduce"]:
        run = lesson(L09, 4, "--moe-comm", moe_comm, "--batch", 2, "--new", 8, "--cache", "absorbed",
                     "--link", "latency=20us", "--ranks-per-node", 2)
        run.succeeds(r"^  absorbed .* tokens/s, MoE [0-9.]+ ms \([0-9]+%\)")


def test_dump_numpy_reads_every_cache_each_token_the_references_argmax(lesson, tmp_path):
    d = tmp_path / "d09"
    run = lesson(L09, 2, "--new", 8, "--dump", d)
    assert run.rc == 0, run.why("exit 0")
    for cache in ("kv", "latent", "absorbed"):
        for b, p in enumerate((6, 7, 14, 17)):  # the default prompts' lengths
            t = np.load(d / f"tokens.{cache}.seq{b}.npy")
            z = np.load(d / f"logits.{cache}.seq{b}.npy")
            r = np.load(d / f"reference.{cache}.seq{b}.npy")
            assert z.shape == r.shape == (len(t) - 1, 65) and len(t) == p + 8, (cache, b, z.shape, r.shape, len(t))
            assert np.abs(z - r).max() < 1e-3, (cache, b, "logits against the reference's")
            assert (t[p:] == r[p - 1:].argmax(1)).all(), (cache, b, "each generated token the reference's argmax")


def test_trace_spans_nest_on_every_track(lesson, script, tmp_path):
    trace = tmp_path / "t09.json"
    run = lesson(L09, 2, "--new", 4, "--trace", trace)
    assert run.rc == 0, run.why("exit 0")
    script("scripts/check-trace.py", trace, "-", 2).succeeds("^trace ok: 2 ranks")


def test_device_sim_decode_under_the_emulator(lesson):
    lesson(L09, 1, "--device", "sim", "--batch", 2, "--new", 4, "--dim", 32, "--ffn", 32).ok()


def test_device_sim_bf16_the_emulated_kernels_read_bf16(lesson):
    lesson(L09, 2, "--device", "sim", "--bf16", "--batch", 2, "--new", 4, "--dim", 32, "--ffn", 32,
           "--val-batches", 1).ok().has(r"every decode step reads them as bf16")


def test_device_sim_int8_every_weight_dequantized_and_the_check_passes(lesson):
    # int8_matmul is the cpu's, so on sim every weight is dequantized at load
    lesson(L09, 1, "--device", "sim", "--int8", "--batch", 2, "--new", 4, "--dim", 32, "--ffn", 32,
           "--val-batches", 1).ok().has(r"every weight dequantized at load")


def test_help_lists_every_flag_with_its_default(lesson):
    lesson(L09, 1, "--help").succeeds(r"--cache \{kv\|latent\|absorbed\|all\} .*\(default: all\)")


@pytest.mark.parametrize("np_, args", [
    (2, ["--prompts", "ROMEO@"]),                                   # a byte outside the vocabulary
    (2, ["--prompts", "a||b"]),                                     # an empty prompt
    (3, []),                                                        # 3 ranks for 4 heads
    (3, ["--heads", "6"]),                                          # 3 ranks for 8 experts
    (2, ["--batch", "256", "--new", "4096", "--max-memory", "0.01"]),  # sizes beyond memory
    (2, ["--ranks-per-node", "1"]),                                 # without --link
    (2, ["--link", "intra=fast"]),                                  # a bad bandwidth
    (1, ["--bug", "rope-off-by-one", "--new", "1"]),                # no decode step to plant it in
    (2, ["--speed", "1"]),                                          # --speed times one process
    (1, ["--speed", "1,0"]),                                        # a batch of 0
    (1, ["--bug", "int8-per-tensor"]),                              # without --int8
    (1, ["--bug", "absorb-transposed", "--cache", "kv"]),           # a bug of a cache not run
    (1, ["--bf16", "--int8"]),                                      # two precisions of the weights
], ids=["prompt-byte-outside-vocabulary", "empty-prompt", "3-ranks-for-4-heads", "3-ranks-for-8-experts",
        "sizes-beyond-memory", "ranks-per-node-without-link", "link-bad-bandwidth", "decode-bug-with-new-1",
        "speed-on-2-ranks", "speed-batch-0", "int8-per-tensor-without-int8", "absorb-transposed-with-cache-kv",
        "bf16-and-int8"])
def test_bad_input(lesson, np_, args):
    lesson(L09, np_, *args, timeout=60).usage_error()


def test_bad_input_checkpoint_of_a_directory_with_none(lesson, tmp_path):
    lesson(L09, 2, "--checkpoint", tmp_path / "no-such-checkpoint", timeout=60).usage_error()


def test_bad_input_checkpoint_of_another_model(lesson, tmp_path):
    # --dim 64 given, the checkpoint's is 32
    ck = tmp_path / "ck09m"
    run = lesson(L08, 1, "--train", 1, *SMALL_08, "--save", ck)
    assert run.rc == 0, run.why("lesson 08 saves a checkpoint")
    lesson(L09, 2, "--checkpoint", ck, "--dim", 64, timeout=60).usage_error("dim = 32, the flags 64")


def test_bad_input_checkpoint_with_a_damaged_file_its_crc_named(lesson, tmp_path):
    # one byte of norm.npy changed: its CRC-32 no longer the manifest's
    ck = tmp_path / "ck09d"
    run = lesson(L08, 1, "--train", 1, *SMALL_08, "--save", ck)
    assert run.rc == 0, run.why("lesson 08 saves a checkpoint")
    [step] = ck.glob("step-*")
    with open(step / "norm.npy", "r+b") as f:
        f.seek(200)
        f.write(b"X")
    lesson(L09, 2, "--checkpoint", ck, timeout=60).usage_error("CRC-32")


def test_device_cuda(lesson, has_cuda):
    if not has_cuda:
        pytest.skip("no GPU here")
    lesson(L09, 1, "--device", "cuda").ok()


def test_the_binary_holds_lesson_08s_checkpoint_files_but_not_its_mesh_model(command, build):
    # the Makefile links what lesson 09's #include lines reach (checkpoint_io, manifest, sharding):
    # lesson 08's readers of a checkpoint are in the binary, its mesh model, pipeline and
    # optimizer groups are not
    syms = command(["nm", "-C", f"{build}/bin/{L09}"], separate=True)
    assert syms.rc == 0, syms.why("nm reads the binary")
    assert "ff::mesh::load_checkpoint_weights" in syms.stdout, syms.why("lesson 08's checkpoint reader linked")
    for absent in ("MeshStages", "ff::mesh::save_checkpoint", "ff::mesh::resume_checkpoint", "ff::mesh::train_step"):
        assert absent not in syms.stdout, f"{build}/bin/{L09} holds {absent}: lesson 08's mesh model is linked into lesson 09"
