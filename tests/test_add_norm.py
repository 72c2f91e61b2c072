"""add_rms_norm / add_layer_norm (fused residual add) and zero-centered scale,
against float64 references, on the default device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads
from reference import (
    as64,
    assert_close,
    lowering_platform,
    norm_jnp64,
    norm_np,
    rand,
    skip_gpu_plan_sizes,
    value_and_vjp,
)
from sharding_util import collective_sizes, make_mesh, needs_devices, row_norm_collectives
from test_row_norm import PLAN_CASES

import jaxnorm

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]
ADD_OPS = {
    "add_rms_norm": (jaxnorm.add_rms_norm, False, 1e-6),
    "add_layer_norm": (jaxnorm.add_layer_norm, True, 1e-5),
}


def add_call(op, x, residual, scale, bias, **kw):
    fn, centered, _ = ADD_OPS[op]
    return fn(x, residual, scale, bias, **kw) if centered else fn(x, residual, scale, **kw)


def add_params(op, seed, shape, dtype):
    scale = rand(seed + 1, shape, dtype, offset=1.0)
    bias = rand(seed + 2, shape, dtype) if ADD_OPS[op][1] else None
    return scale, bias


def rounded_sum(x, residual):
    """x + residual as the unfused code computes it, rounded to residual's dtype."""
    return np.asarray(np.asarray(x, np.float64) + np.asarray(residual, np.float64)).astype(
        residual.dtype
    )


def check_add_values(op, x, residual, scale, bias, zero_centered=False):
    _, centered, eps = ADD_OPS[op]
    f = jax.jit(functools.partial(add_call, op, zero_centered_scale=zero_centered))
    y, h = f(x, residual, scale, bias)
    assert y.shape == h.shape == x.shape and y.dtype == h.dtype == residual.dtype
    want_h = rounded_sum(x, residual)
    np.testing.assert_array_equal(np.asarray(h), want_h)  # the same bits as the unfused sum
    s = None if scale is None else np.asarray(scale, np.float64) + (1 if zero_centered else 0)
    assert_close(y, norm_np(want_h, s, bias, eps, centered, 1), y.dtype)


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("hidden", [1, 3, 127, 1024, 4097, 65536])
def test_values(op, dtype, hidden):
    rows = 5 if hidden < 65536 else 3
    x = rand(hidden, (rows, hidden), dtype, offset=0.5)
    residual = rand(hidden + 7, (rows, hidden), dtype)
    scale, bias = add_params(op, hidden, (hidden,), dtype)
    check_add_values(op, x, residual, scale, bias)


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("shape,x_dtype,p_dtype", PLAN_CASES, ids=str)
def test_every_plan(op, shape, x_dtype, p_dtype):
    """Each CUDA launch plan with the residual add (and zero-centered scale);
    forward, then gradients (the statistics-only forward, the backward with
    the cotangent of h added)."""
    skip_gpu_plan_sizes(shape)
    x = rand(31, shape, x_dtype, offset=0.5)
    residual = rand(33, shape, x_dtype)
    scale, bias = add_params(op, 31, shape[-1:], p_dtype)
    check_add_values(op, x, residual, scale, bias, zero_centered=True)
    check_add_grads64(op, x, residual, scale, bias, zero_centered=True)


def add_jnp64(x, residual, scale, bias, eps, centered, zero_centered):
    h = x + residual
    s = None if scale is None else scale + (1 if zero_centered else 0)
    return norm_jnp64(h, s, bias, eps, centered, 1), h


def check_add_grads64(op, x, residual, scale, bias, zero_centered=False):
    """Gradients with both cotangents (of y and of h) against float64 autodiff,
    from a jitted pullback and from forward and backward in one jit (the
    forward's y dead: it writes h and the statistics only). The float64
    reference differentiates through the exact sum, the kernels through the
    rounded one: both give h's gradient to x and residual."""
    dy, dh = rand(41, x.shape, x.dtype), rand(42, x.shape, x.dtype)
    f = functools.partial(add_call, op, zero_centered_scale=zero_centered)
    _, pullback = jax.vjp(f, x, residual, scale, bias)
    fused = jax.jit(lambda *a: jax.vjp(f, *a)[1]((dy, dh)))
    want = add_grads64(op, x, residual, scale, bias, dy, dh, zero_centered)
    for got in (jax.jit(pullback)((dy, dh)), fused(x, residual, scale, bias)):
        assert_add_grads(got, want, (x, residual, scale, bias))


