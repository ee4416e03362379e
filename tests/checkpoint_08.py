#!/usr/bin/env python3
"""Lesson 08's checkpoints against what a user and a crash do: nothing a save does loses the newest
complete checkpoint, no manifest is trusted, a resumed run is the run it was.

usage: checkpoint_08.py BUILD_BIN WORKDIR TEST [ARGS]
  crash RANK POINT...  for each POINT, kill RANK with SIGKILL there in a save that replaces a step
                     and prunes (lessons/08_mesh/checkpoint.cpp names the points); the newest
                     complete checkpoint must be the step being saved, must resume to the bits of
                     an uninterrupted run, and the next save must leave only complete checkpoints
  keep               --keep and a second run into the same directory: another run's checkpoints
                     are refused, never removed; a lineage's own are kept as --keep says
  resume             a resumed run is the run it was: without --seed (or --batch, --lr) it trains
                     on the same data (the same validation line); a flag that contradicts the
                     checkpoint, or another text, is refused naming the field
  fuzz LESSON        every field of the manifest (LESSON 08: --resume, 09: --checkpoint) fuzzed by
                     type and value end to end: one `error:` line naming the field, exit 2, no
                     Open MPI banner
  npy                every .npy of a checkpoint rewritten with longer headers (192 bytes, and
                     versions 2.0 and 3.0, as numpy writes them): lessons 08 and 09 and the
                     PyTorch loader read the same numbers
Prints "ok: ..." last on success; on a failure, the command, its exit code and its output's tail,
and exits 1. MPIRUN (the Makefile's) is the launcher.
"""
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zlib

import numpy as np

MPIRUN = shlex.split(os.environ.get("MPIRUN", "mpirun --oversubscribe -q --allow-run-as-root"))
NOISE = re.compile(r"^\[warn\] Epoll [A-Z]+\(\d+\) on fd \d+ failed")  # Open MPI's, at shutdown (run-tests.sh)
# A small model: every check is a few runs of a fraction of a second
SMALL = ["--tp", "1", "--dim", "32", "--ffn", "32", "--moe-ffn", "16", "--seq", "16", "--batch", "4"]


class Failed(Exception):
    pass


