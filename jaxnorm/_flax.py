"""What jaxnorm's Flax modules (jaxnorm.linen, jaxnorm.nnx) share: mapping a
Flax norm's fields onto the kernels, or saying that they do not map."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax.linen import dtypes

from jaxnorm.row_norm import add_rms_norm, layer_norm, rms_norm

UNSUPPORTED = """
    Where the fields do not map onto jaxnorm's kernels, the module falls back
    to Flax's own computation (the parent class's ``__call__``): a ``mask``,
    ``axis_index_groups``, reduction axes that are not the trailing axes of
    ``x``, or feature axes outside the reduction axes. Otherwise statistics are
    always float32 (float64 for float64 inputs) and the variance is the exact
    two-pass one, whatever ``use_fast_variance`` and
    ``force_float32_reductions`` say: equal to Flax's results up to rounding.
    ``axis_name`` means what it means in Flax (statistics combined over a
    mapped axis, as when the normalized dimensions are split over it).
"""


def _axes(ndim: int, axes) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(sorted({a % ndim for a in axes}))


def feature_shape(x, feature_axes) -> list[int]:
    """The shape of Flax's scale and bias: x's sizes on the feature axes."""
    return [x.shape[a] for a in _axes(x.ndim, feature_axes)]


def trailing_norm_ndim(x, reduction_axes, feature_axes) -> int | None:
    """k when the reduction axes are x's last k axes and the feature axes are
    among them (the kernels' layout), else None."""
    if x.ndim == 0:
        return None
    red = _axes(x.ndim, reduction_axes)
    k = len(red)
    if red != tuple(range(x.ndim - k, x.ndim)):
        return None
    return k if set(_axes(x.ndim, feature_axes)) <= set(red) else None


def _over_norm_shape(p, x, k, feature_axes):
    """A parameter of the feature axes' shape, broadcast over the normalized
    (trailing k) axes, as Flax broadcasts it."""
    if p is None:
        return None
    feats = _axes(x.ndim, feature_axes)
    norm_axes = range(x.ndim - k, x.ndim)
    p = p.reshape([x.shape[a] if a in feats else 1 for a in norm_axes])
    return jax.numpy.broadcast_to(p, x.shape[x.ndim - k:])


def normalize(
    x: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    *,
    centered: bool,
    k: int,
    feature_axes: int | Sequence[int],
    epsilon: float,
    dtype,
    axis_name,
    residual: jax.Array | None = None,
):
    """A Flax LayerNorm (centered) or RMSNorm over the last k axes of x, on
    the kernels; the result has Flax's dtype (``dtype``, or the promotion of
    x and the parameters). With a residual (RMSNorm only), the fused
    ``add_rms_norm`` of x and residual: returns (y, x + residual)."""
    normed = x if residual is None else residual  # h has residual's dtype
    out = dtypes.canonicalize_dtype(*(a for a in (normed, scale, bias) if a is not None),
                                    dtype=dtype)
    s = _over_norm_shape(scale, x, k, feature_axes)
    b = _over_norm_shape(bias, x, k, feature_axes)
    norm_shape = x.shape[x.ndim - k:]
    if residual is not None:
        return add_rms_norm(x, residual, s, epsilon=epsilon, normalized_shape=norm_shape,
                            dtype=out, axis_name=axis_name)
    if centered:
        return layer_norm(x, s, b, epsilon=epsilon, normalized_shape=norm_shape, dtype=out,
                          axis_name=axis_name)
    return rms_norm(x, s, epsilon=epsilon, normalized_shape=norm_shape, dtype=out,
                    axis_name=axis_name)