def add_grads64(op, x, residual, scale, bias, dy, dh, zero_centered=False):
    """Float64 autodiff's (dx, dresidual, dscale, dbias) for cotangents dy of
    y and dh of h. The reference sees the rounded h as residual (x = 0), so
    that it normalizes the row the kernels do."""
    _, centered, eps = ADD_OPS[op]
    _, (dh64, ds64, db64) = value_and_vjp(
        lambda h, s, b: add_jnp64(jnp.zeros_like(h), h, s, b, eps, centered, zero_centered),
        (as64(rounded_sum(x, residual)), as64(scale), as64(bias)), (as64(dy), as64(dh)),
    )
    return dh64, dh64, ds64, db64


def assert_add_grads(got, want, args):
    rows = args[0].size // args[0].shape[-1]
    for g, w, arg, sums in zip(got, want, args, (1, 1, rows, rows)):
        if arg is None:
            assert g is None
            continue
        assert g.dtype == arg.dtype and g.shape == arg.shape
        assert_close(g, w, arg.dtype, scale=float(np.sqrt(sums)) * 4)


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("shape,x_dtype,p_dtype", PLAN_CASES, ids=str)
def test_backward_handler_given_residual(op, shape, x_dtype, p_dtype):
    """The backward kernel given x and residual (and no statistics) forms h
    itself, on every plan: the few-rows kernels as they load x, the others
    from h formed in scratch."""
    from jaxnorm import row_norm
    from jaxnorm._stats import param_dtype

    skip_gpu_plan_sizes(shape)
    _, centered, eps = ADD_OPS[op]
    x, residual = rand(51, shape, x_dtype, offset=0.5), rand(52, shape, x_dtype)
    scale, bias = add_params(op, 51, shape[-1:], p_dtype)
    dy, dh = rand(53, shape, x_dtype), rand(54, shape, x_dtype)
    none = jnp.zeros((0,), jnp.float32)
    wide = param_dtype(x_dtype, scale)  # what the ops hand the kernels

    def bwd(x, residual, scale, dy, dh):
        return row_norm.row_norm_bwd_kernel_p.bind(
            x, scale.astype(wide), none, none, dy, dh, residual, epsilon=eps,
            centered=centered, zero_centered=False, has_bias=centered, param_dtype=wide)

    dx, dscale, dbias = jax.jit(bwd)(x, residual, scale, dy, dh)
    want = add_grads64(op, x, residual, scale, bias, dy, dh)
    got = (dx, dx, dscale.astype(p_dtype), None if bias is None else dbias.astype(p_dtype))
    assert_add_grads(got, want, (x, residual, scale, bias))


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(5, 1), (9, 127), (3, 4097), (2, 4, 24)])
def test_grads_against_float64(op, dtype, shape):
    x, residual = rand(21, shape, dtype), rand(23, shape, dtype, offset=0.5)
    scale, bias = add_params(op, 21, shape[-1:], dtype)
    check_add_grads64(op, x, residual, scale, bias)


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_check_grads(op, dtype, zero_centered):
    x, residual = rand(1, (4, 130), dtype), rand(2, (4, 130), dtype, offset=1.0)
    scale, bias = add_params(op, 3, (130,), dtype)
    tol = 1e-2 if dtype == jnp.float32 else 1e-6

    def f(x, residual, scale, *bias):
        y, h = add_call(op, x, residual, scale, bias[0] if bias else None,
                        zero_centered_scale=zero_centered)
        return y + jnp.sin(h)  # both outputs reach the result

    args = (x, residual, scale) + ((bias,) if bias is not None else ())
    check_grads(f, args, order=1, modes=["rev"], atol=tol, rtol=tol)


# ------------------------------------------------------ zero-centered scale


