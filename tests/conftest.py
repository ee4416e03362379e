"""pytest's shared fixtures for the tests that run the lessons (tests/lessons/test_NN_*.py).

    make test L=01                      everything of lesson 01 (its pytest file among it)
    /usr/bin/python3 -m pytest tests/lessons -k 01 -n 2      directly, after make

Fixtures:
  build     the build directory (BUILD from the environment, as the Makefile exports it; else build/)
  mpirun    the mpirun command as a list (MPIRUN from the environment: the Makefile's flags)
  lesson    lesson("01_online_softmax", np, *args, env=None) runs a lesson binary under mpirun and
            returns a Run: its exit code, stdout + stderr (out), the command (cmd), and the `check:`
            verdict parsed; run.ok() asserts exit 0 and `check: PASS`, run.fails() exit 1 and
            `check: FAIL`, run.usage_error(text) the error contract (exit 2, one line, `error: ...`
            containing text); every failed assertion shows the command and the output's tail
  script    script("tests/check_dump_01.py", dir, 3) runs one of the repository's Python checkers
            with Debian's python (PYTHON) from the repository's root; returns a Run (no `check:`
            line: run.has("^dump ok") asserts what it printed)
  tmp_path  pytest's own: a fresh directory per test
"""
import os
import re
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# mpirun's own libevent sometimes warns as ranks exit on a loaded machine ("[warn] Epoll MOD(1) on
# fd N failed ...": open-mpi/ompi#2004); it is not the program's output
MPIRUN_NOISE = re.compile(r"^\[warn\] Epoll [A-Z]+\(\d+\) on fd \d+ failed")
DEFAULT_MPIRUN = ("mpirun --oversubscribe -q --bind-to none --mca odls_base_sigkill_timeout 0 --mca pml ob1"
                  + (" --allow-run-as-root" if os.geteuid() == 0 else ""))


class Run:
    def __init__(self, cmd, rc, out):
        self.cmd, self.rc, self.out = cmd, rc, out
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

    def has(self, pattern):
        """The first match of a regular expression in the output (multiline), asserted to exist."""
        m = re.search(pattern, self.out, re.M)
        assert m, self.why(f"expected the output to match /{pattern}/")
        return m


@pytest.fixture(scope="session")
def build():
    return os.path.join(ROOT, os.environ.get("BUILD", "build"))


@pytest.fixture(scope="session")
def mpirun():
    return shlex.split(os.environ.get("MPIRUN", DEFAULT_MPIRUN))


@pytest.fixture(scope="session")
def python():
    return os.environ.get("PYTHON", "/usr/bin/python3")


@pytest.fixture(scope="session")
def lesson(build, mpirun):
    def run(name, np, *args, env=None, timeout=300):
        exported = sum((["-x", k] for k in (env or {})), [])
        cmd = mpirun + exported + ["-np", str(np), os.path.join(build, "bin", name)] + [str(a) for a in args]
        p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout)
        return Run(cmd, p.returncode, p.stdout)
    return run


@pytest.fixture(scope="session")
def has_cuda(build):
    out = subprocess.run([os.path.join(build, "tests", "device_query")], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True).stdout
    return re.search(r"\bcuda\b", out) is not None


@pytest.fixture(scope="session")
def script(python):
    def run(path, *args, timeout=300):
        cmd = [python, path] + [str(a) for a in args]
        p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        return Run(cmd, p.returncode, p.stdout)
    return run
