"""Every output a README shows equals a real run (the convention: tests/check_readme.py), one test
per block so that they run in parallel; the checker can fail (its self-test); and no README shows
a command's output without the marker that has it checked.

    /usr/bin/python3 -m pytest tests/test_readme.py -k 08 -n 2       lesson 08's blocks
    /usr/bin/python3 tests/check_readme.py --actual lessons/08_mesh/README.md   what the runs print
"""
import glob
import os
import re

import pytest

import check_readme
from conftest import ROOT

PATHS = ["README.md"] + sorted(glob.glob("lessons/*/README.md", root_dir=ROOT))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return check_readme.read_blocks(path, f.read())


def lesson_of(path, block):
    m = re.match(r"lessons/(\d\d)_", path)
    return m.group(1) if m else block.command[0]


def ranks(path, block):
    """The ranks the block's command runs on: its NP=, else the lesson's NP file (else 1)."""
    _, np_, _ = block.command
    if np_:
        return int(np_)
    f = os.path.join(ROOT, "lessons", glob.glob(os.path.join(ROOT, "lessons", lesson_of(path, block) + "_*"))[0], "NP")
    return int(open(f).read()) if os.path.exists(f) else 1


# the blocks of tens of seconds on two cores: 16 ranks or more, the emulator, the timed runs
SLOW = re.compile(r"--device sim|--speed|--overlap")


def blocks():
    out = []
    for path in PATHS:
        for b in read(path)[0]:
            marks = [pytest.mark.lesson(lesson_of(path, b))]
            if ranks(path, b) >= 16 or SLOW.search(" ".join(b.command[2])):
                marks.append(pytest.mark.long)
            out.append(pytest.param(b, id=b.where(), marks=marks))
    return out


@pytest.fixture(scope="session")
def readme_env(build):
    return build, os.environ.get("MPIRUN") or check_readme.default_mpirun(), check_readme.has_cuda(build)


@pytest.mark.parametrize("block", blocks())
def test_block_equals_a_real_run(block, readme_env):
    report = check_readme.check_block(block, *readme_env)
    assert not report, report


@pytest.mark.parametrize("path", PATHS)
def test_every_shown_output_is_marked(path):
    errors = read(path)[1]
    assert not errors, "\n".join(errors)


@pytest.mark.lesson("03")
def test_the_checker_catches_a_changed_line(command, python):
    command([python, "tests/check_readme.py", "--self-test"]).succeeds("^self-test ok")
