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


class RMSNorm(nnx.RMSNorm):
    __doc__ = "jaxnorm's kernels behind ``flax.nnx.RMSNorm``.\n" + UNSUPPORTED

    def __call__(self, x, mask=None):
        """x: (..., *normalized); returns y of x's shape."""
        k = trailing_norm_ndim(x, self.reduction_axes, self.feature_axes)
        if k is None or mask is not None or self.axis_index_groups is not None:
            return super().__call__(x, mask=mask)
        x, scale = self.promote_dtype((x, _value(self.scale)), dtype=self.dtype)
        return normalize(x, scale, None, centered=False, k=k, feature_axes=self.feature_axes,
                         epsilon=self.epsilon, dtype=self.dtype, axis_name=self.axis_name)


class LayerNorm(nnx.LayerNorm):
    __doc__ = "jaxnorm's kernels behind ``flax.nnx.LayerNorm``.\n" + UNSUPPORTED

    def __call__(self, x, *, mask=None):
        """x: (..., *normalized); returns y of x's shape."""
        k = trailing_norm_ndim(x, self.reduction_axes, self.feature_axes)
        if k is None or mask is not None or self.axis_index_groups is not None:
            return super().__call__(x, mask=mask)
        x, scale, bias = self.promote_dtype((x, _value(self.scale), _value(self.bias)),
                                            dtype=self.dtype)
        return normalize(x, scale, bias, centered=True, k=k, feature_axes=self.feature_axes,
                         epsilon=self.epsilon, dtype=self.dtype, axis_name=self.axis_name)


class AddRMSNorm(RMSNorm):
    """``h = x + residual; y = RMSNorm(h)`` in one kernel (`jaxnorm.add_rms_norm`):
    a drop-in for a residual add followed by ``flax.nnx.RMSNorm``, with the same
    constructor and parameters. ``h`` is rounded to ``residual``'s dtype.
    """

    def __call__(self, x, residual, mask=None):
        """x, residual: (..., *normalized) of one shape; returns (y, h)."""
        k = trailing_norm_ndim(x, self.reduction_axes, self.feature_axes)
        if k is None or mask is not None or self.axis_index_groups is not None:
            h = (x + residual).astype(residual.dtype)
            return super().__call__(h, mask=mask), h
        _, scale = self.promote_dtype((residual, _value(self.scale)), dtype=self.dtype)
        return normalize(x, scale, None, centered=False, k=k, feature_axes=self.feature_axes,
                         epsilon=self.epsilon, dtype=self.dtype, axis_name=self.axis_name,
                         residual=residual)
