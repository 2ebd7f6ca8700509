#!/usr/bin/env python3
"""Summarises GPU timelines written by libcupti_trace.so (one CSV per process).

    timeline.py TRACE.csv [TRACE.csv ...] [--anchor=Spin] [--min_anchor_us=20] [--positions]

Every kernel named like --anchor (the benchmark's stand-in for the model) of
at least --min_anchor_us starts a cycle; the cycle is what the GPU ran, in any
of the processes, until the next anchor on the same stream. Cycles are grouped
by their pattern (each item's process role and short name), and for each
pattern the table gives the median of every gap and duration, in order: the
gap from the anchor's end to the first item's start, the item's duration, the
gap to the next item, ..., and the gap from the last item's end to the next
anchor's start. "A" marks the anchor's process, "B" any other.

--positions adds a table by the cycle's position in its step (a step ends with
the cycle that runs a CommitPlanKernel): the median gap from the anchor's end
to the other process's first kernel, and from its last item back to the next
anchor, so that one slow layer of every step shows.
"""
import argparse
import collections
import csv
import re
import statistics


def short(name):
    name = name.replace("(anonymous namespace)::", "")
    name = re.sub(r"^void ", "", name)
    name = re.split(r"[<(]", name)[0]          # template arguments, argument list
    return name.split("::")[-1][:40]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--anchor", default="Spin")
    ap.add_argument("--min_anchor_us", type=float, default=20)
    ap.add_argument("--positions", action="store_true")
    args = ap.parse_args()
    items = []
    for path in args.traces:
        with open(path) as f:
            for row in csv.reader(f):
                if len(row) < 6:
                    continue
                kind, pid, stream, start, end = row[:5]
                name = ",".join(row[5:])
                items.append((int(start), int(end), kind, int(pid), int(stream),
                              short(name) if kind == "kernel" else kind))
    items.sort()
    anchors = [i for i, it in enumerate(items)
               if it[5] == args.anchor and (it[1] - it[0]) / 1e3 >= args.min_anchor_us]
    by_stream = collections.defaultdict(list)
    for i in anchors:
        by_stream[(items[i][3], items[i][4])].append(i)
    patterns = collections.defaultdict(list)
    by_position = collections.defaultdict(list)  # position -> [(gap in, gap back)]
    for key, idx in by_stream.items():
        position = 0
        for a, b in zip(idx, idx[1:]):
            anchor, nxt = items[a], items[b]
            if nxt[0] - anchor[1] > 1e6:  # another phase of the benchmark
                position = 0
            # What ran between: started after this anchor ended, ended before the next began.
            between = [it for it in items[a + 1:b] if it[0] >= anchor[1] and it[1] <= nxt[0]]
            if len(between) > 8:
                position = 0  # not a layer's cycle: the next starts afresh
                continue
            pattern = tuple(("A" if it[3] == anchor[3] else "B") + ":" + it[5] for it in between)
            times, last = [], anchor[1]
            for it in between:
                times += [it[0] - last, it[1] - it[0]]
                last = it[1]
            times.append(nxt[0] - last)
            times.append(nxt[0] - anchor[1])
            patterns[pattern].append(times)
            if pattern and pattern[0].startswith("B:"):
                by_position[position].append((times[0], times[-2]))
            position = 0 if any(p.endswith(":CommitPlanKernel") for p in pattern) else position + 1
    print("| cycles | pattern after the anchor | medians (us): gap, duration, gap, ... , gap back | "
          "anchor end to next anchor (us) |")
    print("|---:|---|---|---:|")
    for pattern, rows in sorted(patterns.items(), key=lambda kv: -len(kv[1])):
        if len(rows) < 5:
            continue
        med = [statistics.median(col) / 1e3 for col in zip(*rows)]
        print("| %d | %s | %s | %.2f |" % (len(rows), " -> ".join(pattern) or "(nothing)",
                                           ", ".join("%.2f" % m for m in med[:-1]), med[-1]))
    if args.positions:
        print("\n| position in the step | cycles | anchor end to B's first kernel (us) | "
              "last item to next anchor (us) |")
        print("|---:|---:|---:|---:|")
        for position, gaps in sorted(by_position.items()):
            if len(gaps) < 5:
                continue
            print("| %d | %d | %.2f | %.2f |" % (
                position, len(gaps), statistics.median(g[0] for g in gaps) / 1e3,
                statistics.median(g[1] for g in gaps) / 1e3))


if __name__ == "__main__":
    main()
