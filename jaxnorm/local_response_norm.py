"""Local response normalization across channels, as PyTorch defines it.

``y = x / (k + alpha / size * sum of x**2 over the window) ** beta``; each
channel's window spans ``size`` channels, ``size // 2`` before it and
``(size - 1) // 2`` after, clipped at the ends (the sum is still divided by
``size``, as PyTorch's average pooling with zero padding does). The backward
recomputes the window sums from x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxnorm import _checks
from jaxnorm._channels import channel_axis as _channel_axis
from jaxnorm._channels import cuda_line_fits, cuda_positions_fit, define_along_channels
from jaxnorm._stats import stats_dtype


def _window_sums(v, size):
    """Sum over each channel's window of v (M, C, B), zero outside."""
    before, after = size // 2, (size - 1) // 2
    padded = jnp.pad(v, ((0, 0), (before, after), (0, 0)))
    return lax.reduce_window(padded, 0.0, lax.add, (1, size, 1), (1, 1, 1), "VALID")


def _denominator(xf, size, alpha, k):
    return k + alpha / size * _window_sums(xf * xf, size)


def _fwd_reference(x, *, size, alpha, beta, k):
    xf = x.astype(stats_dtype(x.dtype))
    return (xf * _denominator(xf, size, alpha, k) ** -beta).astype(x.dtype)


def _bwd_reference(x, dy, *, size, alpha, beta, k):
    """dx_j = dy_j den_j^-beta - 2 alpha beta / size * x_j * sum over the
    windows holding j of dy_c x_c den_c^(-beta - 1): the transposed window
    spans (size - 1) // 2 channels before and size // 2 after."""
    acc = stats_dtype(x.dtype)
    xf, g = x.astype(acc), dy.astype(acc)
    den = _denominator(xf, size, alpha, k)
    t = g * xf * den ** (-beta - 1)
    before, after = (size - 1) // 2, size // 2
    padded = jnp.pad(t, ((0, 0), (before, after), (0, 0)))
    around = lax.reduce_window(padded, 0.0, lax.add, (1, size, 1), (1, 1, 1), "VALID")
    return (g * den ** -beta - 2 * alpha * beta / size * xf * around).astype(x.dtype)


def _attributes(*, size, alpha, beta, k):
    return {"size": np.int64(size), "alpha": np.float64(alpha), "beta": np.float64(beta),
            "k": np.float64(k)}


def _supports(platform, x, *, size, **_):
    """The CUDA kernels: windows of 3, 5 or 7 channels; channels last in lines
    a warp holds (one vector of at least 4 channels each way), or channels
    not last (a thread walks each position's channels)."""
    return platform != "cuda" or (
        size in (3, 5, 7) and (cuda_line_fits(x, min_vec=4) or cuda_positions_fit(x)))


_lrn = define_along_channels(
    "local_response_norm",
    fwd_reference=_fwd_reference,
    bwd_reference=_bwd_reference,
    attributes=_attributes,
    supports=_supports,
)


def local_response_norm(
    x: jax.typing.ArrayLike,
    size: int,
    alpha: float = 1e-4,
    beta: float = 0.75,
    k: float = 1.0,
    *,
    channel_axis: int,
) -> jax.Array:
    """Local response normalization across channels (PyTorch's
    ``torch.nn.functional.local_response_norm``).

    ``y = x / (k + alpha / size * sum(x**2 over the window)) ** beta``, the
    window of each channel spanning ``size`` channels: ``size // 2`` before
    and ``(size - 1) // 2`` after it, clipped at the ends.

    Args:
      x: array of any shape with a channel axis, e.g. ``(N, C, H, W)``
        (``channel_axis=1``, PyTorch's layout) or ``(N, H, W, C)``
        (``channel_axis=-1``).
      size: channels in the window, >= 1.
      alpha, beta, k: as above; static floats.
      channel_axis: the axis of the channels.

    Returns:
      Array of ``x``'s shape and dtype (computed in float32, float64 for
      float64 ``x``). Under ``jit`` with sharded inputs, a channel axis split
      over devices is gathered (each window may cross the cut).
    """
    op = "local_response_norm"
    x = _checks.floating_array("x", op, x)
    if x.ndim == 0:
        raise ValueError(f"{op}: x must have a channel axis, got a scalar")
    axis = _channel_axis(op, x, channel_axis)
    if not isinstance(size, int | np.integer) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{op}: size must be an int >= 1, got {size!r}")
    attrs = {"size": int(size)}
    for name, value in (("alpha", alpha), ("beta", beta), ("k", k)):
        attrs[name] = _checks.static_float(op, name, value)
    if x.size == 0:
        return x
    return _lrn(x, axis, tuple(sorted(attrs.items())))
