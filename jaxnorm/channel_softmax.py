"""The softmax over the channels at each position of x (a segmentation
model's class probabilities, an attention map over channels).

``y = exp(x - max) / sum(exp(x - max))`` over the channel axis; the backward
``dx = y * (dy - sum(dy * y))`` recomputes y from x, so that under ``grad``
with the forward's output dead x is read once by each pass and y never
written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxnorm import _checks
from jaxnorm._channels import channel_axis as _channel_axis
from jaxnorm._channels import cuda_line_fits, cuda_position_tiles_fit, define_along_channels
from jaxnorm._stats import stats_dtype


def _fwd_reference(x):
    return jax.nn.softmax(x.astype(stats_dtype(x.dtype)), axis=1).astype(x.dtype)


def _bwd_reference(x, dy):
    acc = stats_dtype(x.dtype)
    yf, g = jax.nn.softmax(x.astype(acc), axis=1), dy.astype(acc)
    return (yf * (g - jnp.sum(g * yf, axis=1, keepdims=True))).astype(x.dtype)


# CUDA: lines of 2-byte vectors (21 bf16 classes) lost to XLA's fusion (notes v61).
_softmax = define_along_channels(
    "channel_softmax",
    fwd_reference=_fwd_reference,
    bwd_reference=_bwd_reference,
    attributes=lambda: {},
    supports=lambda platform, x: platform != "cuda" or cuda_line_fits(x, min_bytes=4)
    or cuda_position_tiles_fit(x),
)


def channel_softmax(x: jax.typing.ArrayLike, *, channel_axis: int) -> jax.Array:
    """Softmax over the channel axis at each position of x.

    Args:
      x: array of any shape, e.g. ``(N, H, W, C)`` (``channel_axis=-1``) or
        ``(N, C, H, W)`` (``channel_axis=1``).
      channel_axis: the axis to take the softmax over.

    Returns:
      Array of ``x``'s shape and dtype, computed in float32 (float64 for
      float64 ``x``); along the channel axis it sums to 1. Under ``jit`` with
      sharded inputs, a channel axis split over devices is gathered.
    """
    op = "channel_softmax"
    x = _checks.floating_array("x", op, x)
    if x.ndim == 0:
        raise ValueError(f"{op}: x must have a channel axis, got a scalar")
    axis = _channel_axis(op, x, channel_axis)
    if x.size == 0:
        return x
    return _softmax(x, axis, ())
