"""jaxnorm: fused normalization kernels for JAX, as XLA FFI primitives."""

from jaxnorm._ffi import kernel_platforms
from jaxnorm.channel_norm import batch_norm, group_norm, instance_norm
from jaxnorm.channel_softmax import channel_softmax
from jaxnorm.local_response_norm import local_response_norm
from jaxnorm.row_norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm

__version__ = "0.1.0"

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "batch_norm",
    "channel_softmax",
    "group_norm",
    "instance_norm",
    "kernel_platforms",
    "layer_norm",
    "local_response_norm",
    "rms_norm",
    "__version__",
]
