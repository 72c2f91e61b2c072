"""RMSNorm and LayerNorm.

Both normalize each row of x over its trailing (normalized) dimensions and
share one forward and one backward primitive; LayerNorm is the `centered` case
(subtract the mean, then add a bias). The forward saves x and per-row float32
statistics (mean, rstd), never the output; the backward reads them.

Dtype rule: x may be float32, bfloat16, float16 or float64; statistics are
float32 (float64 for float64 x); the output has x's dtype unless `dtype` is
given. scale and bias may have another float dtype than x: the kernels read
them in x's dtype or in float32, and any other parameter dtype is cast to
float32 first. Output dtypes other than x's dtype or float32 are produced by
computing in float32 and casting once. Gradients come back in each argument's
own dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxnorm import _checks
from jaxnorm._partition import (
    ABSENT,
    NORM,
    ROWS,
    ROWS_NORM,
    UNSHARDED,
    RowLayout,
    ShardAxes,
    row_partitioned,
)
from jaxnorm._primitive import (
    define_kernel_primitive,
    define_row_primitive,
    like,
    match_varying,
    register_dce_rewrite,
)

Shape = Sequence[int] | int
AxisName = str | tuple[str, ...]


def _stats_dtype(dtype) -> np.dtype:
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def _empty(dtype) -> jax.Array:
    return jnp.zeros((0,), dtype)


# ------------------------------------------------ kernels: (rows, hidden)


def _fwd_kernel_abstract(x, scale, bias, *, epsilon, centered, out_dtype, write_output):
    del epsilon, scale, bias
    rows, hidden = x.shape
    stats = _stats_dtype(x.dtype)
    y = like(x, (rows, hidden if write_output else 0), out_dtype, (0, 1))
    mean = like(x, (rows if centered else 0,), stats, (0,))
    rstd = like(x, (rows,), stats, (0,))
    return y, mean, rstd


def _fwd_kernel_reference(x, scale, bias, **params):
    return _fwd_rows(x, scale, bias, axes=(), hidden_total=x.shape[1], **params)


def _normalize(xf, mean, rstd, scale, bias, out_dtype):
    y = (xf - mean[:, None] if mean.size else xf) * rstd[:, None]
    if scale.size:
        y = y * scale.astype(xf.dtype)
    if bias.size:
        y = y + bias.astype(xf.dtype)
    return y.astype(out_dtype)


def _fwd_kernel_attributes(*, epsilon, centered, **_):
    return {"epsilon": np.float64(epsilon), "centered": np.bool_(centered)}


row_norm_fwd_kernel_p = define_kernel_primitive(
    "row_norm_fwd",
    abstract_eval=_fwd_kernel_abstract,
    reference=_fwd_kernel_reference,
    attributes=_fwd_kernel_attributes,
)


def _bwd_kernel_abstract(x, scale, mean, rstd, dy, *, centered, has_bias, param_dtype):
    del mean, rstd, dy, centered
    hidden = x.shape[1]
    dx = like(x, x.shape, x.dtype, (0, 1))
    dscale = like(x, scale.shape, scale.dtype, (1 if scale.shape[0] else None,))
    dbias = like(x, (hidden if has_bias else 0,), param_dtype, (1 if has_bias else None,))
    return dx, dscale, dbias


def _bwd_kernel_reference(x, scale, mean, rstd, dy, *, centered, has_bias, param_dtype):
    dx, dscale, dbias = _bwd_rows(x, scale, mean, rstd, dy, centered, has_bias, axes=(),
                                  hidden_total=x.shape[1])
    dscale = dscale.astype(scale.dtype)
    dbias = dbias.astype(param_dtype)
    return dx, dscale, dbias


def _bwd_rows(x, scale, mean, rstd, dy, centered, has_bias, *, axes, hidden_total):
    """dx and the float32 (float64) per-device dscale, dbias of rows that may
    be split over the mesh `axes`: then the per-row dot products are local
    partial sums, combined with one psum.

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * scale, with the
    mean(g) term only for LayerNorm.
    """
    acc = _stats_dtype(x.dtype)
    d = dy.astype(acc)
    xc = x.astype(acc) - mean[:, None] if centered else x.astype(acc)
    xhat = xc * rstd[:, None]
    g = d * scale.astype(acc) if scale.size else d
    dots = [jnp.sum(g * xhat, axis=-1)] + ([jnp.sum(g, axis=-1)] if centered else [])
    dots = jnp.stack(dots, axis=-1)
    if axes:
        dots = lax.psum(dots, axes)
    dots = dots / hidden_total
    dx = g - dots[:, :1] * xhat
    if centered:
        dx = dx - dots[:, 1:]
    dx = (dx * rstd[:, None]).astype(x.dtype)
    dscale = jnp.sum(d * xhat, axis=0) if scale.size else jnp.zeros((0,), acc)
    dbias = jnp.sum(d, axis=0) if has_bias else jnp.zeros((0,), acc)
    return dx, dscale, dbias


def _bwd_kernel_attributes(*, centered, **_):
    return {"centered": np.bool_(centered)}


row_norm_bwd_kernel_p = define_kernel_primitive(
    "row_norm_bwd",
    abstract_eval=_bwd_kernel_abstract,
    reference=_bwd_kernel_reference,
    attributes=_bwd_kernel_attributes,
)


def _row_stats(x, axes, hidden_total, epsilon, centered):
    """Per-row (x in the statistics dtype, mean, rstd) of rows that may be
    split over the mesh `axes`: then each device sums its slice and one small
    collective of per-slice statistics combines them.

    RMSNorm: one psum of each slice's sum of squares (1 float per row).
    LayerNorm: each slice's two-pass (mean, M2), all-gathered (2 floats per
    row per slice) and merged with Chan's formula on every device in the same
    order, so all devices agree bitwise. Summing raw moments instead (one psum
    of sum and sum of squares) would cancel catastrophically for rows whose
    mean is large against their spread.
    """
    acc = _stats_dtype(x.dtype)
    xf = x.astype(acc)
    eps = jnp.asarray(epsilon, acc)
    if not centered:
        sum_sq = jnp.sum(xf * xf, axis=-1)
        if axes:
            sum_sq = lax.psum(sum_sq, axes)
        return xf, jnp.zeros((0,), acc), lax.rsqrt(sum_sq / hidden_total + eps)
    mean = jnp.mean(xf, axis=-1)
    m2 = jnp.sum(jnp.square(xf - mean[:, None]), axis=-1)
    if axes:
        parts = lax.all_gather(jnp.stack([mean, m2], axis=-1), axes)  # (slices, rows, 2)
        means = parts[..., 0]
        mean = jnp.mean(means, axis=0)  # slices have equal sizes
        m2 = jnp.sum(parts[..., 1], axis=0) + x.shape[1] * jnp.sum(
            jnp.square(means - mean), axis=0
        )
    return xf, mean, lax.rsqrt(m2 / hidden_total + eps)


def _fwd_rows(x, scale, bias, *, axes, hidden_total, epsilon, centered, out_dtype,
              write_output):
    """The forward in jax.numpy on (rows, hidden), rows possibly split over the
    mesh `axes` (see `_row_stats`)."""
    xf, mean, rstd = _row_stats(x, axes, hidden_total, epsilon, centered)
    if not write_output:
        return jnp.zeros((x.shape[0], 0), out_dtype), mean, rstd
    return _normalize(xf, mean, rstd, scale, bias, out_dtype), mean, rstd


# ---------------------------------------------- per device: (*rows, *norm)


def _flat_rows(x, norm_ndim):
    rows_shape = x.shape[: x.ndim - norm_ndim]
    return rows_shape, x.reshape(math.prod(rows_shape), math.prod(x.shape[len(rows_shape):]))


def _flat(a):
    return a.reshape(-1) if a.size else a


def _fwd_local(x, scale, bias, *, axes, kernel, norm_ndim, **params):
    """The forward on one device's block of x. Rows split over hidden axes
    need their statistics combined across devices; otherwise `kernel` runs on
    the flattened (rows, hidden) block."""
    rows_shape, x2 = _flat_rows(x, norm_ndim)
    s2, b2 = _flat(scale), _flat(bias)
    if axes.hidden:
        hidden_total = x2.shape[1] * axes.hidden_shards
        y2, mean, rstd = _fwd_rows(x2, s2, b2, axes=axes.hidden, hidden_total=hidden_total,
                                   **params)
    else:
        y2, mean, rstd = kernel(x2, s2, b2, **params)
    y = y2.reshape(x.shape) if params["write_output"] else _empty(y2.dtype)
    return y, mean.reshape(rows_shape) if mean.size else mean, rstd.reshape(rows_shape)


def _bwd_local(x, scale, mean, rstd, dy, *, axes, kernel, norm_ndim, centered, has_bias,
               param_dtype):
    """The backward on one device's block. dscale/dbias are partial sums over
    the device's rows, so they are summed over the row axes (in float32, one
    psum for both); rows split over hidden axes also sum their dot products."""
    rows_shape, x2 = _flat_rows(x, norm_ndim)
    dy2 = dy.reshape(x2.shape)
    s2, m2, r2 = _flat(scale), _flat(mean), _flat(rstd)
    if axes.hidden:
        hidden_total = x2.shape[1] * axes.hidden_shards
        dx2, dscale, dbias = _bwd_rows(x2, s2, m2, r2, dy2, centered, has_bias,
                                       axes=axes.hidden, hidden_total=hidden_total)
    else:
        # Partial sums travel in float32 (float64 for float64 parameters).
        wide = jnp.promote_types(param_dtype, jnp.float32) if axes.rows else param_dtype
        dx2, dscale, dbias = kernel(x2, s2.astype(wide), m2, r2, dy2, centered=centered,
                                    has_bias=has_bias, param_dtype=wide)
    if axes.rows:
        dscale, dbias = _psum_concat(axes.rows, dscale, dbias)
    norm_shape = x.shape[x.ndim - norm_ndim:]
    dscale = dscale.astype(scale.dtype).reshape(norm_shape if scale.size else (0,))
    dbias = dbias.astype(param_dtype).reshape(norm_shape if has_bias else (0,))
    return dx2.reshape(x.shape), dscale, dbias


def _psum_concat(axes, *arrays):
    """psum of 1-D arrays as one all-reduce."""
    dtype = jnp.result_type(*arrays)
    total = lax.psum(jnp.concatenate([a.astype(dtype) for a in arrays]), axes)
    splits = np.cumsum([a.shape[0] for a in arrays])[:-1]
    return jnp.split(total, splits)


# ------------------------------------------- user-facing: (*rows, *norm)


def _op_name(centered):
    return "layer_norm" if centered else "rms_norm"


def _param_layout(p):
    return NORM if p.size else ABSENT


def _lower(local, layout, args, params):
    """Lower through automatic partitioning: `local` runs on each device's block."""
    return _partitioned(local, layout, tuple(sorted(params.items())))(*args)


