"""BatchNorm evaluation written several ways in jax.numpy: which kernels XLA
makes of each, and their device time (bf16 NHWC x, float32 parameters and
running statistics, as the benchmark's batch_norm_eval rows).

    python benchmarks/trials/bn_eval_forms.py

Evaluation is all jax.numpy so that XLA fuses it with what surrounds it; the
per-channel rsqrt then becomes a kernel of its own (~1.3 µs). The last
forms: the rsqrt in cheap ops, x over uint32 pairs of channels (4-byte
elements for XLA's loop), and jaxnorm's channel kernels given the
statistics (alone, and followed by a residual add and ReLU). Two baselines
that are not BatchNorm give XLA's bf16 elementwise ceiling: x * 2, over bf16
elements and over pairs.
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


def rsqrt_in_cheap_ops(x, w, b, m, v):
    """The rsqrt as a bit-level first guess and three Newton steps (integer
    and multiply-add ops only, which XLA might repeat in the elementwise
    pass rather than give a kernel of their own)."""
    vb = jnp.broadcast_to(v + EPS, x.shape)
    bits = lax.bitcast_convert_type(vb, jnp.int32)
    r = lax.bitcast_convert_type(jnp.int32(0x5F375A86) - (bits >> 1), jnp.float32)
    for _ in range(3):
        r = r * (1.5 - 0.5 * vb * r * r)
    return ((x.astype(jnp.float32) - m) * r * w + b).astype(x.dtype)


def _pairs(x):
    """bf16 (..., C) as uint32 (..., C / 2): two channels an element."""
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint32)


def _halves(u):
    """The even and odd channels of _pairs' elements, exactly, as float32."""
    lo = lax.bitcast_convert_type(u << 16, jnp.float32)
    hi = lax.bitcast_convert_type(u & jnp.uint32(0xFFFF0000), jnp.float32)
    return lo, hi


def _unpairs(lo, hi, shape):
    """float32 even and odd channels rounded to bf16 (XLA's conversion) and
    interleaved back into x's shape."""
    def bits(t):
        return lax.bitcast_convert_type(t.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)

    u = bits(lo) | (bits(hi) << 16)
    return lax.bitcast_convert_type(u, jnp.bfloat16).reshape(shape)


def in_pairs(x, w, b, m, v):
    """x a + c over uint32 pairs of channels: XLA's loop over 4-byte
    elements rather than 2-byte ones (whether it then loads more a thread)."""
    a = w * lax.rsqrt(v + EPS)
    c = b - m * a
    lo, hi = _halves(_pairs(x))
    return _unpairs(lo * a[0::2] + c[0::2], hi * a[1::2] + c[1::2], x.shape)


def bf16_scale(x, *_):
    """XLA's ceiling for a bf16 elementwise pass: x * 2, nothing a channel."""
    return (x.astype(jnp.float32) * 2).astype(x.dtype)


def bf16_scale_in_pairs(x, *_):
    lo, hi = _halves(_pairs(x))
    return _unpairs(lo * 2, hi * 2, x.shape)


def channel_kernel(x, w, b, m, v):
    """jaxnorm's channel-norm kernels given the statistics (GroupNorm's path,
    a group a channel), not XLA."""
    from jaxnorm import channel_norm

    return channel_norm._normalize("group_norm", x, w, b, lead_ndim=0, channel_axis=-1,
                                   group_size=1, epsilon=EPS, activation=None, dtype=None,
                                   axis_name=None, stats=(m, v))[0]


FORMS = [per_channel_rsqrt, folded, divide_by_sqrt, rsqrt_per_element, rsqrt_of_x_shaped,
         rsqrt_in_cheap_ops, in_pairs, channel_kernel]
# Not BatchNorm: XLA's bf16 elementwise pass alone, as 2-byte and 4-byte elements.
BASELINES = [bf16_scale, bf16_scale_in_pairs]
# Forms timed again followed by a residual add and a ReLU (a ResNet block's
# next ops), which XLA fuses into its elementwise pass but not into a kernel.
THEN_RESIDUAL_RELU = [per_channel_rsqrt, in_pairs, channel_kernel]


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
        for form in FORMS + BASELINES:
            fn = jax.jit(form)
            want = bf16_scale(x) if form in BASELINES else ref
            err = float(jnp.max(jnp.abs(fn(x, w, b, m, v).astype(jnp.float32) - want)))
            times = kernel_times(fn, x, w, b, m, v, iters=50)
            total = sum(times.values())
            gbps = 2 * x.size * 2 / total / 1e3 if total else 0.0
            print(f"{'x'.join(map(str, shape))} {form.__name__:20s} {total:6.1f} µs "
                  f"{gbps:6.0f} GB/s  max diff {err:.1e}  [{kernel_summary(times)}]",
                  flush=True)
        r = jax.random.normal(jax.random.fold_in(k[0], 1), shape, jnp.float32).astype(jnp.bfloat16)
        for form in THEN_RESIDUAL_RELU:
            fn = jax.jit(lambda x, r, *p, form=form: jax.nn.relu(form(x, *p) + r))
            times = kernel_times(fn, x, r, w, b, m, v, iters=50)
            print(f"{'x'.join(map(str, shape))} {form.__name__ + '+res+relu':20s} "
                  f"{sum(times.values()):6.1f} µs  [{kernel_summary(times)}]", flush=True)


if __name__ == "__main__":
    main()
