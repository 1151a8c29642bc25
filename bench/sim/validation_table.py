"""Markdown table of the median errors that bench/sim/validate_all.sh wrote (one column per
comm, shape and source; run 1 / run 2 / ... per cell; bold: within 15%), then the count."""
import re
import sys

out, reps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
cols = [(c, s, z) for c in ("threads", "mpi") for s in ("small", "big") for z in ("", "-zipf")]
stages = ["route", "permute", "dispatch", "experts", "combine", "reduce", "layer"]
row = re.compile(r"\s+(\w+).*?\s([\d.]+)\s+([\d.]+)\s+([+-]\d+)%\s+([+-]\d+)% \.\. ([+-]\d+)%")
err = {}
for c in cols:
    for r in range(1, reps + 1):
        with open(f"{out}/{c[0]}-{c[1]}{c[2]}-{r}.txt") as f:
            for line in f:
                m = row.match(line)
                if m:
                    err[(c, r, m.group(1))] = int(m.group(4))
name = lambda c: f"{'MPI' if c[0] == 'mpi' else 'threads'}, {'small' if c[1] == 'small' else 'large'}, {'Zipf' if c[2] else 'uniform'}"
print("| stage | " + " | ".join(name(c) for c in cols) + " |")
print("|---" * (len(cols) + 1) + "|")
cell = lambda e: f"**{e:+d}%**" if abs(e) <= 15 else f"{e:+d}%"
for s in stages:
    cells = [" / ".join(cell(err[(c, r, s)]) for r in range(1, reps + 1)) for c in cols]
    print(f"| {'layer total' if s == 'layer' else s} | " + " | ".join(cells) + " |")
n = sum(1 for k, e in err.items() if k[2] in stages and abs(e) <= 15)
print(f"\n{n} of {len(cols) * reps * len(stages)} stage medians within 15%")
