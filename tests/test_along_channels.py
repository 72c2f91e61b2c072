"""local_response_norm and channel_softmax against float64 references (the
LRN reference follows PyTorch's definition: a zero-padded average of squares
over the window), on the default device."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from reference import as64, assert_close, lowering_platform, rand, value_and_vjp

import jaxnorm

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]


def lrn_np(x, size, alpha, beta, k, axis):
    """PyTorch's local_response_norm in float64: x / (k + alpha * avg)^beta,
    avg the mean of x^2 over size channels (size // 2 before, (size - 1) // 2
    after), zero padded."""
    xl = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    c = xl.shape[-1]
    sq = np.pad(xl * xl, [(0, 0)] * (xl.ndim - 1) + [(size // 2, (size - 1) // 2)])
    avg = np.stack([sq[..., j:j + size].sum(-1) for j in range(c)], axis=-1) / size
    return np.moveaxis(xl / (k + alpha * avg) ** beta, -1, axis)


def lrn_jnp(x, size, alpha, beta, k, axis):
    """The same in jnp, the window sums as differences of prefix sums."""
    xl = jnp.moveaxis(x, axis, -1)
    c = xl.shape[-1]
    sq = jnp.pad(xl * xl, [(0, 0)] * (xl.ndim - 1) + [(size // 2 + 1, (size - 1) // 2)])
    prefix = jnp.cumsum(sq, axis=-1)
    avg = (prefix[..., size:size + c] - prefix[..., :c]) / size
    return jnp.moveaxis(xl / (k + alpha * avg) ** beta, -1, axis)


def softmax_np(x, axis):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


LRN_CASES = [  # shape, axis, size
    ((2, 16, 5, 7), 1, 5),     # PyTorch's NCHW
    ((2, 5, 7, 16), -1, 5),    # NHWC
    ((3, 7, 9), 1, 4),         # an even window (2 before, 1 after)
    ((2, 3, 4), 1, 1),
    ((2, 3, 4), -1, 9),        # a window wider than the channels
    ((4, 1), 1, 3),            # one channel
    ((1, 127, 2, 3), 1, 7),
    # channels last, as CUDA's kernels take them: windows of 3, 5 and 7,
    # lines of 1 to 3 vectors a lane, 1 to 32 lanes
    ((3, 5, 96), -1, 3),
    ((2, 3, 64), -1, 7),
    ((5, 12), -1, 5),
    ((37, 760), -1, 5),
    ((9, 24), -1, 7),
    # channels first, a thread a position on CUDA: windows of 3, 5 and 7 over
    # fewer channels than a window, a chunk of loads (8) or several chunks
    ((2, 96, 11, 13), 1, 3),
    ((3, 37, 9, 9), 1, 7),
    ((4, 2, 33), 1, 7),
    ((2, 130, 35), 1, 5),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,axis,size", LRN_CASES, ids=str)
def test_lrn_values(shape, axis, size, dtype):
    x = rand(len(shape) + size, shape, dtype)
    f = functools.partial(jaxnorm.local_response_norm, size=size, alpha=0.5, beta=0.75, k=2.0,
                          channel_axis=axis)
    y = jax.jit(f)(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, lrn_np(x, size, 0.5, 0.75, 2.0, axis), dtype)


def test_lrn_defaults_match_pytorch_defaults():
    x = rand(3, (2, 8, 4, 4), jnp.float32, offset=3.0)
    y = jaxnorm.local_response_norm(x, 3, channel_axis=1)
    assert_close(y, lrn_np(x, 3, 1e-4, 0.75, 1.0, 1), jnp.float32)


@pytest.mark.parametrize("shape,axis,size", [((2, 6, 3, 4), 1, 3), ((2, 3, 7), -1, 4)],
                         ids=str)
def test_lrn_gradients(shape, axis, size):
    x = rand(4, shape, jnp.float64)
    f = functools.partial(jaxnorm.local_response_norm, size=size, alpha=0.7, beta=0.6, k=1.5,
                          channel_axis=axis)
    check_grads(f, (x,), order=1, modes=["rev"])
    dy = rand(5, shape, jnp.float64)
    got = jax.vjp(f, x)[1](dy)[0]
    want = jax.vjp(lambda x: lrn_jnp(x, size, 0.7, 0.6, 1.5, axis), x)[1](dy)[0]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    # float32 and bfloat16 against the float64 gradient
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        g = jax.vjp(f, x.astype(dtype))[1](dy.astype(dtype))[0]
        np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,axis", [((2, 10, 5, 5), 1), ((3, 4, 4, 21), -1), ((5, 1), -1),
                                        ((2, 4097), -1), ((2, 3, 7), 0)], ids=str)
def test_softmax_values(shape, axis, dtype):
    x = rand(6, shape, dtype, offset=3.0, scale=3.0)
    y = jax.jit(functools.partial(jaxnorm.channel_softmax, channel_axis=axis))(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, softmax_np(x, axis), dtype)


# Channels not last (the positions' channels strided, an odd count of
# positions after them) and last, from few channels to long lines (4097,
# 65537).
LINE_CASES = [  # shape, axis
    ((3, 37, 5, 7), 1),
    ((2, 3, 70, 33), 2),
    ((67, 3), -1),
    ((5, 9, 8), -1),
    ((3, 11, 40), -1),
    ((2, 13, 129), -1),
    ((3, 4097), -1),
    ((2, 65537), -1),
    # Channels last, many positions, line lengths either side of 32 and 256:
    ((700, 21), -1),
    ((3000, 8), -1),
    ((40, 32), -1),
    ((41, 256), -1),
    ((33, 257), -1),
    ((9, 4096), -1),
    # Lines of 4-byte vectors in teams of 16 lanes of 4-5 vectors (the
    # softmax's 16-bit lines of 98 and 150 channels, float32's of 75):
    ((300, 150), -1),
    ((200, 98), -1),
    ((300, 75), -1),
    # Channels first, the softmax's tiles of positions: position counts
    # odd, even and a multiple of 4 (a thread takes 1, 2 or 4 positions as
    # they allow), tiles short of positions (a last one, and one alone), 3
    # to 256 channels, and 257 (XLA's):
    ((2, 150, 9, 7), 1),
    ((2, 150, 8, 8), 1),
    ((2, 150, 20, 10), 1),
    ((2, 256, 5, 8), 1),
    ((4, 3, 100), 1),
    ((3, 257, 6), 1),
]


def _op(name, axis):
    if name == "lrn":
        return (functools.partial(jaxnorm.local_response_norm, size=5, alpha=0.5, beta=0.75,
                                  k=2.0, channel_axis=axis),
                lambda x: lrn_jnp(x, 5, 0.5, 0.75, 2.0, axis))
    return (functools.partial(jaxnorm.channel_softmax, channel_axis=axis),
            lambda x: jax.nn.softmax(x, axis=axis))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,axis", LINE_CASES, ids=str)
@pytest.mark.parametrize("name", ["lrn", "softmax"])
def test_forward_and_backward_against_float64(name, shape, axis, dtype):
    f, ref = _op(name, axis)
    x = rand(10, shape, dtype, offset=1.0, scale=2.0)
    dy = rand(11, shape, dtype)
    y, pullback = jax.vjp(jax.jit(f), x)
    want_y, (want_dx,) = value_and_vjp(ref, (as64(x),), as64(dy))
    assert y.dtype == x.dtype
    assert_close(y, want_y, dtype)
    (dx,) = pullback(dy)
    assert dx.dtype == x.dtype
    assert_close(dx, want_dx, dtype, scale=float(np.abs(want_dx).max()))


# Either side of what CUDA's line kernels take (cuda_line_fits): dtypes,
# channel counts that set the vector width, lines too long for a warp, and
# channels not last.
FIT_CASES = [  # shape, axis, dtype
    ((50, 96), -1, jnp.bfloat16),
    ((50, 768), -1, jnp.bfloat16),
    ((50, 384), -1, jnp.float32),
    ((50, 776), -1, jnp.bfloat16),
    ((50, 1000), -1, jnp.bfloat16),
    ((50, 21), -1, jnp.float16),
    ((50, 150), -1, jnp.bfloat16),
    ((50, 150), -1, jnp.float32),
    ((5, 12, 16), 1, jnp.bfloat16),
    ((2, 96, 27, 27), 1, jnp.bfloat16),
    ((5, 256, 16), 1, jnp.bfloat16),
    ((5, 257, 16), 1, jnp.bfloat16),
    ((50, 16), -1, jnp.float64),
]


@pytest.mark.parametrize("shape,axis,dtype", FIT_CASES, ids=str)
@pytest.mark.parametrize("name", ["lrn", "softmax"])
def test_kernels_where_the_platform_takes_the_line(name, shape, axis, dtype):
    """The compiled forward and backward call the platform's handlers where it
    takes the line (the CPU's every line; CUDA's, cuda_line_fits), the
    gradient alone runs no forward, and both are right either way."""
    from jaxnorm._channels import cuda_line_fits, cuda_position_tiles_fit, cuda_positions_fit

    platform = lowering_platform()
    if platform not in jaxnorm.kernel_platforms():
        pytest.skip("no kernels here")
    f, ref = _op(name, axis)
    x, dy = rand(14, shape, dtype, offset=0.5), rand(15, shape, dtype)
    grad = jax.jit(lambda x, dy: jax.vjp(f, x)[1](dy)[0]).lower(x, dy).compile()
    hlo = {"fwd": jax.jit(f).lower(x).compile().as_text(), "bwd": grad.as_text()}
    target = "local_response_norm" if name == "lrn" else "channel_softmax"
    c = shape[axis]
    view = jax.ShapeDtypeStruct((x.size // c // math.prod(shape[axis:][1:]), c,
                                 math.prod(shape[axis:][1:])), dtype)
    need = dict(min_vec=4) if name == "lrn" else dict(min_bytes=4)
    positions_fit = cuda_positions_fit if name == "lrn" else cuda_position_tiles_fit
    expected = platform == "cpu" or cuda_line_fits(view, **need) or positions_fit(view)
    for suffix in ("fwd", "bwd"):
        called = f'custom_call_target="jaxnorm_{target}_{suffix}"' in hlo[suffix]
        assert called == expected, suffix
    # y dead under grad: the backward recomputes what it needs from x
    assert f'custom_call_target="jaxnorm_{target}_fwd"' not in hlo["bwd"]
    _, (want_dx,) = value_and_vjp(ref, (as64(x),), as64(dy))
    assert_close(grad(x, dy), want_dx, dtype, scale=float(np.abs(want_dx).max()))


def test_cuda_line_fits():
    from jaxnorm._channels import cuda_line_fits

    def fits(c, dtype, b=1, min_vec=1):
        return cuda_line_fits(jax.ShapeDtypeStruct((7, c, b), dtype), min_vec=min_vec)

    assert fits(96, jnp.bfloat16) and fits(768, jnp.bfloat16) and fits(384, jnp.float32)
    assert not fits(776, jnp.bfloat16) and not fits(388, jnp.float32)
    assert fits(21, jnp.float16) and fits(95, jnp.float16) and not fits(97, jnp.float16)
    assert not fits(96, jnp.bfloat16, b=2) and not fits(96, jnp.float64)
    assert fits(12, jnp.bfloat16, min_vec=4) and not fits(6, jnp.bfloat16, min_vec=4)
    assert fits(760, jnp.bfloat16, min_vec=4) and not fits(1000, jnp.bfloat16, min_vec=4)
    assert not cuda_line_fits(jax.ShapeDtypeStruct((7, 21, 1), jnp.bfloat16), min_bytes=4)
    assert cuda_line_fits(jax.ShapeDtypeStruct((7, 150, 1), jnp.bfloat16), min_bytes=4)
    assert cuda_line_fits(jax.ShapeDtypeStruct((7, 21, 1), jnp.float32), min_bytes=4)


def test_cuda_positions_fit():
    from jaxnorm._channels import cuda_positions_fit

    def fits(b, dtype):
        return cuda_positions_fit(jax.ShapeDtypeStruct((7, 96, b), dtype))

    assert fits(3025, jnp.bfloat16) and fits(2, jnp.float32) and fits(5, jnp.float16)
    assert not fits(1, jnp.bfloat16) and not fits(3025, jnp.float64)
    # lines of 2^31 elements or more (C * B) exceed the kernel's 32-bit offsets
    assert cuda_positions_fit(jax.ShapeDtypeStruct((1, 2, 2**30 - 1), jnp.bfloat16))
    assert not cuda_positions_fit(jax.ShapeDtypeStruct((1, 2, 2**30), jnp.bfloat16))


def test_cuda_position_tiles_fit():
    from jaxnorm._channels import cuda_position_tiles_fit

    def fits(c, b, dtype=jnp.bfloat16):
        return cuda_position_tiles_fit(jax.ShapeDtypeStruct((7, c, b), dtype))

    assert fits(150, 4096) and fits(256, 3) and fits(3, 2, jnp.float32)
    assert not fits(257, 4096) and not fits(150, 1) and not fits(150, 4096, jnp.float64)


def test_softmax_of_minus_infinity_is_zero():
    """A -inf channel gets probability 0 and leaves its position's others
    finite, wherever it is on the line, and half a line of -inf too."""
    x = np.array(rand(12, (4, 200), jnp.float32))
    x[0, 0] = x[1, 37] = x[2, 199] = -np.inf
    x[3, :100] = -np.inf
    y = np.asarray(jaxnorm.channel_softmax(jnp.asarray(x), channel_axis=-1))
    assert np.isfinite(y).all()
    assert y[0, 0] == y[1, 37] == y[2, 199] == 0 and (y[3, :100] == 0).all()
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-5)


def test_softmax_of_large_values_does_not_overflow():
    x = jnp.asarray([[1000.0, 1001.0, 999.0]], jnp.float32)
    y = jaxnorm.channel_softmax(x, channel_axis=-1)
    assert_close(y, softmax_np(x, -1), jnp.float32)


def test_softmax_gradients():
    x = rand(7, (2, 5, 3, 3), jnp.float64)
    f = functools.partial(jaxnorm.channel_softmax, channel_axis=1)
    check_grads(f, (x,), order=1, modes=["rev"])
    dy = rand(8, x.shape, jnp.float64)
    got = jax.vjp(f, x)[1](dy)[0]
    want = jax.vjp(lambda x: jax.nn.softmax(x, axis=1), x)[1](dy)[0]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,axis", [((5, 40), -1), ((3, 300), -1), ((3, 6, 4), 1)],
                         ids=str)
@pytest.mark.parametrize("op", ["lrn", "softmax"])
def test_nan_confined_to_its_position(op, shape, axis):
    f, _ = _op(op, axis)
    bad = np.array(rand(13, shape, jnp.float32))
    where = tuple(min(1, d - 1) for d in shape)
    bad[where] = np.nan
    y = np.asarray(jax.jit(f)(jnp.asarray(bad)))
    hit = np.zeros(y.shape, bool)
    position = list(where)
    position[axis] = slice(None)
    hit[tuple(position)] = True
    assert np.isfinite(y[~hit]).all()
    assert np.isnan(y[where])


@pytest.mark.parametrize("op", ["lrn", "softmax"])
def test_vmap_and_nan_confinement(op):
    f = (functools.partial(jaxnorm.local_response_norm, size=3, channel_axis=-1) if op == "lrn"
         else functools.partial(jaxnorm.channel_softmax, channel_axis=-1))
    x = rand(9, (3, 4, 6), jnp.float32)
    np.testing.assert_allclose(jax.vmap(f)(x), f(x), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(f, in_axes=2, out_axes=2)(x.reshape(3, 6, 4)),
                               jnp.stack([f(x.reshape(3, 6, 4)[:, :, i]) for i in range(4)], 2),
                               rtol=1e-6)
    bad = np.array(x)
    bad[1, 2, 0] = np.nan  # one position's channels only
    y = np.asarray(f(jnp.asarray(bad)))
    hit = np.zeros(y.shape, bool)
    hit[1, 2] = True
    assert np.isfinite(y[~hit]).all()


@pytest.mark.parametrize("op", ["lrn", "softmax"])
def test_empty_and_bad_input(op):
    def f(x, **kw):
        if op == "lrn":
            return jaxnorm.local_response_norm(x, 3, **kw)
        return jaxnorm.channel_softmax(x, **kw)

    assert f(jnp.zeros((0, 4)), channel_axis=-1).shape == (0, 4)
    with pytest.raises(ValueError, match="channel_axis 2 is out of range"):
        f(jnp.zeros((2, 4)), channel_axis=2)
    with pytest.raises(TypeError, match="x must have dtype"):
        f(jnp.zeros((2, 4), jnp.int32), channel_axis=1)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument"):
        f(jnp.zeros((2, 4)))
    if op == "lrn":
        with pytest.raises(ValueError, match="size must be an int >= 1"):
            jaxnorm.local_response_norm(jnp.zeros((2, 4)), 0, channel_axis=1)
        with pytest.raises(ValueError, match="beta must be finite"):
            jaxnorm.local_response_norm(jnp.zeros((2, 4)), 2, beta=float("nan"), channel_axis=1)
