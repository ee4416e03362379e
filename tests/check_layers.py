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


def problems(root):
    out = []
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
        found = problems(tmp)
        want = ["common/core/up.cpp", "common/util/up.cpp", "common/layers/up.cpp",
                "lessons/07_dualpipe/up.cpp", "lessons/08_mesh/main_inc.cpp"]
        for w in want:
            if not any(p.startswith(w + ":") for p in found):
                print(f"self-test FAILED: {w} not caught")
                return 1
        if any(p.startswith(("common/core/ok.cpp", "lessons/08_mesh/ok.cpp")) for p in found):
            print("self-test FAILED: an allowed include was flagged")
            return 1
    print(f"  self-test: {len(want)} includes going up caught, the allowed ones not")
    return 0


def main(argv):
    if argv[:1] == ["--self-test"]:
        return self_test()
    found = problems(ROOT)
    for p in found:
        print("error: " + p)
    if found:
        return 1
    print("layers ok: every include in common/, kernels/ and lessons/ goes down or sideways")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
