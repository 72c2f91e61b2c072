"""Float64 references, written independently of the kernels: plain NumPy for
values, and JAX autodiff of a float64 jnp implementation for gradients."""

import jax
import jax.numpy as jnp
import numpy as np

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


def vjp64(x, scale, bias, dy, eps, centered, ndim):
    """Gradients (dx, dscale, dbias) in float64; None for absent parameters."""
    f64 = lambda a: None if a is None else jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
    args = (f64(x), f64(scale), f64(bias))
    _, pullback = jax.vjp(lambda *a: norm_jnp64(*a, eps, centered, ndim), *args)
    return pullback(f64(dy))


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


def rand(seed, shape, dtype, offset=0.0):
    """Fresh standard-normal data (plus `offset`) in `dtype`."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) + offset, dtype)
