"""The repository as a whole: the build is complete and minimal, make lessons needs no test and no
npm package, every deck builds, the lessons keep their shape (function and file sizes) and their
layers (includes go down or sideways, never up)."""
import os
import re
import shutil
import stat

import pytest

# a make of its own, not a part of the make test that may be running this suite
OWN_MAKE = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")


def test_after_the_build_a_second_make_has_nothing_to_compile_or_link(command):
    if os.environ.get("SANITIZE") == "1":
        pytest.skip("make sanitize builds with other flags than plain make's")
    run = command(["make", "-n", "--no-print-directory", "build", "V=1"], unset=OWN_MAKE)
    assert run.rc == 0, run.why("make -n build")
    steps = [x for x in run.lines if re.search(r" -c | -o ", x)]
    assert not steps, run.why("a second make would compile or link:\n" + "\n".join(steps[:10]))


def test_make_lessons_on_an_empty_build_compiles_the_library_and_the_lessons_and_no_test(command, tmp_path):
    run = command(["make", "-n", "--no-print-directory", "lessons", f"BUILD={tmp_path / 'empty-build'}", "V=1"],
                  unset=OWN_MAKE)
    assert run.rc == 0, run.why("make -n lessons")
    assert " -c lessons/08_mesh/main.cpp" in run.out and " -c common/core/tensor.cpp" in run.out, \
        run.why("make lessons compiles the lessons and the library")
    tests = [x for x in run.lines if re.search(r" -c tests/|FIVEFOLD_WITH_SLIDES", x)]
    assert not tests, run.why("make lessons builds a test or installs the slides' tools:\n" + "\n".join(tests[:5]))


def test_make_lessons_dependencies_fetch_no_npm_package_the_slides_do(command, tmp_path):
    # install-deps.sh in a copy of the tree without slides/node_modules, with an npm that only says
    # it was called: make's and make lessons' call runs no npm, the slides' call does
    d = tmp_path / "deps-tree"
    (d / "scripts").mkdir(parents=True)
    (d / "slides").mkdir()
    (d / "bin").mkdir()
    shutil.copy("scripts/install-deps.sh", d / "scripts")
    for f in ("package.json", "package-lock.json"):
        shutil.copy(os.path.join("slides", f), d / "slides")
    called = d / "npm-called"
    npm = d / "bin" / "npm"
    npm.write_text(f'#!/bin/sh\necho npm "$*" >> {called}\nexit 1\n')
    npm.chmod(npm.stat().st_mode | stat.S_IEXEC)
    path = f"{d / 'bin'}:{os.environ['PATH']}"
    plain = command(["bash", d / "scripts" / "install-deps.sh"], env={"PATH": path}, unset=("FIVEFOLD_WITH_SLIDES",))
    assert plain.rc == 0, plain.why("install-deps.sh for make lessons")
    assert not called.exists(), plain.why("make lessons' dependencies called npm")
    slides = command(["bash", d / "scripts" / "install-deps.sh"], env={"PATH": path, "FIVEFOLD_WITH_SLIDES": 1})
    assert slides.rc != 0, slides.why("the slides' dependencies with a failing npm must fail")
    assert called.exists(), slides.why("the slides' dependencies did not call npm")


@pytest.mark.long
def test_every_deck_builds_to_html_and_its_markers_figures_and_runs_exist(command, python):
    command([python, "scripts/slides.py", "check"], timeout=600).succeeds(r"^slides ok: [0-9]+ decks build to HTML")


@pytest.mark.parametrize("checker, verdict", [
    ("tests/check_shape.py", "^shape ok"),    # no main.cpp over 550 lines, no function over 200 (but those being cut down)
    ("tests/check_layers.py", "^layers ok"),  # util, kernels, core, comm, layers, lesson, then lessons: down or sideways
], ids=["shape", "layers"])
def test_the_lessons_shape_and_layers_and_the_checker_catches_a_breach(command, python, checker, verdict):
    command([python, checker, "--self-test"]).succeeds(r"self-test: .* caught")
    command([python, checker]).succeeds(verdict)
