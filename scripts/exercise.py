"""Exercises: the parts of a lesson a student writes, marked in the lesson's own code.

    /usr/bin/python3 scripts/exercise.py make NN [--force]   write exercises/NN_name/ (make exercise L=NN)
    /usr/bin/python3 scripts/exercise.py list [NN...]        every lesson's exercises, one line each
    /usr/bin/python3 scripts/exercise.py stale DIR           a warning if DIR's originals changed since
    /usr/bin/python3 scripts/exercise.py mine NN             your copy on every run that grades it (make grade L=NN EX=1)
    /usr/bin/python3 scripts/exercise.py grade [NN...]       make grade: every exercise can fail and pass
    /usr/bin/python3 scripts/exercise.py grade --self-test   the grader reports a mistake that does not fail

A region of code is marked so (in a .cpp of the lesson, or of common/ or kernels/ for a subject
the lesson teaches from there), the marks alone in the code:

    // [exercise:NAME] The task, in one line.
    ... the solution: the lesson's own code, whole statements ...
    // [/exercise]

and what teaching it needs is in the lesson's exercises.json (lessons/NN_name/exercises.json,
which also says whose a region in common/ is), NAME: {
    "minutes": 20,                       how long it takes, about
    "hints": ["what to look at", ...],
    "args": ["--gate topk-softmax", ...] the flags of runs that reach the region: the stub and the
                                         mistakes are graded on the first, the solution on each
                                         ("": the default run; no args: only that)
    "mistakes": [{"write": OLD, "as": NEW}, ...]   planted mistakes: the text OLD of the solution
                                         (once in it), replaced by NEW, must fail the lesson's check
    "stub": CODE                         what the stub needs to compile, after the call (optional)
    "see": WHERE                         where the student reads up (default: the lesson's README)
}

The region must be a sequence of whole statements that declares nothing the code after it uses
(a function's body, or statements that assign to variables declared before it): the stub and the
grading versions stand in its place inside braces.

`make` writes the files that hold the lesson's marks into exercises/NN_name/ (lesson files at
the top, others under their own path: exercises/03_smoe/common/layers/moe.cpp), each region
replaced by its task, hints and a call of ff::exercise_missing, which ends the run with one
`error: exercise NAME is not written yet (see ...)` line and exit 2 (common/util/exercise.h).
It keeps a copy the student has edited unless --force. `make run L=NN EX=1` builds the copy
with the lesson's other files (the Makefile's exercise-bin) and runs it: the lesson's own check
is the grade.

`grade` checks, for every lesson with exercises: that the student's copy compiles and its run
(the grading build below with every stub, FF_GRADE=*=0) ends with exactly one such error line
and exit 2; then, in one grading build where each region
holds its stub, its solution and its planted mistakes side by side (FF_GRADE=NAME=K picks one:
common/util/exercise.h), that each stub ends the run with its own error line and exit 2, that
the solutions pass the lesson's check, and that each planted mistake fails it: `check: FAIL`
(exit 1), or an `error:` line (a message of the wrong size, a deadlock the watchdog names, a
schedule the lesson's validation refuses: exit 1 or 2), never a crash.
"""
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPEN = re.compile(r"^(?P<indent>\s*)// \[exercise:(?P<name>[a-z0-9][a-z0-9-]*)\]\s*(?P<task>.*)$")
CLOSE = re.compile(r"^\s*// \[/exercise\]\s*$")
# the old key lines (hint:, bug: ... under the mark): their content belongs in exercises.json
KEY = re.compile(r"^\s*// (?P<key>hint|minutes|args|bug|stub|see):\s?(?P<value>.*)$")
# an exercise's marks (its opening, its closing): what the slides' excerpts and the shape check
# leave out (scripts/slides.py, tests/check_shape.py)
EXERCISE_MARK = re.compile(r"^\s*// (\[exercise:|\[/exercise\])")
META = "exercises.json"  # each lesson's exercises' teaching: hints, mistakes, minutes, args
SOURCES = ("lessons", "common", "kernels")
MANIFEST = ".exercise.json"


class Problem(Exception):
    pass


