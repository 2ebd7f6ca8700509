#!/usr/bin/env python3
"""docs/benchmarks.md's lead table from one kda_bench run: every shape and
state dtype's cold-L2 step per layer (the run's "| N (cold L2) |" tables),
each mode with its ratio to the stock kernel, the fastest mode in bold.

    tools/gpu/summary_table.py RUN.md

Shapes come in the run's order, each with its fp32 rows, then its bf16
rows (kda_bench prints every shape's fp32 before any bf16); a shape's name
is printed on its first row only.
"""
import re
import sys

SHAPE_NAMES = {
    "Kimi-Linear-48B-A3B": "Kimi-Linear-48B-A3B (KDA, H=32, K=V=128, Q=4, 20 layers)",
    "Kimi-K3 (TP8)": "Kimi-K3 at TP8 (KDA, H=12, K=V=128, Q=8, 69 layers)",
    "Qwen3-Next-80B-A3B": "Qwen3-Next-80B-A3B (GDN, 16 key / 32 value heads, K=V=128, Q=4, 36 layers)",
}
MODES = ["EAGER", "DEFERRED", "FAST (F = 4)"]
NUM = r"([\d.]+)"
COLD_ROW = re.compile(r"\| (\d+) \| " + r" \| ".join([NUM] + [NUM + r" \| " + NUM + "x"] * 3) + r" \|")


def parse(path):
    """[(shape, state, {N: (stock, [(mode us, ratio)])})] in the run's order."""
    sections, current, in_cold = [], None, False
    for line in open(path):
        if line.startswith("### "):
            shape = line[4:].split(":")[0]
            state = "bf16" if "bf16 state" in line else "fp32"
            current = (shape, state, {})
            sections.append(current)
            in_cold = False
        elif line.startswith("| N (cold L2)"):
            in_cold = True
        elif in_cold and current is not None:
            m = COLD_ROW.match(line)
            if m:
                g = [float(x) for x in m.groups()[1:]]
                # The run's own ratios (from unrounded times).
                current[2][int(m.group(1))] = (g[0], [(g[1], g[2]), (g[3], g[4]), (g[5], g[6])])
            elif not line.startswith("|---"):
                in_cold = False
    return [s for s in sections if s[2]]


def table(sections):
    lines = ["| shape | state | N | stock | " + " | ".join(MODES) + " |",
             "|---|---|---:|---:|" + "---:|" * len(MODES)]
    named = set()
    for shape, state, rows in sections:
        first_of_state = True
        for n in sorted(rows):
            stock, modes = rows[n]
            fastest = min(us for us, _ in modes)
            cells = []
            for us, ratio in modes:
                cell = f"{us:.1f} ({ratio:.2f}x)"
                cells.append(f"**{cell}**" if us == fastest else cell)
            name = "" if shape in named else SHAPE_NAMES.get(shape, shape)
            named.add(shape)
            lines.append(f"| {name} | {state if first_of_state else ''} | {n} | {stock:.1f} | "
                         + " | ".join(cells) + " |")
            first_of_state = False
    return "\n".join(lines)


def main(argv):
    if len(argv) != 2:
        sys.exit(__doc__)
    sections = parse(argv[1])
    if not sections:
        sys.exit(f"{argv[1]}: no '| N (cold L2) |' tables")
    # The lead table groups a shape's fp32 and bf16 rows.
    order = {name: i for i, name in enumerate(dict.fromkeys(s[0] for s in sections))}
    sections.sort(key=lambda s: (order[s[0]], s[1] != "fp32"))
    print(table(sections))


if __name__ == "__main__":
    main(sys.argv)
