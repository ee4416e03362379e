"""pytest's shared fixtures and helpers for every test here (tests/README.md says what is where).

    make test L=01                                   everything of lesson 01
    /usr/bin/python3 -m pytest tests/lessons -k 01 -n 2      directly, after make

Fixtures:
  build     the build directory (BUILD from the environment, as the Makefile exports it; else build/)
  mpirun    the mpirun command as a list (MPIRUN from the environment: the Makefile's flags)
  lesson    lesson("01_online_softmax", np, *args, env=None, timeout=300, separate=False, cwd=ROOT)
            runs a lesson binary under mpirun and returns a Run: its exit code (rc), stdout +
            stderr (out; separate=True keeps them apart as .stdout and .stderr too), the command
            (cmd), the `check:` verdict parsed. run.ok() asserts exit 0 and `check: PASS`,
            run.fails() exit 1 and `check: FAIL`, run.usage_error(text) the error contract (exit 2,
            one line, `error: ...` containing text), run.succeeds(regex) exit 0 and a matching
            line, run.has(regex) a matching line, run.stdout_has(regex) one on stdout alone. Every
            failed assertion shows the command and the output's tail
  script    script("tests/check_dump_01.py", dir, 3) runs one of the repository's Python checkers
            with Debian's python (PYTHON) from the repository's root; returns a Run
  command   command(argv, env=None, cwd=ROOT, timeout=300, separate=False, unset=()) runs any
            command (make, a test program) and returns a Run
  has_cuda, two_gpus_with_nccl   what device_query says this machine has
  tmp_path  pytest's own: a fresh directory per test
Helpers: passes_on_stdout(run), same_tree(a, b) (diff -r), same_files(a, b, pattern).

Marks:
  lesson("08", ...)   the lessons a test belongs to, beyond its file's (test_NN_*.py is lesson NN's):
                      --lesson 08 (make test L=08) runs those tests only
  long                a test of tens of seconds: started first, so that it does not run alone at the end
"""
import atexit
import filecmp
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# mpirun's own libevent sometimes warns as ranks exit on a loaded machine ("[warn] Epoll MOD(1) on
# fd N failed ...": open-mpi/ompi#2004); it is not the program's output
MPIRUN_NOISE = re.compile(r"^\[warn\] Epoll [A-Z]+\(\d+\) on fd \d+ failed")
DEFAULT_MPIRUN = ("mpirun --oversubscribe -q --bind-to none --mca odls_base_sigkill_timeout 0 --mca pml ob1"
                  + (" --allow-run-as-root" if os.geteuid() == 0 else ""))

# what the Makefile exports to the scripts the tests call (exercise.py, check_readme.py,
# run-lesson.sh), the same when pytest runs without make
os.environ.setdefault("MPIRUN", DEFAULT_MPIRUN)
# The suite starts some 1,300 mpirun jobs on one machine. Without a GPU, hwloc's scan of the PCI
# devices (which mpirun and every rank make to place ranks near GPUs and network cards) serves
# nothing here and is a fifth of a job's start: measured on tests/lessons/test_bad_input.py,
# 30 s with it and 24 s without. With a GPU the scan is kept.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("HWLOC_COMPONENTS", "-pci,-linuxio")
# Each pytest process (xdist worker) gives its mpirun jobs a session directory of their own.
# Open MPI 4 keeps every job's under one /tmp/ompi.HOST.UID, which the last job to end removes:
# a job starting in another worker at that moment fails before its ranks start ("ORTE_ERROR_LOG:
# Error in file ../../../orte/util/session_dir.c"), seen once in a whole suite's run.
# (A worker inherits its controller's environment: FF_OMPI_SESSION_PID tells ours from one the
# user set.)
if "OMPI_MCA_orte_tmpdir_base" not in os.environ or "FF_OMPI_SESSION_PID" in os.environ:
    _session_base = tempfile.mkdtemp(prefix="ff-ompi-")
    os.environ["OMPI_MCA_orte_tmpdir_base"] = _session_base
    os.environ["FF_OMPI_SESSION_PID"] = str(os.getpid())
    atexit.register(shutil.rmtree, _session_base, True)
