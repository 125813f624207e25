#!/usr/bin/env python3
"""Refits the memory model's bytes per activation element and per weight to measured peaks.

Reads the CSV that `recipes bench memory --csv FILE` writes (one line per pipeline stage of
each measured row: the model's terms beside the measurement), and searches a grid for the
`activation_bytes` and `weight_bytes` that make the largest |log(predicted / measured)| over
the rows the fit may see (not held out) smallest. Every other term stays as the model computed
it. Prints the fit and each row's ratio, held-out rows included.

    python3 scripts/fit-memory.py bf16.csv [--precision Bf16Mixed]
"""

import argparse
import csv
import math
from collections import defaultdict


def rows_of(path, precision):
    """Row index -> (measured bytes, held out, label, [stage terms])."""
    rows = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if precision and r["precision"] != precision:
                continue
            key = int(r["row"])
            label = f'{r["preset"]} {r["layout"]} B_m {r["micro_batch"]} {r["checkpointing"]} {r["precision"]}' + (
                " ZeRO-1" if r["zero1"] == "true" else ""
            )
            entry = rows.setdefault(key, (float(r["measured"]), r["held_out"] == "true", label, []))
            terms = {k: float(r[k]) for k in ("ranks", "params", "grads", "optimizer", "activation_per_byte",
                                               "activation_rest", "step_transient", "overhead")}
            entry[3].append(terms)
    return rows


def predicted(stages, activation_bytes, weight_bytes):
    """The whole process's bytes: each stage's rank total times its ranks, summed."""
    total = 0.0
    for s in stages:
        state = s["params"] * weight_bytes + s["grads"] + s["optimizer"] + s["overhead"]
        activations = s["activation_per_byte"] * activation_bytes + s["activation_rest"]
        total += s["ranks"] * (state + max(activations, s["step_transient"]))
    return total


def worst(rows, a, w, held_out):
    return max(abs(math.log(predicted(st, a, w) / m)) for m, h, _, st in rows.values() if h == held_out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--precision", default=None, help="only rows of this precision (F32 or Bf16Mixed)")
    args = p.parse_args()
    rows = rows_of(args.csv, args.precision)
    if not any(not h for _, h, _, _ in rows.values()):
        raise SystemExit("no row to fit (every row is held out, or none matches)")
    grid = [(a / 20, w / 10) for a in range(60, 161) for w in range(40, 121)]
    a, w = min(grid, key=lambda g: worst(rows, g[0], g[1], False))
    print(f"activation_bytes {a:.2f}, weight_bytes {w:.1f}: fitted rows within {math.exp(worst(rows, a, w, False)) - 1:.1%}")
    if any(h for _, h, _, _ in rows.values()):
        print(f"held-out rows within {math.exp(worst(rows, a, w, True)) - 1:.1%}")
    for key in sorted(rows):
        m, h, label, st = rows[key]
        print(f"{label}{' (held out)' if h else ''}: measured {m / 2**20:.1f} MiB, predicted {predicted(st, a, w) / 2**20:.1f}, ratio {predicted(st, a, w) / m:.3f}")


if __name__ == "__main__":
    main()
