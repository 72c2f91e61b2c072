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
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxnorm import _checks
from jaxnorm._primitive import define_primitive, like, match_varying, register_dce_rewrite

Shape = Sequence[int] | int


def _stats_dtype(dtype) -> np.dtype:
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def _empty(dtype) -> jax.Array:
    return jnp.zeros((0,), dtype)


# ------------------------------------------------------------- forward


def _fwd_abstract(x, scale, bias, *, epsilon, centered, out_dtype, write_output):
    del epsilon, scale, bias
    rows, hidden = x.shape
    stats = _stats_dtype(x.dtype)
    y = like(x, (rows, hidden if write_output else 0), out_dtype, (0, 1))
    mean = like(x, (rows if centered else 0,), stats, (0,))
    rstd = like(x, (rows,), stats, (0,))
    return y, mean, rstd


def _fwd_reference(x, scale, bias, *, epsilon, centered, out_dtype, write_output):
    acc = _stats_dtype(x.dtype)
    xf = x.astype(acc)
    mean = jnp.mean(xf, axis=-1) if centered else jnp.zeros((0,), acc)
    xc = xf - mean[:, None] if centered else xf
    rstd = lax.rsqrt(jnp.mean(xc * xc, axis=-1) + jnp.asarray(epsilon, acc))
    if not write_output:
        return jnp.zeros((x.shape[0], 0), out_dtype), mean, rstd
    y = xc * rstd[:, None]
    if scale.size:
        y = y * scale.astype(acc)
    if bias.size:
        y = y + bias.astype(acc)
    return y.astype(out_dtype), mean, rstd


def _fwd_attributes(*, epsilon, centered, **_):
    return {"epsilon": np.float64(epsilon), "centered": np.bool_(centered)}


