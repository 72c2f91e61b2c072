import os

# Test processes side by side (pytest -n) share one GPU: none takes most of
# its memory up front, as JAX does by default.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after the allocator's setting)

# Before any computation: float64 tests need x64, and the shard_map tests use
# 8 virtual CPU devices (other backends keep their own device count).
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_num_cpu_devices", 8)