os.environ.setdefault("BUILD", "build")
os.environ.setdefault("PYTHON", "/usr/bin/python3")


class Run:
    def __init__(self, cmd, rc, out, stdout=None, stderr=None):
        self.cmd, self.rc, self.out = cmd, rc, out
        self.stdout, self.stderr = stdout, stderr
        self.lines = [x for x in out.splitlines() if not MPIRUN_NOISE.match(x)]
        m = re.search(r"^check: (PASS|FAIL)", out, re.M)
        self.check = m.group(1) if m else None

    def why(self, what):
        tail = "\n".join("    | " + x for x in self.lines[-30:])
        return f"{what}\n  command: {' '.join(map(shlex.quote, self.cmd))}\n  exit {self.rc}, output's tail:\n{tail}"

    def ok(self):
        assert self.rc == 0 and self.check == "PASS", self.why("expected exit 0 and check: PASS")
        return self

    def fails(self):
        assert self.rc == 1 and self.check == "FAIL", self.why("expected exit 1 and check: FAIL (a planted bug caught)")
        return self

    def usage_error(self, text=""):
        shown = [x for x in self.lines if x.strip()]
        assert self.rc == 2 and len(shown) == 1 and shown[0].startswith("error: "), \
            self.why("expected the error contract: exit 2, exactly one line, `error: ...`")
        assert text in shown[0], self.why(f"expected the error to say {text!r}")
        return self

    def succeeds(self, pattern):
        """Exit 0 and the output matching a regular expression (multiline); returns the match."""
        assert self.rc == 0, self.why("expected exit 0")
        return self.has(pattern)

    def stdout_has(self, pattern):
        """The first match of a regular expression (multiline) in stdout alone (separate=True)."""
        m = re.search(pattern, self.stdout, re.M)
        assert m, self.why(f"expected stdout to match /{pattern}/")
        return m

    def has(self, pattern):
        """The first match of a regular expression in the output (multiline), asserted to exist."""
        m = re.search(pattern, self.out, re.M)
        assert m, self.why(f"expected the output to match /{pattern}/")
        return m


LESSON_FILE = re.compile(r"(?:^|/)test_(\d\d)_[^/]*\.py$")


def pytest_addoption(parser):
    parser.addoption("--lesson", metavar="NN", default="",
                     help="only lesson NN's tests (make test L=NN): its test_NN_*.py and every test marked lesson(NN)")


def pytest_configure(config):
    config.addinivalue_line("markers", "lesson(*nn): the lessons this test belongs to, beyond its file's")
    config.addinivalue_line("markers", "long: tens of seconds; started first")


def lessons_of(item):
    """The lessons a test belongs to: its file's number (test_NN_*.py) and its lesson marks."""
    found = set()
    m = LESSON_FILE.search(item.nodeid.split("::")[0])
    if m:
        found.add(m.group(1))
    for mark in item.iter_markers("lesson"):
        found.update(str(a) for a in mark.args)
    return found


def pytest_collection_modifyitems(session, config, items):
    want = config.getoption("--lesson")
    if want:
        if not re.fullmatch(r"\d\d", want):
            raise pytest.UsageError(f"--lesson {want}: a lesson's two digits (01 ... 10)")
        keep = [i for i in items if want in lessons_of(i)]
        config.hook.pytest_deselected(items=[i for i in items if want not in lessons_of(i)])
        items[:] = keep
    # the long ones first (a stable sort keeps the files' order otherwise)
    items.sort(key=lambda i: i.get_closest_marker("long") is None)


PASSED, FAILED = set(), set()  # node ids


def pytest_runtest_logreport(report):
    """A test passed when its call passed and no phase failed; failed when any phase failed (with
    pytest-xdist the reports reach the controlling process, which counts)."""
    if report.failed:
        FAILED.add(report.nodeid)
    elif report.when == "call" and report.passed:
        PASSED.add(report.nodeid)