@functools.cache
def _partitioned(local, layout, params):
    op = _op_name(dict(params)["centered"])
    return row_partitioned(op, layout, functools.partial(local, **dict(params)))


def _fwd_layout(x, scale, bias, *, norm_ndim, centered, write_output, **_):
    return RowLayout(
        ins=(ROWS_NORM, _param_layout(scale), _param_layout(bias)),
        outs=(ROWS_NORM if write_output else ABSENT, ROWS if centered else ABSENT, ROWS),
        row_ndim=x.ndim - norm_ndim,
        norm_ndim=norm_ndim,
    )


def _fwd_abstract(x, scale, bias, **params):
    layout = _fwd_layout(x, scale, bias, **params)
    stats = _stats_dtype(x.dtype)
    dtypes = (params["out_dtype"], stats, stats)
    return tuple(_aval(x, layout, kind, dt) for kind, dt in zip(layout.outs, dtypes))


def _aval(x, layout, kind, dtype):
    dims = layout.dims(kind)
    if kind == ABSENT:
        return like(x, (0,), dtype, (None,))
    return like(x, tuple(x.shape[d] for d in dims), dtype, dims)


_fwd_on_device = functools.partial(_fwd_local, kernel=row_norm_fwd_kernel_p.bind)


def _fwd_lower(x, scale, bias, **params):
    layout = _fwd_layout(x, scale, bias, **params)
    return _lower(_fwd_on_device, layout, (x, scale, bias), params)


