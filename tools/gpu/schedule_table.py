#!/usr/bin/env python3
"""FAST's Verify under each FastVerifySchedule, side by side, from kda_bench
outputs (its `FAST verify 3xTF32, <schedule>` rows, cold-L2 CUDA-graph time):
one row per shape, state dtype and N in --ns, the stock kernel beside, and
optionally the served Verify of an earlier run.

    tools/gpu/schedule_table.py RUN.md [--earlier=EARLIER.md] [--ns=1,16] [--set=piped]

--set=piped: the kernel of large grids loading the checkpoint in the pass
(served for fp32 state rows) beside the same kernel with the piped
checkpoint pass (served for bf16 ones where four blocks an SM fit), its copies
made by the lanes (cp.async) and by the TMA (bulk copies); --set=piped_v1
the same columns of the first piped version's run; --set=prefetch_checkpoint:
the unpiped kernel with its checkpoint prefetched into L2 after the window or
the ring, beside the unpiped and piped kernels.

--set=ring_values: the staged kernel's ring values summed per state row
(FastVerifySchedule::RingValues::kPerRow) and spread over the block (served),
at two and four blocks a head and the launcher's choice of split (kda_bench
times the per-row sums at N = 1 only: pass --ns=1). --set=ring_values_v1
reads the runs from before the spread was served (kda_bench's rows then
named the spread, not the per-row sums).

--set=window_loads: the staged kernel at N = 1 (pass --ns=1) with its window
loaded after the row's cursor (FastVerifySchedule::WindowLoads::kAfterCursor)
beside the served load with the cursor, at four blocks a head and the
launcher's split; --set=window_loads_v1 reads the run that decided it
(2026-12-07, when kda_bench's rows named the option, not the served order).

--set=floors: the served Verify beside kda_bench's floors (the checkpoint
read once after one and two dependent loads, no math;
tests/bench/floor_kernels.h) and the stock kernel, at any N.

--set=folds: Commit's folds and cursors alone (kda_bench's `FAST folds and
cursors, <schedule>, direct call` rows) under each FastFoldSchedule, and the
served commit (conv windows and plan included), each per layer.
"""
import argparse
import re
import sys

ROW = re.compile(r"\| (.+?) \| (\d+) \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|")
COLUMNS = ["unstaged", "staged, 1 a head", "staged, 2 a head", "staged, 4 a head",
           "staged, 8 a head", "launcher's choice", "served"]
SETS = {
    "schedules": COLUMNS,
    "piped": ["unstaged", "unstaged, piped checkpoint pass",
              "unstaged, piped checkpoint pass, TMA bulk copies", "served"],
    # FastVerifySchedule::checkpoint_prefetch beside the unpiped kernel and
    # the piped one.
    "prefetch_checkpoint": ["unstaged", "unstaged, checkpoint prefetched after the window",
                            "unstaged, checkpoint prefetched after the ring",
                            "unstaged, piped checkpoint pass", "served"],
    # The first piped version's run (docs/results/fast_verify_piped_v1_*),
    # where "unstaged" was piped and the other row loaded in the pass.
    "piped_v1": ["unstaged, checkpoint loaded in the pass", "unstaged", "served"],
    # FastVerifySchedule::ring_values (N = 1).
    "ring_values": ["staged, 2 a head, ring values per row", "staged, 2 a head",
                    "staged, 4 a head, ring values per row", "staged, 4 a head",
                    "launcher's choice, ring values per row", "launcher's choice", "served"],
    "ring_values_v1": ["staged, 2 a head", "staged, 2 a head, ring values spread",
                       "staged, 4 a head", "staged, 4 a head, ring values spread",
                       "launcher's choice", "launcher's choice, ring values spread", "served"],
    # FastVerifySchedule::window_loads (N = 1).
    "window_loads": ["staged, 4 a head, window loaded after the cursor", "staged, 4 a head",
                     "launcher's choice, window loaded after the cursor", "launcher's choice",
                     "served"],
    "window_loads_v1": ["staged, 4 a head", "launcher's choice",
                        "launcher's choice, window loaded with the cursor", "served"],
    # kda_bench's floors (any N) beside the served Verify.
    "floors": ["floor: 1 dependent load", "floor: 2 dependent loads", "launcher's choice",
               "served"],
    # FastFoldSchedule: kda_bench's direct-call fold rows, per layer.
    "folds": ["folds: unstaged, 16 blocks a head", "folds: staged, 16 blocks a head",
              "folds: pipelined, 1 block a head", "folds: pipelined, 2 blocks a head",
              "folds: pipelined, 4 blocks a head", "served commit"],
}
FOLD_ROW = re.compile(r"FAST folds and cursors, (.+), direct call, (\d+) layers")
COMMIT_ROW = re.compile(r"FAST commit, (\d+) layers \(F")
FLOOR_ROW = re.compile(r"floor: the checkpoint read once after (\d+ dependent loads?)")


def parse(path):
    """{((shape, state), N): {column: us}}."""
    out, section = {}, None
    for line in open(path):
        if line.startswith("### "):
            shape = line[4:].split(":")[0].split(" (")[0]
            shape = shape.replace("-48B-A3B", "").replace("-80B-A3B", "")
            section = (shape, "bf16" if "bf16 state" in line else "fp32")
            continue
        m = ROW.match(line)
        if not m or section is None:
            continue
        name, n, us = m.group(1), int(m.group(2)), float(m.group(3))
        if name.startswith("FAST verify (F"):
            column = "served"
        elif name.startswith("FAST verify 3xTF32, "):
            column = name[len("FAST verify 3xTF32, "):].replace(" (F=4), 1 layer", "")
        elif FOLD_ROW.match(name):
            fold = FOLD_ROW.match(name)
            column, us = "folds: " + fold.group(1), round(us / int(fold.group(2)), 1)
        elif COMMIT_ROW.match(name):
            column, us = "served commit", round(us / int(COMMIT_ROW.match(name).group(1)), 1)
        elif name.startswith("stock spec path"):
            column = "stock"
        elif FLOOR_ROW.match(name):
            column = "floor: " + FLOOR_ROW.match(name).group(1)
        else:
            continue
        out.setdefault((section, n), {})[column] = us
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run")
    ap.add_argument("--earlier", help="a run whose served Verify is the last column")
    ap.add_argument("--ns", default="1,16")
    ap.add_argument("--set", default="schedules", choices=sorted(SETS))
    args = ap.parse_args(argv[1:])
    ns = {int(n) for n in args.ns.split(",")}
    run = parse(args.run)
    earlier = parse(args.earlier) if args.earlier else {}
    columns = SETS[args.set]
    head = ["shape", "state", "N", "stock"] + columns + (["served, earlier run"] if earlier else [])
    print("| " + " | ".join(head) + " |")
    print("|---|---|" + "---:|" * (len(head) - 2))
    order = {"fp32": 0, "bf16": 1}
    for (section, n) in sorted(run, key=lambda k: (order[k[0][1]], k[1] not in ns, k[0][0], k[1])):
        if n not in ns:
            continue
        cells = run[(section, n)]
        row = [section[0], section[1], str(n), str(cells.get("stock", ""))]
        row += [str(cells.get(c, "")) for c in columns]
        if earlier:
            row.append(str(earlier.get((section, n), {}).get("served", "")))
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
