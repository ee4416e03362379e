"""The exercises (scripts/exercise.py), graded: for every lesson, the student's copy compiles and
its run (the grading build with every stub, FF_GRADE=*=0) stops at its first unwritten exercise
with one error line and exit 2; in the grading build (each region's stub, solution and planted
mistakes side by side, FF_GRADE picking one at run time) each exercise's stub alone stops the
run, its solution passes the lesson's check on every run that grades it, and each planted
mistake fails it. The grader can fail (its self-test), and the
student's flow works: make exercise, make run EX=1, make grade EX=1, an edited copy kept.

A lesson's build and compile happen once per pytest process (its tests share an xdist group, so they run
in one worker: pytest.ini's --dist loadgroup).
"""
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import exercise  # noqa: E402  (scripts/exercise.py)

BY_LESSON, FILES = exercise.all_exercises()
BUILDS = {}  # lesson -> its grading binary, or the Problem that stopped the build


def problem(step, *args):
    """What the grading step reports (exercise.Problem), or None; and its result."""
    try:
        return None, step(*args)
    except exercise.Problem as p:
        return str(p), None


def binaries(lesson):
    if lesson not in BUILDS:
        BUILDS[lesson] = problem(exercise.build_copies, lesson, BY_LESSON[lesson], FILES)
    why, built = BUILDS[lesson]
    if why:
        pytest.fail(f"the exercise copies of {lesson} do not build: {why}", False)
    return built


def graded(step, *args):
    why, _ = problem(step, *args)
    if why:
        pytest.fail(why, False)


def cases():
    """(lesson, what, exercise, detail) for every graded run."""
    out = []
    for lesson in sorted(BY_LESSON):
        nn = lesson[:2]

        def add(what, e=None, detail=None, name=""):
            out.append(pytest.param(lesson, what, e, detail, id=f"{nn}-{name or what}",
                                    marks=[pytest.mark.lesson(nn), pytest.mark.xdist_group(f"exercises-{nn}")]))
        add("student-copy")
        for e in BY_LESSON[lesson]:
            add("stub", e, name=f"{e.name}-stub")
            for args in e.args or [""]:
                add("solution", e, args, name=f"{e.name}-solution" + (f"[{args}]" if args else ""))
            for k, (old, new) in enumerate(e.bugs, 1):
                add("mistake", e, k, name=f"{e.name}-mistake-{k}")
    return out


@pytest.mark.parametrize("lesson, what, e, detail", cases())
def test_exercise(lesson, what, e, detail):
    grading = binaries(lesson)
    if what == "student-copy":    # compiles; every stub in: stops at the first, exit 2, one line
        graded(exercise.grade_student, lesson, grading)
    elif what == "stub":          # this stub alone stops the run with its own error line
        graded(exercise.grade_stub, lesson, e, grading)
    elif what == "solution":      # the solution passes the lesson's check on this run
        graded(exercise.grade_solution, lesson, e, grading, detail)
    else:                         # planted mistake number `detail` fails the lesson's check
        graded(exercise.grade_mistake, lesson, e, grading, detail)


@pytest.mark.lesson("01")
def test_the_grader_reports_a_planted_mistake_that_changes_nothing(command, python):
    command([python, "scripts/exercise.py", "grade", "--self-test"], timeout=600).succeeds("^self-test ok")