row_norm_fwd_p = define_primitive(
    "row_norm_fwd",
    abstract_eval=_fwd_abstract,
    reference=_fwd_reference,
    attributes=_fwd_attributes,
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


# ------------------------------------------------------------ backward


def _bwd_abstract(x, scale, mean, rstd, dy, *, centered, has_bias, param_dtype):
    del mean, rstd, dy, centered
    hidden = x.shape[1]
    dx = like(x, x.shape, x.dtype, (0, 1))
    dscale = like(x, scale.shape, scale.dtype, (1 if scale.shape[0] else None,))
    dbias = like(x, (hidden if has_bias else 0,), param_dtype, (1 if has_bias else None,))
    return dx, dscale, dbias


def _bwd_reference(x, scale, mean, rstd, dy, *, centered, has_bias, param_dtype):
    acc = _stats_dtype(x.dtype)
    d = dy.astype(acc)
    xc = x.astype(acc) - mean[:, None] if centered else x.astype(acc)
    xhat = xc * rstd[:, None]
    g = d * scale.astype(acc) if scale.size else d
    dx = g - jnp.mean(g * xhat, axis=-1, keepdims=True) * xhat
    if centered:
        dx = dx - jnp.mean(g, axis=-1, keepdims=True)
    dx = (dx * rstd[:, None]).astype(x.dtype)
    dscale = jnp.sum(d * xhat, axis=0).astype(scale.dtype) if scale.size else scale
    dbias = jnp.sum(d, axis=0).astype(param_dtype) if has_bias else _empty(param_dtype)
    return dx, dscale, dbias


def _bwd_attributes(*, centered, **_):
    return {"centered": np.bool_(centered)}


row_norm_bwd_p = define_primitive(
    "row_norm_bwd",
    abstract_eval=_bwd_abstract,
    reference=_bwd_reference,
    attributes=_bwd_attributes,
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


def _or_empty(p, dtype):
    return _empty(dtype) if p is None else p


def _row_norm_fwd(x, scale, bias, cfg: _Config):
    y, mean, rstd = row_norm_fwd_p.bind(
        x,
        _or_empty(scale, cfg.param_dtype),
        _or_empty(bias, cfg.param_dtype),
        epsilon=cfg.epsilon,
        centered=cfg.centered,
        out_dtype=cfg.out_dtype,
        write_output=True,
    )
    return y, (x, scale, mean, rstd)


def _row_norm_bwd(cfg: _Config, res, dy):
    x, scale, mean, rstd = res
    dx, dscale, dbias = row_norm_bwd_p.bind(
        x,
        _or_empty(scale, cfg.param_dtype),
        mean,
        rstd,
        dy,
        centered=cfg.centered,
        has_bias=cfg.has_bias,
        param_dtype=cfg.param_dtype,
    )
    return dx, None if scale is None else dscale, dbias if cfg.has_bias else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _row_norm_2d(x, scale, bias, cfg: _Config):
    return _row_norm_fwd(x, scale, bias, cfg)[0]


_row_norm_2d.defvjp(_row_norm_fwd, _row_norm_bwd)


def _row_norm(op, x, scale, bias, epsilon, normalized_shape, dtype, centered):
    x = _checks.floating_array("x", op, x)
    scale = _checks.parameter(op, "scale", scale)
    bias = _checks.parameter(op, "bias", bias)
    norm_shape = _checks.normalized_shape(
        op, x, {"scale": scale, "bias": bias}, normalized_shape
    )
    eps = _checks.epsilon(op, epsilon)
    out_dtype = _checks.output_dtype(op, dtype, x.dtype)
    rows, hidden = _checks.rows_and_size(x.shape, norm_shape)

    f32 = jnp.dtype(jnp.float32)
    given = [p for p in (scale, bias) if p is not None]
    param_dtype = jnp.dtype(given[0].dtype) if given else jnp.dtype(x.dtype)
    if param_dtype not in (x.dtype, f32) or any(p.dtype != param_dtype for p in given):
        param_dtype = f32
    kernel_out = out_dtype if out_dtype in (x.dtype, f32) else f32
    cfg = _Config(eps, centered, kernel_out, param_dtype, bias is not None)

    def flat(p):
        return None if p is None else p.astype(param_dtype).reshape(hidden)

    x2, s2, b2 = match_varying(x.reshape(rows, hidden), flat(scale), flat(bias))
    if x.size == 0:  # nothing to launch; keeps gradients' shapes and dtypes
        y2 = _fwd_reference(
            x2, _or_empty(s2, param_dtype), _or_empty(b2, param_dtype), epsilon=eps,
            centered=centered, out_dtype=kernel_out, write_output=True,
        )[0]
    else:
        y2 = _row_norm_2d(x2, s2, b2, cfg)
    return y2.reshape(x.shape).astype(out_dtype)


def rms_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None = None,
    *,
    epsilon: float = 1e-6,
    normalized_shape: Shape | None = None,
    dtype: jax.typing.DTypeLike | None = None,
) -> jax.Array:
    """Root-mean-square normalization: ``y = x / sqrt(mean(x**2) + epsilon) * scale``.

    Args:
      x: array of shape ``(*batch, *normalized_shape)``.
      scale: optional array of shape ``normalized_shape``.
      epsilon: added to the mean square; a static float >= 0.
      normalized_shape: the trailing dimensions to normalize over, when there
        is no ``scale`` to take them from (default: the last axis).
      dtype: output dtype (default: ``x.dtype``).

    Returns:
      Array of ``x``'s shape and dtype ``dtype``. Statistics are computed in
      float32 (float64 for float64 ``x``).
    """
    return _row_norm("rms_norm", x, scale, None, epsilon, normalized_shape, dtype, False)


def layer_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None = None,
    bias: jax.typing.ArrayLike | None = None,
    *,
    epsilon: float = 1e-5,
    normalized_shape: Shape | None = None,
    dtype: jax.typing.DTypeLike | None = None,
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

    Returns:
      Array of ``x``'s shape and dtype ``dtype``.
    """
    return _row_norm("layer_norm", x, scale, bias, epsilon, normalized_shape, dtype, True)
