"""Where a kernel's warps stall, by how often the code runs: a summary of Nsight Compute's per-SASS-line CSV.

    ncu --section SourceCounters --page source --print-source sass --csv ... > sass.csv
    python bench/ncu_sass_summary.py sass.csv [--top 12] [--elements N]

SASS lines that execute equally often belong to the same loop level (in the grouped GEMM: once per k-step group,
per pipeline stage, per work item, per CTA), so grouping the stall samples by execution count splits a kernel's time
into its main loop and its per-item code without reading the SASS. Prints, per execution count, the lines, the share
of all stall samples and the largest stall reasons; then the lines with the most samples. With --elements N (the
elements the profiled launch processed), also the thread instructions executed per element, in all and by opcode:
the figure to hold against what the memory bandwidth allows (docs/TARGETS.md, the quantization kernels).
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


def opcode(source: str) -> str:
    """The SASS opcode without its modifiers and predicate: '@!P0 LDG.E.128 R4, [R2]' -> 'LDG'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def print_per_element(rows: list, elements: int) -> None:
    """Thread instructions executed per element (warp instructions x 32 / elements), in all and by opcode."""
    by_opcode = collections.Counter()
    for _, source, _, executed, _ in rows:
        by_opcode[opcode(source)] += executed
    scale = 32 / elements
    total = sum(by_opcode.values())
    print(f"thread instructions per element: {total * scale:.2f} "
          f"({total} warp instructions, {elements} elements); by opcode (>= 0.1):")
    print("  " + ", ".join(f"{name} {n * scale:.2f}" for name, n in by_opcode.most_common() if n * scale >= 0.1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=12, help="lines with the most samples to list")
    parser.add_argument("--levels", type=int, default=8, help="execution counts to list")
    parser.add_argument("--elements", type=int, default=0,
                        help="elements the launch processed: print thread instructions per element by opcode")
    args = parser.parse_args(argv)
    if args.elements < 0:
        parser.error(f"--elements must be a positive count (or 0: off), got {args.elements}")
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
    if args.elements > 0:
        print_per_element(rows, args.elements)
    print("lines with the most samples:")
    for address, source, samples, executed, reasons in sorted(rows, key=lambda r: -r[2])[:args.top]:
        top = ", ".join(f"{name} {n}" for name, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:2])
        print(f"  {address[-6:]} {100 * samples / total:5.2f}% executed {executed:>9d}  {source.strip()[:56]:56s} {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
