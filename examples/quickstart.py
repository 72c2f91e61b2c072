"""rms_norm and layer_norm under jit and grad on the default device, checked
against the same math written in jax.numpy."""

import functools

import jax
import jax.numpy as jnp

import jaxnorm


def reference(x, scale, bias, *, centered, epsilon, use_bias):
    bias = bias if use_bias else None
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True) if centered else 0.0
    xc = xf - mean
    y = xc * jax.lax.rsqrt((xc * xc).mean(-1, keepdims=True) + epsilon) * scale
    return (y + bias if bias is not None else y).astype(x.dtype)


def loss(f, x, s, b):
    return jnp.sum(jnp.tanh(f(x, s, b).astype(jnp.float32)))


def check(name, fn, ref_fn, x, scale, bias):
    y = jax.jit(fn)(x, scale, bias)
    y_ref = ref_fn(x, scale, bias).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref)))
    grads = jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1)))(x, scale, bias)
    grads_ref = jax.grad(functools.partial(loss, ref_fn), argnums=(0, 1))(x, scale, bias)
    rel = [
        float(jnp.linalg.norm((g - r).astype(jnp.float32)) / jnp.linalg.norm(r))
        for g, r in zip(grads, grads_ref)
    ]
    print(f"{name:10s} y max |err| {err:.3g}; grad rel err x {rel[0]:.2g}, scale {rel[1]:.2g}")
    assert err < 0.05 and max(rel) < 0.02, name


def main():
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
          f"jaxnorm kernels for {jaxnorm.kernel_platforms()}")
    kx, ks, kb = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (8, 128, 1024), jnp.bfloat16)
    scale = 1 + 0.1 * jax.random.normal(ks, (1024,), jnp.float32)
    bias = 0.1 * jax.random.normal(kb, (1024,), jnp.float32)

    cases = {
        "rms_norm": (lambda x, s, b: jaxnorm.rms_norm(x, s), False, 1e-6),
        "layer_norm": (lambda x, s, b: jaxnorm.layer_norm(x, s, b), True, 1e-5),
    }
    for name, (fn, centered, eps) in cases.items():
        check(name, fn, functools.partial(reference, centered=centered, epsilon=eps,
                                          use_bias=centered), x, scale, bias)
    print("OK")


if __name__ == "__main__":
    main()