class Exercise:
    def __init__(self, path, line, indent, name, task):
        self.path, self.line, self.indent, self.name, self.task = path, line, indent, name, task
        self.hints, self.bugs, self.stub, self.args, self.minutes, self.see = [], [], "", [], 0, ""
        self.first = self.last = 0  # the region's lines: marker .. closing marker (0-based)
        self.body_start = 0         # first line of the solution

    def where(self):
        return f"{self.path}:{self.line}"


def lesson_dirs():
    return sorted(d for d in os.listdir(os.path.join(ROOT, "lessons")) if re.match(r"^\d\d_", d))


def lesson_dir(nn):
    for d in lesson_dirs():
        if d.startswith(nn + "_"):
            return d
    raise Problem(f"no lesson {nn} (available: {' '.join(d[:2] for d in lesson_dirs())})")


def parse_file(path):
    """The exercises marked in one file (path relative to ROOT), their teaching not yet attached."""
    lines = open(os.path.join(ROOT, path)).read().split("\n")
    found, cur = [], None
    for i, line in enumerate(lines):
        m = OPEN.match(line)
        if m:
            if cur:
                raise Problem(f"{path}:{i + 1}: exercise {m['name']} opens inside exercise {cur.name}")
            cur = Exercise(path, i + 1, m["indent"], m["name"], m["task"].strip())
            cur.first = i
            cur.body_start = i + 1
            if i + 1 < len(lines) and KEY.match(lines[i + 1]):
                raise Problem(f"{path}:{i + 2}: exercise {cur.name}: its {KEY.match(lines[i + 1])['key']}: belongs in "
                              f"its lesson's {META}, the code keeps only the marks")
            continue
        if CLOSE.match(line):
            if not cur:
                raise Problem(f"{path}:{i + 1}: [/exercise] without an opening mark")
            cur.last = i
            if not cur.task:
                raise Problem(f"{cur.where()}: exercise {cur.name} has no task on its mark")
            found.append(cur)
            cur = None
    if cur:
        raise Problem(f"{cur.where()}: exercise {cur.name} is never closed (// [/exercise])")
    return found, lines


def attach(e, lesson, meta, lines):
    """Exercise e's teaching from its lesson's exercises.json entry, checked."""
    where = f"lessons/{lesson}/{META}: {e.name}"
    known = {"minutes", "hints", "args", "mistakes", "stub", "see"}
    if set(meta) - known:
        raise Problem(f"{where}: unknown keys {sorted(set(meta) - known)} (allowed: {sorted(known)})")
    e.minutes = int(meta.get("minutes", 0))
    e.hints, e.args, e.stub, e.see = list(meta.get("hints", [])), list(meta.get("args", [])), meta.get("stub", ""), meta.get("see", "")
    mistakes = meta.get("mistakes", [])
    if any(not isinstance(b, dict) or set(b) != {"write", "as"} for b in mistakes):
        raise Problem(f"{where}: each mistake is {{\"write\": OLD, \"as\": NEW}}, got {mistakes}")
    e.bugs = [(b["write"], b["as"]) for b in mistakes]
    if not e.bugs:
        raise Problem(f"{where}: no planted mistake (mistakes: [{{\"write\": OLD, \"as\": NEW}}])")
    body = "\n".join(lines[e.body_start:e.last])
    for old, _ in e.bugs:
        if body.count(old) != 1:
            raise Problem(f"{where}: the mistake's text '{old}' occurs {body.count(old)} times in the solution at "
                          f"{e.where()} (must be once)")


