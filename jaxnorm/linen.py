"""Flax linen drop-ins for ``flax.linen.RMSNorm`` and ``flax.linen.LayerNorm``.

Subclasses of Flax's modules: the same fields, defaults, parameter names,
shapes, dtypes and initializers, so checkpoints move between the two
unchanged; only the computation runs on jaxnorm's kernels.
"""

from __future__ import annotations

import flax.linen as nn

from jaxnorm._flax import UNSUPPORTED, feature_shape, normalize, trailing_norm_ndim


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
