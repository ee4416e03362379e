"""Lesson 08's checkpoints against what a user and a crash do: nothing a save does loses the newest
complete checkpoint, no manifest is trusted, a resumed run is the run it was.

  crash     a rank killed (SIGKILL, FF_TEST_KILL_IN_SAVE=R:S:POINT) at each point of a save that
            replaces a step and prunes (lessons/08_mesh/checkpoint.cpp names the points): the newest
            complete checkpoint is the step being saved, resumes to the bits of an uninterrupted
            run, and the next save leaves only complete checkpoints
  keep      another run's directory refused and untouched; --keep prunes only the lineage
  resume    without --seed, --batch, --lr the same data; a contradicting flag or text refused
  fuzz      every manifest field fuzzed end to end in lessons 08 (--resume) and 09 (--checkpoint):
            one `error:` line naming the field, exit 2 (tests/unit/test_manifest.cpp fuzzes every
            field with every mutation through the same reader)
  npy       every .npy rewritten with 192-byte, version 2.0 and 3.0 headers: lessons 08 and 09 and
            PyTorch's loader read the same numbers
"""
import glob
import hashlib
import json
import os
import shutil
import zlib

import numpy as np
import pytest

L08, L09 = "08_mesh", "09_inference"
NP = 2
# a small model: every test is a few runs of a fraction of a second
SMALL = ["--tp", "1", "--dim", "32", "--ffn", "32", "--moe-ffn", "16", "--seq", "16", "--batch", "4"]


def sign(ckpt, manifest):
    """manifest.json replaced, manifest.crc32 made to match it (only the schema can refuse it)."""
    text = (json.dumps(manifest, indent=1) + "\n").encode()
    with open(os.path.join(ckpt, "manifest.json"), "wb") as f:
        f.write(text)
    with open(os.path.join(ckpt, "manifest.crc32"), "w") as f:
        f.write(f"{zlib.crc32(text):08x}\n")


def load_manifest(ckpt):
    with open(os.path.join(ckpt, "manifest.json")) as f:
        return json.load(f)


def listing(d):
    return sorted(os.listdir(d))


def tree_digest(d):
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(d, "**"), recursive=True)):
        h.update(path.encode())
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def same_dumps(a, b):
    names = sorted(os.listdir(a))
    assert names and names == sorted(os.listdir(b)), f"the same dump files in {a} and {b}"
    for n in names:
        with open(os.path.join(a, n), "rb") as fa, open(os.path.join(b, n), "rb") as fb:
            assert fa.read() == fb.read(), f"{n}: the same bits in {a} and {b}"
    return len(names)


# ---- a rank killed at each point of a save

@pytest.fixture(scope="module")
def crash_base(lesson, tmp_path_factory):
    """D after --train 4 --save-every 2 (step-000002, step-000004), and the uninterrupted run's dump."""
    work = tmp_path_factory.mktemp("crash")
    base, ref = work / "base", work / "ref"
    lesson(L08, NP, *SMALL, "--train", 4, "--save-every", 2, "--save", base).ok()
    lesson(L08, NP, *SMALL, "--train", 6, "--dump", ref).ok()
    return base, ref


@pytest.mark.parametrize("rank, point", [(0, p) for p in (
    "tidy", "mkdir", "create", "write", "fsync", "written", "manifest", "fsync-tmp", "aside", "publish",
    "remove-aside", "prune", "prune-remove")] + [(1, p) for p in ("write", "fsync", "written")])
def test_crash_leaves_the_newest_complete_checkpoint(lesson, crash_base, tmp_path, rank, point):
    base, ref = crash_base
    d, got = tmp_path / "d", tmp_path / "got"
    shutil.copytree(base, d)
    # the save after 4 steps replaces step-000004 (the same numbers: the same lineage) and prunes step-000002
    run = lesson(L08, NP, *SMALL, "--resume", d / "step-000002", "--train", 4, "--save-every", 2, "--keep", 1,
                 "--save", d, env={"FF_TEST_KILL_IN_SAVE": f"{rank}:4:{point}"})
    assert run.rc != 0 and "checkpoint after 4 steps" not in run.out, \
        run.why(f"rank {rank} killed at {point} (a point the save reaches): a non-zero exit, no checkpoint line")
    # the newest complete checkpoint is step 4's, and goes on as the uninterrupted run did
    run = lesson(L08, NP, *SMALL, "--train", 6, "--resume", d, "--dump", got, "--save", d, "--keep", 1).ok()
    run.has(r"^resumed from .*step-000004: 4 steps done")
    same_dumps(ref, got)
    # and the next save put everything right: only complete checkpoints, no temporaries
    assert listing(d) == ["step-000006"], f"after the next save, {d} holds step-000006 alone: {listing(d)}"


