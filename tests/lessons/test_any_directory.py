"""Every lesson from any directory: the course's data (data/tinyshakespeare.txt, read by lessons 05
with --train, 08 and 10) found from the executable's directory upward, or else in the tree the binary
was built from (common/util/files.h: course_data_file)."""
import glob
import os
import shutil

import pytest

from conftest import ROOT, passes_on_stdout

LESSONS = sorted(os.path.basename(d) for d in glob.glob(os.path.join(ROOT, "lessons", "[0-9][0-9]_*")))


@pytest.mark.long
@pytest.mark.lesson(*(n[:2] for n in LESSONS))
def test_every_lessons_default_demo_passes_started_from_root_with_the_binarys_full_path(lesson):
    # each lesson's default run on its NP file's ranks, all ten of them; the three that read the
    # course's data train two steps on it (05's --train 2, 08's 16 ranks on 2 steps of its 20, 10's
    # training part: the data is found at its start or never; the default runs whole are make run's
    # README blocks)
    assert len(LESSONS) == 10, f"the course's lessons: {LESSONS}"
    for name in LESSONS:
        with open(os.path.join(ROOT, "lessons", name, "NP")) as f:
            np_ = int(f.read())
        args = ["--train", 2] if name in ("05_deepseek_moe", "08_mesh", "10_precision") else []
        passes_on_stdout(lesson(name, np_, *args, cwd="/", separate=True))


@pytest.mark.lesson("08")
def test_08_copied_out_of_the_tree_reads_the_data_of_the_tree_it_was_built_from(command, mpirun, build, tmp_path):
    # run from /tmp: --help names the data file of the tree it was built from, and the run finds it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    binary = shutil.copy(os.path.join(os.path.realpath(build), "bin", "08_mesh"), elsewhere)
    data = os.path.join(os.path.realpath(ROOT), "data", "tinyshakespeare.txt")
    run = command(mpirun + ["-np", 1, binary, "--help"], cwd="/tmp", separate=True)
    assert run.rc == 0 and f"(default: {data})" in run.stdout, run.why(f"--help names (default: {data}) on stdout")
    passes_on_stdout(command(mpirun + ["-np", 2, binary, "--train", 2], cwd="/tmp", separate=True))
