#!/usr/bin/env python3
"""check-trace.py JSON CSV NRANKS — validates a fivefold trace (run with /usr/bin/python3).
CSV may be "-" when only the JSON was written.

The JSON must load, hold a "traceEvents" list with one process track per rank (exactly
NRANKS distinct pids, each named "rank R" by a process_name metadata event) and complete
events ("X") with ts >= 0 and dur >= 0. The CSV must have the header
rank,name,stream,start_us,end_us,bytes and rows from every rank.
Prints "trace ok: N ranks, M spans", or one "error: ..." line and exits 1.
"""
import csv
import json
import sys


def fail(msg):
    print(f"error: {msg}")
    sys.exit(1)


def check_json(path, nranks):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}: not a readable JSON file: {e}")
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        fail(f'{path}: no "traceEvents" list')
    names = {}  # pid -> process name
    spans = 0
    pids = set()
    for i, e in enumerate(events):
        if not isinstance(e, dict) or "ph" not in e or "pid" not in e:
            fail(f"{path}: event {i} lacks ph or pid: {e!r}")
        pids.add(e["pid"])
        if e["ph"] == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e.get("args", {}).get("name")
        elif e["ph"] == "X":
            for key in ("ts", "dur"):
                v = e.get(key)
                if not isinstance(v, (int, float)) or v < 0:
                    fail(f"{path}: event {i} ({e.get('name')!r}) has {key} = {v!r}, want a number >= 0")
            spans += 1
    if len(pids) != nranks:
        fail(f"{path}: {len(pids)} distinct pids {sorted(pids)}, want {nranks}")
    for r in range(nranks):
        if names.get(r) != f"rank {r}":
            fail(f'{path}: pid {r} is named {names.get(r)!r}, want "rank {r}"')
    return spans


def check_csv(path, nranks):
    header = ["rank", "name", "stream", "start_us", "end_us", "bytes"]
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        fail(f"{path}: cannot read: {e}")
    if not rows or rows[0] != header:
        fail(f"{path}: header is {rows[0] if rows else None!r}, want {','.join(header)}")
    ranks = set()
    for n, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            fail(f"{path}:{n}: {len(row)} fields, want {len(header)}")
        try:
            rank, start, end = int(row[0]), float(row[3]), float(row[4])
            int(row[5])
        except ValueError:
            fail(f"{path}:{n}: not numbers where numbers belong: {row!r}")
        if end < start:
            fail(f"{path}:{n}: ends ({end}) before it starts ({start})")
        ranks.add(rank)
    if ranks != set(range(nranks)):
        fail(f"{path}: rows from ranks {sorted(ranks)}, want 0..{nranks - 1}")
    return len(rows) - 1


def main():
    if len(sys.argv) != 4:
        fail("usage: check-trace.py TRACE.json TRACE.csv NRANKS")
    try:
        nranks = int(sys.argv[3])
    except ValueError:
        nranks = 0
    if nranks < 1:
        fail(f"NRANKS must be a positive integer, got {sys.argv[3]!r}")
    spans = check_json(sys.argv[1], nranks)
    if sys.argv[2] == "-":  # no CSV to check
        print(f"trace ok: {nranks} ranks, {spans} spans")
        return
    rows = check_csv(sys.argv[2], nranks)
    if rows != spans:
        fail(f"{sys.argv[2]} has {rows} rows but {sys.argv[1]} has {spans} spans")
    print(f"trace ok: {nranks} ranks, {spans} spans")


if __name__ == "__main__":
    main()