# ---- keep, lineage, another run's directory

def test_another_runs_directory_is_refused_and_keep_prunes_only_the_lineage(lesson, tmp_path):
    d, d2, e = tmp_path / "d", tmp_path / "d2", tmp_path / "e"
    # 1. a second run from scratch into a directory of another run: refused, nothing touched
    lesson(L08, NP, *SMALL, "--train", 10, "--save-every", 5, "--save", d).ok()
    before = tree_digest(d)
    lesson(L08, NP, *SMALL, "--train", 4, "--save-every", 2, "--save", d).usage_error("another run's checkpoints")
    assert tree_digest(d) == before and listing(d) == ["step-000005", "step-000010"], listing(d)
    # 2. a lineage carried on by a resumed run: --keep 2 keeps its newest two
    lesson(L08, NP, *SMALL, "--train", 6, "--save-every", 2, "--keep", 2, "--save", d2).ok()
    assert listing(d2) == ["step-000004", "step-000006"]
    lesson(L08, NP, *SMALL, "--resume", d2, "--train", 10, "--save-every", 2, "--keep", 2, "--save", d2).ok()
    assert listing(d2) == ["step-000008", "step-000010"]
    # 3. a branch from an older step: the newest by steps (10) and this run's last save (9) stay
    lesson(L08, NP, *SMALL, "--resume", d2 / "step-000008", "--train", 9, "--save-every", 1, "--keep", 1,
           "--save", d2).ok()
    assert listing(d2) == ["step-000009", "step-000010"]
    # 4. a run resumed from another lineage into this directory: refused
    lesson(L08, NP, *SMALL, "--train", 2, "--save", e).ok()
    before = tree_digest(d2)
    lesson(L08, NP, *SMALL, "--resume", e, "--train", 4, "--save", d2).usage_error("another run's checkpoints")
    assert tree_digest(d2) == before


@pytest.mark.parametrize("flag", ["--save-every", "--keep"])
def test_save_every_and_keep_need_save(lesson, flag):
    lesson(L08, NP, *SMALL, flag, 2).usage_error("--save-every and --keep need --save")


# ---- a resumed run is the run it was

def test_resume_restores_the_data_position_and_refuses_contradicting_flags(lesson, tmp_path):
    d = tmp_path / "d"
    # SMALL without its --batch: the resumed run gives neither --seed, --batch nor --lr
    small = [x for i, x in enumerate(SMALL) if x != "--batch" and (i == 0 or SMALL[i - 1] != "--batch")]
    whole = lesson(L08, NP, *small, "--seed", 99, "--batch", 2, "--lr", 0.002, "--train", 6, "--save-every", 3,
                   "--save", d).ok().has(r"^validation loss after .*$").group(0)
    ck = d / "step-000003"
    run = lesson(L08, NP, *small, "--train", 6, "--resume", ck).ok()
    assert run.has(r"^validation loss after .*$").group(0) == whole, run.why(f"the uninterrupted run's line: {whole}")
    run.has(r"from the checkpoint: seed 99, batch 2, lr 0\.002")
    for args, text in [(["--seed", 1234], "seed = 99, --seed 1234 given"), (["--batch", 4], "batch = 2, --batch 4 given"),
                       (["--lr", 0.003], "lr = 0.002, --lr 0.003 given"), (["--dim", 64], "dim = 32, --dim 64 given")]:
        lesson(L08, NP, *small, *args, "--train", 6, "--resume", ck).usage_error(text)
    other = tmp_path / "other.txt"
    other.write_text("a different text, long enough for a validation split of more than seq bytes. " * 20)
    lesson(L08, NP, *small, "--data", other, "--train", 6, "--resume", ck).usage_error("the checkpoint's data is a text of")
    lesson(L08, NP, *small, "--train", 2, "--resume", ck).usage_error("3 steps done, more than --train 2")


# ---- every manifest field fuzzed end to end