def all_exercises():
    """{lesson dir: [Exercise...]}, in file order within a lesson, and the files' lines."""
    by_lesson, files, marked = {}, {}, []
    for top in SOURCES:
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for n in sorted(names):
                if not n.endswith((".cpp", ".cu")):
                    continue
                path = os.path.relpath(os.path.join(dirpath, n), ROOT)
                text = open(os.path.join(ROOT, path)).read()
                if "// [exercise:" not in text:
                    continue
                exs, lines = parse_file(path)
                files[path] = lines
                marked += exs
    teaching = {}  # exercise name -> (its lesson, its entry)
    for lesson in lesson_dirs():
        meta_path = os.path.join(ROOT, "lessons", lesson, META)
        if not os.path.exists(meta_path):
            continue
        try:
            entries = json.load(open(meta_path))
        except ValueError as err:
            raise Problem(f"lessons/{lesson}/{META}: not valid JSON: {err}")
        for name, meta in entries.items():
            if name in teaching:
                raise Problem(f"lessons/{lesson}/{META}: exercise {name} is also lessons/{teaching[name][0]}/{META}'s")
            teaching[name] = (lesson, meta)
    names = {}
    for e in marked:
        if e.name in names:
            raise Problem(f"{e.where()}: exercise name {e.name} is used twice (also {names[e.name]})")
        names[e.name] = e.where()
        if e.name not in teaching:
            raise Problem(f"{e.where()}: exercise {e.name} is in no lesson's {META}")
        owner, meta = teaching[e.name]
        inside = re.match(r"^lessons/(\d\d_[^/]+)/", e.path)
        if inside and inside.group(1) != owner:
            raise Problem(f"{e.where()}: exercise {e.name} is marked in lesson {inside.group(1)} but listed in "
                          f"lessons/{owner}/{META}")
        attach(e, owner, meta, files[e.path])
        by_lesson.setdefault(owner, []).append(e)
    for name, (lesson, _) in teaching.items():
        if name not in names:
            raise Problem(f"lessons/{lesson}/{META}: exercise {name} is marked nowhere (// [exercise:{name}])")
    return by_lesson, files


def see_of(e, lesson):
    return e.see or f"lessons/{lesson}/README.md, Exercises"


def copy_path(path, lesson):
    """Where a marked file goes in the exercise directory."""
    prefix = f"lessons/{lesson}/"
    return path[len(prefix):] if path.startswith(prefix) else path


def c_string(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def student_region(e, lesson):
    ind = e.indent
    out = [f"{ind}// [exercise:{e.name}] {e.task}"]
    out += [f"{ind}// hint: {h}" for h in e.hints]
    for a in e.args:
        out.append(f"{ind}// graded by: make run L={lesson[:2]} EX=1" + (f" ARGS=\"{a}\"" if a else ""))
    out.append(f"{ind}// Write it here, in place of the next line; make run L={lesson[:2]} EX=1 grades it.")
    out.append(f"{ind}ff::exercise_missing({c_string(e.name)}, {c_string(see_of(e, lesson))});")
    if e.stub:
        out.append(f"{ind}{e.stub}")
    out.append(f"{ind}// [/exercise]")
    return out


def grading_region(e, lesson, lines):
    """Stub, planted mistakes and solution side by side, FF_GRADE choosing one."""
    ind = e.indent
    body = lines[e.body_start:e.last]
    text = "\n".join(body)
    out = [f"{ind}{{",
           f"{ind}const int ff_variant_ = ff::exercise_variant({c_string(e.name)});",
           f"{ind}if (ff_variant_ == 0) {{",
           f"{ind}  ff::exercise_missing({c_string(e.name)}, {c_string(see_of(e, lesson))});"]
    if e.stub:
        out.append(f"{ind}  {e.stub}")
    for k, (old, new) in enumerate(e.bugs, 1):
        out.append(f"{ind}}} else if (ff_variant_ == {k}) {{")
        out += text.replace(old, new).split("\n")
    out.append(f"{ind}}} else {{")
    out += body
    out += [f"{ind}}}", f"{ind}}}"]
    return out


def rewrite(path, lines, exs, region_fn, lesson):
    """The file with each of its regions replaced by region_fn's lines, and the include the
    stubs need."""
    out, i = [], 0
    for e in sorted((e for e in exs if e.path == path), key=lambda e: e.first):
        out += lines[i:e.first]
        out += region_fn(e)
        i = e.last + 1
    out += lines[i:]
    include = '#include "common/util/exercise.h"'
    if include not in out:  # after the file's first include (its own header)
        for j, line in enumerate(out):
            if line.startswith("#include"):
                out.insert(j + 1, include)
                break
    return "\n".join(out)


def write_copy(lesson, exs, files, dest, kind):
    """Writes the lesson's marked files into dest; returns {copy path: original path}."""
    os.makedirs(dest, exist_ok=True)
    mapping = {}
    for path in sorted({e.path for e in exs}):
        if kind == "student":
            text = rewrite(path, files[path], exs, lambda e: student_region(e, lesson), lesson)
        else:
            text = rewrite(path, files[path], exs, lambda e: grading_region(e, lesson, files[path]), lesson)
        rel = copy_path(path, lesson)
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target + ".tmp", "w") as f:
            f.write(text)
        os.replace(target + ".tmp", target)
        mapping[rel] = path
    # the build's list: which objects of the lesson the copies stand in for
    with open(os.path.join(dest, "files.mk"), "w") as f:
        f.write("# written by scripts/exercise.py: the lesson's files this directory replaces\n")
        f.write(f"EX_LESSON := {lesson}\n")
        f.write("EX_REPLACES := " + " ".join(sorted(mapping.values())) + "\n")
        def named(path):  # relative to the tree when inside it (build/obj/ mirrors it)
            rel = os.path.relpath(path, ROOT)
            return path if rel.startswith("..") else rel
        f.write("EX_COPIES := " + " ".join(sorted(named(os.path.join(dest, r)) for r in mapping)) + "\n")
    return mapping


