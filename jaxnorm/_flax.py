"""What jaxnorm's Flax modules (jaxnorm.linen, jaxnorm.nnx) share: mapping a
Flax norm's fields onto the kernels, or saying that they do not map."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax.linen import dtypes

from jaxnorm.channel_norm import _activation, batch_norm
from jaxnorm.channel_norm import _normalize as channel_normalize
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


GROUP_NORM_UNSUPPORTED = """
    Where the fields do not map onto jaxnorm's kernels, the module falls back
    to Flax's own computation: a ``mask``, ``axis_index_groups``, reduction
    axes that are not x's trailing axes from some axis after the first, or
    invalid group fields (Flax's error then). Statistics are float32 (float64
    for float64 inputs) and the variance is the exact two-pass one, whatever
    ``use_fast_variance`` and ``force_float32_reductions`` say: equal to
    Flax's results up to rounding. ``axis_name`` means what it means in Flax:
    the reduced (spatial) dims are split over that mapped axis.

    One field more than Flax's: ``activation`` (None, ``"silu"`` or
    ``"relu"``) applies that function to the output, fused into the kernel
    (as diffusion models' blocks apply SiLU right after the norm).
"""

BATCH_NORM_UNSUPPORTED = """
    Where the fields do not map onto jaxnorm's kernels, the module falls back
    to Flax's own computation: ``axis_index_groups``, or several feature
    axes. Batch statistics are float32 (float64 for float64 inputs) with the
    exact two-pass variance, whatever ``use_fast_variance`` says, and
    ``batch_stats`` ``mean``/``var`` are updated as Flax updates them. With
    ``axis_name`` (inside ``shard_map``) the statistics are synchronized
    across the devices of that axis by one all-gather of each device's
    (mean, M2); under ``jit`` with the batch sharded, automatically. A
    ``mask`` runs `jaxnorm.batch_norm`'s masked path (jax.numpy), whose
    synchronization weighs each device by its count of True positions.

    One field more than Flax's: ``activation`` (None, ``"relu"`` or
    ``"silu"``) applies that function to the output, fused (a ResNet's
    BatchNorm then ReLU): y and dx then come from the kernels, in training
    and evaluation; without one they are XLA's, fused with the ops that
    follow. A ResNet's training step ran 1.05x Flax's with its ReLUs fused,
    0.96x with them apart (H200, benchmarks/NOTES.md v90); evaluation's
    BatchNorm then ReLU 1.08-1.15x Flax's (v91).
"""


def group_lead_ndim(x, reduction_axes) -> int | None:
    """Flax GroupNorm's batch dims: the axes before its reduction axes, which
    must be x's trailing axes from some axis k >= 1 (the channels, the last
    axis, among them); None where they are not."""
    if x.ndim < 2:
        return None
    red = (tuple(range(1, x.ndim)) if reduction_axes is None
           else _axes(x.ndim, reduction_axes))
    k = red[0]
    return k if k >= 1 and red == tuple(range(k, x.ndim)) else None


def flax_num_groups(channels: int, num_groups, group_size) -> int | None:
    """The number of groups Flax's GroupNorm fields give, None where they are
    invalid (Flax's own code then raises its error)."""
    if (num_groups is None) == (group_size is None):
        return None
    if group_size is not None:
        return channels // group_size if group_size > 0 and channels % group_size == 0 else None
    ok = isinstance(num_groups, int) and num_groups > 0 and channels % num_groups == 0
    return num_groups if ok else None


def group_normalize(x, scale, bias, *, lead_ndim, num_groups, epsilon, dtype, axis_name,
                    activation):
    """Flax's GroupNorm over the channels (last axis) of x, on the kernels, in
    Flax's output dtype, with the fused activation."""
    out = dtypes.canonicalize_dtype(*(a for a in (x, scale, bias) if a is not None), dtype=dtype)
    return channel_normalize("GroupNorm", x, scale, bias, lead_ndim=lead_ndim, channel_axis=-1,
                             group_size=x.shape[-1] // num_groups, epsilon=epsilon,
                             activation=activation, dtype=out, axis_name=axis_name)[0]


def check_activation(module: str, activation):
    """`activation`, once jaxnorm's ops take it (a ValueError naming `module`
    if not)."""
    _activation(module, activation)
    return activation


def activate(module: str, y, activation):
    """The activation applied after Flax's own computation (the fallback)."""
    if check_activation(module, activation) is None:
        return y
    return jax.nn.relu(y) if activation == "relu" else jax.nn.silu(y)


def single_feature_axis(x, axis) -> int | None:
    """Flax BatchNorm's feature axis where there is exactly one."""
    if x.ndim == 0:
        return None
    axes = _axes(x.ndim, axis)
    return axes[0] if len(axes) == 1 else None


def batch_normalize(x, scale, bias, running_mean, running_var, *, use_running_average,
                    momentum, epsilon, dtype, axis_name, axis, mask, activation):
    """Flax's BatchNorm on the kernels, in Flax's output dtype: (y, new mean,
    new var), the running statistics unchanged with ``use_running_average``."""
    out = dtypes.canonicalize_dtype(*(a for a in (x, scale, bias) if a is not None), dtype=dtype)
    return batch_norm(x, scale, bias, running_mean, running_var,
                      training=not use_running_average, momentum=momentum, epsilon=epsilon,
                      axis_name=axis_name, channel_axis=axis, dtype=out,
                      mask=None if mask is None else jax.numpy.asarray(mask, bool),
                      activation=activation)