@pytest.mark.parametrize("centered", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_zero_centered_scale(centered, dtype):
    """y = xhat * (1 + scale), with (1 + scale) in float32: a bf16 scale near
    zero keeps its precision (1 + scale rounded to bf16 would not)."""
    eps = 1e-5 if centered else 1e-6
    x = rand(5, (6, 4097), dtype, offset=0.5)
    scale = rand(6, (4097,), dtype) * 0.01
    bias = rand(7, (4097,), dtype) if centered else None
    if centered:
        y = jaxnorm.layer_norm(x, scale, bias, zero_centered_scale=True)
    else:
        y = jaxnorm.rms_norm(x, scale, zero_centered_scale=True)
    s = np.asarray(scale, np.float64) + 1
    assert_close(y, norm_np(x, s, bias, eps, centered, 1), dtype)


@pytest.mark.parametrize("centered", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=lambda d: jnp.dtype(d).name)
def test_zero_centered_grads(centered, dtype):
    x = rand(8, (5, 300), dtype, offset=0.5)
    scale, bias = rand(9, (300,), dtype), rand(10, (300,), dtype)

    def f(x, s, b):
        if centered:
            return jaxnorm.layer_norm(x, s, b, zero_centered_scale=True)
        return jaxnorm.rms_norm(x, s, zero_centered_scale=True) + b

    tol = 1e-2 if dtype == jnp.float32 else 1e-6
    check_grads(f, (x, scale, bias), order=1, modes=["rev"], atol=tol, rtol=tol)
    # and equal to the plain op with scale + 1, whose gradient is the same
    dy = rand(11, x.shape, dtype)

    def g(x, s, b):
        return jaxnorm.layer_norm(x, s + 1, b) if centered else jaxnorm.rms_norm(x, s + 1) + b

    for a, b in zip(jax.vjp(f, x, scale, bias)[1](dy), jax.vjp(g, x, scale, bias)[1](dy)):
        assert_close(a, b, dtype)


# ------------------------------------------------------ buffers


def _custom_calls(text):
    return [line for line in text.splitlines()
            if 'custom_call_target="jaxnorm_row_norm_fwd"' in line and "custom-call(" in line]


def _kernels_here():
    return lowering_platform() in jaxnorm.kernel_platforms()


# On a GPU: few rows (the decode kernel), and many rows of 4 vectors a thread
# (rows not a whole number of the block's vectors) and of 8, whose residual
# reaches shared memory (cp.async) before h is stored over it.
@pytest.mark.skipif(not _kernels_here(), reason="no kernels here")
@pytest.mark.parametrize(
    "shape,dtype",
    [((16, 256), jnp.float32), ((600, 4104), jnp.bfloat16), ((540, 32768), jnp.bfloat16)],
    ids=str,
)
def test_donated_residual_is_updated_in_place(shape, dtype):
    x, residual = rand(1, shape, dtype), rand(2, shape, dtype)
    scale = rand(3, shape[-1:], dtype, 1.0)
    # float64 references, taken before the donation deletes x and residual
    want_h = rounded_sum(x, residual)
    want_y = norm_np(want_h, np.asarray(scale, np.float64), None, ADD_OPS["add_rms_norm"][2],
                     False, 1)
    # jit pairs donated inputs with outputs of their type in order: x -> y,
    # residual -> h.
    f = jax.jit(jaxnorm.add_rms_norm, donate_argnums=(0, 1))
    compiled = f.lower(x, residual, scale).compile()
    text = compiled.as_text()
    calls = _custom_calls(text)
    assert len(calls) == 1 and "output_to_operand_aliasing={{3}: (3, {}), {0}: (0, {})}" in calls[0]
    assert " copy(" not in text and "copy-start" not in text
    assert "input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }" in text
    x_ptr, r_ptr = x.unsafe_buffer_pointer(), residual.unsafe_buffer_pointer()
    y, h = compiled(x, residual, scale)
    assert (y.unsafe_buffer_pointer(), h.unsafe_buffer_pointer()) == (x_ptr, r_ptr)
    assert residual.is_deleted() and x.is_deleted()
    assert_close(y, want_y, dtype)
    np.testing.assert_array_equal(np.asarray(h), want_h)


@pytest.mark.skipif(not _kernels_here(), reason="no kernels here")
def test_undonated_inputs_are_left_intact():
    x, residual = rand(4, (16, 256), jnp.bfloat16), rand(5, (16, 256), jnp.bfloat16)
    before = np.asarray(x).copy(), np.asarray(residual).copy()
    f = jax.jit(jaxnorm.add_rms_norm)
    y, h = f(x, residual, None)
    np.testing.assert_array_equal(np.asarray(x), before[0])
    np.testing.assert_array_equal(np.asarray(residual), before[1])
    np.testing.assert_array_equal(np.asarray(h), rounded_sum(x, residual))
    # Under autodiff the forward writes h to a buffer of its own: residual is
    # typically saved for an earlier layer's backward.
    text = jax.jit(jax.grad(lambda x, r: jnp.sum(add_call("add_rms_norm", x, r, None, None)[0]
                                                  .astype(jnp.float32)))).lower(
        x, residual).compile().as_text()
    assert all("output_to_operand_aliasing" not in c for c in _custom_calls(text))


@pytest.mark.skipif(not _kernels_here(), reason="no kernels here")
@pytest.mark.parametrize("op", ADD_OPS)
def test_backward_forms_h_where_the_forward_is_dead(op):
    """Forward and backward in one jit with y and h both dead: up to 64 KiB
    of h the backward is given x and residual and no forward is left; above,
    the forward writes h for it. With h used, the forward runs."""
    def grads_only(x, r, s, dy, dh):
        return jax.vjp(lambda *a: add_call(op, *a, None), x, r, s)[1]((dy, dh))

    def with_h(x, r, s, dy, dh):
        (_, h), pullback = jax.vjp(lambda *a: add_call(op, *a, None), x, r, s)
        return h, pullback((dy, dh))

    for rows, f, forwards in ((4, grads_only, 0), (4, with_h, 1), (17, grads_only, 1)):
        args = [rand(61 + k, (rows, 1024), jnp.float32) for k in range(2)]
        args += [rand(63, (1024,), jnp.float32, 1.0)]
        args += [rand(64 + k, (rows, 1024), jnp.float32) for k in range(2)]
        assert len(_custom_calls(jax.jit(f).lower(*args).compile().as_text())) == forwards
        got = jax.jit(f)(*args)
        got = got if f is grads_only else got[1]
        want = add_grads64(op, *args[:3], None, *args[3:])
        assert_add_grads(got, want[:3], args[:3])


# ------------------------------------------------------ transformations


@pytest.mark.parametrize("op", ADD_OPS)
def test_vmap(op):
    x, residual = rand(1, (3, 4, 64), jnp.float32), rand(2, (3, 4, 64), jnp.float32)
    scale, bias = add_params(op, 3, (64,), jnp.float32)
    y, h = add_call(op, x, residual, scale, bias)
    for axis in (0, 1):
        got_y, got_h = jax.vmap(lambda a, r: add_call(op, a, r, scale, bias), in_axes=axis,
                                out_axes=axis)(x, residual)
        assert_close(got_y, y, jnp.float32)
        np.testing.assert_array_equal(np.asarray(got_h), np.asarray(h))
    # residual not batched: broadcast to each example
    got_y, _ = jax.vmap(lambda a: add_call(op, a, residual[0], scale, bias))(x)
    want_y, _ = add_call(op, x, jnp.broadcast_to(residual[0], x.shape), scale, bias)
    assert_close(got_y, want_y, jnp.float32)


def test_mixed_dtypes_add_then_normalize():
    """bf16 x into a float32 residual stream: h in float32, y by default too."""
    x, residual = rand(1, (7, 96), jnp.bfloat16), rand(2, (7, 96), jnp.float32)
    scale = rand(3, (96,), jnp.float32, 1.0)
    y, h = jax.jit(jaxnorm.add_rms_norm)(x, residual, scale)
    assert h.dtype == y.dtype == jnp.float32
    want_h = rounded_sum(x, residual)
    np.testing.assert_array_equal(np.asarray(h), want_h)
    assert_close(y, norm_np(want_h, scale, None, 1e-6, False, 1), jnp.float32)
    y16, _ = jaxnorm.add_rms_norm(x, residual, scale, dtype=jnp.bfloat16)
    assert y16.dtype == jnp.bfloat16


def test_empty_and_nonfinite_rows():
    x, r = jnp.ones((0, 512), jnp.bfloat16), jnp.ones((0, 512), jnp.bfloat16)
    y, h = jaxnorm.add_rms_norm(x, r, jnp.ones((512,), jnp.bfloat16))
    assert y.shape == h.shape == (0, 512)
    g = jax.grad(lambda x, r: jnp.sum(jaxnorm.add_rms_norm(x, r)[0]), argnums=(0, 1))(x, r)
    assert all(a.shape == (0, 512) for a in g)
    x = np.array(rand(3, (4, 300), jnp.float32))
    x[2, 5] = np.nan
    y, h = jax.jit(jaxnorm.add_layer_norm)(jnp.asarray(x), rand(4, (4, 300), jnp.float32))
    bad = ~np.isfinite(np.asarray(y))
    assert bad[2].all() and not bad[[0, 1, 3]].any()


def test_bad_arguments():
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"add_rms_norm: residual must have the shape of x "
                                         r"\(4, 8\), got \(4, 7\)"):
        jaxnorm.add_rms_norm(x, jnp.ones((4, 7), jnp.float32))
    with pytest.raises(TypeError, match="add_layer_norm: residual must have dtype"):
        jaxnorm.add_layer_norm(x, jnp.ones((4, 8), jnp.int32))


