#!/usr/bin/env python3
"""check-trace.py JSON CSV NRANKS — validates a fivefold trace (run with /usr/bin/python3).
CSV may be "-" when only the JSON was written.

The JSON must load, hold a "traceEvents" list with one process track per rank (exactly
NRANKS distinct pids, each named "rank R" by a process_name metadata event), complete
events ("X", spans) with ts >= 0 and dur >= 0, and nestable async events ("b"/"e",
flights) with ts >= 0. On every track (pid, tid) the spans must nest or be disjoint, as the
calls of one thread do (ends may touch, and differ by EPSILON_US for the rounding of the
%.3f times); the flights' begins and ends must pair up by (cat, id, pid), an end no
earlier than its begin. The CSV must have the header
rank,name,stream,start_us,end_us,bytes,kind,peer,tag,from, rows from every rank, and one row
per span and per flight of the JSON.
Prints "trace ok: N ranks, M spans, F flights", or one "error: ..." line and exits 1.
"""
import csv
import json
import sys
from collections import defaultdict

# The JSON writes times with %.3f: ends computed from a rounded ts and a rounded dur may
# differ from the exact ones by this much (plus float noise), and touching spans by as much.
EPSILON_US = 0.001 + 1e-6


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
    threads = {}  # (pid, tid) -> thread name
    tracks = defaultdict(list)  # (pid, tid) -> [(start, end, index)] of the X events
    asyncs = []  # (index, event) of the b/e events
    pids = set()
    for i, e in enumerate(events):
        if not isinstance(e, dict) or "ph" not in e or "pid" not in e:
            fail(f"{path}: event {i} lacks ph or pid: {e!r}")
        pids.add(e["pid"])
        if e["ph"] == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e.get("args", {}).get("name")
        elif e["ph"] == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name")
        elif e["ph"] == "X":
            for key in ("ts", "dur"):
                v = e.get(key)
                if not isinstance(v, (int, float)) or v < 0:
                    fail(f"{path}: event {i} ({e.get('name')!r}) has {key} = {v!r}, want a number >= 0")
            tracks[(e["pid"], e.get("tid"))].append((e["ts"], e["ts"] + e["dur"], i))
        elif e["ph"] in ("b", "e"):
            v = e.get("ts")
            if not isinstance(v, (int, float)) or v < 0:
                fail(f"{path}: event {i} ({e.get('name')!r}) has ts = {v!r}, want a number >= 0")
            if "id" not in e or "cat" not in e:
                fail(f"{path}: async event {i} ({e.get('name')!r}) lacks id or cat")
            asyncs.append((i, e))
    if len(pids) != nranks:
        fail(f"{path}: {len(pids)} distinct pids {sorted(pids)}, want {nranks}")
    for r in range(nranks):
        if names.get(r) != f"rank {r}":
            fail(f'{path}: pid {r} is named {names.get(r)!r}, want "rank {r}"')
    spans = sum(len(v) for v in tracks.values())
    for track, spans_on_track in tracks.items():
        check_nesting(path, events, track, threads.get(track), spans_on_track)
    flights = check_async_pairs(path, asyncs)
    return spans, flights


def describe(events, i):
    e = events[i]
    return f'"{e.get("name")}" [{e["ts"]:.3f}, {e["ts"] + e["dur"]:.3f}] (event {i})'


def check_nesting(path, events, track, thread_name, spans):
    """Spans on one track: each one nests in the innermost open span or starts after it ends."""
    spans.sort(key=lambda s: (s[0], -s[1], s[2]))  # by start; at equal starts, outer first
    open_spans = []  # a stack of (start, end, index), innermost last
    for start, end, i in spans:
        while open_spans and open_spans[-1][1] <= start + EPSILON_US:
            open_spans.pop()  # ended before this one starts (touching counts as before)
        inner = []
        if open_spans and end > open_spans[-1][1] + EPSILON_US and start - open_spans[-1][0] <= EPSILON_US:
            inner = [open_spans.pop()]  # the same start, to rounding: this one is the outer one
        if open_spans and end > open_spans[-1][1] + EPSILON_US:
            pid, tid = track
            fail(f'{path}: on track "{thread_name}" (pid {pid}, tid {tid}) '
                 f"{describe(events, open_spans[-1][2])} and {describe(events, i)} cross: "
                 f"neither nests in the other")
        open_spans += [(start, end, i)] + inner


def check_async_pairs(path, asyncs):
    """Flights: every "e" closes the innermost open "b" of its (cat, id, pid); none left open."""
    opened = defaultdict(list)  # (cat, id, pid) -> stack of (index, event)
    order = {"b": 0, "e": 1}
    pairs = 0
    for i, e in sorted(asyncs, key=lambda ie: (ie[1]["ts"], order[ie[1]["ph"]], ie[0])):
        key = (e["cat"], e["id"], e["pid"])
        if e["ph"] == "b":
            opened[key].append((i, e))
            continue
        if not opened[key]:
            fail(f'{path}: async end "{e.get("name")}" (event {i}, cat {e["cat"]!r}, id {e["id"]}, '
                 f"pid {e['pid']}) at {e['ts']:.3f} has no begin")
        opened[key].pop()
        pairs += 1
    for key, stack in opened.items():
        if stack:
            i, e = stack[-1]
            fail(f'{path}: async begin "{e.get("name")}" (event {i}, cat {key[0]!r}, id {key[1]}, '
                 f"pid {key[2]}) at {e['ts']:.3f} never ends")
    return pairs


def check_csv(path, nranks):
    header = ["rank", "name", "stream", "start_us", "end_us", "bytes", "kind", "peer", "tag", "from"]
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        fail(f"{path}: cannot read: {e}")
    if not rows or rows[0] != header:
        fail(f"{path}: header is {rows[0] if rows else None!r}, want {','.join(header)}")
    ranks = set()
    kinds = {"span": 0, "flight": 0}
    for n, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            fail(f"{path}:{n}: {len(row)} fields, want {len(header)}")
        try:
            rank, start, end = int(row[0]), float(row[3]), float(row[4])
            int(row[5])
            for value in (row[7], row[8], row[9]):  # peer, tag, from: a number, "all" or empty
                if value not in ("", "all"):
                    int(value)
        except ValueError:
            fail(f"{path}:{n}: not numbers where numbers belong: {row!r}")
        if end < start:
            fail(f"{path}:{n}: ends ({end}) before it starts ({start})")
        if row[6] not in ("span", "flight"):
            fail(f"{path}:{n}: kind is {row[6]!r}, want span or flight")
        kinds[row[6]] += 1
        ranks.add(rank)
    if ranks != set(range(nranks)):
        fail(f"{path}: rows from ranks {sorted(ranks)}, want 0..{nranks - 1}")
    return kinds["span"], kinds["flight"]


def main():
    if len(sys.argv) != 4:
        fail("usage: check-trace.py TRACE.json TRACE.csv NRANKS")
    try:
        nranks = int(sys.argv[3])
    except ValueError:
        nranks = 0
    if nranks < 1:
        fail(f"NRANKS must be a positive integer, got {sys.argv[3]!r}")
    spans, flights = check_json(sys.argv[1], nranks)
    if sys.argv[2] != "-":  # a CSV to check
        csv_spans, csv_flights = check_csv(sys.argv[2], nranks)
        if (csv_spans, csv_flights) != (spans, flights):
            fail(f"{sys.argv[2]} has {csv_spans} span and {csv_flights} flight rows but "
                 f"{sys.argv[1]} has {spans} spans and {flights} flights")
    print(f"trace ok: {nranks} ranks, {spans} spans, {flights} flights")


if __name__ == "__main__":
    main()