row_norm_fwd_p = define_row_primitive(
    "row_norm_fwd",
    abstract_eval=_fwd_abstract,
    reference=functools.partial(_fwd_local, axes=UNSHARDED, kernel=_fwd_kernel_reference),
    lower=_fwd_lower,
    row_args=(True, False, False),
    row_outs=(True, True, True),
)

# A forward whose output is dead (as under jax.grad, where only the saved
# statistics reach the backward) only computes the statistics: it reads x once
# and writes no output.
register_dce_rewrite(
    row_norm_fwd_p,
    lambda used, params: None if used[0] or not params["write_output"]
    else dict(params, write_output=False),
)


def _bwd_layout(x, scale, mean, *, norm_ndim, has_bias, **_):
    return RowLayout(
        ins=(ROWS_NORM, _param_layout(scale), ROWS if mean.size else ABSENT, ROWS, ROWS_NORM),
        outs=(ROWS_NORM, _param_layout(scale), NORM if has_bias else ABSENT),
        row_ndim=x.ndim - norm_ndim,
        norm_ndim=norm_ndim,
    )


def _bwd_abstract(x, scale, mean, rstd, dy, **params):
    del rstd, dy
    layout = _bwd_layout(x, scale, mean, **params)
    dtypes = (x.dtype, scale.dtype, params["param_dtype"])
    return tuple(_aval(x, layout, kind, dt) for kind, dt in zip(layout.outs, dtypes))


