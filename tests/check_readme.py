"""The output shown in the READMEs, checked against real runs, so that it cannot go stale.

Convention. In README.md and lessons/*/README.md, a run's output is shown as a fenced block
with an HTML comment on the line right before it (invisible on GitHub):

    <!-- expected-output -->
    ```
    $ make run L=02 NP=4 ARGS="--causal"
    ...
    + mpirun --oversubscribe -q --bind-to none --mca odls_base_sigkill_timeout 0 --mca pml ob1 --allow-run-as-root -np 4 build/bin/02_ring_attention --causal
    == 02 ring attention: P=4 ranks, B=1 H=2 S=128 D=16, causal, layout contiguous, order evenodd, device cpu
    ...
        forward … ms, backward … ms (slowest rank)
    ...
    check: PASS (0 comparisons failed)
    ```

  * The block's first line is the command, `$ make run L=NN [NP=P] [ARGS="..."]`. The checker
    runs what `make run` runs once the build is done, scripts/run-lesson.sh NN P ARGS..., with
    $BUILD and $MPIRUN from the environment (the Makefile exports them; tests/conftest.py sets the same defaults).
  * Every other line is a line of the run's output (stdout and stderr), equal after stripping
    trailing whitespace, except:
      - a line `...` stands for any number of lines, none included (make's build lines, a long
        middle): the next line of the block is looked for from there on, and its first match
        is taken;
      - `…` stands for any number (12, -3.5, 1.2e-07, inf, nan): write it for what varies from
        run to run (times, rates, anything that depends on the machine's load); the spaces
        next to it stand for any number of spaces, so a column still matches when a number's
        width changes, and so does a number padded on its left: `(…%)` matches `( 9.6%)`.
  * The output ends where the block ends, unless the block's last line is `...`.
  * The run must exit 0; `<!-- expected-output: exit=N -->` expects exit status N instead.
  * The `+ ...` line that make run prints is shown as root sees it with the default build
    directory: in the output, "+ $MPIRUN " reads as "+ mpirun --oversubscribe -q --bind-to none --mca
    odls_base_sigkill_timeout 0 --mca pml ob1 --allow-run-as-root " and "$BUILD/bin/" as "build/bin/".
  * The blocks show device cpu (`--device auto` without a GPU). Where this build and machine
    have a GPU, auto would pick cuda, so a block that names no --device runs with --device cpu
    added (and left out of its `+` line again).
  * A block whose ARGS give --save /tmp/fivefold-NAME shows a first run: that directory is
    removed before the run (lesson 08 saves only into a directory without another run's
    checkpoints).
  * A block may be indented (inside a list item): its fence's indentation is removed from its lines.
  * A fenced block that starts with a `$ ` line and shows output must carry the marker, so
    that no shown output escapes the check.

Usage: /usr/bin/python3 tests/check_readme.py [README...]   (default: README.md, lessons/*/README.md)
       /usr/bin/python3 tests/check_readme.py --self-test  (the checker catches a wrong line)
       /usr/bin/python3 tests/check_readme.py --actual [README...]  (print the real outputs)
On success one line, "readme ok: N blocks, M lines"; on a mismatch, for each block that differs,
README:LINE with the expected and the actual line, and exit 1.
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!--\s*expected-output(?::\s*(?P<opts>.*?))?\s*-->\s*$")
DOC_MPIRUN = "mpirun --oversubscribe -q --bind-to none --mca odls_base_sigkill_timeout 0 --mca pml ob1 --allow-run-as-root"
NUMBER = r"(?:[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan)"
GAP = "..."


def default_mpirun():
    root = " --allow-run-as-root" if os.geteuid() == 0 else ""
    return "mpirun --oversubscribe -q --bind-to none --mca odls_base_sigkill_timeout 0 --mca pml ob1" + root


# ---------------------------------------------------------------------------- reading

class Block:
    def __init__(self, path, marker_line, opts, first_line, lines):
        self.path = path
        self.marker_line = marker_line  # 1-based line of the marker
        self.first_line = first_line    # 1-based line of the `$` command line
        self.lines = lines              # the block's lines after the command
        self.command = None             # (L, NP, [args]) of `$ make run ...`
        self.command_text = ""
        self.exit = 0
        for opt in (opts or "").split():
            key, _, value = opt.partition("=")
            if key == "exit" and value.isdigit():
                self.exit = int(value)
            else:
                raise ValueError(f"{path}:{marker_line}: unknown marker option '{opt}' "
                                 "(allowed: exit=N)")

    def where(self, i=None):
        return f"{self.path}:{self.first_line if i is None else self.first_line + 1 + i}"


def parse_command(line, where):
    """`$ make run L=NN [NP=P] [ARGS="..."]` -> (L, NP, [args])."""
    words = shlex.split(line[2:])
    if words[:2] != ["make", "run"]:
        raise ValueError(f"{where}: a checked block starts with `$ make run L=NN ...`, not `{line}`")
    vals = {}
    for w in words[2:]:
        key, eq, value = w.partition("=")
        if not eq or key not in ("L", "NP", "ARGS"):
            raise ValueError(f"{where}: `{w}` in `{line}`: make run takes L=, NP= and ARGS=")
        vals[key] = value
    if "L" not in vals:
        raise ValueError(f"{where}: `{line}` names no lesson (L=NN)")
    return vals["L"], vals.get("NP", ""), shlex.split(vals.get("ARGS", ""))


def read_blocks(path, text):
    """The marked blocks of a README; unmarked blocks that show a command's output are errors."""
    blocks, errors = [], []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i].strip())
        fence = lines[i].strip().startswith("```")
        if not (m or fence):
            i += 1
            continue
        start = i + 1 if m else i  # the fence line
        if m and (start >= len(lines) or not lines[start].strip().startswith("```")):
            errors.append(f"{path}:{i + 1}: the expected-output marker must be followed by a fenced block")
            i += 1
            continue
        end = start + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        indent = len(lines[start]) - len(lines[start].lstrip(" "))  # a block inside a list item
        body = [l[min(indent, len(l) - len(l.lstrip(" "))):].rstrip() for l in lines[start + 1:end]]
        if m:
            if not body or not body[0].startswith("$ "):
                errors.append(f"{path}:{start + 2}: a checked block starts with its command, "
                              "`$ make run L=NN ...`")
            else:
                try:
                    b = Block(path, i + 1, m.group("opts"), start + 2, body[1:])
                    b.command = parse_command(body[0], b.where())
                    b.command_text = body[0][2:]
                    blocks.append(b)
                except ValueError as e:
                    errors.append(str(e))
        elif body and body[0].startswith("$ ") and len(body) > 1:
            errors.append(f"{path}:{start + 1}: this block shows the output of `{body[0][2:]}` "
                          "but is not checked: put <!-- expected-output --> on the line before it")
        i = end + 1
    return blocks, errors


