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


def blocks():
    out = []
    for path in PATHS:
        for b in read(path)[0]:
            out.append(pytest.param(b, id=b.where(), marks=pytest.mark.lesson(lesson_of(path, b))))
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
