"""The layer rule between the lessons and what is below them (README.md, "How to read a lesson"):
nothing in common/ or kernels/ includes a lesson's file, and a lesson includes, besides its own
folder's headers, only the headers of earlier lessons: never a later lesson's (LOOK_AHEAD names
the one exception), never a main.cpp. The tests may include any lesson's header.

  check_layers.py              check the tree
  check_layers.py --self-test  show that each kind of wrong include is caught
"""
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE = re.compile(r'^\s*#\s*include\s+"(lessons/(\d\d)_[^/"]+/([^"]+))"')
SOURCES = (".cpp", ".h", ".cu")
# file -> the later lesson's header it may include: lesson 06's last table runs lesson 07's
# schedules in the simulator on the costs it measured
LOOK_AHEAD = {"lessons/06_overlap/main.cpp": "lessons/07_dualpipe/schedules.h"}


def problems_in(root, look_ahead):
    problems = []
    for top in ("common", "kernels", "lessons"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                parts = rel.split(os.sep)
                own = parts[1][:2] if top == "lessons" and len(parts) > 2 else None
                for lineno, line in enumerate(open(path, encoding="utf-8"), 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    header, number, name = m.group(1), m.group(2), m.group(3)
                    where = f"{rel}:{lineno}: includes {header}"
                    if own is None:
                        problems.append(f"{where}: {top}/ never includes a lesson")
                    elif name == "main.cpp" or name.endswith("/main.cpp"):
                        problems.append(f"{where}: never a main.cpp")
                    elif number > own and look_ahead.get(rel.replace(os.sep, "/")) != header:
                        problems.append(f"{where}: a lesson includes only its own or an earlier "
                                        f"lesson's headers, never a later one's")
    return problems


def self_test():
    """A common/ file including a lesson, a lesson including a later lesson and a main.cpp are
    caught; an earlier lesson's header and the named look ahead are not."""
    with tempfile.TemporaryDirectory() as d:
        def write(rel, text):
            os.makedirs(os.path.join(d, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(d, rel), "w") as f:
                f.write(text)
        write("common/layers/x.cpp", '#include "lessons/02_a/ring.h"\n')
        write("lessons/02_a/ring.cpp", '#include "lessons/02_a/ring.h"\n#include "lessons/07_b/s.h"\n')
        write("lessons/07_b/main.cpp", '#include "lessons/02_a/ring.h"\n#include "lessons/02_a/main.cpp"\n')
        write("lessons/06_c/main.cpp", '#include "lessons/07_b/s.h"\n')
        got = problems_in(d, {"lessons/06_c/main.cpp": "lessons/07_b/s.h"})
        want = ["common/layers/x.cpp:1: includes lessons/02_a/ring.h: common/ never",
                "lessons/02_a/ring.cpp:2: includes lessons/07_b/s.h: a lesson includes only",
                "lessons/07_b/main.cpp:2: includes lessons/02_a/main.cpp: never a main.cpp"]
        missing = [w for w in want if not any(p.startswith(w) for p in got)]
        if missing or len(got) != len(want):
            print("self-test failed: " + "; ".join(got), file=sys.stderr)
            return 1
    print("self-test: common/ including a lesson, a lesson including a later lesson's header and "
          "a main.cpp are caught")
    return 0


def main(argv):
    if argv and argv[0] == "--self-test":
        return self_test()
    problems = problems_in(ROOT, LOOK_AHEAD)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"layers ok: common/ and kernels/ include no lesson; every lesson includes only its own "
          f"and earlier lessons' headers, no main.cpp ({len(LOOK_AHEAD)} named look ahead)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
