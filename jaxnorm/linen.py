"""Flax linen drop-ins for ``flax.linen.RMSNorm``, ``LayerNorm``, ``GroupNorm``
and ``BatchNorm``.

Subclasses of Flax's modules: the same fields, defaults, parameter names,
shapes, dtypes and initializers, so checkpoints move between the two
unchanged; only the computation runs on jaxnorm's kernels.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxnorm._flax import (
    BATCH_NORM_UNSUPPORTED,
    GROUP_NORM_UNSUPPORTED,
    UNSUPPORTED,
    activate,
    batch_normalize,
    feature_shape,
    flax_num_groups,
    group_lead_ndim,
    group_normalize,
    normalize,
    single_feature_axis,
    trailing_norm_ndim,
)


def _apply(module, x, mask, *, centered, residual=None):
    """The kernels' result, or None where the fields do not map onto them."""
    k = trailing_norm_ndim(x, module.reduction_axes, module.feature_axes)
    if k is None or mask is not None or module.axis_index_groups is not None:
        return None

    def param(name, init, use):
        shape = feature_shape(x, module.feature_axes)
        return module.param(name, init, shape, module.param_dtype) if use else None

    scale = param("scale", module.scale_init, module.use_scale)
    bias = param("bias", module.bias_init, module.use_bias) if centered else None
    return normalize(x, scale, bias, centered=centered, k=k, feature_axes=module.feature_axes,
                     epsilon=module.epsilon, dtype=module.dtype, axis_name=module.axis_name,
                     residual=residual)


class RMSNorm(nn.RMSNorm):
    __doc__ = "jaxnorm's kernels behind ``flax.linen.RMSNorm``.\n" + UNSUPPORTED

    @nn.compact
    def __call__(self, x, *, mask=None):
        """x: (..., *normalized); returns y of x's shape."""
        y = _apply(self, x, mask, centered=False)
        return super().__call__(x, mask=mask) if y is None else y


class LayerNorm(nn.LayerNorm):
    __doc__ = "jaxnorm's kernels behind ``flax.linen.LayerNorm``.\n" + UNSUPPORTED

    @nn.compact
    def __call__(self, x, *, mask=None):
        """x: (..., *normalized); returns y of x's shape."""
        y = _apply(self, x, mask, centered=True)
        return super().__call__(x, mask=mask) if y is None else y


class AddRMSNorm(RMSNorm):
    """``h = x + residual; y = RMSNorm(h)`` in one kernel (`jaxnorm.add_rms_norm`):
    a drop-in for a residual add followed by ``flax.linen.RMSNorm``, with the
    same fields and parameters (so a checkpoint of the unfused model loads when
    the module keeps the norm's name). ``h`` is rounded to ``residual``'s dtype.
    """

    @nn.compact
    def __call__(self, x, residual, *, mask=None):
        """x, residual: (..., *normalized) of one shape; returns (y, h)."""
        out = _apply(self, x, mask, centered=False, residual=residual)
        if out is None:
            h = (x + residual).astype(residual.dtype)
            return super().__call__(h, mask=mask), h
        return out


class GroupNorm(nn.GroupNorm):
    __doc__ = "jaxnorm's kernels behind ``flax.linen.GroupNorm``.\n" + GROUP_NORM_UNSUPPORTED

    activation: str | None = None

    @nn.compact
    def __call__(self, x, *, mask=None):
        """x: (*batch, ..., C); returns y of x's shape."""
        lead = group_lead_ndim(x, self.reduction_axes)
        groups = flax_num_groups(x.shape[-1], self.num_groups, self.group_size) if x.ndim else None
        if lead is None or groups is None or mask is not None or self.axis_index_groups:
            return activate("GroupNorm", super().__call__(x, mask=mask), self.activation)
        shape = (x.shape[-1],)
        scale = self.param("scale", self.scale_init, shape, self.param_dtype) if (
            self.use_scale) else None
        bias = self.param("bias", self.bias_init, shape, self.param_dtype) if (
            self.use_bias) else None
        return group_normalize(x, scale, bias, lead_ndim=lead, num_groups=groups,
                               epsilon=self.epsilon, dtype=self.dtype, axis_name=self.axis_name,
                               activation=self.activation)


class BatchNorm(nn.BatchNorm):
    __doc__ = "jaxnorm's kernels behind ``flax.linen.BatchNorm``.\n" + BATCH_NORM_UNSUPPORTED

    activation: str | None = None

    @nn.compact
    def __call__(self, x, use_running_average=None, *, mask=None):
        """x: (..., C, ...) with the features on ``axis``; returns y of x's shape."""
        axis = single_feature_axis(x, self.axis)
        if axis is None or self.axis_index_groups is not None:
            return activate("BatchNorm", super().__call__(x, use_running_average, mask=mask),
                            self.activation)
        use_ra = nn.merge_param("use_running_average", self.use_running_average,
                                use_running_average)
        shape = (x.shape[axis],)
        stats_dtype = jnp.float32 if self.force_float32_reductions else self.param_dtype
        ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, stats_dtype), shape)
        ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, stats_dtype), shape)
        scale = self.param("scale", self.scale_init, shape, self.param_dtype) if (
            self.use_scale) else None
        bias = self.param("bias", self.bias_init, shape, self.param_dtype) if (
            self.use_bias) else None
        initializing = self.is_initializing()
        y, mean, var = batch_normalize(
            x, scale, bias, ra_mean.value, ra_var.value, use_running_average=use_ra,
            momentum=self.momentum, epsilon=self.epsilon, dtype=self.dtype,
            axis_name=None if initializing else self.axis_name, axis=axis, mask=mask,
            activation=self.activation)
        if not use_ra and not initializing:  # Flax leaves the statistics at init
            ra_mean.value, ra_var.value = mean, var
        return y

