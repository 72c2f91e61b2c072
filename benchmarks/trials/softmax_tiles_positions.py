"""softmax_tiles' device time at each positions a thread P, forward and
forward+backward, over channel counts and tile counts (NCHW x).

Needs a build with `softmax_tiles_positions.patch` applied (P from the
environment variable TRIAL_SOFTMAX_P where it fits):

    git apply benchmarks/trials/softmax_tiles_positions.patch
    # build, then on the GPU:
    python benchmarks/trials/softmax_tiles_positions.py

(The run in results/softmax_tiles_positions_*.txt also timed P = 8 for 16-bit
x, from a build whose dispatch took it.)
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from devtime import kernel_times  # noqa: E402

import jaxnorm  # noqa: E402

SHAPES = [(16, 150, 64, 64), (8, 21, 128, 128), (4, 256, 64, 64), (16, 256, 64, 64),
          (32, 64, 64, 64), (2, 150, 64, 64), (64, 19, 64, 64), (8, 128, 32, 32)]


def main():
    print("#", jax.devices()[0].device_kind)
    for dt in (jnp.bfloat16, jnp.float32):
        for shape in SHAPES:
            x = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32).astype(dt)
            dy = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32).astype(dt)

            def softmax(x):
                return jaxnorm.channel_softmax(x, channel_axis=1)

            fwd = jax.jit(softmax)
            grad = jax.jit(lambda x, dy: jax.vjp(softmax, x)[1](dy)[0])
            for name, fn, args in (("fwd", fwd, (x,)), ("fwd+bwd", grad, (x, dy))):
                row = []
                for p in (1, 2, 4):
                    os.environ["TRIAL_SOFTMAX_P"] = str(p)
                    t = kernel_times(fn, *args, iters=30)
                    row.append(f"P{p} {sum(v for k, v in t.items() if 'jaxnorm' in k):6.1f}")
                print(f"{jnp.dtype(dt).name:8s} {'x'.join(map(str, shape)):14s} {name:8s}",
                      "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
