#!/usr/bin/env python3
"""Sums a kernel's warp stall samples between barriers.

Reads the CSV of `ncu --import REPORT --page source --csv --print-source sass`
(tools/gpu/profile_fast.sh writes OUTDIR/fast_verify_source.csv and
OUTDIR/fast_fold_source.csv) and prints a markdown table: each stretch of SASS
instructions between two BAR.SYNCs that holds at least 4% of the samples, its
share, its top three stall reasons and its most frequent opcodes; then the
share of spill traffic (STL, LDL). The tables of
docs/results/fast_tensor_cores_h200.md are its output.

  tools/gpu/stall_regions.py CSV [TITLE]
"""
import csv
import sys

REASONS = ['stall_barrier', 'stall_long_sb', 'stall_short_sb', 'stall_wait', 'stall_no_inst',
           'stall_math', 'stall_mio', 'stall_lg', 'stall_not_selected', 'stall_selected',
           'stall_branch_resolving', 'stall_dispatch']


def number(text):
    try:
        return int(text)
    except ValueError:
        return 0


def opcode(sass):
    words = sass.strip().split()
    if not words:
        return ''
    word = words[1] if words[0].startswith('@') and len(words) > 1 else words[0]
    return word.split('.')[0]


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rows = list(csv.reader(open(sys.argv[1])))
    header, data = rows[1], rows[2:]
    samples = header.index('Warp Stall Sampling (All Samples)')
    reason_at = {r: header.index(r) for r in REASONS}
    total = sum(number(r[samples]) for r in data)
    title = sys.argv[2] if len(sys.argv) > 2 else sys.argv[1]
    print(f'### {title}\n\n{total} warp stall samples over {len(data)} SASS instructions, by the '
          'stretch of code between two `BAR.SYNC`s (regions under 4% left out):\n')
    print('| SASS instructions | samples | share | top stall reasons (samples) | '
          'most frequent opcodes |\n|---|---:|---:|---|---|')
    start, region, reasons, ops = 0, 0, dict.fromkeys(REASONS, 0), {}
    for i, r in enumerate(data):
        region += number(r[samples])
        for k in REASONS:
            reasons[k] += number(r[reason_at[k]])
        op = opcode(r[1])
        ops[op] = ops.get(op, 0) + 1
        if 'BAR.SYNC' in r[1] or i == len(data) - 1:
            if region > 0.04 * total:
                top = ', '.join(f'{k[6:]} {v}' for k, v in
                                sorted(reasons.items(), key=lambda x: -x[1])[:3])
                common = ', '.join(f'{k} {v}' for k, v in
                                   sorted(ops.items(), key=lambda x: -x[1])[:5])
                print(f'| {start}-{i} | {region} | {100 * region / total:.0f}% | {top} | {common} |')
            start, region, reasons, ops = i + 1, 0, dict.fromkeys(REASONS, 0), {}
    spill = sum(number(r[samples]) for r in data if opcode(r[1]) in ('STL', 'LDL'))
    print(f'\nSpill traffic (STL, LDL): {spill} samples ({100 * spill / total:.0f}%).\n')


if __name__ == '__main__':
    main()
