"""The exercises (scripts/exercise.py), graded: for every lesson, the student's copy builds and
stops at its first unwritten exercise with one error line and exit 2; in the grading build (each
region's stub, solution and planted mistakes side by side, FF_GRADE picking one at run time) each
exercise's stub alone stops the run, its solution passes the lesson's check on every run that
grades it, and each planted mistake fails it. The grader can fail (its self-test), and the
student's flow works: make exercise, make run EX=1, make grade EX=1, an edited copy kept.

A lesson's two builds happen once per pytest process (its tests share an xdist group, so they run
in one worker: pytest.ini's --dist loadgroup).
"""
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import exercise  # noqa: E402  (scripts/exercise.py)

BY_LESSON, FILES = exercise.all_exercises()
BUILDS = {}  # lesson -> (student binary, grading binary), or the Problem that stopped the build


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
    student, grading = binaries(lesson)
    if what == "student-copy":    # stops at its first stub: exit 2, one error line
        graded(exercise.grade_student, lesson, student)
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