def exercises_root():
    """Where make exercise writes: exercises/ in the tree, or FF_EXERCISES (the Makefile's
    EXERCISES=DIR; the tests use one of their own)."""
    return os.path.abspath(os.environ.get("FF_EXERCISES") or os.path.join(ROOT, "exercises"))


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# ---------------------------------------------------------------------------- make

def cmd_make(nn, force):
    lesson = lesson_dir(nn)
    by_lesson, files = all_exercises()
    exs = by_lesson.get(lesson, [])
    if not exs:
        raise Problem(f"lesson {nn} has no exercises yet")
    dest = os.path.join(exercises_root(), lesson)
    manifest = os.path.join(dest, MANIFEST)
    if os.path.isdir(dest) and not force:
        edited = []
        if os.path.exists(manifest):
            recorded = json.load(open(manifest))
            for rel, sha in recorded.get("written", {}).items():
                p = os.path.join(dest, rel)
                if not os.path.exists(p) or digest(p) != sha:
                    edited.append(rel)
        else:
            edited = ["(no record of what was written)"]
        if edited:
            raise Problem(f"{os.path.relpath(dest)}/ holds your work ({', '.join(edited)}): "
                          f"make exercise L={nn} FORCE=1 starts it over")
    if os.path.exists(manifest):  # the files written before (unedited): only those go
        for rel in json.load(open(manifest)).get("written", {}):
            if os.path.exists(os.path.join(dest, rel)):
                os.remove(os.path.join(dest, rel))
    mapping = write_copy(lesson, exs, files, dest, "student")
    written = {rel: digest(os.path.join(dest, rel)) for rel in mapping}
    sources = {orig: digest(os.path.join(ROOT, orig)) for orig in mapping.values()}
    with open(manifest, "w") as f:
        json.dump({"lesson": lesson, "written": written, "sources": sources}, f, indent=1)
    shown = os.path.relpath(dest)
    print(f"{shown}/: {len(exs)} exercises to write")
    for e in exs:
        rel = copy_path(e.path, lesson)
        mins = f", ~{e.minutes} min" if e.minutes else ""
        print(f"  {e.name:<24} {shown}/{rel}{mins}: {e.task}")
    print(f"Edit those files where each says; then make run L={nn} EX=1 builds your copy and runs "
          "the lesson: its check grades you (check: PASS).")


# ---------------------------------------------------------------------------- mine

