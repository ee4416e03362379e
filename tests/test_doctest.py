"""The doctest suites, each test case a pytest item: tests/unit (tensor, autograd, ops, cli, npy,
the lessons' units, the goldens), the kernel tests (every CUDA kernel against its cpu twin, on
the SIMT emulator; on the GPU too where there is one) and tests/mpi (communication, ZeRO, FSDP,
tensor and expert parallelism) under mpirun at 1 to 4 ranks.

The test cases are doctest's (`unit_tests --list-test-cases`); a group of them (one source file,
or one world size of mpi_tests) runs as one process with doctest's XML reporter, and each
item asserts its own case's result there. A process that dies before it reports fails every item
of its group, with its output's tail. The items of one group run in one pytest-xdist worker
(xdist_group: make test passes --dist loadgroup).

    build/tests/unit_tests -tc='autograd: a diamond*'       one case, as doctest runs it
    mpirun -np 3 build/tests/mpi_tests -sf='*test_zero*'     one file's cases at 3 ranks
"""
import os
import re
import shlex
import xml.etree.ElementTree as ET

import pytest

from conftest import DEFAULT_MPIRUN, ROOT, device_query, run_command

BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
UNIT = os.path.join(BUILD, "tests", "unit_tests")
MPI = os.path.join(BUILD, "tests", "mpi_tests")
MPIRUN = shlex.split(os.environ.get("MPIRUN", DEFAULT_MPIRUN))

# The lessons a test file's cases belong to (make test L=NN runs them); the rest are the core's.
LESSONS_OF_FILE = {
    "test_kernels_lesson01.cpp": ["01"],
    "test_kernels_attention.cpp": ["02"],
    "test_moe.cpp": ["03", "04"], "test_kernels_moe.cpp": ["03", "04"], "test_kernels_moe_routing.cpp": ["03", "04"],
    "test_dsv3_moe.cpp": ["05"], "test_dsv3_ep.cpp": ["05", "08"], "test_kernels_rope.cpp": ["05", "09"],
    "test_overlap.cpp": ["06"],
    "test_schedule.cpp": ["07"],
    "test_estimate.cpp": ["08"], "test_manifest.cpp": ["08", "09"], "test_zero.cpp": ["08"], "test_fsdp.cpp": ["08"],
    "test_tensor_parallel.cpp": ["08"], "test_mesh.cpp": ["08"], "test_model.cpp": ["08", "09"],
    "test_corpus.cpp": ["08"],
    "test_inference.cpp": ["09"],
}


def listing(cmd):
    """[(case name, source file, skipped)] of a doctest binary: its XML listing."""
    run = run_command(cmd + ["--list-test-cases", "--reporters=xml"], timeout=60)
    start = run.out.find("<?xml")
    if run.rc != 0 or start < 0:
        raise RuntimeError(run.why("the doctest binary could not list its test cases (make builds it)"))
    root = ET.fromstring(run.out[start:run.out.index("</doctest>") + len("</doctest>")])
    return [(t.get("name"), t.get("filename"), t.get("skipped") == "true") for t in root.iter("TestCase")]


class Group:
    """One process of a doctest binary: the command and, once run, each case's verdict."""

    def __init__(self, key, cmd, env=None, skip=None):
        self.key, self.cmd, self.env, self.skip = key, cmd, env or {}, skip
        self.verdicts = None  # {case: [failure texts]} once run

    def run(self):
        if self.verdicts is None:
            self.result = run_command(self.cmd + ["--reporters=xml"], env=self.env, timeout=600)
            self.verdicts = xml_verdicts(self.result.out)
        return self.verdicts

    def check(self, case):
        verdicts = self.run()
        run = self.result
        if case not in verdicts:
            pytest.fail(run.why(f"doctest case {case!r} has no result: the process ended before it reported"), pytrace=False)
        problems = verdicts[case]
        command = " ".join(map(shlex.quote, run.cmd))
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        if problems:
            pytest.fail(f"doctest case {case!r} failed\n  command: {env + ' ' if env else ''}{command}\n"
                        + "\n".join("  " + p for p in problems), pytrace=False)
        assert run.rc == 0 or any(verdicts.values()), run.why("every case passed, yet the process failed")