# ------------------------------------------------------ sharding


@needs_devices(8)
@pytest.mark.parametrize("op", ADD_OPS)
def test_partitioned_rows_and_hidden(op):
    """Under jit with x and residual split over rows ("data") and hidden
    ("model"): values and gradients equal one device's, h keeps x's sharding,
    and the collectives are the plain norm's."""
    _, centered, _ = ADD_OPS[op]
    mesh = make_mesh((4, 2))
    shape = (8, 16, 64)
    x, residual = rand(1, shape, jnp.float32, offset=2.0), rand(2, shape, jnp.float32)
    scale, bias = add_params(op, 3, (64,), jnp.float32)
    spec = P("data", None, "model")
    xs = NamedSharding(mesh, spec)
    ps = NamedSharding(mesh, P("model"))

    def loss(x, r, s, b):
        y, h = add_call(op, x, r, s, b)
        return jnp.sum(jnp.sin(y)) + jnp.sum(h * h)

    grad = jax.grad(loss, argnums=(0, 1, 2) + ((3,) if centered else ()))
    for name, f in (("fwd", functools.partial(add_call, op)), ("grad", grad)):
        sharded = jax.jit(f, in_shardings=(xs, xs, ps, ps if centered else None)).lower(
            x, residual, scale, bias).compile()
        got = sharded(x, residual, scale, bias)
        want = jax.jit(f)(x, residual, scale, bias)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
        assert collective_sizes(sharded.as_text()) == row_norm_collectives(
            centered, 8 * 16 // 4, 4, 2, 32, grad=name == "grad"
        )
        if name == "fwd":
            assert got[1].sharding.is_equivalent_to(xs, 3)


