"""Time to a first jaxnorm result in a fresh process.

The first call of an op pays for jit compilation and, on a GPU, for loading the
CUDA module that holds its kernels (decompressing its device code). A second
shape compiles again but finds the module loaded, so the difference between
the two first calls is roughly the load. XLA's own op is timed first so that
the runtime's start-up is not counted against jaxnorm.
    python benchmarks/first_call.py
"""

import time

import jax
import jax.numpy as jnp

import jaxnorm


def first_call_ms(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(jax.jit(fn)(*args))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    key = jax.random.key(0)
    x_a = jax.random.normal(key, (64, 4096), jnp.bfloat16)
    x_b = jax.random.normal(key, (32, 2048), jnp.bfloat16)
    w_a, w_b = jnp.ones(4096, jnp.bfloat16), jnp.ones(2048, jnp.bfloat16)

    def xla_rms(x, w):
        x32 = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
        return (x32 * inv).astype(x.dtype) * w

    grad = jax.grad(lambda x, w: jaxnorm.rms_norm(x, w).astype(jnp.float32).sum())
    print(f"device: {jax.devices()[0].device_kind}")
    for label, fn, args in (("XLA rms_norm, first call", xla_rms, (x_a, w_a)),
                            ("jaxnorm.rms_norm, first call", jaxnorm.rms_norm, (x_a, w_a)),
                            ("jaxnorm.rms_norm, new shape", jaxnorm.rms_norm, (x_b, w_b)),
                            ("jaxnorm.rms_norm grad, first call", grad, (x_a, w_a))):
        print(f"{label + ':':<37}{first_call_ms(fn, *args):8.1f} ms")

if __name__ == "__main__":
    main()
