"""jaxnorm: fused normalization kernels for JAX, as XLA FFI primitives."""

from jaxnorm._ffi import kernel_platforms
from jaxnorm.row_norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm

__version__ = "0.1.0"

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "kernel_platforms",
    "layer_norm",
    "rms_norm",
    "__version__",
]