@pytest.mark.lesson("01")
def test_make_exercise_run_and_grade_flow_and_an_edited_copy_is_kept(command, tmp_path):
    """make exercise L=01 writes the student's copy, make run L=01 EX=1 stops at its first stub,
    make grade L=01 EX=1 says FAIL, an edited copy is kept (FORCE=1 starts over)."""
    d = tmp_path / "ex"
    make = ["make", "-s", "--no-print-directory"]
    unset = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")
    wrote = command(make + ["exercise", "L=01", f"EXERCISES={d}"], unset=unset)
    copy = d / "01_online_softmax" / "main.cpp"
    assert wrote.rc == 0 and copy.is_file(), wrote.why(f"make exercise writes {copy}")
    ran = command(make + ["run", "L=01", "EX=1", f"EXERCISES={d}"], unset=unset)
    errors = [x for x in ran.lines if x.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: exercise merge is not written yet"), \
        ran.why("make run EX=1 stops at the first stub with one error line")
    grade = command(make + ["grade", "L=01", "EX=1", f"EXERCISES={d}"], unset=unset)
    assert grade.rc != 0, grade.why("make grade EX=1 fails on the unwritten copy")
    grade.has(r"^  FAIL  make run L=01 EX=1 the default run: error: exercise merge is not written yet")
    grade.has(r"^your exercises of lesson 01: 0 of 1 runs pass")
    with open(copy, "a") as f:
        f.write("// mine\n")
    kept = command(make + ["exercise", "L=01", f"EXERCISES={d}"], unset=unset)
    assert kept.rc != 0 and "// mine" in copy.read_text(), kept.why("make exercise refuses to overwrite an edited copy")
    forced = command(make + ["exercise", "L=01", f"EXERCISES={d}", "FORCE=1"], unset=unset)
    assert forced.rc == 0 and "// mine" not in copy.read_text(), forced.why("FORCE=1 starts the copy over")


@pytest.mark.lesson("01")
@pytest.mark.parametrize("case, want", [
    ("ok", None),
    ("key-line-left", "its hint: belongs in its lesson's exercises.json"),
    ("not-listed", "exercise add is in no lesson's exercises.json"),
    ("listed-nowhere", "exercise gone is marked nowhere"),
    ("mistake-twice", "occurs 2 times in the solution"),
    ("mistake-malformed", 'each mistake is {"write": OLD, "as": NEW}'),
    ("other-lessons-mark", "is marked in lesson 02_y but listed in lessons/01_x/exercises.json"),
])
def test_the_exercises_metadata_is_refused_where_it_does_not_match_the_marks(tmp_path, monkeypatch, case, want):
    """scripts/exercise.py reads the marks in the code and each lesson's exercises.json together:
    a key line left under a mark, a mark no lesson lists, an entry marked nowhere, a mistake's
    text that is not once in the solution, a malformed mistake and a lesson listing another
    lesson's mark are each one Problem naming it; a mark under common/ belongs to the lesson
    that lists it."""
    import json
    code = {"lessons/01_x/main.cpp": "int f(int x) {\n  // [exercise:add] Add one.\n  return x + 1;\n  // [/exercise]\n}\n",
            "common/layers/twice.cpp": "int g(int x) {\n  // [exercise:twice] Double it.\n  return x * 2;\n  // [/exercise]\n}\n"}
    meta = {"add": {"minutes": 5, "hints": ["one more"], "mistakes": [{"write": "x + 1", "as": "x"}]},
            "twice": {"minutes": 5, "mistakes": [{"write": "x * 2", "as": "x * 3"}]}}
    if case == "key-line-left":
        code["lessons/01_x/main.cpp"] = code["lessons/01_x/main.cpp"].replace("Add one.\n", "Add one.\n  // hint: one more\n")
    elif case == "not-listed":
        del meta["add"]
    elif case == "listed-nowhere":
        meta["gone"] = meta["add"]
    elif case == "mistake-twice":
        code["lessons/01_x/main.cpp"] = code["lessons/01_x/main.cpp"].replace("return x + 1;", "return x + 1 + (x + 1) * 0;")
    elif case == "mistake-malformed":
        meta["add"]["mistakes"] = [{"write": "x + 1"}]
    elif case == "other-lessons-mark":
        code["lessons/02_y/main.cpp"] = "int h() {\n  // [exercise:h] Zero.\n  return 0;\n  // [/exercise]\n}\n"
        meta["h"] = {"mistakes": [{"write": "0", "as": "1"}]}
    for path, text in code.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (tmp_path / "lessons" / "01_x" / "exercises.json").write_text(json.dumps(meta))
    monkeypatch.setattr(exercise, "ROOT", str(tmp_path))
    if want is None:
        by_lesson, _ = exercise.all_exercises()
        assert sorted(by_lesson) == ["01_x"], by_lesson
        got = {e.name: (e.path, e.bugs, e.hints) for e in by_lesson["01_x"]}
        assert got == {"add": ("lessons/01_x/main.cpp", [("x + 1", "x")], ["one more"]),
                       "twice": ("common/layers/twice.cpp", [("x * 2", "x * 3")], [])}, got
        return
    with pytest.raises(exercise.Problem) as refused:
        exercise.all_exercises()
    assert want in str(refused.value), str(refused.value)
