#!/usr/bin/env python3
"""Lesson 06's trace: does compute overlap the all-to-alls on every rank?

usage: check_trace_06.py TRACE.json P overlapped|sequential

Reads the Chrome trace lesson 06 writes with --trace: per rank (pid), the compute spans
(ph "X" on the "compute" track) and the message flights (async events ph "b"/"e" on the
"comm" track, from post to completion). Counts, per rank, the compute time spent while at
least one flight was in the air. overlapped: every rank must have some (> 0); sequential:
no rank may have any (every all-to-all is waited for before the next compute starts).
Prints one line per rank and "overlap ok: ..." when the expectation holds; exits 1 if not.
"""
import json
import sys


def main():
    if len(sys.argv) != 4 or sys.argv[3] not in ("overlapped", "sequential"):
        sys.exit(__doc__)
    path, P, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    track = {}  # (pid, tid) -> name
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            track[(e["pid"], e["tid"])] = e["args"]["name"]
    compute = {r: [] for r in range(P)}
    begins, flights = {}, {r: [] for r in range(P)}
    for e in events:
        r, name = e.get("pid"), track.get((e.get("pid"), e.get("tid")))
        if r not in compute:
            continue
        if e.get("ph") == "X" and name == "compute":
            compute[r].append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("ph") == "b" and name == "comm":
            begins[(r, e["id"])] = e["ts"]
        elif e.get("ph") == "e" and name == "comm" and (r, e["id"]) in begins:
            flights[r].append((begins.pop((r, e["id"])), e["ts"]))
    ok = True
    for r in range(P):
        # the union of the flights, then the compute time inside it
        union = []
        for a, b in sorted(flights[r]):
            if union and a <= union[-1][1]:
                union[-1][1] = max(union[-1][1], b)
            else:
                union.append([a, b])
        inside = 0.0
        for a, b in compute[r]:
            for ua, ub in union:
                inside += max(0.0, min(b, ub) - max(a, ua))
        total = sum(b - a for a, b in compute[r])
        print(f"rank {r}: {len(compute[r])} compute spans ({total / 1e3:.2f} ms), {len(flights[r])} flights, "
              f"compute while a message is in flight {inside / 1e3:.2f} ms")
        if not flights[r] or not compute[r]:
            ok = False
        elif mode == "overlapped" and inside <= 0:
            ok = False
        elif mode == "sequential" and inside > 0:
            ok = False
    if not ok:
        sys.exit(f"overlap FAILED: expected {'some' if mode == 'overlapped' else 'no'} compute during flights on every rank")
    print(f"overlap ok: {P} ranks, {mode}")


if __name__ == "__main__":
    main()
