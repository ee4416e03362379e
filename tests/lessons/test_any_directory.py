"""Every lesson from any directory: the course's data (data/tinyshakespeare.txt, read by lessons 05
with --train and 08) found from the executable's directory upward, or else in the tree the binary
was built from (common/util/files.h: course_data_file)."""
import glob
import os
import re
import shutil

import pytest

from conftest import ROOT

LESSONS = sorted(os.path.basename(d) for d in glob.glob(os.path.join(ROOT, "lessons", "[0-9][0-9]_*")))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.lesson(n[:2])) for n in LESSONS])
def test_default_demo_passes_started_from_root_with_the_binarys_full_path(lesson, name):
    with open(os.path.join(ROOT, "lessons", name, "NP")) as f:
        np_ = int(f.read())
    args = ["--train", 2] if name == "05_deepseek_moe" else []
    lesson(name, np_, *args, cwd="/").ok()


@pytest.mark.lesson("08")
def test_08_copied_out_of_the_tree_reads_the_data_of_the_tree_it_was_built_from(command, mpirun, build, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    binary = shutil.copy(os.path.join(os.path.realpath(build), "bin", "08_mesh"), elsewhere)
    data = os.path.join(os.path.realpath(ROOT), "data", "tinyshakespeare.txt")
    command(mpirun + ["-np", 1, binary, "--help"], cwd="/tmp").succeeds(re.escape(f"(default: {data})"))
    command(mpirun + ["-np", 2, binary, "--train", 2], cwd="/tmp").ok()