def cmd_mine(nn):
    """make grade L=NN EX=1: the student's copy run as the grader runs the solutions, every run
    some exercise of the lesson names (and the default one); a line per run, exit 1 unless all
    pass."""
    lesson = lesson_dir(nn)
    by_lesson, _ = all_exercises()
    dest = os.path.join(exercises_root(), lesson)
    if not os.path.exists(os.path.join(dest, "files.mk")):
        raise Problem(f"no {os.path.relpath(dest)}/: make exercise L={nn} writes the lesson's exercises")
    cmd_stale(os.path.relpath(dest, ROOT) if not os.path.relpath(dest, ROOT).startswith("..") else dest)
    rel = os.path.relpath(dest, ROOT)
    binary = build(rel if not rel.startswith("..") else dest)
    runs = [""]
    for e in by_lesson.get(lesson, []):
        runs += [a for a in e.args if a not in runs]
    failed = 0
    for args in runs:
        code, out = run(binary, lesson, args)
        ok = code == 0 and re.search(r"^check: PASS", out, re.M)
        why = "" if ok else next((l for l in out.split("\n") if l.startswith(("error:", "check:"))),
                                 f"exit {code}")
        failed += not ok
        shown = f'ARGS="{args}"' if args else "the default run"
        print(f"  {'PASS' if ok else 'FAIL'}  make run L={nn} EX=1 {shown}" + (f": {why}" if why else ""))
    print(f"your exercises of lesson {nn}: {len(runs) - failed} of {len(runs)} runs pass")
    if failed:
        raise SystemExit(1)


# ---------------------------------------------------------------------------- stale

def cmd_stale(exdir):
    """make run EX=1: a warning line when a file the copy was made from has changed since (a
    git pull): the copy then pairs old code with the rest of the lesson as it is now."""
    manifest = os.path.join(ROOT, exdir, MANIFEST)
    if not os.path.exists(manifest):
        return
    record = json.load(open(manifest))
    changed = [orig for orig, sha in record.get("sources", {}).items()
               if not os.path.exists(os.path.join(ROOT, orig)) or digest(os.path.join(ROOT, orig)) != sha]
    if changed:
        print(f"warning: {', '.join(changed)} changed since {exdir} was written: if the build or the "
              f"check fails for that, save your regions and start over with make exercise "
              f"L={record['lesson'][:2]} FORCE=1", file=sys.stderr)


# ---------------------------------------------------------------------------- list

def cmd_list(nns):
    by_lesson, _ = all_exercises()
    for lesson in lesson_dirs():
        if nns and lesson[:2] not in nns:
            continue
        for e in by_lesson.get(lesson, []):
            print(f"{lesson[:2]}  {e.name:<24} {e.minutes:>3} min  {e.where():<44} {e.task}")


# ---------------------------------------------------------------------------- grade

