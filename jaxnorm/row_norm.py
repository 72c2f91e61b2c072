"""RMSNorm and LayerNorm, and both fused with a residual add.

They normalize each row of x over its trailing (normalized) dimensions and
share one forward and one backward primitive; LayerNorm is the `centered` case
(subtract the mean, then add a bias). The fused residual add normalizes
h = x + residual and returns h too; its backward is the norm's backward of h
plus the cotangent of h, added in the same kernel. The forward saves x (h) and
per-row float32 statistics (mean, rstd), never the output; the backward reads
them (or, where the forward's output is dead, computes them itself:
`_drop_recomputable_stats`). With `zero_centered` the scale is applied as (1 + scale).

Dtype rule: x may be float32, bfloat16, float16 or float64; statistics are
float32 (float64 for float64 x); the output has x's dtype unless `dtype` is
given. scale and bias may have another float dtype than x: the kernels read
them in x's dtype, or in float32 for 16-bit x (_stats.kernel_dtypes), and any
other parameter dtype is cast to the statistics dtype first. Other output
dtypes are produced by computing in the statistics dtype and casting once.
Gradients come back in each argument's own dtype.
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
from jax.extend.mlir import ir
from jax.interpreters import mlir

from jaxnorm import _checks
from jaxnorm._ffi import TARGET_PREFIX
from jaxnorm._partition import (
    REDUCED,
    ROW,
    UNSHARDED,
    Layout,
    lower_partitioned,
)
from jaxnorm._primitive import (
    _is_placeholder,
    aval_of,
    define_kernel_primitive,
    define_row_primitive,
    like,
    match_varying,
    register_dce_rewrite,
)
from jaxnorm._stats import (
    empty,
    kernel_out_dtype,
    manual_axes,
    merge_moments,
    or_empty,
    param_dtype,
    psum_concat,
    stats_dtype,
)

Shape = Sequence[int] | int
AxisName = str | tuple[str, ...]


# ------------------------------------------------ kernels: (rows, hidden)


def _fwd_kernel_abstract(x, scale, bias, residual, *, epsilon, centered, zero_centered,
                         out_dtype, write_output, alias_residual):
    del epsilon, scale, bias, zero_centered, alias_residual
    rows, hidden = x.shape
    stats = stats_dtype(x.dtype)
    y = like(x, (rows, hidden if write_output else 0), out_dtype, (0, 1))
    mean = like(x, (rows if centered else 0,), stats, (0,))
    rstd = like(x, (rows,), stats, (0,))
    new_residual = like(x, residual.shape, x.dtype, (0, 1) if residual.ndim == 2 else (None,))
    return y, mean, rstd, new_residual


def _fwd_kernel_reference(x, scale, bias, residual, *, alias_residual, **params):
    del alias_residual
    return _fwd_rows(x, scale, bias, residual, axes=(), hidden_total=x.shape[1], **params)


def _scale_as_applied(scale, dtype, zero_centered):
    w = scale.astype(dtype)
    return w + 1 if zero_centered else w


def _normalize(xf, mean, rstd, scale, bias, zero_centered, out_dtype):
    y = (xf - mean[:, None] if mean.size else xf) * rstd[:, None]
    if scale.size:
        y = y * _scale_as_applied(scale, xf.dtype, zero_centered)
    if bias.size:
        y = y + bias.astype(xf.dtype)
    return y.astype(out_dtype)


def _fwd_kernel_attributes(*, epsilon, centered, zero_centered, **_):
    return {"epsilon": np.float64(epsilon), "centered": np.bool_(centered),
            "zero_centered": np.bool_(zero_centered)}


def _fwd_kernel_aliases(avals_in, *, alias_residual, write_output, out_dtype, **_):
    """Where asked, the fused add writes in place, as FlashInfer's does: h
    (result 3) in residual's buffer (operand 3) and y in x's. Each kernel
    thread reads its elements of x and residual before it writes them there."""
    x, residual = avals_in[0], avals_in[3]
    if not alias_residual or residual.ndim != 2:
        return {}
    return {3: 3, 0: 0} if write_output and x.dtype == out_dtype else {3: 3}


row_norm_fwd_kernel_p = define_kernel_primitive(
    "row_norm_fwd",
    abstract_eval=_fwd_kernel_abstract,
    reference=_fwd_kernel_reference,
    attributes=_fwd_kernel_attributes,
    aliases=_fwd_kernel_aliases,
)


def _bwd_kernel_abstract(x, scale, mean, rstd, dy, dres, residual, *, epsilon, centered,
                         zero_centered, has_bias, param_dtype):
    del mean, rstd, dy, dres, residual, epsilon, centered, zero_centered
    hidden = x.shape[1]
    dx = like(x, x.shape, x.dtype, (0, 1))
    dscale = like(x, scale.shape, scale.dtype, (1 if scale.shape[0] else None,))
    dbias = like(x, (hidden if has_bias else 0,), param_dtype, (1 if has_bias else None,))
    return dx, dscale, dbias


def _bwd_kernel_reference(x, scale, mean, rstd, dy, dres, residual, *, epsilon, centered,
                          zero_centered, has_bias, param_dtype):
    if residual.size:  # h = x + residual is what was normalized (_drop_recomputable_stats)
        x = _add_residual(x, residual)
    if x.shape[0] and _is_placeholder(rstd):  # statistics not kept: from x
        _, mean, rstd = _row_stats(x, (), x.shape[1], epsilon, centered)
    dx, dscale, dbias = _bwd_rows(x, scale, mean, rstd, dy, dres, centered, zero_centered,
                                  has_bias, axes=(), hidden_total=x.shape[1])
    dscale = dscale.astype(scale.dtype)
    dbias = dbias.astype(param_dtype)
    return dx, dscale, dbias


def _bwd_rows(x, scale, mean, rstd, dy, dres, centered, zero_centered, has_bias, *, axes,
              hidden_total):
    """dx and the float32 (float64) per-device dscale, dbias of rows that may
    be split over the mesh `axes`: then the per-row dot products are local
    partial sums, combined with one psum.

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) [+ dres], g = dy * scale,
    with the mean(g) term only for LayerNorm.
    """
    acc = stats_dtype(x.dtype)
    d = dy.astype(acc)
    xc = x.astype(acc) - mean[:, None] if centered else x.astype(acc)
    xhat = xc * rstd[:, None]
    g = d * _scale_as_applied(scale, acc, zero_centered) if scale.size else d
    dots = [jnp.sum(g * xhat, axis=-1)] + ([jnp.sum(g, axis=-1)] if centered else [])
    dots = jnp.stack(dots, axis=-1)
    if axes:
        dots = lax.psum(dots, axes)
    dots = dots / hidden_total
    dx = g - dots[:, :1] * xhat
    if centered:
        dx = dx - dots[:, 1:]
    dx = dx * rstd[:, None]
    if dres.size:
        dx = dx + dres.astype(acc)
    dx = dx.astype(x.dtype)
    dscale = jnp.sum(d * xhat, axis=0) if scale.size else jnp.zeros((0,), acc)
    dbias = jnp.sum(d, axis=0) if has_bias else jnp.zeros((0,), acc)
    return dx, dscale, dbias


def _bwd_kernel_attributes(*, epsilon, centered, zero_centered, **_):
    return {"epsilon": np.float64(epsilon), "centered": np.bool_(centered),
            "zero_centered": np.bool_(zero_centered)}


def _unreshaped(value):
    """`value` before any reshapes."""
    while True:
        op = getattr(value.owner, "operation", value.owner)
        if not isinstance(op, ir.Operation) or op.name != "stablehlo.reshape":
            return value
        value = op.operands[0]


def _shape(value) -> list[int]:
    return list(ir.RankedTensorType(value.type).shape)


def _stats_only_forward(rstd) -> ir.Operation | None:
    """The forward custom call that produced `rstd` if it computed statistics
    only (its output dead)."""
    op = getattr(_unreshaped(rstd).owner, "operation", None)
    if not isinstance(op, ir.Operation) or op.name != "stablehlo.custom_call":
        return None
    if ir.StringAttr(op.attributes["call_target_name"]).value != TARGET_PREFIX + "row_norm_fwd":
        return None
    x, y = op.operands[0], op.results[0]
    return op if _shape(y)[-1:] == [0] and _shape(x)[-1:] != [0] else None


# Where the backward forms h = x + residual itself, h's bytes at most. Where
# nothing else reads h that saves the forward's launch, 1.3-1.6 us; where h
# is read elsewhere (a model's residual stream) the forward runs anyway and
# the backward's extra loads cost 0.05 us up to 64 KiB, 0.26 at 512 KiB and
# 0.5 at 1 MiB on an H100 (benchmarks/recompute_h.py, notes v57). Models
# read h: the limit keeps their cost at 1%.
_RECOMPUTE_H_BYTES = 1 << 16


def _drop_recomputable_stats(ctx, args, **_):
    """Where the statistics come from a statistics-only forward of the same x
    (the forward's output dead, as under jax.grad), the backward is given none
    and computes them from the x it reads anyway: the forward then has no
    reader left and XLA removes it, which saves a read of x. A forward whose
    output is used keeps its statistics, and the backward reads them.

    With a residual the backward reads h, the forward's new_residual. For
    small h (_RECOMPUTE_H_BYTES) it is given the forward's x and residual
    instead and forms h itself, so that the forward goes too where nothing
    else reads h; for larger h the extra loads would cost too much wherever
    h is read elsewhere, as in a model's residual stream."""
    x, rstd = args[0], args[3]
    fwd = _stats_only_forward(rstd)
    if fwd is None:
        return ctx, args
    fwd_x, fwd_residual = fwd.operands[0], fwd.operands[3]
    avals = list(ctx.avals_in)
    if _shape(fwd_residual) == [0]:  # the backward reads the forward's x
        if _unreshaped(fwd_x) != _unreshaped(x):
            return ctx, args
    else:  # the backward reads h, the forward's new_residual
        h_bytes = avals[0].size * avals[0].dtype.itemsize
        if _unreshaped(x) != _unreshaped(fwd.results[3]) or h_bytes > _RECOMPUTE_H_BYTES:
            return ctx, args
        args = (fwd_x, *args[1:6], fwd_residual)  # both (rows, hidden), as h
        avals[6] = avals[0]
    absent = jax.core.ShapedArray((0,), avals[3].dtype)
    none = mlir.ir_constant(np.zeros((0,), absent.dtype))
    avals[2] = avals[3] = absent
    return ctx.replace(avals_in=avals), (args[0], args[1], none, none, *args[4:])


row_norm_bwd_kernel_p = define_kernel_primitive(
    "row_norm_bwd",
    abstract_eval=_bwd_kernel_abstract,
    reference=_bwd_kernel_reference,
    attributes=_bwd_kernel_attributes,
    rewrite_operands=_drop_recomputable_stats,
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
    acc = stats_dtype(x.dtype)
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
        _, mean, m2 = merge_moments(x.shape[1], mean, m2, axes)
    return xf, mean, lax.rsqrt(m2 / hidden_total + eps)


def _add_residual(x, residual):
    """h = x + residual, rounded to x's dtype as the unfused sum would be."""
    acc = stats_dtype(x.dtype)
    return (x.astype(acc) + residual.astype(acc)).astype(x.dtype)


def _fwd_rows(x, scale, bias, residual, *, axes, hidden_total, epsilon, centered,
              zero_centered, out_dtype, write_output):
    """The forward in jax.numpy on (rows, hidden), rows possibly split over the
    mesh `axes` (see `_row_stats`)."""
    new_residual = residual
    if residual.size:
        x = new_residual = _add_residual(x, residual)
    xf, mean, rstd = _row_stats(x, axes, hidden_total, epsilon, centered)
    if not write_output:
        return jnp.zeros((x.shape[0], 0), out_dtype), mean, rstd, new_residual
    y = _normalize(xf, mean, rstd, scale, bias, zero_centered, out_dtype)
    return y, mean, rstd, new_residual


# ---------------------------------------------- per device: (*rows, *norm)


def _flat_rows(x, norm_ndim):
    rows_shape = x.shape[: x.ndim - norm_ndim]
    return rows_shape, x.reshape(math.prod(rows_shape), math.prod(x.shape[len(rows_shape):]))


def _flat(a):
    return a.reshape(-1) if a.size else a


def _fwd_local(x, scale, bias, residual, *, axes, kernel, norm_ndim, alias_residual,
               **params):
    """The forward on one device's block of x. Rows split over hidden axes
    need their statistics combined across devices; otherwise `kernel` runs on
    the flattened (rows, hidden) block."""
    rows_shape, x2 = _flat_rows(x, norm_ndim)
    s2, b2 = _flat(scale), _flat(bias)
    r2 = residual.reshape(x2.shape) if residual.size else residual
    if axes.hidden:
        hidden_total = x2.shape[1] * axes.hidden_shards
        y2, mean, rstd, h2 = _fwd_rows(x2, s2, b2, r2, axes=axes.hidden,
                                       hidden_total=hidden_total, **params)
    else:
        y2, mean, rstd, h2 = kernel(x2, s2, b2, r2, alias_residual=alias_residual, **params)
    y = y2.reshape(x.shape) if params["write_output"] else empty(y2.dtype)
    h = h2.reshape(x.shape) if residual.size else h2
    return y, mean.reshape(rows_shape) if mean.size else mean, rstd.reshape(rows_shape), h


def _bwd_local(x, scale, mean, rstd, dy, dres, *, axes, kernel, norm_ndim, epsilon, centered,
               zero_centered, has_bias, param_dtype):
    """The backward on one device's block. dscale/dbias are partial sums over
    the device's rows, so they are summed over the row axes (in float32, one
    psum for both); rows split over hidden axes also sum their dot products."""
    rows_shape, x2 = _flat_rows(x, norm_ndim)
    dy2 = dy.reshape(x2.shape)
    dres2 = dres.reshape(x2.shape) if dres.size else dres
    s2, m2, r2 = _flat(scale), _flat(mean), _flat(rstd)
    if axes.hidden:
        hidden_total = x2.shape[1] * axes.hidden_shards
        dx2, dscale, dbias = _bwd_rows(x2, s2, m2, r2, dy2, dres2, centered, zero_centered,
                                       has_bias, axes=axes.hidden, hidden_total=hidden_total)
    else:
        # Partial sums travel in float32 (float64 for float64 parameters).
        wide = jnp.promote_types(param_dtype, jnp.float32) if axes.rows else param_dtype
        dx2, dscale, dbias = kernel(x2, s2.astype(wide), m2, r2, dy2, dres2, empty(x.dtype),
                                    epsilon=epsilon, centered=centered,
                                    zero_centered=zero_centered, has_bias=has_bias,
                                    param_dtype=wide)
    if axes.rows:
        dscale, dbias = psum_concat(axes.rows, dscale, dbias)
    norm_shape = x.shape[x.ndim - norm_ndim:]
    dscale = dscale.astype(scale.dtype).reshape(norm_shape if scale.size else (0,))
    dbias = dbias.astype(param_dtype).reshape(norm_shape if has_bias else (0,))
    return dx2.reshape(x.shape), dscale, dbias


# ------------------------------------------- user-facing: (*rows, *norm)


def _op_name(centered):
    return "layer_norm" if centered else "rms_norm"


def _lower(local, layout, args, params):
    op = _op_name(params["centered"])
    return lower_partitioned(op, local, layout, args, params)


def _layout(x, norm_ndim, ins, outs) -> Layout:
    """Rows (the leading dims) are independent; the normalized dims are
    reduced over. ins/outs name each array's dims: "x", "norm", "rows" or
    None."""
    cut = x.ndim - norm_ndim
    dims = {"x": tuple(range(x.ndim)), "rows": tuple(range(cut)),
            "norm": tuple(range(cut, x.ndim)), None: None}
    return Layout(roles=(ROW,) * cut + (REDUCED,) * norm_ndim,
                  ins=tuple(dims[k] for k in ins), outs=tuple(dims[k] for k in outs))


def _x_or_none(a):
    return None if _is_placeholder(a) else "x"


def _norm_or_none(a):
    return None if _is_placeholder(a) else "norm"


def _fwd_layout(x, scale, bias, residual, *, norm_ndim, centered, write_output, **_):
    return _layout(
        x, norm_ndim,
        ins=("x", _norm_or_none(scale), _norm_or_none(bias), _x_or_none(residual)),
        outs=("x" if write_output else None, "rows" if centered else None, "rows",
              _x_or_none(residual)),
    )


def _fwd_abstract(x, scale, bias, residual, **params):
    layout = _fwd_layout(x, scale, bias, residual, **params)
    stats = stats_dtype(x.dtype)
    dtypes = (params["out_dtype"], stats, stats, x.dtype)
    return tuple(aval_of(x, dims, dt) for dims, dt in zip(layout.outs, dtypes))


_fwd_on_device = functools.partial(_fwd_local, kernel=row_norm_fwd_kernel_p.bind)


def _fwd_lower(x, scale, bias, residual, **params):
    layout = _fwd_layout(x, scale, bias, residual, **params)
    return _lower(_fwd_on_device, layout, (x, scale, bias, residual), params)


row_norm_fwd_p = define_row_primitive(
    "row_norm_fwd",
    abstract_eval=_fwd_abstract,
    reference=functools.partial(_fwd_local, axes=UNSHARDED, kernel=_fwd_kernel_reference),
    lower=_fwd_lower,
    unsplit=functools.partial(_fwd_on_device, axes=UNSHARDED),
    row_args=(True, False, False, True),
    row_outs=(True, True, True, True),
)

# A forward whose output is dead (as under jax.grad, where only the saved
# statistics reach the backward) only computes the statistics: it reads x once
# and writes no output (but new_residual, if any).
register_dce_rewrite(
    row_norm_fwd_p,
    lambda used, params: None if used[0] or not params["write_output"]
    else dict(params, write_output=False),
)


def _bwd_layout(x, scale, mean, dres, *, norm_ndim, has_bias, **_):
    return _layout(
        x, norm_ndim,
        ins=("x", _norm_or_none(scale), "rows" if mean.size else None, "rows", "x",
             _x_or_none(dres)),
        outs=("x", _norm_or_none(scale), "norm" if has_bias else None),
    )


def _bwd_abstract(x, scale, mean, rstd, dy, dres, **params):
    del rstd, dy
    layout = _bwd_layout(x, scale, mean, dres, **params)
    dtypes = (x.dtype, scale.dtype, params["param_dtype"])
    return tuple(aval_of(x, dims, dt) for dims, dt in zip(layout.outs, dtypes))


_bwd_on_device = functools.partial(_bwd_local, kernel=row_norm_bwd_kernel_p.bind)


def _bwd_lower(x, scale, mean, rstd, dy, dres, **params):
    layout = _bwd_layout(x, scale, mean, dres, **params)
    return _lower(_bwd_on_device, layout, (x, scale, mean, rstd, dy, dres), params)


row_norm_bwd_p = define_row_primitive(
    "row_norm_bwd",
    abstract_eval=_bwd_abstract,
    reference=functools.partial(_bwd_local, axes=UNSHARDED, kernel=_bwd_kernel_reference),
    lower=_bwd_lower,
    row_args=(True, False, True, True, True, True),
    row_outs=(True, False, False),
    unsplit=functools.partial(_bwd_on_device, axes=UNSHARDED),
    in_place=True,  # for _drop_recomputable_stats
)


# ------------------------------------------------------------ autodiff


class _Config(NamedTuple):
    epsilon: float
    centered: bool
    zero_centered: bool
    out_dtype: np.dtype    # what the kernel writes: one of kernel_dtypes
    param_dtype: np.dtype  # scale/bias dtype as the kernel reads them
    has_bias: bool
    norm_ndim: int
    axis_name: tuple        # shard_map axes that split the normalized dims


def _row_norm_fwd(x, scale, bias, residual, cfg: _Config, alias_residual=False):
    scale_, bias_ = or_empty(scale, cfg.param_dtype), or_empty(bias, cfg.param_dtype)
    res_ = or_empty(residual, x.dtype)
    params = dict(epsilon=cfg.epsilon, centered=cfg.centered, zero_centered=cfg.zero_centered,
                  out_dtype=cfg.out_dtype, write_output=True, norm_ndim=cfg.norm_ndim,
                  alias_residual=alias_residual)
    if cfg.axis_name:
        y, mean, rstd, h = _fwd_local(x, scale_, bias_, res_, axes=manual_axes(cfg.axis_name),
                                      kernel=None, **params)
    else:
        y, mean, rstd, h = row_norm_fwd_p.bind(x, scale_, bias_, res_, **params)
    # The backward reads the normalized input: h with a residual, else x.
    return (y, h), (h if residual is not None else x, scale, mean, rstd)


def _row_norm_bwd(cfg: _Config, res, cotangents):
    x, scale, mean, rstd = res
    dy, dh = cotangents
    scale_ = or_empty(scale, cfg.param_dtype)
    params = dict(epsilon=cfg.epsilon, centered=cfg.centered, zero_centered=cfg.zero_centered,
                  has_bias=cfg.has_bias, param_dtype=cfg.param_dtype, norm_ndim=cfg.norm_ndim)
    if cfg.axis_name:
        dx, dscale, dbias = _bwd_local(x, scale_, mean, rstd, dy, dh,
                                       axes=manual_axes(cfg.axis_name), kernel=None, **params)
    else:
        dx, dscale, dbias = row_norm_bwd_p.bind(x, scale_, mean, rstd, dy, dh, **params)
    # With a residual, x and residual get the same gradient, dh (its shape
    # (0,) says there is none).
    return (dx, None if scale is None else dscale, dbias if cfg.has_bias else None,
            None if _is_placeholder(dh) else dx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _row_norm_nd(x, scale, bias, residual, cfg: _Config):
    """(y, h): h = x + residual (a (0,) placeholder without residual). Not
    under differentiation (inference, decoding), h is written in residual's
    buffer: XLA reuses it where residual is donated or dead, else copies it
    first. Under autodiff residual is usually saved for an earlier backward,
    so the forward there writes h to a buffer of its own."""
    return _row_norm_fwd(x, scale, bias, residual, cfg, alias_residual=True)[0]


_row_norm_nd.defvjp(_row_norm_fwd, _row_norm_bwd)


def _row_norm(op, x, scale, bias, *, epsilon, normalized_shape, dtype, centered, axis_name,
              zero_centered=False, residual=None):
    """The public ops' checks, dtype rules and dispatch. Returns y, or
    (y, new_residual) when a residual is given."""
    x = _checks.floating_array("x", op, x)
    if residual is not None:
        residual = _checks.floating_array("residual", op, residual)
        _checks.same_shape(op, "residual", residual, "x", x)
        if residual.dtype != x.dtype:  # not fused: the sum, then the norm
            h = _add_residual(residual, x)
            return _row_norm(op, h, scale, bias, epsilon=epsilon,
                             normalized_shape=normalized_shape, dtype=dtype, centered=centered,
                             axis_name=axis_name, zero_centered=zero_centered), h
    scale = _checks.parameter(op, "scale", scale)
    bias = _checks.parameter(op, "bias", bias)
    norm_shape = _checks.normalized_shape(
        op, x, {"scale": scale, "bias": bias}, normalized_shape
    )
    eps = _checks.epsilon(op, epsilon)
    out_dtype = _checks.output_dtype(op, dtype, x.dtype)
    axes = _checks.axis_name(op, axis_name)

    params_dt = param_dtype(x.dtype, scale, bias)
    cfg = _Config(eps, centered, bool(zero_centered) and scale is not None,
                  kernel_out_dtype(x.dtype, out_dtype), params_dt, bias is not None,
                  len(norm_shape), axes)

    def cast(p):
        return None if p is None else p.astype(params_dt)

    # Row dims: at least one, so per-row statistics are arrays.
    def with_rows(a):
        return a.reshape((1, *a.shape)) if a is not None and x.ndim == len(norm_shape) else a

    xr, s, b, r = match_varying(with_rows(x), cast(scale), cast(bias), with_rows(residual))
    if x.size == 0:  # nothing to launch; keeps gradients' shapes and dtypes
        y, h = _zero_size_output(xr, s, b, r, cfg)
    else:
        y, h = _row_norm_nd(xr, s, b, r, cfg)
    y = y.reshape(x.shape).astype(out_dtype)
    return y if residual is None else (y, h.reshape(x.shape))


def _zero_size_output(x, scale, bias, residual, cfg):
    """The forward of an empty x, differentiable (to zero gradients) in jnp."""
    rows_shape, x2 = _flat_rows(x, cfg.norm_ndim)
    r2 = empty(x.dtype) if residual is None else residual.reshape(x2.shape)
    y2, _, _, h2 = _fwd_kernel_reference(
        x2, _flat(or_empty(scale, cfg.param_dtype)), _flat(or_empty(bias, cfg.param_dtype)),
        r2, epsilon=cfg.epsilon, centered=cfg.centered, zero_centered=cfg.zero_centered,
        out_dtype=cfg.out_dtype, write_output=True, alias_residual=False,
    )
    return y2.reshape(x.shape), h2.reshape(x.shape) if residual is not None else h2


def rms_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None = None,
    *,
    epsilon: float = 1e-6,
    zero_centered_scale: bool = False,
    normalized_shape: Shape | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    axis_name: AxisName | None = None,
) -> jax.Array:
    """Root-mean-square normalization: ``y = x / sqrt(mean(x**2) + epsilon) * scale``.

    Args:
      x: array of shape ``(*batch, *normalized_shape)``.
      scale: optional array of shape ``normalized_shape``.
      epsilon: added to the mean square; a static float >= 0.
      zero_centered_scale: apply the scale as ``(1 + scale)`` (Gemma's
        convention), computed in float32; gradients are the same as for scale.
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
    return _row_norm("rms_norm", x, scale, None, epsilon=epsilon,
                     normalized_shape=normalized_shape, dtype=dtype, centered=False,
                     axis_name=axis_name, zero_centered=zero_centered_scale)


def layer_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None = None,
    bias: jax.typing.ArrayLike | None = None,
    *,
    epsilon: float = 1e-5,
    zero_centered_scale: bool = False,
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
      zero_centered_scale: apply the scale as ``(1 + scale)``, computed in
        float32.
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
    return _row_norm("layer_norm", x, scale, bias, epsilon=epsilon,
                     normalized_shape=normalized_shape, dtype=dtype, centered=True,
                     axis_name=axis_name, zero_centered=zero_centered_scale)


_ADD_NOTES = """
    ``h = x + residual`` is rounded to ``residual``'s dtype, as the unfused
    sum would be, and then normalized. With ``x`` and ``residual`` of one
    dtype both steps are one kernel that reads ``x`` and ``residual`` once and
    writes ``y`` and ``h`` once (other dtype pairs add first, unfused).

    Outside of differentiation (inference, decoding) the kernel works in
    place: ``h`` is written in ``residual``'s buffer and ``y`` (of ``x``'s
    dtype) in ``x``'s. Where ``x`` and ``residual`` are intermediates that are
    dead afterwards (as in a model), or are both donated to jit
    (``donate_argnums``: jit pairs ``x`` with ``y`` and ``residual`` with
    ``h``), no memory is copied; otherwise XLA copies an input that is still
    live first. Under ``jax.grad`` the outputs get buffers of their own, and
    the backward adds the cotangent of ``h`` to the gradient (``x`` and
    ``residual`` get the same gradient) in the same kernel.
"""


def add_rms_norm(
    x: jax.typing.ArrayLike,
    residual: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None = None,
    *,
    epsilon: float = 1e-6,
    zero_centered_scale: bool = False,
    normalized_shape: Shape | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    axis_name: AxisName | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Fused residual add and RMSNorm: ``h = x + residual; y = rms_norm(h)``.

    Args:
      x: array of shape ``(*batch, *normalized_shape)``.
      residual: array of ``x``'s shape.
      scale, epsilon, zero_centered_scale, normalized_shape, axis_name: as for
        `rms_norm`.
      dtype: dtype of ``y`` (default: ``residual.dtype``).

    Returns:
      ``(y, h)``, both of ``x``'s shape; ``h`` has ``residual``'s dtype.
    """
    return _row_norm("add_rms_norm", x, scale, None, epsilon=epsilon,
                     normalized_shape=normalized_shape, dtype=dtype, centered=False,
                     axis_name=axis_name, zero_centered=zero_centered_scale,
                     residual=residual)


def add_layer_norm(
    x: jax.typing.ArrayLike,
    residual: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None = None,
    bias: jax.typing.ArrayLike | None = None,
    *,
    epsilon: float = 1e-5,
    zero_centered_scale: bool = False,
    normalized_shape: Shape | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    axis_name: AxisName | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Fused residual add and LayerNorm: ``h = x + residual; y = layer_norm(h)``.

    Args:
      x: array of shape ``(*batch, *normalized_shape)``.
      residual: array of ``x``'s shape.
      scale, bias, epsilon, zero_centered_scale, normalized_shape, axis_name:
        as for `layer_norm`.
      dtype: dtype of ``y`` (default: ``residual.dtype``).

    Returns:
      ``(y, h)``, both of ``x``'s shape; ``h`` has ``residual``'s dtype.
    """
    return _row_norm("add_layer_norm", x, scale, bias, epsilon=epsilon,
                     normalized_shape=normalized_shape, dtype=dtype, centered=True,
                     axis_name=axis_name, zero_centered=zero_centered_scale,
                     residual=residual)


add_rms_norm.__doc__ += _ADD_NOTES
add_layer_norm.__doc__ += _ADD_NOTES