def leaves(j, name=""):
    """Every leaf of a JSON value, as (path of keys, field name as the errors write it)."""
    if isinstance(j, dict):
        for k, v in j.items():
            yield from ((([k] + p), n) for p, n in leaves(v, f"{name}.{k}" if name else k))
    elif isinstance(j, list):
        for i, v in enumerate(j):
            yield from ((([i] + p), n) for p, n in leaves(v, f"{name}[{i}]"))
    else:
        yield [], name


MUTATIONS = [("a string", "x"), ("null", None), ("negative", -1), ("huge", 1e300), ("a list", [1, 2]), ("missing", KeyError)]


@pytest.mark.long
@pytest.mark.parametrize("which", [L08, L09])
def test_every_manifest_field_fuzzed_is_one_error_naming_it(lesson, tmp_path, which):
    base = tmp_path / "base"
    lesson(L08, NP, *SMALL, "--train", 2, "--save", base).ok()
    ck = base / "step-000002"
    good = load_manifest(ck)
    fields = [(p, n) for p, n in leaves(good) if not n.startswith("tensors.") or n.startswith("tensors.embed.")]
    assert len(fields) > 40, f"the manifest's fields ({len(fields)})"
    d = tmp_path / "step-000002"
    for i, (path, name) in enumerate(fields):
        what, value = MUTATIONS[i % len(MUTATIONS)]  # each field once, every mutation in turn
        bad = json.loads(json.dumps(good))
        parent = bad
        for k in path[:-1]:
            parent = parent[k]
        if value is KeyError:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(ck, d)
        sign(d, bad)
        named = name[: name.rindex("[")] if value is KeyError and name.endswith("]") else name
        args = [*SMALL, "--train", 4, "--resume", d] if which == L08 else ["--checkpoint", d, "--new", 4]
        lesson(which, NP, *args).usage_error(f"field {named}")


# ---- .npy files as numpy defines them

def rewrite_npy(path, how):
    """The file's array written again with a longer header: v1 with 192 bytes, or numpy's v2 / v3."""
    a = np.load(path)
    with open(path, "wb") as f:
        if how == "v1-192":
            d = np.lib.format.header_data_from_array_1_0(a)
            text = repr({k: d[k] for k in sorted(d)}).encode()
            text += b" " * (192 - 10 - len(text) - 1) + b"\n"
            f.write(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + a.tobytes())
        else:
            np.lib.format.write_array(f, a, version=(int(how[1]), 0))
    back = np.load(path)
    assert back.dtype == a.dtype and np.array_equal(back, a), path


def test_npy_with_longer_headers_reads_the_same_everywhere(lesson, script, tmp_path):
    d = tmp_path / "d"
    lesson(L08, NP, *SMALL, "--train", 2, "--save", d).ok()
    ck, long = d / "step-000002", tmp_path / "long" / "step-000002"
    shutil.copytree(ck, long)
    m = load_manifest(long)
    offsets = set()
    for i, name in enumerate(sorted(m["tensors"])):
        path = long / (name + ".npy")
        rewrite_npy(path, ["v1-192", "v2", "v3"][i % 3])
        data = path.read_bytes()
        hlen = int.from_bytes(data[8:10], "little") + 10 if data[6] == 1 else int.from_bytes(data[8:12], "little") + 12
        offsets.add((data[6], hlen))
        m["tensors"][name]["bytes"], m["tensors"][name]["crc32"] = len(data), zlib.crc32(data)
    assert (1, 192) in offsets and {v for v, _ in offsets} == {1, 2, 3}, sorted(offsets)
    sign(long, m)
    lesson(L08, NP, *SMALL, "--train", 3, "--resume", ck, "--dump", tmp_path / "r0").ok()
    lesson(L08, NP, *SMALL, "--train", 3, "--resume", long, "--dump", tmp_path / "r1").ok()
    same_dumps(tmp_path / "r0", tmp_path / "r1")
    outs = []
    for c in (ck, long):
        out = lesson(L09, NP, "--checkpoint", c, "--new", 8).ok().lines
        outs.append([x for x in out if not any(s in x for s in ("ms", "tok/s", "GB/s", "MB/s", "weights:"))])
    assert outs[0] == outs[1], "lesson 09: the same output from both"
    # PyTorch's loader (np.load) on the rewritten one gives lesson 08's validation loss
    dump = tmp_path / "dump"
    lesson(L08, NP, *SMALL, "--train", 0, "--resume", long, "--dump", dump).ok()
    run = script("tests/reference/load_checkpoint.py", long, dump)
    assert run.rc == 0, run.why("PyTorch's loader on the rewritten checkpoint")
