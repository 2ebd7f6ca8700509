#!/usr/bin/env python3
"""Each kernel's duration from an Nsight Compute CSV of one metric
(`ncu --metrics gpu__time_duration.sum --csv ...`, launches serialized, as
tools/gpu/fast_schedules_run.sh's step 4 writes it): one row per kernel, in
the order of its first launch, with its launches and their mean, min and max.

    tools/gpu/kernel_durations.py N1_KERNELS.csv
"""
import csv
import re
import sys


def short(name):
    """A kernel's name and template arguments, without its parameters and
    namespaces."""
    # ncu's names may start mid-namespace ("unnamed>::Kernel(...)").
    name = re.sub(r"^void ", "", name).replace("<unnamed>::", "")
    name = name.replace("unnamed>::", "").replace("(anonymous namespace)::", "")
    depth, end = 0, len(name)
    for i, c in enumerate(name):  # the parameter list: the first "(" outside <>
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0:
            end = i
            break
    name = name[:end]
    name = re.sub(r"\b[A-Za-z_]\w*::", "", name)
    return name.replace("|", "/")


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    rows = [r for r in csv.reader(open(argv[1])) if len(r) > 10]
    if not rows:
        print("no CSV rows in " + argv[1], file=sys.stderr)
        return 1
    head = rows[0]
    name_at, value_at, unit_at = (head.index("Kernel Name"), head.index("Metric Value"),
                                  head.index("Metric Unit"))
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    kernels = {}
    for r in rows[1:]:
        us = float(r[value_at].replace(",", "")) * scale.get(r[unit_at], 1e-3)
        kernels.setdefault(short(r[name_at]), []).append(us)
    print("| kernel | launches | mean (us) | min (us) | max (us) |")
    print("|---|---:|---:|---:|---:|")
    for name, us in kernels.items():
        print(f"| {name} | {len(us)} | {sum(us) / len(us):.2f} | {min(us):.2f} | {max(us):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
