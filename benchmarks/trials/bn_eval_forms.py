"""BatchNorm evaluation written several ways in jax.numpy: which kernels XLA
makes of each, and their device time (bf16 NHWC x, float32 parameters and
running statistics, as the benchmark's batch_norm_eval rows).

    python benchmarks/trials/bn_eval_forms.py

Evaluation is all jax.numpy so that XLA fuses it with what surrounds it; the
per-channel rsqrt then becomes a kernel of its own (~1.3 µs).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from devtime import kernel_summary, kernel_times  # noqa: E402

EPS = 1e-5
SHAPES = [(256, 56, 56, 64), (128, 28, 28, 256), (64, 14, 14, 1024)]


def per_channel_rsqrt(x, w, b, m, v):
    """jaxnorm's form: rstd a channel, then the elementwise pass."""
    xf = x.astype(jnp.float32)
    return ((xf - m) * lax.rsqrt(v + EPS) * w + b).astype(x.dtype)


def folded(x, w, b, m, v):
    """x a + c, with a and c a channel."""
    a = w * lax.rsqrt(v + EPS)
    return (x.astype(jnp.float32) * a + (b - m * a)).astype(x.dtype)


def divide_by_sqrt(x, w, b, m, v):
    xf = x.astype(jnp.float32)
    return ((xf - m) / jnp.sqrt(v + EPS) * w + b).astype(x.dtype)


def rsqrt_per_element(x, w, b, m, v):
    """The variance broadcast to x's shape before the rsqrt."""
    xf = x.astype(jnp.float32)
    vb = jnp.broadcast_to(v, x.shape)
    return ((xf - m) * lax.rsqrt(vb + EPS) * w + b).astype(x.dtype)


def rsqrt_of_x_shaped(x, w, b, m, v):
    """The rsqrt of an x-shaped array that is not a broadcast of a
    channel's value (0 x), so that no rewrite hoists it to the channels."""
    xf = x.astype(jnp.float32)
    return ((xf - m) * lax.rsqrt(v + EPS + 0 * xf) * w + b).astype(x.dtype)


FORMS = [per_channel_rsqrt, folded, divide_by_sqrt, rsqrt_per_element, rsqrt_of_x_shaped]


def main():
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    key = jax.random.PRNGKey(0)
    for shape in SHAPES:
        k = jax.random.split(key, 5)
        c = shape[-1]
        x = jax.random.normal(k[0], shape, jnp.float32).astype(jnp.bfloat16)
        w = 1 + 0.1 * jax.random.normal(k[1], (c,))
        b = 0.1 * jax.random.normal(k[2], (c,))
        m = 0.1 * jax.random.normal(k[3], (c,))
        v = 1 + jax.random.uniform(k[4], (c,))
        ref = per_channel_rsqrt(x, w, b, m, v).astype(jnp.float32)
        for form in FORMS:
            fn = jax.jit(form)
            err = float(jnp.max(jnp.abs(fn(x, w, b, m, v).astype(jnp.float32) - ref)))
            times = kernel_times(fn, x, w, b, m, v, iters=50)
            total = sum(times.values())
            gbps = 2 * x.size * 2 / total / 1e3 if total else 0.0
            print(f"{'x'.join(map(str, shape))} {form.__name__:20s} {total:6.1f} µs "
                  f"{gbps:6.0f} GB/s  max diff {err:.1e}  [{kernel_summary(times)}]",
                  flush=True)


if __name__ == "__main__":
    main()
