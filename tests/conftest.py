import jax

# Before any computation: float64 tests need x64, and the shard_map tests use
# 8 virtual CPU devices (other backends keep their own device count).
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_num_cpu_devices", 8)