# ---------------------------------------------------------------------------- matching

def line_matcher(expected):
    """A function telling whether an output line matches the expected line."""
    if "…" not in expected:
        return lambda actual: actual == expected
    parts = expected.split("…")
    rx = ""
    for k, part in enumerate(parts):
        lead = part[:len(part) - len(part.lstrip(" "))] if k > 0 else ""
        core = part[len(lead):]
        trail = core[len(core.rstrip(" ")):] if k < len(parts) - 1 else ""
        core = core[:len(core) - len(trail)]
        rx += (" *" if lead else "") + re.escape(core) + (" *" if trail else "")
        if k < len(parts) - 1:
            rx += " *" + NUMBER     # a field printed right-aligned (%5.1f) pads on the left
    pattern = re.compile(rx)
    return lambda actual: pattern.fullmatch(actual) is not None


def compare(expected, actual):
    """expected: the block's lines (`...` a gap); actual: the output's lines. Returns None when
    they match, else (index into expected or None for 'end of block', expected, actual)."""
    pos, gap = 0, False
    for i, exp in enumerate(expected):
        if exp.strip() == GAP:
            gap = True
            continue
        match = line_matcher(exp)
        if gap:
            j = next((j for j in range(pos, len(actual)) if match(actual[j])), None)
            if j is None:
                return (i, exp, f"(no line of the output from line {pos + 1} on matches it)")
            pos, gap = j + 1, False
        else:
            if pos >= len(actual):
                return (i, exp, "(the output ended)")
            if not match(actual[pos]):
                return (i, exp, actual[pos])
            pos += 1
    if not gap and pos < len(actual):
        return (None, "(the end of the block)", actual[pos])
    return None


