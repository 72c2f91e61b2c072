"""RMSNorm, LayerNorm and fused add+RMSNorm: jaxnorm against XLA's fused jnp
implementation of the same math (same dtypes, float32 statistics), as device
kernel time. Decode shapes (1 to 256 rows) for the forwards of RMSNorm and
add+RMSNorm.

add+RMSNorm forward, jaxnorm: the fused kernel's time, as in a model or with x
and residual donated, where it works in place; a standalone call on inputs that
stay live adds XLA's copies of them first (listed in the log, not counted).

Prints a markdown table and writes the same records as JSON:
  python benchmarks/bench_row_norm.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import platform

import jax
import jax.numpy as jnp
import numpy as np
from devtime import copy_bandwidth_gbps, kernel_times, write_results

import jaxnorm

SHAPES = [(16384, 4096), (4096, 8192), (65536, 1024), (8192, 12288), (64, 4096), (1, 4096)]
DECODE = [(t, h) for h in (4096, 8192) for t in (1, 8, 64, 256)]


def xla_rms_norm(x, scale, epsilon=1e-6):
    xf = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + epsilon)
    return (xf * rstd * scale.astype(jnp.float32)).astype(x.dtype)


def xla_layer_norm(x, scale, bias, epsilon=1e-5):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xc = xf - mean
    rstd = jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + epsilon)
    y = xc * rstd * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def xla_add_rms_norm(x, residual, scale, epsilon=1e-6):
    h = x + residual
    return xla_rms_norm(h, scale, epsilon), h


IMPLS = {
    "rms_norm": {"jaxnorm": jaxnorm.rms_norm, "xla": xla_rms_norm},
    "layer_norm": {"jaxnorm": jaxnorm.layer_norm, "xla": xla_layer_norm},
    "add_rms_norm": {"jaxnorm": jaxnorm.add_rms_norm, "xla": xla_add_rms_norm},
}
# bytes moved per element of x, at the least
BYTES = {("fwd", False): 2, ("fwd+bwd", False): 3, ("fwd", True): 4, ("fwd+bwd", True): 5}


def inputs(op, shape, dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    dy = jnp.asarray(rng.standard_normal(shape), dtype)
    params = [jnp.asarray(rng.standard_normal(shape[-1]) + 1, dtype)]
    if op == "add_rms_norm":  # residual first; dy: the cotangents of y and h
        params.insert(0, jnp.asarray(rng.standard_normal(shape), dtype))
        dy = (dy, jnp.asarray(rng.standard_normal(shape), dtype))
    if op == "layer_norm":
        params.append(jnp.asarray(rng.standard_normal(shape[-1]), dtype))
    return x, params, dy


def timed(op, impl, pass_, shape, dtype):
    f = IMPLS[op][impl]
    x, params, dy = inputs(op, shape, dtype)
    if pass_ == "fwd":
        fn, args = jax.jit(f), (x, *params)
    else:  # the primal output is unused, as under jax.grad
        fn, args = jax.jit(lambda x, dy, *p: jax.vjp(f, x, *p)[1](dy)), (x, dy, *params)
    kernels = kernel_times(fn, *args)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])
    detail = ", ".join(f"{name[:40]} {us:.1f}" for name, us in ranked)
    print(f"# {op} {pass_} {shape} {impl}: {detail}", flush=True)
    if op == "add_rms_norm" and pass_ == "fwd" and impl == "jaxnorm":
        return sum(us for name, us in kernels.items() if "jaxnorm" in name)
    return sum(kernels.values())


def shapes_for(op, pass_, shapes):
    if pass_ == "fwd" and op != "layer_norm" and shapes == SHAPES:
        return SHAPES[:4] + DECODE
    return shapes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default=None, help="e.g. 64x256,8x128 (default: the full set)")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    device = jax.devices()[0].device_kind
    copy = copy_bandwidth_gbps()
    records = []
    for op in IMPLS:
        for pass_ in ("fwd", "fwd+bwd"):
            for shape in shapes_for(op, pass_, shapes):
                n = shape[0] * shape[1] * dtype.itemsize
                nbytes = BYTES[pass_, op.startswith("add")] * n
                times = {impl: timed(op, impl, pass_, shape, dtype) for impl in IMPLS[op]}
                for impl, us in times.items():
                    records.append(dict(
                        op=op, **{"pass": pass_}, shape=list(shape), dtype=dtype.name,
                        impl=impl, us=round(us, 2), gbps=round(nbytes / us / 1e3, 1),
                        vs_xla=round(times["xla"] / us, 3),
                    ))
    meta = dict(
        device=device, date=datetime.date.today().isoformat(), copy_gbps=round(copy, 1),
        jax=jax.__version__, jaxnorm=jaxnorm.__version__, python=platform.python_version(),
        bytes="fwd: read x + write y; fwd+bwd: read x, dy + write dx (primal output unused); "
              "add_rms_norm fwd: read x, residual + write y, h; fwd+bwd: read x, residual, "
              "dy, dh + write dx (= dresidual)",
    )
    lines = [
        f"Device: {device}; date {meta['date']}; jax {jax.__version__}; "
        f"measured copy bandwidth {copy:.0f} GB/s; dtype {dtype.name}; device kernel time.",
        "",
        "| op | pass | shape | impl | µs | GB/s | % of copy | speed-up vs XLA |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['op']} | {r['pass']} | {r['shape'][0]}x{r['shape'][1]} | {r['impl']} | "
            f"{r['us']:.1f} | {r['gbps']:.0f} | {100 * r['gbps'] / copy:.0f}% | "
            f"{r['vs_xla']:.2f} |"
        )
    write_results(args.out, "row_norm", device, meta, records, "\n".join(lines))


if __name__ == "__main__":
    main()