def run(cmd, env=None, timeout=120):
    full = dict(os.environ, **(env or {}))
    launch = MPIRUN + sum((["-x", k] for k in (env or {})), [])
    p = subprocess.run(launch + cmd, env=full, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, " ".join(launch + cmd)


def expect(ok, what, cmd="", out=""):
    if not ok:
        tail = "\n".join("    | " + line for line in out.splitlines()[-25:])
        raise Failed(f"FAIL: {what}\n  command: {cmd}\n{tail}")


def ok_run(cmd, env=None):
    rc, out, line = run(cmd, env)
    expect(rc == 0 and re.search(r"^check: PASS", out, re.M), f"exit 0 and check: PASS (exit {rc})", line, out)
    return out


def usage_error(cmd, must_name):
    """The error contract: exit 2, one line of output, `error: ...` naming must_name, no banner."""
    rc, out, line = run(cmd)
    lines = [x for x in out.splitlines() if x.strip() and not NOISE.match(x)]
    expect(rc == 2, f"exit 2 (got {rc})", line, out)
    expect(len(lines) == 1 and lines[0].startswith("error: "), "exactly one line, `error: ...`", line, out)
    expect(must_name in lines[0], f"the error names {must_name!r}", line, out)
    return lines[0]


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
    expect(names and names == sorted(os.listdir(b)), f"the same dump files in {a} and {b}")
    for n in names:
        with open(os.path.join(a, n), "rb") as fa, open(os.path.join(b, n), "rb") as fb:
            expect(fa.read() == fb.read(), f"{n}: the same bits in {a} and {b}")
    return len(names)


def validation_line(out):
    m = re.search(r"^validation loss after .*$", out, re.M)
    expect(m, "a validation line", "", out)
    return m.group(0)


# ---------------------------------------------------------------------------------------------


def test_crash(b, work, rank, *points):
    l08 = os.path.join(b, "08_mesh")
    base, ref = os.path.join(work, "base"), os.path.join(work, "ref")
    ok_run([l08, *SMALL, "--train", "4", "--save-every", "2", "--save", base])
    ok_run([l08, *SMALL, "--train", "6", "--dump", ref])
    for point in points:
        d, got = os.path.join(work, point), os.path.join(work, point + "-dump")
        shutil.copytree(base, d)
        # the save after 4 steps replaces step-000004 (the same numbers: the same lineage) and prunes step-000002
        env = {"FF_TEST_KILL_IN_SAVE": f"{rank}:4:{point}"}
        cmd = [l08, *SMALL, "--resume", os.path.join(d, "step-000002"), "--train", "4", "--save-every", "2",
               "--keep", "1", "--save", d]
        rc, out, line = run(cmd, env)
        expect(rc != 0 and "checkpoint after 4 steps" not in out,
               f"rank {rank} killed at {point} (a point the save reaches): a non-zero exit, no checkpoint line", line, out)
        # the newest complete checkpoint is step 4's, and goes on as the uninterrupted run did
        cmd = [l08, *SMALL, "--train", "6", "--resume", d, "--dump", got, "--save", d, "--keep", "1"]
        out = ok_run(cmd)
        expect(re.search(r"^resumed from .*step-000004: 4 steps done", out, re.M),
               f"after a kill at {point}: resumed from step 4 (the newest complete checkpoint)", " ".join(cmd), out)
        n = same_dumps(ref, got)
        # and the next save put everything right: only complete checkpoints, no temporaries
        expect(listing(d) == ["step-000006"], f"after the next save, {d} holds step-000006 alone: {listing(d)}")
        print(f"rank {rank} killed at {point}: the newest complete checkpoint (4 steps) resumed to the same bits "
              f"({n} files) as the uninterrupted run")
    print(f"ok: rank {rank} killed at each of {len(points)} points of a save: never without its newest complete checkpoint")


def test_keep(b, work):
    l08 = os.path.join(b, "08_mesh")
    d, d2, e = (os.path.join(work, x) for x in ("d", "d2", "e"))
    # 1. a second run from scratch into a directory of another run: refused, nothing touched
    ok_run([l08, *SMALL, "--train", "10", "--save-every", "5", "--save", d])
    before = tree_digest(d)
    usage_error([l08, *SMALL, "--train", "4", "--save-every", "2", "--save", d], "another run's checkpoints")
    expect(tree_digest(d) == before and listing(d) == ["step-000005", "step-000010"],
           f"the first run's checkpoints untouched: {listing(d)}")
    # 2. a lineage carried on by a resumed run: --keep 2 keeps its newest two
    ok_run([l08, *SMALL, "--train", "6", "--save-every", "2", "--keep", "2", "--save", d2])
    expect(listing(d2) == ["step-000004", "step-000006"], f"--keep 2: {listing(d2)}")
    ok_run([l08, *SMALL, "--resume", d2, "--train", "10", "--save-every", "2", "--keep", "2", "--save", d2])
    expect(listing(d2) == ["step-000008", "step-000010"], f"resumed, --keep 2: {listing(d2)}")
    # 3. a branch from an older step: the newest by steps (10) and this run's last save (9) stay
    ok_run([l08, *SMALL, "--resume", os.path.join(d2, "step-000008"), "--train", "9", "--save-every", "1",
            "--keep", "1", "--save", d2])
    expect(listing(d2) == ["step-000009", "step-000010"], f"a branch with --keep 1: {listing(d2)}")
    # 4. a run resumed from another lineage into this directory: refused
    ok_run([l08, *SMALL, "--train", "2", "--save", e])
    before = tree_digest(d2)
    usage_error([l08, *SMALL, "--resume", e, "--train", "4", "--save", d2], "another run's checkpoints")
    expect(tree_digest(d2) == before, "the directory untouched")
    # 5. --save-every and --keep without --save
    usage_error([l08, *SMALL, "--save-every", "2"], "--save-every and --keep need --save")
    usage_error([l08, *SMALL, "--keep", "3"], "--save-every and --keep need --save")
    print("ok: another run's checkpoints refused and untouched; --keep prunes the lineage (4 6 -> 8 10 -> 9 10)")


def test_resume(b, work):
    l08 = os.path.join(b, "08_mesh")
    d = os.path.join(work, "d")
    # SMALL without its --batch: the resumed run gives neither --seed, --batch nor --lr
    small = [x for i, x in enumerate(SMALL) if x != "--batch" and (i == 0 or SMALL[i - 1] != "--batch")]
    flags = [*small, "--seed", "99", "--batch", "2", "--lr", "0.002"]
    whole = validation_line(ok_run([l08, *flags, "--train", "6", "--save-every", "3", "--save", d]))
    out = ok_run([l08, *small, "--train", "6", "--resume", os.path.join(d, "step-000003")])
    expect(validation_line(out) == whole, f"the same validation line as the uninterrupted run: {whole}", "", out)
    expect(re.search(r"from the checkpoint: seed 99, batch 2, lr 0\.002", out), "the resumed flags printed", "", out)
    ck = os.path.join(d, "step-000003")
    usage_error([l08, *small, "--seed", "1234", "--train", "6", "--resume", ck], "seed = 99, --seed 1234 given")
    usage_error([l08, *small, "--batch", "4", "--train", "6", "--resume", ck], "batch = 2, --batch 4 given")
    usage_error([l08, *small, "--lr", "0.003", "--train", "6", "--resume", ck], "lr = 0.002, --lr 0.003 given")
    usage_error([l08, *small, "--dim", "64", "--train", "6", "--resume", ck], "dim = 32, --dim 64 given")
    other = os.path.join(work, "other.txt")
    with open(other, "w") as f:
        f.write("a different text, long enough for a validation split of more than seq bytes. " * 20)
    usage_error([l08, *small, "--data", other, "--train", "6", "--resume", ck], "the checkpoint's data is a text of")
    usage_error([l08, *small, "--train", "2", "--resume", ck], "3 steps done, more than --train 2")
    print(f"ok: resumed without --seed, --batch, --lr: {whole}; contradicting flags and another text refused")


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


def test_fuzz(b, work, lesson):
    l08, l09 = os.path.join(b, "08_mesh"), os.path.join(b, "09_inference")
    base = os.path.join(work, "base")
    ok_run([l08, *SMALL, "--train", "2", "--save", base])
    ck = os.path.join(base, "step-000002")
    good = load_manifest(ck)
    fields = [(p, n) for p, n in leaves(good) if not n.startswith("tensors.") or n.startswith("tensors.embed.")]
    expect(len(fields) > 40, f"the manifest's fields ({len(fields)})")
    d = os.path.join(work, "step-000002")
    refused = 0
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
        cmd = ([l08, *SMALL, "--train", "4", "--resume", d] if lesson == "08"
               else [l09, "--checkpoint", d, "--new", "4"])
        line = usage_error(cmd, f"field {named}")
        refused += 1
    print(f"ok: lesson {lesson}: {refused} manifest fields fuzzed (string, null, negative, huge, list, missing in "
          f"turn), each one `error:` line naming it, exit 2 (e.g. {line})")


def rewrite_npy(path, how):
    """The file's array written again by numpy with a longer header: v1 with 192 bytes, or v2 / v3."""
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


def test_npy(b, work):
    l08, l09 = os.path.join(b, "08_mesh"), os.path.join(b, "09_inference")
    d = os.path.join(work, "d")
    ok_run([l08, *SMALL, "--train", "2", "--save", d])
    ck, long = os.path.join(d, "step-000002"), os.path.join(work, "long", "step-000002")
    shutil.copytree(ck, long)
    m = load_manifest(long)
    offsets = set()
    for i, name in enumerate(sorted(m["tensors"])):
        path = os.path.join(long, name + ".npy")
        rewrite_npy(path, ["v1-192", "v2", "v3"][i % 3])
        with open(path, "rb") as f:
            data = f.read()
        hlen = int.from_bytes(data[8:10], "little") + 10 if data[6] == 1 else int.from_bytes(data[8:12], "little") + 12
        offsets.add((data[6], hlen))
        m["tensors"][name]["bytes"], m["tensors"][name]["crc32"] = len(data), zlib.crc32(data)
    expect((1, 192) in offsets and any(v == 2 for v, _ in offsets) and any(v == 3 for v, _ in offsets),
           f"headers rewritten: {sorted(offsets)}")
    sign(long, m)
    ok_run([l08, *SMALL, "--train", "3", "--resume", ck, "--dump", os.path.join(work, "r0")])
    ok_run([l08, *SMALL, "--train", "3", "--resume", long, "--dump", os.path.join(work, "r1")])
    n = same_dumps(os.path.join(work, "r0"), os.path.join(work, "r1"))
    outs = []
    for c in (ck, long):
        out = ok_run([l09, "--checkpoint", c, "--new", "8"])
        outs.append([x for x in out.splitlines() if not re.search(r"ms|tok/s|GB/s|MB/s|weights:", x)])
    expect(outs[0] == outs[1], "lesson 09: the same output from both", "", "\n".join(outs[1]))
    # PyTorch's loader (np.load) on the rewritten one gives lesson 08's validation loss
    dump = os.path.join(work, "dump")
    ok_run([l08, *SMALL, "--train", "0", "--resume", long, "--dump", dump])
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, os.path.join(here, "reference", "load_checkpoint.py"), long, dump],
                       capture_output=True, text=True)
    expect(p.returncode == 0, "tests/reference/load_checkpoint.py on the rewritten checkpoint", "", p.stdout + p.stderr)
    print(f"ok: .npy headers of {sorted(h for _, h in offsets)} bytes (versions 1.0, 2.0, 3.0): lesson 08 resumes "
          f"the same bits ({n} files), lesson 09 serves the same text, PyTorch loads it")


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    b, work, test, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    tests = {"crash": test_crash, "keep": test_keep, "resume": test_resume, "fuzz": test_fuzz, "npy": test_npy}
    if test not in tests:
        sys.exit(__doc__)
    try:
        tests[test](b, work, *args)
    except Failed as e:
        print(e)
        sys.exit(1)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
