"""Where a kernel's warps stall, by how often the code runs: a summary of Nsight Compute's per-SASS-line CSV.

    ncu --section SourceCounters --page source --print-source sass --csv ... > sass.csv
    python bench/ncu_sass_summary.py sass.csv [--top 12]

SASS lines that execute equally often belong to the same loop level (in the grouped GEMM: once per k-step group,
per pipeline stage, per work item, per CTA), so grouping the stall samples by execution count splits a kernel's time
into its main loop and its per-item code without reading the SASS. Prints, per execution count, the lines, the share
of all stall samples and the largest stall reasons; then the lines with the most samples.
"""
from __future__ import annotations

import argparse
import collections
import csv


def read_rows(path: str) -> list:
    """(address, source, samples, executed, {stall reason: samples}) per SASS line."""
    with open(path) as f:
        lines = [line for line in f if not line.startswith("==")]  # ncu's own messages
    reader = csv.reader(lines)
    next(reader, None)  # the kernel name
    header = next(reader, [])
    column = {name: i for i, name in enumerate(header)}
    needed = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    missing = [name for name in needed if name not in column]
    if missing:  # e.g. ncu failed and the file holds its error message
        raise ValueError(f"{path}: not an ncu --page source --csv report (no column {', '.join(missing)})")
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    rows = []
    for row in reader:
        if len(row) < len(header):
            continue
        try:
            rows.append((row[column["Address"]], row[column["Source"]],
                         int(row[column["Warp Stall Sampling (All Samples)"]] or 0),
                         int(row[column["Instructions Executed"]] or 0),
                         {r[len("stall_"):]: int(row[column[r]] or 0) for r in reasons}))
        except ValueError:
            continue
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=12, help="lines with the most samples to list")
    parser.add_argument("--levels", type=int, default=8, help="execution counts to list")
    args = parser.parse_args(argv)
    rows = read_rows(args.csv)
    total = sum(r[2] for r in rows) or 1
    print(f"{len(rows)} SASS lines, {total} stall samples")
    levels = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for _, _, samples, executed, reasons in rows:
        level = levels[executed]
        level[0] += samples
        level[1] += 1
        level[2].update(reasons)
    print("by execution count (warp-level instructions executed per line):")
    for executed, (samples, count, reasons) in sorted(levels.items(), key=lambda kv: -kv[1][0])[:args.levels]:
        top = ", ".join(f"{name} {100 * n / total:.1f}%" for name, n in reasons.most_common(4))
        print(f"  executed {executed:>10d}: {count:5d} lines, {100 * samples / total:5.1f}% of samples ({top})")
    print("lines with the most samples:")
    for address, source, samples, executed, reasons in sorted(rows, key=lambda r: -r[2])[:args.top]:
        top = ", ".join(f"{name} {n}" for name, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:2])
        print(f"  {address[-6:]} {100 * samples / total:5.2f}% executed {executed:>9d}  {source.strip()[:56]:56s} {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
