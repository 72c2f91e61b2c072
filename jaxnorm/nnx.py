"""Flax NNX drop-ins for ``flax.nnx.RMSNorm`` and ``flax.nnx.LayerNorm``.

Subclasses of Flax's modules: the same constructor, fields, ``nnx.Param``
names, shapes, dtypes and initializers, so states move between the two
unchanged; only the computation runs on jaxnorm's kernels.
"""

from __future__ import annotations

from flax import nnx

from jaxnorm._flax import UNSUPPORTED, normalize, trailing_norm_ndim


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
