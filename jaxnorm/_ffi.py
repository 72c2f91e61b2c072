"""Registers the compiled FFI handlers with XLA, once, at import.

The extension is built with CPU handlers always and CUDA handlers when nvcc was
found; `KERNELS` records which targets exist for which lowering platform, so
that primitives lower to a kernel only where one was built.
"""

from __future__ import annotations

import jax

from jaxnorm import _jaxnorm

TARGET_PREFIX = "jaxnorm_"

# lowering platform -> (XLA FFI platform name, handlers the extension exports)
_PLATFORMS = {
    "cpu": ("cpu", _jaxnorm.cpu_targets()),
    "cuda": ("CUDA", _jaxnorm.cuda_targets()),
}


def _register() -> dict[str, frozenset[str]]:
    kernels = {}
    for platform, (ffi_platform, handlers) in _PLATFORMS.items():
        for name, capsule in handlers.items():
            jax.ffi.register_ffi_target(TARGET_PREFIX + name, capsule, platform=ffi_platform)
        kernels[platform] = frozenset(handlers)
    return kernels


KERNELS: dict[str, frozenset[str]] = _register()


def kernel_platforms() -> tuple[str, ...]:
    """The platforms ("cpu", "cuda") for which this build has compiled kernels."""
    return tuple(p for p, names in KERNELS.items() if names)
