"""What the norms share around their kernels: the dtype rules, placeholders
for absent arguments, and the collectives that combine per-device partial
statistics and gradients."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxnorm._partition import ShardAxes


def stats_dtype(dtype) -> np.dtype:
    """Statistics and accumulations: float32, float64 for float64 x."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def empty(dtype) -> jax.Array:
    """The ``(0,)`` placeholder for an absent argument or result."""
    return jnp.zeros((0,), dtype)


def or_empty(a, dtype) -> jax.Array:
    return empty(dtype) if a is None else a


def kernel_dtypes(x_dtype) -> tuple[np.dtype, ...]:
    """The dtypes the kernels read parameters and write outputs in: x's, and
    float32 as well for 16-bit x (float32 and float64 x stay in their own)."""
    x = jnp.dtype(x_dtype)
    return (x, jnp.dtype(jnp.float32)) if x.itemsize == 2 else (x,)


def param_dtype(x_dtype, *params) -> np.dtype:
    """The dtype the kernels read the parameters in: theirs where all agree on
    one of kernel_dtypes, else the statistics dtype (they are cast to it)."""
    given = [p for p in params if p is not None]
    dtype = jnp.dtype(given[0].dtype) if given else jnp.dtype(x_dtype)
    if dtype not in kernel_dtypes(x_dtype) or any(p.dtype != dtype for p in given):
        return stats_dtype(x_dtype)
    return dtype


def kernel_out_dtype(x_dtype, out_dtype) -> np.dtype:
    """What the kernels write: out_dtype where it is one of kernel_dtypes, else
    the statistics dtype (cast to out_dtype after)."""
    out = jnp.dtype(out_dtype)
    return out if out in kernel_dtypes(x_dtype) else stats_dtype(x_dtype)


def manual_axes(axis_name: tuple[str, ...]) -> ShardAxes:
    """Inside shard_map: the reduced dims split over `axis_name`. No row axes:
    shard_map's own transposes sum a replicated parameter's gradient over the
    devices that hold different rows."""
    return ShardAxes((), axis_name, math.prod(lax.axis_size(a) for a in axis_name), manual=True)


def psum_concat(axes, *arrays):
    """psum of arrays (any shapes) as one all-reduce."""
    dtype = jnp.result_type(*arrays)
    flat = [a.astype(dtype).reshape(-1) for a in arrays]
    total = lax.psum(jnp.concatenate(flat), axes)
    splits = np.cumsum([f.shape[0] for f in flat])[:-1]
    return [t.reshape(a.shape) for t, a in zip(jnp.split(total, splits), arrays)]


def merge_moments(count, mean, m2, axes, *, invariant=False):
    """Each statistic's (count, mean, M2) summed over the devices of the mesh
    `axes` with Chan's formula, from one all-gather: the same result, bitwise,
    on every device, and as accurate as unsplit data for means far from zero
    against the spread (summing raw moments would cancel). `count` is a Python
    number where every device counts the same (then only the means and M2s
    travel), else an array like `mean`. `invariant` (inside shard_map) types
    the result as the same on every device, as a psum's is, so that it may
    leave shard_map as a replicated output."""
    uniform = np.ndim(count) == 0 and not isinstance(count, jax.Array)
    parts = [mean, m2] if uniform else [count, mean, m2]
    parts = jnp.stack(parts, axis=-1)
    if invariant:
        parts = lax.all_gather(parts, axes, to="invarying")  # (devices, ..., 2 or 3)
    else:
        parts = lax.all_gather(parts, axes)
    means, m2s = parts[..., -2], parts[..., -1]
    counts = count if uniform else parts[..., 0]
    total = jnp.sum(jnp.broadcast_to(counts, means.shape), axis=0)
    merged = jnp.sum(counts * means, axis=0) / total
    spread = jnp.sum(m2s + counts * jnp.square(means - merged), axis=0)
    return total, merged, spread
