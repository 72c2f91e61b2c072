"""jaxnorm: fused normalization kernels for JAX, as XLA FFI primitives."""

from jaxnorm._ffi import kernel_platforms
from jaxnorm.row_norm import layer_norm, rms_norm

__version__ = "0.1.0"

__all__ = ["kernel_platforms", "layer_norm", "rms_norm", "__version__"]