def sh(cmd, env=None, timeout=600):
    """Runs cmd in its own session: past the timeout the whole group (mpirun and its ranks) is
    killed and the run reported as hanging."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, _ = p.communicate()
        raise Problem(f"{' '.join(cmd)} did not end within {timeout} s (a hang):\n{out[-2000:]}")
    return p.returncode, out


def build(exdir, cxxflags=None):
    """Builds the copies in exdir with the lesson's other objects; cxxflags, when given, replaces
    the copies' optimisation and debug flags (the grader's builds: no debug information)."""
    make = os.environ.get("MAKE", "make")
    passed = [f"{k}={os.environ[k]}" for k in ("BUILD", "OPT", "SANFLAGS", "NO_CUDA") if k in os.environ]
    if cxxflags is not None:
        passed.append(f"CXXFLAGS={cxxflags}")
    code, out = sh([make, "--no-print-directory", "-s", "exercise-bin", f"EXDIR={exdir}"] + passed)
    if code != 0:
        raise Problem(f"{exdir} does not build:\n{out[-3000:]}")
    build_dir = os.environ.get("BUILD", "build")
    return os.path.join(build_dir, "ex", exdir.replace("/", "_"))


def run(binary, lesson, args, grade=None):
    mpirun = shlex.split(os.environ.get("MPIRUN", "mpirun"))
    np = open(os.path.join(ROOT, "lessons", lesson, "NP")).read().strip() if os.path.exists(
        os.path.join(ROOT, "lessons", lesson, "NP")) else "1"
    env = dict(os.environ)
    env.pop("FF_GRADE", None)
    if grade:
        env["FF_GRADE"] = grade
    return sh(mpirun + ["-x", "FF_GRADE"] * bool(grade) + ["-np", np, binary] + shlex.split(args), env=env,
              timeout=300)


MISSING = re.compile(r"^error: exercise (\S+) is not written yet \(see [^)]*\)$", re.M)


def expect_stub(code, out, name, what):
    errors = [l for l in out.split("\n") if l.startswith("error:")]
    m = MISSING.findall(out)
    if code != 2 or len(errors) != 1 or len(m) != 1 or (name and m[0] != name):
        raise Problem(f"{what}: want exit 2 and one line 'error: exercise {name or 'NAME'} is not "
                      f"written yet (see ...)', got exit {code} and:\n{out[-2000:]}")


def check_docs(lesson, exs):
    """The lesson's README lists its exercises (its "Exercises" section) and so does its deck's
    "Your turn" slide."""
    readme = open(os.path.join(ROOT, "lessons", lesson, "README.md")).read()
    if "\n## Exercises\n" not in readme:
        raise Problem(f"lessons/{lesson}/README.md has no '## Exercises' section")
    section = readme.split("\n## Exercises\n", 1)[1].split("\n## ", 1)[0]
    decks = [d for d in os.listdir(os.path.join(ROOT, "slides")) if d.startswith(lesson[:3]) and d.endswith(".md")]
    deck = open(os.path.join(ROOT, "slides", decks[0])).read() if decks else ""
    turn = deck.split("\n# Your turn\n", 1)[1] if "\n# Your turn\n" in deck else ""
    for e in exs:
        if f"`{e.name}`" not in section:
            raise Problem(f"lessons/{lesson}/README.md's Exercises section does not list `{e.name}`")
        if f"`{e.name}`" not in turn:
            raise Problem(f"slides/{decks[0] if decks else lesson + '.md'}: its 'Your turn' slide does not list `{e.name}`")


def build_copies(lesson, exs, files, tag=""):
    """The grading copy of the lesson (each region's stub, solution and planted mistakes side by
    side, FF_GRADE picking one), written under build/grade and built with the build's
    optimisation (no debug information); and the student's copy written beside it and compiled
    to the compiler's checks only (it is what `make exercise` hands out: it must compile; its run,
    every stub in place, is the grading build's with FF_GRADE=*=0). Returns the grading binary."""
    check_docs(lesson, exs)
    base = os.path.join(os.environ.get("BUILD", "build"), "grade")
    student_dir = os.path.join(base, lesson + tag)
    grading_dir = os.path.join(base, lesson + tag + "-graded")
    for d in (student_dir, grading_dir):
        if os.path.isdir(os.path.join(ROOT, d)):
            shutil.rmtree(os.path.join(ROOT, d))
    write_copy(lesson, exs, files, os.path.join(ROOT, grading_dir), "grading")
    grading = build(grading_dir, os.environ.get("OPT", "-O2"))
    write_copy(lesson, exs, files, os.path.join(ROOT, student_dir), "student")
    compiles(student_dir)
    return grading


def compiles(exdir):
    """The copies in exdir pass the compiler (make exercise-syntax: exercise-bin's flags,
    -fsyntax-only)."""
    make = os.environ.get("MAKE", "make")
    passed = [f"{k}={os.environ[k]}" for k in ("BUILD", "SANFLAGS", "NO_CUDA") if k in os.environ]
    code, out = sh([make, "--no-print-directory", "-s", "exercise-syntax", f"EXDIR={exdir}"] + passed)
    if code != 0:
        raise Problem(f"{exdir} does not compile:\n{out[-3000:]}")


def grade_student(lesson, binary):
    """The student's copy stops at its first unwritten exercise: the grading build with every
    stub in place (FF_GRADE=*=0) stops with one error line, exit 2."""
    code, out = run(binary, lesson, "", "*=0")
    expect_stub(code, out, None, f"{lesson}: the student's copy")