def xml_verdicts(out):
    """{case name: [what failed]} from doctest's XML reports: rank 0's, then those of any other
    rank that failed (its lines prefixed "rank R| "; tests/mpi/main.cpp gathers them)."""
    reports = [("", "\n".join(x for x in out.splitlines() if not re.match(r"rank \d+\| ", x)))]
    for r in sorted(set(re.findall(r"^rank (\d+)\| ", out, re.M))):
        prefix = f"rank {r}| "
        reports.append((f"rank {r}: ", "\n".join(x[len(prefix):] for x in out.splitlines() if x.startswith(prefix))))
    verdicts = {}
    for who, text in reports:
        m = re.search(r"<doctest .*?</doctest>", text, re.S)
        if not m:
            continue
        for tc in ET.fromstring(m.group(0)).iter("TestCase"):
            if tc.get("skipped") == "true":
                continue
            problems = verdicts.setdefault(tc.get("name"), [])
            for e in tc.iter():
                where = f"{e.get('filename')}:{e.get('line')}: " if e.get("filename") else ""
                if e.tag == "Expression" and e.get("success") == "false":
                    original, expanded = e.findtext("Original", "").strip(), e.findtext("Expanded", "").strip()
                    problems.append(f"{who}{where}{e.get('type')}( {original} ) is {e.get('type')}( {expanded} )")
                elif e.tag == "Message" and "ERROR" in (e.get("type") or ""):
                    problems.append(f"{who}{where}{e.get('type')}: {e.findtext('Text', '').strip()}")
                elif e.tag == "Exception":
                    problems.append(f"{who}exception: {(e.text or '').strip()}")
            overall = tc.find("OverallResultsAsserts")
            if overall is not None and overall.get("test_case_success") == "false" and not problems:
                problems.append(f"{who}the case failed (doctest's verdict)")
    return verdicts


def params():
    """One pytest.param per (group, case)."""
    out = []

    def add(group, cases):
        for name, filename, skipped in cases:
            base = os.path.basename(filename)
            marks = [pytest.mark.xdist_group(group.key),
                     pytest.mark.lesson(*LESSONS_OF_FILE.get(base, []))]
            if skipped:
                marks.append(pytest.mark.skip(reason="skipped in doctest"))
            if group.skip:
                marks.append(pytest.mark.skip(reason=group.skip))
            out.append(pytest.param(group, name, marks=marks, id=f"{group.key}::{name}"))

    def by_file(cases):
        files = {}
        for c in cases:
            files.setdefault(os.path.basename(c[1]), []).append(c)
        return files

    unit = listing([UNIT, "--test-suite-exclude=kernels"])
    for base, cases in by_file(unit).items():
        add(Group(f"unit/{base}", [UNIT, "--test-suite-exclude=kernels", f"--source-file=*/{base}"]), cases)
    kernels = listing([UNIT, "--test-suite=kernels"])
    gpu = device_query(BUILD)[0]
    for device in ("sim", "cuda"):
        for base, cases in by_file(kernels).items():
            cmd = [UNIT, "--test-suite=kernels", f"--source-file=*/{base}"]
            skip = None if device == "sim" or gpu else "no GPU here (the same case ran on sim)"
            add(Group(f"kernels-{device}/{base}", cmd, env={"FF_TEST_DEVICE": device}, skip=skip), cases)
    mpi = listing(MPIRUN + ["-np", "1", MPI])
    for np in (1, 2, 3, 4):
        add(Group(f"mpi-np{np}", MPIRUN + ["-np", str(np), MPI]), mpi)
    return out


@pytest.mark.parametrize("group, case", params())
def test_doctest(group, case):
    group.check(case)
