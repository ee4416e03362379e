"""The layers of the tree point one way: every #include "..." in common/, kernels/ and lessons/
goes down or sideways, never up.

  common/util    errors, checked files, the trace            (includes nothing of ours)
  kernels/       the kernels per device                      (util)
  common/core    Tensor, autograd, ops, optimizers, .npy     (util, kernels)
  common/comm    Comm, the link model, all-to-alls, the mesh (util, kernels, core)
  common/layers  the layers the lessons share                (and comm)
  common/lesson  the lesson skeleton                         (and layers)
  lessons/NN     a lesson                                    (all of common/, and the headers of
                                                              an earlier lesson, never a main.cpp)

A later lesson may build on an earlier one's files (lesson 08 runs lesson 02's ring and lesson
07's schedules); LOOK_AHEAD names the one include of a later lesson's header.

And common/ holds only what is shared: every header of common/layers is included by two lessons or
more, or by another file of common/ (what one lesson alone uses lives in its folder).

  check_layers.py              check the tree
  check_layers.py --self-test  show that an include going up is caught
"""
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = ["common/util", "kernels", "common/core", "common/comm", "common/layers", "common/lesson"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
LESSON = re.compile(r"^lessons/(\d\d)_[^/]+/")
# file -> the later lesson's header it may include: lesson 06's last table runs lesson 07's
# schedules in the simulator on the costs it measured
LOOK_AHEAD = {"lessons/06_overlap/report.cpp": "lessons/07_dualpipe/schedules.h"}


def floor_of(path):
    """The floor of a path of ours (a source file or an include), None for what is not ours."""
    for i, f in enumerate(FLOORS):
        if path.startswith(f + "/"):
            return i
    if LESSON.match(path):
        return len(FLOORS)
    return None


def used_by_one_lesson(root):
    """common/layers headers that one lesson alone includes (and no other file of common/)."""
    users = {}  # header -> the lessons and the common/ files that include it
    for top in ("common", "lessons"):
        for d, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                path = os.path.relpath(os.path.join(d, name), root)
                if not name.endswith((".h", ".cpp", ".cu", ".cuh")):
                    continue
                with open(os.path.join(root, path), errors="replace") as f:
                    for line in f:
                        m = INCLUDE.match(line)
                        if not m or not m.group(1).startswith("common/layers/"):
                            continue
                        inc = m.group(1)
                        if os.path.splitext(path)[0] == os.path.splitext(inc)[0]:
                            continue  # its own .cpp
                        lesson = LESSON.match(path)
                        users.setdefault(inc, set()).add(lesson.group(0) if lesson else path)
    out = []
    layers = os.path.join(root, "common", "layers")
    for name in sorted(os.listdir(layers)) if os.path.isdir(layers) else []:
        if not name.endswith(".h"):
            continue
        inc = "common/layers/" + name
        who = users.get(inc, set())
        lessons = sorted(u for u in who if u.startswith("lessons/"))
        if len(lessons) < 2 and len(who) == len(lessons):
            out.append(f"{inc}: included by {' '.join(lessons) or 'no lesson'} alone: a file one lesson uses "
                       f"lives in that lesson's folder")
    return out


def problems(root):
    out = used_by_one_lesson(root)
    for top in ("common", "kernels", "lessons"):
        for d, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith((".h", ".cpp", ".cu", ".cuh")):
                    continue
                path = os.path.relpath(os.path.join(d, name), root)
                mine = floor_of(path)
                if mine is None:
                    continue
                with open(os.path.join(root, path), errors="replace") as f:
                    for n, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        inc = m.group(1)
                        theirs = floor_of(inc)
                        if theirs is None:
                            continue
                        where = f"{path}:{n}: includes {inc}"
                        if theirs > mine:
                            out.append(f"{where}, a layer above it")
                        elif theirs == mine == len(FLOORS):
                            a, b = LESSON.match(path).group(1), LESSON.match(inc).group(1)
                            if inc.endswith("main.cpp"):
                                out.append(f"{where}: a lesson's main.cpp is included by nobody")
                            elif b > a and LOOK_AHEAD.get(path) != inc:
                                out.append(f"{where}: a lesson includes only earlier lessons' headers")
    return out


def self_test():
    with tempfile.TemporaryDirectory() as tmp:
        def write(path, text):
            os.makedirs(os.path.dirname(os.path.join(tmp, path)), exist_ok=True)
            with open(os.path.join(tmp, path), "w") as f:
                f.write(text)
        write("common/core/ok.cpp", '#include "common/util/error.h"\n#include "kernels/kernels.h"\n')
        write("common/core/up.cpp", '#include "common/comm/comm.h"\n')
        write("common/util/up.cpp", '#include "common/lesson/lesson.h"\n')
        write("common/layers/up.cpp", '#include "lessons/07_dualpipe/schedules.h"\n')
        write("lessons/08_mesh/ok.cpp", '#include "lessons/07_dualpipe/schedules.h"\n')
        write("lessons/07_dualpipe/up.cpp", '#include "lessons/08_mesh/mesh_model.h"\n')
        write("lessons/08_mesh/main_inc.cpp", '#include "lessons/07_dualpipe/main.cpp"\n')
        # common/layers: shared.h by two lessons, inner.h by common/, lonely.h by one lesson only
        for h in ("shared", "inner", "lonely"):
            write(f"common/layers/{h}.h", "#pragma once\n")
            write(f"common/layers/{h}.cpp", f'#include "common/layers/{h}.h"\n')
        write("lessons/05_x/a.cpp", '#include "common/layers/shared.h"\n#include "common/layers/lonely.h"\n')
        write("lessons/06_y/b.cpp", '#include "common/layers/shared.h"\n')
        write("common/layers/user.cpp", '#include "common/layers/inner.h"\n')
        found = problems(tmp)
        want = ["common/core/up.cpp", "common/util/up.cpp", "common/layers/up.cpp",
                "lessons/07_dualpipe/up.cpp", "lessons/08_mesh/main_inc.cpp", "common/layers/lonely.h"]
        for w in want:
            if not any(p.startswith(w + ":") for p in found):
                print(f"self-test FAILED: {w} not caught")
                return 1
        if any(p.startswith(("common/core/ok.cpp", "lessons/08_mesh/ok.cpp", "common/layers/shared.h",
                             "common/layers/inner.h")) for p in found):
            print("self-test FAILED: an allowed include was flagged")
            return 1
    print(f"  self-test: {len(want) - 1} includes going up and a common/layers header one lesson alone uses "
          f"caught, the allowed ones not")
    return 0


def main(argv):
    if argv[:1] == ["--self-test"]:
        return self_test()
    found = problems(ROOT)
    for p in found:
        print("error: " + p)
    if found:
        return 1
    print("layers ok: every include in common/, kernels/ and lessons/ goes down or sideways; every "
          "common/layers header is shared")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