def grade_stub(lesson, e, binary):
    code, out = run(binary, lesson, (e.args or [""])[0], f"{e.name}=0")
    expect_stub(code, out, e.name, f"{lesson}: exercise {e.name}'s stub")


def grade_solution(lesson, e, binary, args):
    code, out = run(binary, lesson, args)
    if code != 0 or not re.search(r"^check: PASS", out, re.M):
        raise Problem(f"{lesson}: exercise {e.name}'s solution does not pass the lesson's check "
                      f"with '{args}' (exit {code}):\n{out[-2000:]}")


def grade_mistake(lesson, e, binary, k):
    old, new = e.bugs[k - 1]
    code, out = run(binary, lesson, (e.args or [""])[0], f"{e.name}={k}")
    # a wrong answer fails the check, or stops the run with an error line (sizes that do not
    # match, a deadlock the watchdog names): exit 1 either way, not a crash
    failed = re.search(r"^(check: FAIL|error: )", out, re.M) and not MISSING.search(out)
    if code not in (1, 2) or not failed:
        raise Problem(f"{lesson}: exercise {e.name} with '{old}' written as '{new}' does not "
                      f"fail the lesson's check (exit {code}):\n{out[-2000:]}")


def grade_lesson(lesson, exs, files, tag=""):
    grading = build_copies(lesson, exs, files, tag)
    grade_student(lesson, grading)
    for e in exs:
        grade_stub(lesson, e, grading)
        for args in e.args or [""]:
            grade_solution(lesson, e, grading, args)
        for k in range(1, len(e.bugs) + 1):
            grade_mistake(lesson, e, grading, k)
    return sum(len(e.bugs) for e in exs)


def cmd_self_test():
    """The grader can fail: lesson 01's first exercise given a 'mistake' that changes nothing
    (its first bug's text replaced by itself) must be reported as not failing."""
    by_lesson, files = all_exercises()
    lesson = lesson_dir("01")
    exs = by_lesson[lesson]
    old, _ = exs[0].bugs[0]
    exs[0].bugs[0] = (old, old)
    try:
        grading = build_copies(lesson, exs, files, tag="-selftest")
        grade_mistake(lesson, exs[0], grading, 1)
    except Problem as p:
        if "does not fail the lesson's check" in str(p):
            print(f"self-test ok: a mistake that changes nothing in {exs[0].name} is caught")
            return
        raise
    raise Problem("self-test FAILED: a 'mistake' that changes nothing was not reported")


def cmd_grade(nns):
    nns = [n[:2] for n in nns]  # 03 or 03_smoe
    by_lesson, files = all_exercises()
    lessons = [l for l in lesson_dirs() if (not nns or l[:2] in nns) and l in by_lesson]
    if nns and len(lessons) != len(nns):
        missing = [n for n in nns if not any(l[:2] == n for l in lessons)]
        raise Problem(f"no exercises in lesson(s) {' '.join(missing)}")
    total_ex = total_bugs = 0
    for lesson in lessons:
        bugs = grade_lesson(lesson, by_lesson[lesson], files)
        total_ex += len(by_lesson[lesson])
        total_bugs += bugs
        print(f"  {lesson}: {len(by_lesson[lesson])} exercises, each stub stops the run, the "
              f"solutions pass, {bugs} planted mistakes fail")
    print(f"grade ok: {len(lessons)} lessons, {total_ex} exercises, {total_bugs} planted mistakes")


def main(argv):
    if len(argv) < 2 or argv[1] not in ("make", "list", "grade", "stale", "mine"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        if argv[1] == "make":
            if len(argv) < 3 or not re.match(r"^\d\d$", argv[2]):
                raise Problem("make exercise L=NN (a lesson's two digits)")
            cmd_make(argv[2], "--force" in argv[3:])
        elif argv[1] == "list":
            cmd_list(argv[2:])
        elif argv[1] == "stale":
            cmd_stale(argv[2])
        elif argv[1] == "mine":
            cmd_mine(argv[2] if len(argv) > 2 else "")
        elif argv[2:3] == ["--self-test"]:
            cmd_self_test()
        else:
            cmd_grade(argv[2:])
    except Problem as p:
        print(f"error: {p}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
