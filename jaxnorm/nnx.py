"""Flax NNX drop-ins for ``flax.nnx.RMSNorm``, ``LayerNorm``, ``GroupNorm`` and
``BatchNorm``.

Subclasses of Flax's modules: the same constructor, fields, ``nnx.Param``
names, shapes, dtypes and initializers, so states move between the two
unchanged; only the computation runs on jaxnorm's kernels.
"""

from __future__ import annotations

import jax
from flax import nnx
from flax.nnx.module import first_from

from jaxnorm._flax import (
    BATCH_NORM_UNSUPPORTED,
    GROUP_NORM_UNSUPPORTED,
    UNSUPPORTED,
    activate,
    batch_normalize,
    check_activation,
    group_lead_ndim,
    group_normalize,
    normalize,
    single_feature_axis,
    trailing_norm_ndim,
)


def _value(p):
    return None if p is None else p[...]


def _apply(module, x, mask, *, centered, residual=None):
    """The kernels' result, or None where the fields do not map onto them.
    Parameters are promoted as Flax's modules promote them."""
    k = trailing_norm_ndim(x, module.reduction_axes, module.feature_axes)
    if k is None or mask is not None or module.axis_index_groups is not None:
        return None
    bias = _value(module.bias) if centered else None
    normed = x if residual is None else residual
    promoted = module.promote_dtype((normed, _value(module.scale), bias), dtype=module.dtype)
    normed, scale, bias = promoted
    if residual is None:
        x = normed
    return normalize(x, scale, bias, centered=centered, k=k, feature_axes=module.feature_axes,
                     epsilon=module.epsilon, dtype=module.dtype, axis_name=module.axis_name,
                     residual=residual)


class RMSNorm(nnx.RMSNorm):
    __doc__ = "jaxnorm's kernels behind ``flax.nnx.RMSNorm``.\n" + UNSUPPORTED

    def __call__(self, x, mask=None):
        """x: (..., *normalized); returns y of x's shape."""
        y = _apply(self, x, mask, centered=False)
        return super().__call__(x, mask=mask) if y is None else y


class LayerNorm(nnx.LayerNorm):
    __doc__ = "jaxnorm's kernels behind ``flax.nnx.LayerNorm``.\n" + UNSUPPORTED

    def __call__(self, x, *, mask=None):
        """x: (..., *normalized); returns y of x's shape."""
        y = _apply(self, x, mask, centered=True)
        return super().__call__(x, mask=mask) if y is None else y


class AddRMSNorm(RMSNorm):
    """``h = x + residual; y = RMSNorm(h)`` in one kernel (`jaxnorm.add_rms_norm`):
    a drop-in for a residual add followed by ``flax.nnx.RMSNorm``, with the same
    constructor and parameters. ``h`` is rounded to ``residual``'s dtype.
    """

    def __call__(self, x, residual, mask=None):
        """x, residual: (..., *normalized) of one shape; returns (y, h)."""
        out = _apply(self, x, mask, centered=False, residual=residual)
        if out is None:
            h = (x + residual).astype(residual.dtype)
            return super().__call__(h, mask=mask), h
        return out


class GroupNorm(nnx.GroupNorm):
    __doc__ = "jaxnorm's kernels behind ``flax.nnx.GroupNorm``.\n" + GROUP_NORM_UNSUPPORTED

    def __init__(self, *args, activation: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.activation = check_activation("GroupNorm", activation)

    def __call__(self, x, *, mask=None):
        """x: (*batch, ..., num_features); returns y of x's shape."""
        lead = group_lead_ndim(x, self.reduction_axes)
        if lead is None or mask is not None or self.axis_index_groups is not None:
            return activate("GroupNorm", super().__call__(x, mask=mask), self.activation)
        x, scale, bias = self.promote_dtype((x, _value(self.scale), _value(self.bias)),
                                            dtype=self.dtype)
        return group_normalize(x, scale, bias, lead_ndim=lead, num_groups=self.num_groups,
                               epsilon=self.epsilon, dtype=self.dtype, axis_name=self.axis_name,
                               activation=self.activation)


class BatchNorm(nnx.BatchNorm):
    __doc__ = "jaxnorm's kernels behind ``flax.nnx.BatchNorm``.\n" + BATCH_NORM_UNSUPPORTED

    def __init__(self, *args, activation: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.activation = check_activation("BatchNorm", activation)

    def __call__(self, x, use_running_average=None, *, mask=None):
        """x: (..., num_features, ...) with the features on ``axis``; returns y
        of x's shape."""
        axis = single_feature_axis(x, self.axis)
        if axis is None or self.axis_index_groups is not None:
            return activate("BatchNorm", super().__call__(x, use_running_average, mask=mask),
                            self.activation)
        use_ra = first_from(use_running_average, self.use_running_average,
                            error_msg="No `use_running_average` argument was provided to "
                                      "BatchNorm (see flax.nnx.BatchNorm)")
        x, _, _, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], _value(self.scale), _value(self.bias)),
            dtype=self.dtype)
        # The running statistics in their own (float32) dtype, as Flax updates them.
        y, mean, var = batch_normalize(
            x, scale, bias, self.mean[...], self.var[...], use_running_average=use_ra,
            momentum=self.momentum, epsilon=self.epsilon, dtype=self.dtype,
            axis_name=self.axis_name, axis=axis, mask=mask, activation=self.activation)
        if not use_ra:
            self.mean[...] = jax.lax.stop_gradient(mean)
            self.var[...] = jax.lax.stop_gradient(var)
        return y

