"""What add_rms_norm's backward forming h itself gains and costs (notes v57).

Forward+backward of add_rms_norm in one jit, bf16, few rows, with the rule
that hands the backward x and residual in place of h at three size limits
(0: never, the package's default, and always), in two programs:
  dead:  only the gradients (y and h dead): the forward can go;
  live:  h returned as well, as a model's residual stream: the forward runs.
Device kernel time, medians of the summed kernels.

    python benchmarks/recompute_h.py [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os

import jax
import jax.numpy as jnp
import numpy as np
from devtime import kernel_summary, kernel_times

import jaxnorm
from jaxnorm import row_norm

SHAPES = [(1, 4096), (8, 4096), (64, 4096), (128, 4096), (256, 4096), (64, 8192)]


def programs(shape):
    rng = np.random.default_rng(0)
    x, r, dy, dh = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    s = jnp.asarray(rng.standard_normal(shape[-1]) + 1, jnp.bfloat16)

    def dead(x, r, s, dy, dh):
        return jax.vjp(jaxnorm.add_rms_norm, x, r, s)[1]((dy, dh))

    def live(x, r, s, dy, dh):
        (_, h), pullback = jax.vjp(jaxnorm.add_rms_norm, x, r, s)
        return h, pullback((dy, dh))

    return {"dead": dead, "live": live}, (x, r, s, dy, dh)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    default = row_norm._RECOMPUTE_H_BYTES
    limits = {"never": 0, f"default ({default} B)": default, "always": 1 << 40}
    lines = [f"# {jax.devices()[0].device_kind}, {datetime.date.today()}, jax {jax.__version__}",
             "# shape, program, limit: us (kernels)"]
    for shape in SHAPES:
        fns, inputs = programs(shape)
        for name, fn in fns.items():
            for label, limit in limits.items():
                row_norm._RECOMPUTE_H_BYTES = limit
                # a fresh function object each time: jit lowers it again
                kernels = kernel_times(jax.jit(lambda *a, fn=fn: fn(*a)), *inputs, iters=50)
                total = sum(kernels.values())
                lines.append(f"{shape[0]}x{shape[1]} {name:4s} {label:22s} {total:6.2f}  "
                             f"{kernel_summary(kernels)}")
                print(lines[-1], flush=True)
    row_norm._RECOMPUTE_H_BYTES = default
    name = jax.devices()[0].device_kind.replace(" ", "_")
    with open(os.path.join(args.out, f"recompute_h_{name}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
