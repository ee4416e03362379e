#!/usr/bin/env python3
"""check_trace_08.py JSON AXIS... — lesson 08's trace names its communication by axis.

Every span on a rank's "comm" track (the training's communication; the check's traffic is on
the "check" track) must be named "<axis> <operation>" with <axis> one of tp, cp, ep, dp-cp,
edp, pp, dp; and each AXIS given on the command line (the axes the mesh ran with more than one
rank) must appear on some rank. Prints "trace axes ok: ..." or one "error: ..." line, exit 1.
"""
import json
import sys
from collections import Counter

AXES = ("tp", "cp", "ep", "dp-cp", "edp", "pp", "dp")

if len(sys.argv) < 2:
    sys.exit(__doc__)
with open(sys.argv[1]) as f:
    events = json.load(f)["traceEvents"]
tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
          if e.get("ph") == "M" and e.get("name") == "thread_name"}
seen = Counter()
for e in events:
    if e.get("ph") != "X" or tracks.get((e["pid"], e["tid"])) != "comm":
        continue
    axis = e["name"].split(" ", 1)[0]
    if axis not in AXES or " " not in e["name"]:
        print(f"error: rank {e['pid']}: a communication span named '{e['name']}' names no axis")
        sys.exit(1)
    seen[axis] += 1
missing = [a for a in sys.argv[2:] if not seen[a]]
if missing:
    print(f"error: no communication span of axis {', '.join(missing)} (seen: {dict(seen)})")
    sys.exit(1)
print("trace axes ok: " + ", ".join(f"{a} {n}" for a, n in sorted(seen.items())))