_bwd_on_device = functools.partial(_bwd_local, kernel=row_norm_bwd_kernel_p.bind)


def _bwd_lower(x, scale, mean, rstd, dy, **params):
    layout = _bwd_layout(x, scale, mean, **params)
    return _lower(_bwd_on_device, layout, (x, scale, mean, rstd, dy), params)


row_norm_bwd_p = define_row_primitive(
    "row_norm_bwd",
    abstract_eval=_bwd_abstract,
    reference=functools.partial(_bwd_local, axes=UNSHARDED, kernel=_bwd_kernel_reference),
    lower=_bwd_lower,
    row_args=(True, False, True, True, True),
    row_outs=(True, False, False),
)


# ------------------------------------------------------------ autodiff


class _Config(NamedTuple):
    epsilon: float
    centered: bool
    out_dtype: np.dtype    # what the kernel writes: x's dtype or float32
    param_dtype: np.dtype  # scale/bias dtype as the kernel reads them
    has_bias: bool
    norm_ndim: int
    axis_name: tuple        # shard_map axes that split the normalized dims


def _or_empty(p, dtype):
    return _empty(dtype) if p is None else p


def _row_norm_fwd(x, scale, bias, cfg: _Config):
    scale_, bias_ = _or_empty(scale, cfg.param_dtype), _or_empty(bias, cfg.param_dtype)
    if cfg.axis_name:
        y, mean, rstd = _fwd_local(
            x, scale_, bias_, axes=_manual_axes(cfg.axis_name), kernel=None,
            norm_ndim=cfg.norm_ndim, epsilon=cfg.epsilon, centered=cfg.centered,
            out_dtype=cfg.out_dtype, write_output=True,
        )
    else:
        y, mean, rstd = row_norm_fwd_p.bind(
            x, scale_, bias_, epsilon=cfg.epsilon, centered=cfg.centered,
            out_dtype=cfg.out_dtype, write_output=True, norm_ndim=cfg.norm_ndim,
        )
    return y, (x, scale, mean, rstd)


def _row_norm_bwd(cfg: _Config, res, dy):
    x, scale, mean, rstd = res
    scale_ = _or_empty(scale, cfg.param_dtype)
    if cfg.axis_name:
        dx, dscale, dbias = _bwd_local(
            x, scale_, mean, rstd, dy, axes=_manual_axes(cfg.axis_name), kernel=None,
            norm_ndim=cfg.norm_ndim, centered=cfg.centered, has_bias=cfg.has_bias,
            param_dtype=cfg.param_dtype,
        )
    else:
        dx, dscale, dbias = row_norm_bwd_p.bind(
            x, scale_, mean, rstd, dy, centered=cfg.centered, has_bias=cfg.has_bias,
            param_dtype=cfg.param_dtype, norm_ndim=cfg.norm_ndim,
        )
    return dx, None if scale is None else dscale, dbias if cfg.has_bias else None


def _manual_axes(axis_name) -> ShardAxes:
    """Inside shard_map: the normalized dims split over `axis_name`; the row
    axes need no psum here, since shard_map's own transposes sum a replicated
    scale's gradient over the devices that hold different rows."""
    return ShardAxes((), axis_name, math.prod(lax.axis_size(a) for a in axis_name))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _row_norm_nd(x, scale, bias, cfg: _Config):
    return _row_norm_fwd(x, scale, bias, cfg)[0]


_row_norm_nd.defvjp(_row_norm_fwd, _row_norm_bwd)