# ---------------------------------------------------------------------------- running

def has_cuda(build):
    """Whether --device auto means cuda here (tests/progs/device_query says so)."""
    try:
        out = subprocess.run([os.path.join(build, "tests", "device_query")], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b" cuda" in out


def run_block(block, build, mpirun, cuda=False):
    lesson, np_, args = block.command
    # a block that saves checkpoints shows a first run: lesson 08 saves only into a directory
    # without another run's checkpoints, so the one a previous check left goes first
    for flag, value in zip(args, args[1:]):
        if flag == "--save" and value.startswith("/tmp/fivefold-"):
            shutil.rmtree(value, ignore_errors=True)
    added = ["--device", "cpu"] if cuda and not any(a.startswith("--device") for a in args) else []
    env = dict(os.environ, BUILD=build, MPIRUN=mpirun)
    try:
        p = subprocess.run(["bash", "scripts/run-lesson.sh", lesson, np_] + args + added, cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        out, rc = p.stdout.decode("utf-8", "replace"), p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode("utf-8", "replace"), "timeout (300 s)"
    lines = [l.rstrip() for l in out.rstrip("\n").split("\n")] if out.strip() else []
    for k, l in enumerate(lines):  # the `+` line as the README shows it (see the top)
        if l.startswith(f"+ {mpirun} "):
            l = f"+ {DOC_MPIRUN} " + l[len(f"+ {mpirun} "):]
            if added and l.endswith(" " + " ".join(added)):
                l = l[:-len(" " + " ".join(added))]
            lines[k] = l.replace(f" {build}/bin/", " build/bin/")
    return rc, lines


def check_block(block, build, mpirun, cuda=False):
    """"" when the block matches a real run, else the report."""
    rc, actual = run_block(block, build, mpirun, cuda)
    cmd = f"`{block.command_text}`"
    if rc != block.exit:
        tail = "\n".join("    | " + l for l in actual[-15:])
        return f"{block.where()}: {cmd} exited {rc}, the block expects {block.exit}\n{tail}"
    diff = compare(block.lines, actual)
    if diff is None:
        return ""
    i, exp, act = diff
    where = block.where(i) if i is not None else f"{block.path}:{block.first_line + 1 + len(block.lines)}"
    return (f"{where}: the output of {cmd} differs from the README\n"
            f"  expected: {exp}\n  actual:   {act}")


def counted_lines(block):
    return sum(1 for l in block.lines if l.strip() != GAP)


def check_files(paths, build, mpirun, texts=None):
    """Returns (blocks, lines, reports)."""
    nblocks = nlines = 0
    reports = []
    cuda = has_cuda(build)
    for path in paths:
        text = texts[path] if texts else open(os.path.join(ROOT, path), encoding="utf-8").read()
        blocks, errors = read_blocks(path, text)
        reports += errors
        for b in blocks:
            nblocks += 1
            nlines += counted_lines(b)
            report = check_block(b, build, mpirun, cuda)
            if report:
                reports.append(report)
    return nblocks, nlines, reports


# ---------------------------------------------------------------------------- self-test

def self_test(build, mpirun):
    """The checker must be able to fail: wrong lines, missing and extra lines are caught, and a
    real block with one line changed is reported at that line."""
    cases = [  # (expected, actual, index of the expected line reported, or None for a match)
        (["a 1", "b 2"], ["a 1", "b 2"], None),
        (["a 1", "b 2"], ["a 1", "b 3"], 1),                                 # a wrong line
        (["t  …  us"], ["t     12.5  us"], None),                             # a number, any width
        (["t  …  us"], ["t   1.2e-07  us"], None),
        (["t  …  us"], ["t  fast  us"], 0),                                   # … is a number only
        (["x …%  7.7%"], ["x 8.4%   7.7%"], 0),                               # spaces not next to … are exact
        (["b (…% of …)"], ["b ( 9.6% of 44.5)"], None),                       # a number padded on its left
        (["b (…% of …)"], ["b (9.6%of 44.5)"], 0),
        (["a", "...", "z"], ["a", "b", "c", "z"], None),                       # a gap
        (["a", "...", "z"], ["a", "b", "c"], 2),                               # missing after a gap
        (["a", "b"], ["a", "b", "c"], "end"),                                 # output longer
        (["a", "b", "c"], ["a", "b"], 2),                                      # output shorter
        (["a", "..."], ["a", "b", "c"], None),                                 # trailing gap
    ]
    for n, (exp, act, want) in enumerate(cases):
        got = compare(exp, act)
        got_i = None if got is None else ("end" if got[0] is None else got[0])
        if got_i != want:
            print(f"self-test FAILED: case {n + 1}: {exp} vs {act}: reported {got}, want {want}")
            return 1
    # A real block: unchanged it passes, with one line changed the mismatch names that line.
    src = "lessons/03_smoe/README.md"
    text = open(os.path.join(ROOT, src), encoding="utf-8").read()
    blocks, errors = read_blocks(src, text)
    if errors or not blocks:
        print(f"self-test FAILED: {src} has no checkable block: {errors}")
        return 1
    b = blocks[0]
    k = max(i for i, l in enumerate(b.lines) if l.strip() != GAP and "…" not in l)
    target = b.first_line + 1 + k  # 1-based README line that gets changed
    lines = text.split("\n")
    lines[target - 1] = lines[target - 1].replace("PASS", "FAIL") if "PASS" in lines[target - 1] \
        else lines[target - 1] + " (changed)"
    wrong = "\n".join(lines)
    _, _, ok_reports = check_files([src], build, mpirun, {src: text})
    if ok_reports:
        print("self-test FAILED: the unchanged README does not pass:\n" + "\n".join(ok_reports))
        return 1
    _, _, reports = check_files([src], build, mpirun, {src: wrong})
    if len(reports) != 1 or not reports[0].startswith(f"{src}:{target}: ") \
            or "expected:" not in reports[0]:
        print(f"self-test FAILED: a changed line {src}:{target} was not reported as such: {reports}")
        return 1
    print(f"self-test ok: {len(cases)} matching cases, and a changed line at {src}:{target} is caught")
    return 0


# ---------------------------------------------------------------------------- main

def main(argv):
    build = os.environ.get("BUILD", "build")
    mpirun = os.environ.get("MPIRUN") or default_mpirun()
    os.chdir(ROOT)
    if argv[:1] == ["--self-test"]:
        return self_test(build, mpirun)
    show = argv[:1] == ["--actual"]
    if show:
        argv = argv[1:]
    paths = argv or ["README.md"] + sorted(glob.glob("lessons/*/README.md"))
    if show:
        for path in paths:
            blocks, errors = read_blocks(path, open(path, encoding="utf-8").read())
            for e in errors:
                print(e)
            for b in blocks:
                rc, lines = run_block(b, build, mpirun, has_cuda(build))
                print(f"==== {b.where()} (exit {rc})")
                print("\n".join(lines))
        return 0
    nblocks, nlines, reports = check_files(paths, build, mpirun)
    if reports:
        print("\n".join(reports))
        print(f"readme FAILED: {len(reports)} of the shown outputs differ from real runs "
              "(convention: tests/check_readme.py)")
        return 1
    print(f"readme ok: {nblocks} blocks, {nlines} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
