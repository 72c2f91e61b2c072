"""A norm's backward kernel in three contexts: launched back to back (as
bench_row_norm.py's loop runs it), after a matmul that writes its dy (as in a
training step, where the layer above's input gradient is the norm's dy), and
after an element-wise op that writes dy. Device time of the backward's own
kernel (devtime.kernel_times, median over the calls), per context.

  python benchmarks/norm_context.py [--op rms_norm] [--shape 65536x1024] [--k 2816]

v97 (benchmarks/NOTES.md): RMSNorm's backward at 65536x1024 ran 102-104 us in a
training step and 114-118 back to back; this reproduces the contexts without
the model.
"""

from __future__ import annotations

import argparse
import datetime

import jax
import jax.numpy as jnp
from devtime import kernel_times

import jaxnorm


def norm_fn(op: str):
    if op == "rms_norm":
        return lambda x, s, b: jaxnorm.rms_norm(x, s)
    return lambda x, s, b: jaxnorm.layer_norm(x, s, b)


def backward_kernels(times: dict[str, float]) -> dict[str, float]:
    """The jaxnorm kernels of a call other than the forward's."""
    return {n: us for n, us in times.items() if "jaxnorm" in n and "fwd" not in n}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="rms_norm", choices=["rms_norm", "layer_norm"])
    ap.add_argument("--shape", default="65536x1024")
    ap.add_argument("--k", type=int, default=2816, help="the matmul's inner dimension")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    rows, hidden = map(int, args.shape.split("x"))
    keys = jax.random.split(jax.random.key(0), 6)
    bf16 = jnp.bfloat16
    x = jax.random.normal(keys[0], (rows, hidden), bf16)
    scale = (1 + 0.1 * jax.random.normal(keys[1], (hidden,))).astype(bf16)
    bias = (0.1 * jax.random.normal(keys[2], (hidden,))).astype(bf16)
    a = jax.random.normal(keys[3], (rows, args.k), bf16)
    w = (jax.random.normal(keys[4], (args.k, hidden)) / args.k**0.5).astype(bf16)
    dy0 = jax.random.normal(keys[5], (rows, hidden), bf16)
    f = norm_fn(args.op)
    _, vjp = jax.vjp(f, x, scale, bias)  # the forward's statistics saved

    contexts = {
        # The backward alone, call after call: each launch follows the last.
        "back to back, given the statistics": (jax.jit(lambda dy: vjp(dy)), (dy0,)),
        # As under jax.grad with y unused: the backward computes the statistics.
        "back to back, computing the statistics": (
            jax.jit(lambda x, dy: jax.vjp(f, x, scale, bias)[1](dy)), (x, dy0)),
        # dy written by a matmul just before, as the layer above writes it.
        "after a matmul writing dy": (jax.jit(lambda a, w: vjp(a @ w)), (a, w)),
        # dy written by an element-wise op just before.
        "after an element-wise op writing dy": (
            jax.jit(lambda d: vjp((d.astype(jnp.float32) * 1.5).astype(bf16))), (dy0,)),
    }
    print(f"# {jax.devices()[0].device_kind}; {datetime.date.today()}; {args.op} {args.shape}, "
          f"bf16, matmul inner dimension {args.k}; µs a call, median of {args.iters}")
    for name, (fn, fn_args) in contexts.items():
        times = kernel_times(fn, *fn_args, iters=args.iters)
        bwd = backward_kernels(times)
        others = sum(us for n, us in times.items() if n not in bwd)
        print(f"{name:42s} backward {sum(bwd.values()):7.1f}   other kernels {others:7.1f}")
        for n, us in sorted(bwd.items(), key=lambda kv: -kv[1]):
            print(f"    {us:7.1f}  {n[:150]}")


if __name__ == "__main__":
    main()
