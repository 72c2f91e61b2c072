"""The row norms' memory ceiling at each benchmark shape's own size.

bench_row_norm.py counts bandwidth against one figure: XLA's float32 `a * 2`
over 1 GB, where a launch's ramp and tail are a fraction of a percent. A
30-100 µs kernel pays them in full. This times XLA's bf16 element-wise ops
that move each large shape's bytes in the norms' patterns (as device kernel
time, like the benchmark):
  fwd:         y = x * 2          (read x, write y)
  fwd+bwd:     dx = x * dy        (read x, dy, write dx)
  add fwd:     (x + r, x * r)     (read x, r, write two outputs)
  copy:        the 1 GB figure's own op, float32 `a * 2`, on the forward's
               bytes (a float32 array of half the elements): the 1:1 pattern
               at the shape's size, without XLA's bf16 code
and, given the benchmark's JSON, jaxnorm's time for the matching row as a
percent of that op's (above 100: jaxnorm moved the same bytes faster).
  python benchmarks/copy_sizes.py --table results/row_norm_NVIDIA_H200.json --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from bench_row_norm import LARGE
from devtime import copy_bandwidth_gbps, device_time_us

# pattern: (op rows of the benchmark it stands for, the jitted op, tensors read, written)
PATTERNS = {
    "fwd": ([("rms_norm", "fwd"), ("layer_norm", "fwd")], lambda x, r: x * 2, 1, 1),
    "fwd+bwd": ([("rms_norm", "fwd+bwd"), ("layer_norm", "fwd+bwd")], lambda x, r: x * r, 2, 1),
    "add fwd": ([("add_rms_norm", "fwd")], lambda x, r: (x + r, x * r), 2, 2),
}


def jaxnorm_us(records: list, op: str, pass_: str, shape) -> float | None:
    for r in records:
        if (r["op"], r["pass"], r["impl"], tuple(r["shape"])) == (op, pass_, "jaxnorm",
                                                                   tuple(shape)):
            return r["us"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", help="bench_row_norm.py's JSON, for jaxnorm's times")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    records = json.load(open(args.table))["records"] if args.table else []
    device = jax.devices()[0].device_kind
    copy = copy_bandwidth_gbps()
    lines = [f"Device: {device}; date {datetime.date.today()}; jax {jax.__version__}; "
             f"the benchmark's copy figure (float32 a * 2 over 1 GB) in this run: "
             f"{copy:.0f} GB/s; bf16; device kernel time (µs).", "",
             "| pattern | shape | XLA op µs | GB/s | % of the 1 GB figure | jaxnorm µs "
             "(op, from the table) | jaxnorm % of the op |",
             "|---|---|---:|---:|---:|---|---|"]
    rng = np.random.default_rng(0)
    for shape in LARGE:
        x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        r = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        half = jnp.asarray(rng.standard_normal(x.size // 2), jnp.float32)
        us = device_time_us(jax.jit(lambda a: a * 2), half)
        gbps = 2 * half.size * 4 / us / 1e3
        lines.append(f"| copy | {shape[0]}x{shape[1]} | {us:.1f} | {gbps:.0f} | "
                     f"{100 * gbps / copy:.0f}% | | |")
        print(lines[-1], flush=True)
        for name, (rows, op, reads, writes) in PATTERNS.items():
            us = device_time_us(jax.jit(op), x, r)
            gbps = (reads + writes) * x.size * 2 / us / 1e3
            ours = [(o, p, jaxnorm_us(records, o, p, shape)) for o, p in rows]
            ours = [(o, t) for o, _, t in ours if t]
            lines.append(
                f"| {name} | {shape[0]}x{shape[1]} | {us:.1f} | {gbps:.0f} | "
                f"{100 * gbps / copy:.0f}% | "
                + ", ".join(f"{o} {t:.1f}" for o, t in ours) + " | "
                + ", ".join(f"{100 * us / t:.0f}%" for _, t in ours) + " |")
            print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "copy_sizes_" + device.replace(" ", "_") + ".md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
