#!/usr/bin/env python3
"""FAST's two fold schedules side by side, from a kda_bench run's output.

  tools/gpu/fold_schedules.py docs/results/kda_bench_fold_ahead_h200.md

kda_bench (--fast_both_schedules, the default) times FAST's verify and commit
under Commit's folds and under fold ahead (FastRings::fold_ahead). This
prints, per shape and N, each schedule's step per layer with cold L2 (CUDA
graph): verify of one layer + commit of every layer / layers, and its folds
a row a step.
"""
import re
import sys


def main(path):
    shape = None
    rows = {}
    order = []
    for line in open(path):
        if line.startswith('### '):
            shape = line[4:].split(':')[0]
            continue
        if not line.startswith('| FAST') or 'launcher' in line or 'align' in line:
            continue
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        name = cells[0]
        try:
            n, cold = int(cells[1]), float(cells[4])
        except ValueError:
            continue
        schedule = 'fold ahead' if 'fold ahead' in name else "Commit's folds"
        if 'verify (' in name:
            kind = 'verify'
        elif 'commit,' in name:
            kind = 'commit'
        else:
            continue
        layers = int(re.search(r'(\d+) layers', name).group(1)) if kind == 'commit' else 1
        folds = re.search(r'([\d.]+) folds a row', name)
        rows[(shape, n, schedule, kind)] = (cold / layers, folds.group(1) if folds else None)
        if shape not in order:
            order.append(shape)
    print("| shape | N | Commit's folds: verify + commit/layer (us) | folds a row a step "
          "| fold ahead: verify + commit/layer (us) | folds a row a step | fold ahead / "
          "Commit's folds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape in order:
        for n in (1, 16, 64, 256):
            cells = []
            steps = []
            for schedule in ("Commit's folds", 'fold ahead'):
                v = rows.get((shape, n, schedule, 'verify'))
                c = rows.get((shape, n, schedule, 'commit'))
                if not v or not c:
                    cells += ['-', '-']
                    continue
                step = v[0] + c[0]
                steps.append(step)
                cells += ['%.1f + %.1f = **%.1f**' % (v[0], c[0], step), c[1]]
            ratio = '%.2fx' % (steps[1] / steps[0]) if len(steps) == 2 else '-'
            print('| %s | %d | %s | %s |' % (shape, n, ' | '.join(cells), ratio))


if __name__ == '__main__':
    main(sys.argv[1])