@needs_devices(8)
@pytest.mark.parametrize("op", ADD_OPS)
def test_shard_map_axis_name(op):
    """Inside shard_map with the hidden dim split over "model": values and
    gradients (of x, residual and scale) equal one device's."""
    mesh = make_mesh((4, 2))
    x, residual = rand(1, (8, 64), jnp.float32, offset=2.0), rand(2, (8, 64), jnp.float32)
    scale, _ = add_params(op, 3, (64,), jnp.float32)
    spec, p_spec = P("data", "model"), P("model")

    def loss(x, r, s, **kw):
        y, h = add_call(op, x, r, s, None, **kw)
        return jnp.sum(jnp.sin(y)) + jnp.sum(h * h)

    def local(x, r, s):
        out = add_call(op, x, r, s, None, axis_name="model")
        g = jax.grad(lambda *a: jax.lax.psum(loss(*a, axis_name="model"), ("data", "model")),
                     argnums=(0, 1, 2))(x, r, s)
        return out, g

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, p_spec),
                              out_specs=((spec, spec), (spec, spec, p_spec))))
    (y, h), grads = f(x, residual, scale)
    want_y, want_h = add_call(op, x, residual, scale, None)
    assert_close(y, want_y, jnp.float32)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(want_h))
    for g, w in zip(grads, jax.grad(loss, argnums=(0, 1, 2))(x, residual, scale)):
        assert_close(g, w, jnp.float32, scale=10)
