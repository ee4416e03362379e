"""The shape of the lessons: each lesson's main.cpp reads in one sitting, so no lessons/*/main.cpp
is longer than MAX_MAIN lines and no function in lessons/ longer than MAX_FUNCTION lines; the
floors every lesson reads through hold shorter pieces still, no function in common/ longer than
MAX_COMMON_FUNCTION. An
exercise's marks (its `// [exercise:...]` line, its key lines and its closing line:
scripts/exercise.py) are annotations, not the code, and are not counted in a main.cpp.

A function is found as C++ is written here: a definition at column 0 (or a member defined in its
class, indented two spaces) whose line or the lines after it end in `{`, running to the `}` at
its own indentation. Lambdas count as part of the function around them; a class is not a
function, its members are.

CEILINGS holds the files and functions still being cut down to size (DESIGN.md: a main.cpp of
about 550 lines): each may not grow past the length it has, so the shape only gets better;
an entry whose file or function has shrunk under the limit, or is gone, is itself an error, so
the table shrinks with them.

  check_shape.py              check the tree
  check_shape.py --self-test  show that an oversized main and function are caught
"""
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MAIN = 550
MAX_FUNCTION = 200
MAX_COMMON_FUNCTION = 100
# file or file:function -> the most lines it may have until it is cut down
CEILINGS = {}

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from exercise import EXERCISE_MARK  # noqa: E402 (the marks' one definition)
START = re.compile(r"^( {0,2})(?!//|#|return\b|if\b|for\b|while\b|switch\b|else\b)"
                   r"[A-Za-z_][\w:<>,*&\s]*?\b([A-Za-z_~][\w]*)\s*\(")
CLASS = re.compile(r"^(class|struct)\s+([A-Za-z_]\w*)[^;]*$")


def functions(lines):
    """(name, first line, length) of every function and class body in a C++ file."""
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        m = CLASS.match(line) or START.match(line)
        if not m:
            i += 1
            continue
        indent = len(line) - len(line.lstrip(" "))
        name = m.group(2)
        # the opening brace: on this line or within the next few (a long signature)
        j = i
        while j < len(lines) and j < i + 8 and not lines[j].rstrip().endswith("{"):
            if lines[j].rstrip().endswith((";", "}")):  # a declaration, or a body on one line
                break
            j += 1
        if j >= len(lines) or not lines[j].rstrip().endswith("{"):
            i += 1
            continue
        end = j + 1
        close = re.compile(r"^" + " " * indent + r"\}")
        while end < len(lines) and not close.match(lines[end]):
            end += 1
        if CLASS.match(line):
            i = j + 1  # on into its members
            continue
        out.append((name, i + 1, end - i + 1))
        i = end + 1
    return out


def problems_in(root, ceilings):
    problems, seen = [], set()

    def judge(key, where, n, most):
        """n lines at `where` against `most`, or against its ceiling while it has one."""
        limit = ceilings.get(key, most)
        if key in ceilings:
            seen.add(key)
            if n <= most:
                problems.append(f"{key}: {n} lines, within {most}: take it out of CEILINGS")
        if n > limit:
            problems.append(f"{where} {n} lines, more than {limit}"
                            + (" (its ceiling until it is cut down)" if key in ceilings else ""))

    for dirpath, _, files in os.walk(os.path.join(root, "lessons")):
        for f in sorted(files):
            if not f.endswith((".cpp", ".h", ".cu")):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)
            lines = open(path, encoding="utf-8").read().split("\n")
            if f == "main.cpp":
                marks = sum(1 for l in lines if EXERCISE_MARK.match(l))
                judge(rel, f"{rel}:", len(lines) - (1 if lines[-1] == "" else 0) - marks, MAX_MAIN)
            for name, first, length in functions(lines):
                judge(f"{rel}:{name}", f"{rel}:{first}: {name} is", length, MAX_FUNCTION)
    for dirpath, _, files in os.walk(os.path.join(root, "common")):
        for f in sorted(files):
            if not f.endswith((".cpp", ".h", ".cu")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            for name, first, length in functions(open(os.path.join(dirpath, f), encoding="utf-8").read().split("\n")):
                judge(f"{rel}:{name}", f"{rel}:{first}: {name} is", length, MAX_COMMON_FUNCTION)
    for key in sorted(set(ceilings) - seen):
        problems.append(f"{key}: in CEILINGS but not found (gone or renamed): take it out")
    return problems


def self_test():
    """A main.cpp of 600 lines, a function of 250 and one of 120 in common/ are caught; the tree's
    own code is not."""
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "lessons", "99_x"))
        os.makedirs(os.path.join(d, "common", "core"))
        with open(os.path.join(d, "common", "core", "long.cpp"), "w") as f:
            f.write("\n".join(["void walk() {"] + ["  x++;"] * 118 + ["}"]) + "\n")
        # a one-line function, then a namespace of short ones: no function of 112 lines
        with open(os.path.join(d, "common", "core", "short.cpp"), "w") as f:
            f.write("\n".join(["int one() const { return 1; }", "namespace {"] +
                              [f"int f{k}() {{ return {k}; }}" for k in range(110)] + ["}  // namespace"]) + "\n")
        body = ["int helper() {"] + ["  x++;"] * 250 + ["}"]
        filler = ["// line"] * (600 - len(body))
        with open(os.path.join(d, "lessons", "99_x", "main.cpp"), "w") as f:
            f.write("\n".join(filler + body) + "\n")
        got = problems_in(d, {})
        want_main = any("main.cpp: 600 lines, more than 550" in p for p in got)
        want_fn = any("helper is 252 lines, more than 200" in p for p in got)
        stale = problems_in(d, {"lessons/99_x/main.cpp:gone": 300})
        want_stale = any("not found" in p for p in stale)
        want_common = any("walk is 120 lines, more than 100" in p for p in got)
        one_liner = not any("short.cpp" in p for p in got)
        if not (want_main and want_fn and want_stale and want_common and one_liner):
            print("self-test failed: " + "; ".join(got + stale), file=sys.stderr)
            return 1
    print("self-test: an oversized main.cpp, an oversized function in lessons/ and in common/ and a stale "
          "ceiling are caught; a one-line function is one line")
    return 0


def main(argv):
    if argv and argv[0] == "--self-test":
        return self_test()
    problems = problems_in(ROOT, CEILINGS)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 1
    cut = f", but {len(CEILINGS)} still being cut down (tests/check_shape.py: CEILINGS)" if CEILINGS else ""
    print(f"shape ok: every lessons/*/main.cpp within {MAX_MAIN} lines, every function within "
          f"{MAX_FUNCTION} and every one of common/ within {MAX_COMMON_FUNCTION}{cut}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
