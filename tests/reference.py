"""Float64 references, written independently of the kernels: plain NumPy for
values, and JAX autodiff of a float64 jnp implementation for gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

TOLERANCE = {  # (rtol, atol) against float64, by the dtype results are rounded to
    np.dtype("float64"): (1e-10, 1e-10),
    np.dtype("float32"): (2e-5, 2e-5),
    np.dtype(jnp.float16): (4e-3, 4e-3),
    np.dtype(jnp.bfloat16): (3e-2, 3e-2),
}


def norm_np(x, scale, bias, eps, centered, ndim):
    x = np.asarray(x, np.float64)
    axes = tuple(range(x.ndim - ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True) if centered else 0.0
    xc = x - mean
    y = xc / np.sqrt((xc * xc).mean(axis=axes, keepdims=True) + eps)
    if scale is not None:
        y = y * np.asarray(scale, np.float64)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    return y


def norm_jnp64(x, scale, bias, eps, centered, ndim):
    axes = tuple(range(x.ndim - ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True) if centered else 0.0
    xc = x - mean
    y = xc / jnp.sqrt((xc * xc).mean(axis=axes, keepdims=True) + eps)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


def value_and_vjp(f, primals, cotangent):
    """(f(*primals), f's pullback of cotangent), traced as one jit: a reference
    compiles once instead of once an eager op."""

    def run(primals, cotangent):
        y, pullback = jax.vjp(f, *primals)
        return y, pullback(cotangent)

    return jax.jit(run)(primals, cotangent)


def as64(a):
    """a (None passes) as a float64 array."""
    return None if a is None else jnp.asarray(np.asarray(a, np.float64))


def vjp64(x, scale, bias, dy, eps, centered, ndim):
    """Gradients (dx, dscale, dbias) in float64; None for absent parameters."""
    f = lambda *a: norm_jnp64(*a, eps, centered, ndim)  # noqa: E731
    return value_and_vjp(f, (as64(x), as64(scale), as64(bias)), as64(dy))[1]


def skip_gpu_plan_sizes(shape):
    """Skips, off the GPU, a case of over 2^20 elements: such sizes only pick
    among CUDA launch plans, and the CPU handlers have one way (smaller cases
    cover it)."""
    if jax.default_backend() != "gpu" and np.prod(shape) > 1 << 20:
        pytest.skip("sizes for a GPU plan: the CPU handler has one way")


def lowering_platform():
    """The default device's lowering platform ("cpu", "cuda" or "rocm"), as
    jaxnorm.kernel_platforms() names them; a GPU's device platform is "gpu"."""
    device = jax.devices()[0]
    if device.platform == "gpu":
        return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"
    return device.platform


def assert_close(actual, expected, dtype, scale=1.0):
    rtol, atol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64),
        rtol=rtol, atol=atol * scale,
    )


def rand(seed, shape, dtype, offset=0.0, scale=1.0):
    """Fresh normal data of mean `offset` and deviation `scale` in `dtype`."""
    rng = np.random.default_rng(seed)
    # Rounded by NumPy (ml_dtypes for the 16-bit types): no compile a shape.
    return jnp.asarray((rng.standard_normal(shape) * scale + offset).astype(jnp.dtype(dtype)))
