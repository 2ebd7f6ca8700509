#!/usr/bin/env python3
"""Two kda_bench outputs side by side: every row both have, cold-L2 CUDA-graph
time before and after and their ratio, as a markdown table.

    tools/gpu/compare_bench.py BEFORE.md AFTER.md [BEFORE2.md AFTER2.md ...]

With several pairs (runs alternated on one machine), each side's times are
the mean over its runs.
"""
import re
import sys

ROW = re.compile(r"\| (.+?) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|")


def cold_graph_times(path):
    """{(kernel, N): us}; a row of a shape section other than the first
    fp32-state one carries its section's shape and state in its name."""
    times = {}
    section = ""
    first = None
    with open(path) as f:
        for line in f:
            if line.startswith("### "):
                name, _, rest = line[4:].partition(":")
                state = "bf16 state" if "bf16 state" in rest else "fp32 state"
                section = f"{name.strip()}, {state}"
                if first is None:
                    first = section
                continue
            m = ROW.match(line)
            if m:
                kernel = m.group(1) if section == first else f"{section}: {m.group(1)}"
                times[(kernel, int(m.group(2)))] = float(m.group(5))
    return times


def mean_times(paths):
    """{(kernel, N): mean us} over the rows every file has."""
    runs = [cold_graph_times(p) for p in paths]
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    return {k: sum(r[k] for r in runs) / len(runs) for k in keys}


def main(argv):
    if len(argv) < 3 or len(argv) % 2 != 1:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = mean_times(argv[1::2]), mean_times(argv[2::2])
    print("| kernel | N | before (us) | after (us) | after / before |")
    print("|---|---:|---:|---:|---:|")
    ratios = []
    for key, b in before.items():
        if key not in after:
            print(f"| {key[0]} | {key[1]} | {b:.1f} | (not run) | |")
            continue
        ratios.append(after[key] / b)
        print(f"| {key[0]} | {key[1]} | {b:.1f} | {after[key]:.1f} | {after[key] / b:.3f} |")
    for key in after:
        if key not in before:
            print(f"| {key[0]} | {key[1]} | (not run) | {after[key]:.1f} | |")
    if ratios:
        print(f"\n{len(ratios)} rows in both; after / before from {min(ratios):.3f} to "
              f"{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