def pytest_unconfigure(config):
    # the last line of make test, after pytest's own summary: the plain count
    if not hasattr(config, "workerinput") and not config.option.collectonly:
        print(f"{len(PASSED - FAILED)} passed, {len(FAILED)} failed")


def passes_on_stdout(run):
    """Exit 0 and `check: PASS` on stdout (a run made with separate=True); the run."""
    run.ok()
    run.stdout_has(r"^check: PASS")
    return run


def same_tree(a, b):
    """Two directories with the same paths and every file byte-identical (diff -r); the file count."""
    def paths(d):
        return sorted(str(p.relative_to(d)) for p in d.rglob("*"))
    pa, pb = paths(a), paths(b)
    assert pa == pb, f"{a} and {b} hold different paths: only in the first {sorted(set(pa) - set(pb))[:10]}, " \
                     f"only in the second {sorted(set(pb) - set(pa))[:10]}"
    files = [x for x in pa if (a / x).is_file()]
    _, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert not (mismatch or errors), f"files of {a} that differ in {b}: {(mismatch + errors)[:10]}"
    return len(files)


def same_files(a, b, pattern="*.npy"):
    """The number of files of a matching pattern, each byte-identical to its namesake in b (asserted)."""
    names = sorted(p.name for p in a.glob(pattern))
    assert names, f"no {pattern} in {a}"
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not (mismatch or errors), f"files of {a} that differ in {b}: {(mismatch + errors)[:10]}"
    return len(names)


@pytest.fixture(scope="session")
def build():
    return os.path.join(ROOT, os.environ.get("BUILD", "build"))


@pytest.fixture(scope="session")
def mpirun():
    return shlex.split(os.environ.get("MPIRUN", DEFAULT_MPIRUN))


@pytest.fixture(scope="session")
def python():
    return os.environ.get("PYTHON", "/usr/bin/python3")


def run_command(argv, env=None, cwd=ROOT, timeout=300, separate=False, unset=()):
    """Runs argv in a session of its own: past the timeout the whole group (mpirun and its ranks)
    is killed and the Run has exit 124 and a last line saying so. env adds to the environment,
    unset takes variables out of it."""
    cmd = [str(a) for a in argv]
    full_env = dict(os.environ, **{k: str(v) for k, v in (env or {}).items()})
    for k in unset:
        full_env.pop(k, None)
    p = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, text=True,
                         stderr=subprocess.PIPE if separate else subprocess.STDOUT, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        out += f"\n(killed: no end within {timeout} s)\n"
        rc = 124
    if separate:
        err = "\n".join(x for x in err.splitlines() if not MPIRUN_NOISE.match(x))
        return Run(cmd, rc, out + err, stdout=out, stderr=err)
    return Run(cmd, rc, out)


@pytest.fixture(scope="session")
def lesson(build, mpirun):
    def run(name, np, *args, env=None, timeout=300, separate=False, cwd=ROOT):
        exported = sum((["-x", k] for k in (env or {})), [])
        cmd = mpirun + exported + ["-np", str(np), os.path.join(build, "bin", name)] + list(args)
        return run_command(cmd, env=env, cwd=cwd, timeout=timeout, separate=separate)
    return run


@pytest.fixture(scope="session")
def command():
    return run_command


def device_query(build):
    """What tests/progs/device_query says this build and machine have: (cuda usable, GPUs with NCCL
    between them: at least two)."""
    out = run_command([os.path.join(build, "tests", "device_query")], timeout=60).out
    gpus = re.search(r"^gpus: (\d+)", out, re.M)
    nccl = bool(re.search(r"^backends:.* nccl", out, re.M) and gpus and int(gpus.group(1)) >= 2)
    return re.search(r"\bcuda\b", out) is not None, nccl


@pytest.fixture(scope="session")
def has_cuda(build):
    return device_query(build)[0]


@pytest.fixture(scope="session")
def two_gpus_with_nccl(build):
    return device_query(build)[1]


@pytest.fixture(scope="session")
def script(python):
    def run(path, *args, timeout=300):
        cmd = [python, path] + [str(a) for a in args]
        p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        return Run(cmd, p.returncode, p.stdout)
    return run