def _row_norm(op, x, scale, bias, epsilon, normalized_shape, dtype, centered, axis_name):
    x = _checks.floating_array("x", op, x)
    scale = _checks.parameter(op, "scale", scale)
    bias = _checks.parameter(op, "bias", bias)
    norm_shape = _checks.normalized_shape(
        op, x, {"scale": scale, "bias": bias}, normalized_shape
    )
    eps = _checks.epsilon(op, epsilon)
    out_dtype = _checks.output_dtype(op, dtype, x.dtype)
    axes = _checks.axis_name(op, axis_name)

    f32 = jnp.dtype(jnp.float32)
    given = [p for p in (scale, bias) if p is not None]
    param_dtype = jnp.dtype(given[0].dtype) if given else jnp.dtype(x.dtype)
    if param_dtype not in (x.dtype, f32) or any(p.dtype != param_dtype for p in given):
        param_dtype = f32
    kernel_out = out_dtype if out_dtype in (x.dtype, f32) else f32
    cfg = _Config(eps, centered, kernel_out, param_dtype, bias is not None, len(norm_shape),
                  axes)

    def cast(p):
        return None if p is None else p.astype(param_dtype)

    # Row dims: at least one, so per-row statistics are arrays.
    xr = x.reshape((1, *x.shape)) if x.ndim == len(norm_shape) else x
    xr, s, b = match_varying(xr, cast(scale), cast(bias))
    if x.size == 0:  # nothing to launch; keeps gradients' shapes and dtypes
        y = _zero_size_output(xr, s, b, cfg)
    else:
        y = _row_norm_nd(xr, s, b, cfg)
    return y.reshape(x.shape).astype(out_dtype)


def _zero_size_output(x, scale, bias, cfg):
    """The forward of an empty x, differentiable (to zero gradients) in jnp."""
    rows_shape, x2 = _flat_rows(x, cfg.norm_ndim)
    y2 = _fwd_kernel_reference(
        x2, _flat(_or_empty(scale, cfg.param_dtype)), _flat(_or_empty(bias, cfg.param_dtype)),
        epsilon=cfg.epsilon, centered=cfg.centered, out_dtype=cfg.out_dtype, write_output=True,
    )[0]
    return y2.reshape(x.shape)


def rms_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None = None,
    *,
    epsilon: float = 1e-6,
    normalized_shape: Shape | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    axis_name: AxisName | None = None,
) -> jax.Array:
    """Root-mean-square normalization: ``y = x / sqrt(mean(x**2) + epsilon) * scale``.

    Args:
      x: array of shape ``(*batch, *normalized_shape)``.
      scale: optional array of shape ``normalized_shape``.
      epsilon: added to the mean square; a static float >= 0.
      normalized_shape: the trailing dimensions to normalize over, when there
        is no ``scale`` to take them from (default: the last axis).
      dtype: output dtype (default: ``x.dtype``).
      axis_name: inside ``shard_map``, the mesh axis name (or tuple of names)
        over which the normalized dimensions are split: ``x`` and ``scale``
        hold one slice of each row, and the per-row statistics are combined
        across the axis with one all-reduce of one float per row (and the
        backward's with one more).

    Returns:
      Array of ``x``'s shape and dtype ``dtype``. Statistics are computed in
      float32 (float64 for float64 ``x``).
    """
    return _row_norm("rms_norm", x, scale, None, epsilon, normalized_shape, dtype, False,
                     axis_name)


def layer_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None = None,
    bias: jax.typing.ArrayLike | None = None,
    *,
    epsilon: float = 1e-5,
    normalized_shape: Shape | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    axis_name: AxisName | None = None,
) -> jax.Array:
    """Layer normalization: ``y = (x - mean) / sqrt(var + epsilon) * scale + bias``.

    The mean and (biased) variance are taken over the normalized dimensions.

    Args:
      x: array of shape ``(*batch, *normalized_shape)``.
      scale: optional array of shape ``normalized_shape``.
      bias: optional array of shape ``normalized_shape``.
      epsilon: added to the variance; a static float >= 0.
      normalized_shape: the trailing dimensions to normalize over, when there
        is neither ``scale`` nor ``bias`` (default: the last axis).
      dtype: output dtype (default: ``x.dtype``).
      axis_name: inside ``shard_map``, the mesh axis name (or tuple of names)
        over which the normalized dimensions are split: ``x``, ``scale`` and
        ``bias`` hold one slice of each row, and the per-row statistics are
        combined across the axis with one all-gather of each slice's (mean, M2)
        (and the backward's with one all-reduce of two floats per row).

    Returns:
      Array of ``x``'s shape and dtype ``dtype``.
    """
    return _row_norm("layer_norm", x, scale, bias, epsilon, normalized_shape, dtype, True,
                     axis_name)
