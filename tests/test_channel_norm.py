"""group_norm, instance_norm and batch_norm against float64 references, on the
default device (the CUDA kernels on a GPU where built, the CPU kernels
elsewhere)."""

import functools
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from reference import TOLERANCE, as64, assert_close, lowering_platform, rand, value_and_vjp

import jaxnorm

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]
dtype_id = functools.partial(lambda d: jnp.dtype(d).name)


def _channels_last(x, axis):
    return np.moveaxis(np.asarray(x, np.float64), axis, -1)


def group_norm_np(x, groups, scale, bias, eps, axis=-1, act=None):
    """Float64 GroupNorm: x (N, ..., C, ...) with the channels on `axis`."""
    xl = _channels_last(x, axis)
    n, c = xl.shape[0], xl.shape[-1]
    xg = xl.reshape(n, -1, groups, c // groups)
    mean = xg.mean(axis=(1, 3), keepdims=True)
    var = ((xg - mean) ** 2).mean(axis=(1, 3), keepdims=True)
    y = ((xg - mean) / np.sqrt(var + eps)).reshape(xl.shape)
    y = _affine_np(y, scale, bias, act)
    return np.moveaxis(y, -1, axis)


def _affine_np(y, scale, bias, act):
    if scale is not None:
        y = y * np.asarray(scale, np.float64)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    return {None: y, "silu": y / (1 + np.exp(-y)), "relu": np.maximum(y, 0)}[act]


def batch_stats_np(x, axis=-1):
    xl = _channels_last(x, axis).reshape(-1, x.shape[axis])
    return xl.mean(axis=0), xl.var(axis=0)


def batch_norm_np(x, scale, bias, mean, var, eps, axis=-1, act=None):
    xl = _channels_last(x, axis)
    y = _affine_np((xl - mean) / np.sqrt(np.asarray(var, np.float64) + eps), scale, bias, act)
    return np.moveaxis(y, -1, axis)


def params(seed, c, dtype):
    return rand(seed, (c,), dtype, offset=1.0), rand(seed + 1, (c,), dtype)


def gn(x, groups, scale, bias, **kw):
    return jax.jit(functools.partial(jaxnorm.group_norm, num_groups=groups, **kw))(
        x, scale=scale, bias=bias)


# ------------------------------------------------------------- values

GN_SHAPES = [  # (shape, channel_axis, groups)
    ((2, 5, 7, 32), -1, 8),       # NHWC, 4 channels a group
    ((2, 32, 5, 7), 1, 8),        # NCHW
    ((3, 9, 12), -1, 4),          # 1-D spatial, 3 channels a group
    ((2, 3, 4, 5, 6), -1, 2),     # 3-D spatial
    ((2, 6, 3, 4, 5), 1, 3),      # NCDHW
    ((4, 12), -1, 3),             # no spatial dims
    ((1, 1, 1, 1), -1, 1),        # one element a group
    ((2, 4, 6, 10), 2, 3),        # channels in the middle (N, H, C, W)
    ((1, 127, 33, 20), -1, 4),    # odd spatial sizes, 5 channels a group
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,axis,groups", GN_SHAPES, ids=str)
def test_group_norm_values(shape, axis, groups, dtype):
    x = rand(len(shape), shape, dtype, offset=0.5)
    scale, bias = params(7, shape[axis], dtype)
    y = gn(x, groups, scale, bias, channel_axis=axis)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, group_norm_np(x, groups, scale, bias, 1e-5, axis), dtype)


@pytest.mark.parametrize("act", ["silu", "relu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("axis", [-1, 1])
def test_group_norm_activation(dtype, axis, act):
    shape = (2, 16, 9, 24) if axis == 1 else (2, 9, 24, 16)
    x = rand(3, shape, dtype)
    scale, bias = params(4, shape[axis], dtype)
    y = gn(x, 4, scale, bias, channel_axis=axis, activation=act)
    assert_close(y, group_norm_np(x, 4, scale, bias, 1e-5, axis, act=act), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape,axis", [((8, 5, 5, 16), -1), ((8, 16, 5, 5), 1)], ids=str)
def test_batch_norm_relu(shape, axis, dtype):
    c = shape[axis]
    x = rand(5, shape, dtype, offset=1.0)
    scale, bias = params(6, c, jnp.float32)
    rm, rv = jnp.zeros(c), jnp.ones(c)
    y = bn_train(x, scale, bias, rm, rv, channel_axis=axis, activation="relu")[0]
    mean, var = batch_stats_np(x, axis)
    assert_close(y, batch_norm_np(x, scale, bias, mean, var, 1e-5, axis, act="relu"), dtype)
    y = jaxnorm.batch_norm(x, scale, bias, rm, rv, training=False, channel_axis=axis,
                           activation="relu")[0]
    assert_close(y, batch_norm_np(x, scale, bias, rm, rv, 1e-5, axis, act="relu"), dtype)


def test_a_group_larger_than_a_block():
    # 64 channels in 32 groups over 256 x 256 positions: 131072 elements a
    # group, more than one GPU block holds.
    x = rand(5, (1, 256, 256, 64), jnp.bfloat16, offset=1.0)
    scale, bias = params(6, 64, jnp.float32)
    y = gn(x, 32, scale, bias)
    assert_close(y, group_norm_np(x, 32, scale, bias, 1e-5), jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_group_norm_without_params_and_other_dtypes(dtype):
    x = rand(8, (3, 6, 6, 20), dtype)
    y = gn(x, 5, None, None)
    assert_close(y, group_norm_np(x, 5, None, None, 1e-5), dtype)
    # f32 parameters with 16-bit x, an f32 output
    scale, bias = params(9, 20, jnp.float32)
    y = jax.jit(lambda x: jaxnorm.group_norm(x, 5, scale, bias, dtype=jnp.float32))(x)
    assert y.dtype == jnp.float32
    assert_close(y, group_norm_np(x, 5, scale, bias, 1e-5), dtype)


@pytest.mark.parametrize("axis", [-1, 1])
def test_instance_norm(axis):
    shape = (3, 10, 7, 6) if axis == -1 else (3, 6, 10, 7)
    x = rand(11, shape, jnp.float32, offset=2.0)
    scale, bias = params(12, 6, jnp.float32)
    y = jax.jit(functools.partial(jaxnorm.instance_norm, channel_axis=axis))(x, scale, bias)
    assert_close(y, group_norm_np(x, 6, scale, bias, 1e-5, axis), jnp.float32)


def test_group_norm_large_mean_is_stable():
    # float32 x near 1e3: a one-pass E[x^2] - E[x]^2 would be off by O(1).
    x = rand(13, (2, 64, 64, 8), jnp.float32, offset=1e3)
    y = gn(x, 2, None, None)
    assert_close(y, group_norm_np(x, 2, None, None, 1e-5), jnp.float32, scale=20)


@pytest.mark.parametrize("shape,groups,dtype,act,offset", [
    ((4, 32, 32, 1280), 32, jnp.bfloat16, None, 0.5),   # 40 channels a group
    ((4, 31, 33, 320), 32, jnp.float16, "silu", 0.5),   # 10 a group; 1023 rows
    ((8, 1, 5, 1280), 32, jnp.float32, None, 0.5),      # fewer rows than blocks
    ((6, 16, 16, 256), 256, jnp.bfloat16, "relu", 0.5),  # one channel a group
    ((4, 32, 32, 640), 32, jnp.float32, None, 1e3),     # a large mean
    # several clusters a sample, meeting through global memory
    ((8, 32, 32, 1280), 32, jnp.bfloat16, None, 0.5),
    ((2, 64, 64, 320), 32, jnp.float16, "silu", 0.5),
    ((2, 33, 31, 640), 20, jnp.bfloat16, None, 0.5),    # rows not a multiple of the blocks
    ((3, 128, 128, 128), 32, jnp.float32, None, 1e3),   # a large mean
    # one sample spread over the SMs
    ((1, 32, 32, 1280), 32, jnp.bfloat16, None, 0.5),
    ((1, 37, 29, 256), 256, jnp.float16, "silu", 0.5),  # one channel a group
    ((1, 64, 64, 640), 20, jnp.float32, None, 1e3),     # a large mean
], ids=str)
def test_group_norm_samples_in_clusters(shape, groups, dtype, act, offset):
    """Batches whose samples the CUDA forward takes in one cluster of blocks
    each, or in several (channel_norm_cluster.cuh, on an H100 or H200): y
    and, through the gradients, the statistics it saves, against float64; the
    same bits twice."""
    x = rand(63, shape, dtype, offset=offset)
    scale, bias = params(64, shape[-1], jnp.float32)
    y = gn(x, groups, scale, bias, activation=act)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(gn(x, groups, scale, bias,
                                                               activation=act)))
    tol = 20 if offset > 1 else 1
    assert_close(y, group_norm_np(x, groups, scale, bias, 1e-5, act=act), dtype, scale=tol)
    if dtype == jnp.float32:
        dy = rand(65, shape, dtype)
        def f(x, s, b):
            return jaxnorm.group_norm(x, groups, s, b, activation=act)

        def with_y(x, s, b):  # y alive: the backward takes the forward's statistics
            y, pull = jax.vjp(f, x, s, b)
            return y, *pull(dy)

        got = jax.jit(with_y)(x, scale, bias)[1:]
        _, want = value_and_vjp(lambda x, s, b: _gn_f64(x, s, b, groups, -1, act),
                                (as64(x), as64(scale), as64(bias)), as64(dy))
        rows = x.size // shape[-1]
        for g, w, s in zip(got, want, (tol, tol * np.sqrt(rows), np.sqrt(rows))):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-4, atol=1e-4 * s)


_H100_OR_H200 = pytest.mark.skipif(
    not any(k in jax.devices()[0].device_kind for k in ("H100", "H200")),
    reason="the cluster plan's rule is drawn from an H200 (notes v80, v87)")


@_H100_OR_H200
@pytest.mark.parametrize("shape,groups,dtype,act,offset", [
    ((16, 64, 64, 320), 32, jnp.bfloat16, None, 0.5),
    ((32, 32, 32, 640), 32, jnp.float16, "silu", 0.5),
    ((64, 31, 33, 320), 20, jnp.bfloat16, "relu", 0.5),  # uneven rows
    ((16, 48, 50, 320), 32, jnp.float32, None, 1e3),     # a large mean
    ((1, 512, 512, 64), 32, jnp.bfloat16, None, 0.5),    # one sample, 15 clusters
    ((2, 256, 256, 128), 32, jnp.float32, None, 1e3),
], ids=str)
def test_group_norm_streamed_rows(shape, groups, dtype, act, offset):
    """Batches larger than the SMs' shared memory: the cluster forward holds
    part of each block's rows and streams the rest (read again for y)."""
    test_group_norm_samples_in_clusters(shape, groups, dtype, act, offset)


def _gpu_kernel_names(f, *args, logdir):
    """Names of the kernels one call of f launches on the GPU (a profiler trace)."""
    jax.block_until_ready(f(*args))
    jax.profiler.start_trace(str(logdir))
    jax.block_until_ready(f(*args))
    jax.profiler.stop_trace()
    (path,) = glob.glob(os.path.join(str(logdir), "**", "*.xplane.pb"), recursive=True)
    planes = jax.profiler.ProfileData.from_file(path).planes
    return {event.name for plane in planes if plane.name.startswith("/device:GPU")
            for line in plane.lines for event in line.events}


@_H100_OR_H200
def test_batches_that_fit_take_the_cluster_forward(tmp_path):
    """Batches of test_group_norm_samples_in_clusters run as one launch of
    the cluster kernel (one cluster a sample at 4, several at 1, 2 and 8),
    as do those that stream part of their rows (16x64x64x320, 1x512x512x64);
    one sample of 1024 groups keeps the passes."""
    def names(shape, groups, sub):
        x = rand(66, shape, jnp.bfloat16)
        return _gpu_kernel_names(jax.jit(lambda x: jaxnorm.group_norm(x, groups)), x,
                                 logdir=tmp_path / sub)

    shapes = [(n, 32, 32, 1280) for n in (1, 2, 4, 8)] + [(16, 64, 64, 320), (1, 512, 512, 64)]
    for i, shape in enumerate(shapes):
        got = names(shape, 32, str(i))
        assert any("group_norm_cluster_fwd" in k for k in got), got
        assert not any("tile_stats" in k for k in got), got
    got = names((1, 16, 16, 1024), 1024, "instance")
    assert any("tile_stats" in k for k in got), got
    assert not any("group_norm_cluster_fwd" in k for k in got), got


# The backward in clusters (channel_norm_cluster_bwd.cuh, on an H100 or
# H200; no activation, 64 channels or more): one cluster a sample, several
# meeting through global memory, rows streamed, one sample spread, blocks
# without rows.
CLUSTER_BWD_CASES = [
    ((4, 32, 32, 1280), 32, jnp.bfloat16, 0.5),    # 2 clusters a sample
    ((8, 32, 32, 1280), 32, jnp.bfloat16, 0.5),    # rows streamed
    ((4, 31, 33, 320), 32, jnp.float16, 0.5),      # 10 channels a group
    ((6, 16, 16, 256), 256, jnp.bfloat16, 0.5),    # one channel a group
    ((2, 33, 31, 640), 20, jnp.float32, 1e3),      # a large mean, uneven rows
    ((1, 32, 32, 1280), 32, jnp.bfloat16, 0.5),    # one sample spread
    ((8, 1, 5, 1280), 32, jnp.float32, 0.5),       # fewer rows than blocks
    ((16, 64, 64, 320), 32, jnp.bfloat16, 0.5),    # streamed, 8 blocks a cluster
    ((4, 128, 128, 128), 32, jnp.bfloat16, 0.5),   # 4 channels a group, streamed
    ((1, 512, 512, 64), 32, jnp.bfloat16, 0.5),    # one sample spread, streamed
]


def _gn_grads(x, scale, bias, dy, groups, act, y_alive):
    """jaxnorm's (dx, dscale, dbias): with y alive the backward takes the
    forward's statistics, with y dead (jax.grad alone) it may compute its own."""
    def f(x, s, b):
        return jaxnorm.group_norm(x, groups, s, b, activation=act)

    def with_y(x, s, b):
        y, pull = jax.vjp(f, x, s, b)
        return (*pull(dy), y)

    def loss(x, s, b):
        return jnp.sum(f(x, s, b).astype(jnp.float32) * dy.astype(jnp.float32))

    if y_alive:
        return jax.jit(with_y)(x, scale, bias)[:3]
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, bias)


@pytest.mark.parametrize("y_alive", [True, False], ids=["y-alive", "y-dead"])
@pytest.mark.parametrize("shape,groups,dtype,offset", CLUSTER_BWD_CASES, ids=str)
def test_group_norm_backward_in_clusters(shape, groups, dtype, offset, y_alive):
    """dx, dscale and dbias against float64; the same bits twice."""
    if jax.default_backend() != "gpu" and np.prod(shape) > 2**22:
        pytest.skip("sized for the GPU's cluster plans")
    x = rand(67, shape, dtype, offset=offset)
    scale, bias = params(68, shape[-1], jnp.float32)
    dy = rand(69, shape, dtype)
    got = _gn_grads(x, scale, bias, dy, groups, None, y_alive)
    again = _gn_grads(x, scale, bias, dy, groups, None, y_alive)
    for g, h in zip(got, again):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))
    _, want = value_and_vjp(lambda x, s, b: _gn_f64(x, s, b, groups, -1, None),
                            (as64(x), as64(scale), as64(bias)), as64(dy))
    rows = x.size // shape[-1]
    tol = 20 if offset > 1 else 1
    assert_close(got[0], want[0], dtype, scale=tol)
    for g, w in zip(got[1:], want[1:]):  # float32, sums over every row
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-4,
                                   atol=1e-4 * tol * np.sqrt(rows))


@_H100_OR_H200
def test_batches_that_fit_take_the_cluster_backward(tmp_path):
    """The backward of CLUSTER_BWD_CASES' bf16 batches runs as one launch of
    the cluster kernel, dscale and dbias included (no param_grads), with y
    alive or dead; with SiLU, or with 32 channels, the passes."""
    def names(shape, groups, act, y_alive, sub):
        x, dy = rand(70, shape, jnp.bfloat16), rand(71, shape, jnp.bfloat16)
        scale, bias = params(72, shape[-1], jnp.float32)
        grads = functools.partial(_gn_grads, groups=groups, act=act, y_alive=y_alive)
        return _gpu_kernel_names(grads, x, scale, bias, dy, logdir=tmp_path / sub)

    def clusters(got):
        return any("group_norm_cluster_bwd" in k for k in got)

    def passes(got):
        return any("apply_dx" in k for k in got) and any("tile_" in k for k in got)

    for i, (shape, groups, dtype, _) in enumerate(CLUSTER_BWD_CASES):
        for y_alive in (True, False):
            if dtype == jnp.bfloat16:
                got = names(shape, groups, None, y_alive, f"{i}{y_alive}")
                assert clusters(got) and not passes(got), (shape, y_alive, got)
                assert not any("param_grads" in k for k in got), (shape, y_alive, got)
    for shape, act in [((8, 32, 32, 1280), "silu"), ((16, 64, 64, 32), None)]:
        got = names(shape, 32, act, True, f"{shape}{act}")
        assert passes(got) and not clusters(got), (shape, act, got)


def test_nan_stays_in_its_group():
    x = np.array(rand(14, (3, 4, 4, 8), jnp.float32))
    x[1, 2, 3, 5] = np.nan  # sample 1, group 2 of 4 (channels 4-5)
    y = np.asarray(gn(jnp.asarray(x), 4, None, None))
    bad = np.zeros(y.shape, bool)
    bad[1, :, :, 4:6] = True
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()


@pytest.mark.parametrize("shape", [(0, 4, 8), (2, 0, 8)], ids=str)
def test_group_norm_of_empty_arrays(shape):
    x = jnp.zeros(shape, jnp.float32)
    scale, bias = params(15, 8, jnp.float32)
    y = gn(x, 2, scale, bias)
    assert y.shape == shape
    grads = jax.grad(lambda x, s, b: jnp.sum(jaxnorm.group_norm(x, 2, s, b)),
                     argnums=(0, 1, 2))(x, scale, bias)
    assert grads[0].shape == shape
    np.testing.assert_array_equal(grads[1], 0)


# ---------------------------------------------------------- gradients


def _act_f64(y, act):
    return {None: y, "silu": y * jax.nn.sigmoid(y), "relu": jax.nn.relu(y)}[act]


def _gn_f64(x, scale, bias, groups, axis, act):
    xl = jnp.moveaxis(x, axis, -1)
    n, c = xl.shape[0], xl.shape[-1]
    xg = xl.reshape(n, -1, groups, c // groups)
    mean = xg.mean(axis=(1, 3), keepdims=True)
    var = ((xg - mean) ** 2).mean(axis=(1, 3), keepdims=True)
    y = ((xg - mean) / jnp.sqrt(var + 1e-5)).reshape(xl.shape) * scale + bias
    return jnp.moveaxis(_act_f64(y, act), -1, axis)


@pytest.mark.parametrize("act", [None, "silu", "relu"])
@pytest.mark.parametrize("shape,axis,groups", [((2, 5, 6, 8), -1, 4), ((2, 6, 5, 3), 1, 3)],
                         ids=str)
def test_group_norm_gradients_float64(shape, axis, groups, act):
    x = rand(16, shape, jnp.float64, offset=0.3)
    scale, bias = params(17, shape[axis], jnp.float64)

    def f(x, s, b):
        return jaxnorm.group_norm(x, groups, s, b, channel_axis=axis, activation=act)

    if act != "relu":  # finite differences across ReLU's kink would be wrong
        check_grads(f, (x, scale, bias), order=1, modes=["rev"])
    dy = rand(18, shape, jnp.float64)
    got = jax.vjp(f, x, scale, bias)[1](dy)
    _, want = value_and_vjp(lambda *a: _gn_f64(*a, groups, axis, act), (x, scale, bias), dy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=dtype_id)
def test_group_norm_gradients_against_float64(dtype):
    shape, groups = (2, 7, 5, 12), 3
    x = rand(19, shape, dtype)
    scale, bias = params(20, 12, jnp.float32)
    dy = rand(21, shape, dtype)

    def f(x, s, b):
        return jaxnorm.group_norm(x, groups, s, b, activation="silu")

    got = jax.jit(lambda *a: jax.vjp(f, *a[:3])[1](a[3]))(x, scale, bias, dy)
    _, want = value_and_vjp(lambda *a: _gn_f64(*a, groups, -1, "silu"),
                            (as64(x), as64(scale), as64(bias)), as64(dy))
    rtol, atol = TOLERANCE[np.dtype(dtype)]
    for g, w, scale_ in zip(got, want, (1, 20, 20)):  # parameter grads sum many rows
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rtol, atol=atol * scale_)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_silu_far_from_zero(dtype):
    """SiLU (and its gradient) where exp(-z) under- and overflows float32:
    z from about -300 to 300, so that the GPU's fast sigmoid (common/
    activation.h) meets 1 + exp(-z) past 2^126 and exp(-z) = inf."""
    shape, groups = (2, 9, 7, 8), 2
    x = rand(61, shape, dtype)
    scale = jnp.asarray(np.linspace(-120.0, 120.0, 8), jnp.float32)
    bias = jnp.asarray(np.linspace(-60.0, 60.0, 8), jnp.float32)
    dy = rand(62, shape, dtype)

    def f(x, s, b):
        return jaxnorm.group_norm(x, groups, s, b, activation="silu")

    y, pullback = jax.vjp(jax.jit(f), x, scale, bias)
    got = pullback(dy)
    f64 = (as64(x), as64(scale), as64(bias))
    want_y, want = value_and_vjp(lambda *a: _gn_f64(*a, groups, -1, "silu"), f64, as64(dy))
    z = np.asarray(jax.jit(_gn_f64, static_argnums=(3, 4, 5))(*f64, groups, -1, None))
    assert z.min() < -100 and z.max() > 100  # exp(-z) past float32's range both ways
    assert np.isfinite(np.asarray(y, np.float64)).all()
    assert_close(y, want_y, dtype, scale=float(np.abs(want_y).max()))
    rtol, atol = TOLERANCE[np.dtype(dtype)]
    for g, w in zip(got, want):
        g = np.asarray(g, np.float64)
        assert np.isfinite(g).all()
        top = float(np.abs(np.asarray(w)).max())
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * top)


def test_gradients_of_a_float32_output_of_bf16_x():
    """The cotangent arrives in float32 (y's dtype), the gradient in bf16."""
    x = rand(53, (4, 6, 16), jnp.bfloat16)
    scale, bias = params(54, 16, jnp.float32)
    dy = rand(55, x.shape, jnp.float32)

    def f(x, s, b):
        return jaxnorm.group_norm(x, 4, s, b, dtype=jnp.float32)

    got = jax.jit(lambda *a: jax.vjp(f, *a[:3])[1](a[3]))(x, scale, bias, dy)
    assert [g.dtype for g in got] == [jnp.bfloat16, jnp.float32, jnp.float32]
    _, want = value_and_vjp(lambda *a: _gn_f64(*a, 4, -1, None),
                            (as64(x), as64(scale), as64(bias)), as64(dy))
    for g, w, tol in zip(got, want, (3e-2, 1e-4, 1e-4)):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol, atol=tol)


def test_group_norm_gradients_float32():
    x = rand(22, (2, 4, 3, 8), jnp.float32)
    scale, bias = params(23, 8, jnp.float32)
    check_grads(lambda x, s, b: jaxnorm.group_norm(x, 2, s, b), (x, scale, bias), order=1,
                modes=["rev"], atol=5e-2, rtol=5e-2)


# ---------------------------------------------------------------- vmap


def test_group_norm_vmap():
    x = rand(24, (3, 2, 4, 5, 8), jnp.float32)
    scale, bias = params(25, 8, jnp.float32)
    f = functools.partial(jaxnorm.group_norm, num_groups=4, scale=scale, bias=bias)
    got = jax.jit(jax.vmap(f))(x)
    want = jnp.stack([f(x[i]) for i in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # vmap of the gradient, and over an inner axis
    g = jax.vmap(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(x)
    want = jnp.stack([jax.grad(lambda x: jnp.sum(f(x) ** 2))(x[i]) for i in range(3)])
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
    got = jax.vmap(f, in_axes=2, out_axes=2)(x.reshape(2, 3, 4, 5, 8))
    want = jnp.stack([f(x.reshape(2, 3, 4, 5, 8)[:, :, i]) for i in range(4)], axis=2)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_batch_norm_vmap_keeps_statistics_apart():
    # Under vmap each mapped instance is a batch of its own.
    x = rand(26, (3, 16, 6), jnp.float32, offset=1.0)
    rm, rv = jnp.zeros(6), jnp.ones(6)

    def f(x):
        return jaxnorm.batch_norm(x, None, None, rm, rv, training=True)

    y, m, v = jax.jit(jax.vmap(f))(x)
    for i in range(3):
        yi, mi, vi = f(x[i])
        np.testing.assert_allclose(y[i], yi, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(m[i], mi, rtol=1e-6, atol=1e-7)
    g = jax.vmap(jax.grad(lambda x: jnp.sum(f(x)[0] ** 3)))(x)
    want = jax.grad(lambda x: jnp.sum(f(x)[0] ** 3))(x[1])
    np.testing.assert_allclose(g[1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_batch_norm_vmap_by_mode(training, activation):
    """vmap over x, and over x and the running statistics, in training and
    evaluation, with and without an activation fused (the kernels' y and dx
    or XLA's): each mapped instance as a call of its own, gradients too."""
    x = rand(27, (3, 16, 5, 6), jnp.float32, offset=0.5)
    scale, bias = params(28, 6, jnp.float32)
    rms = rand(29, (3, 6), jnp.float32)
    rvs = jnp.abs(rand(30, (3, 6), jnp.float32)) + 0.5

    def f(x, rm, rv):
        return jaxnorm.batch_norm(x, scale, bias, rm, rv, training=training,
                                  activation=activation)[0]

    def loss(x, rm, rv):
        return jnp.sum(jnp.sin(f(x, rm, rv)))

    for in_axes in ((0, None, None), (0, 0, 0)):
        rm, rv = (rms[1], rvs[1]) if in_axes[1] is None else (rms, rvs)
        y = jax.jit(jax.vmap(f, in_axes=in_axes))(x, rm, rv)
        g = jax.jit(jax.vmap(jax.grad(loss), in_axes=in_axes))(x, rm, rv)
        for i in range(3):
            rmi, rvi = (rms[1], rvs[1]) if in_axes[1] is None else (rms[i], rvs[i])
            np.testing.assert_allclose(y[i], f(x[i], rmi, rvi), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(g[i], jax.grad(loss)(x[i], rmi, rvi), rtol=1e-4,
                                       atol=1e-5)


# ------------------------------------------------------------ BatchNorm

BN_SHAPES = [((16, 5, 5, 12), -1), ((8, 12, 3, 4), 1), ((33, 7), -1), ((4, 3, 2, 2, 5), 1)]


def bn_train(x, scale, bias, rm, rv, **kw):
    return jax.jit(functools.partial(jaxnorm.batch_norm, training=True, **kw))(
        x, scale, bias, rm, rv)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,axis", BN_SHAPES, ids=str)
def test_batch_norm_training(shape, axis, dtype):
    c = shape[axis]
    x = rand(27, shape, dtype, offset=2.0)
    scale, bias = params(28, c, jnp.float32)
    rm, rv = rand(29, (c,), jnp.float32), jnp.abs(rand(30, (c,), jnp.float32)) + 0.5
    y, new_rm, new_rv = bn_train(x, scale, bias, rm, rv, channel_axis=axis, momentum=0.9)
    mean, var = batch_stats_np(x, axis)
    assert y.dtype == x.dtype and new_rm.dtype == new_rv.dtype == jnp.float32
    assert_close(y, batch_norm_np(x, scale, bias, mean, var, 1e-5, axis), dtype)
    # Flax's update: momentum * running + (1 - momentum) * batch (biased)
    np.testing.assert_allclose(new_rm, 0.9 * np.asarray(rm) + 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_rv, 0.9 * np.asarray(rv) + 0.1 * var, rtol=1e-5, atol=1e-6)


def test_batch_norm_pytorch_running_variance():
    x = rand(31, (6, 4, 4, 3), jnp.float32)
    rm, rv = jnp.zeros(3), jnp.ones(3)
    _, new_rm, new_rv = bn_train(x, None, None, rm, rv, momentum=0.9, unbiased_running_var=True)
    n = 6 * 4 * 4
    _, var = batch_stats_np(x)
    np.testing.assert_allclose(new_rv, 0.9 + 0.1 * var * n / (n - 1), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,axis", BN_SHAPES[:2], ids=str)
def test_batch_norm_evaluation(shape, axis, dtype):
    c = shape[axis]
    x = rand(32, shape, dtype)
    scale, bias = params(33, c, jnp.float32)
    rm, rv = rand(34, (c,), jnp.float32), jnp.abs(rand(35, (c,), jnp.float32)) + 0.5
    y, same_rm, same_rv = jax.jit(functools.partial(
        jaxnorm.batch_norm, training=False, channel_axis=axis))(x, scale, bias, rm, rv)
    assert same_rm is not None
    np.testing.assert_array_equal(same_rm, rm)
    np.testing.assert_array_equal(same_rv, rv)
    assert_close(y, batch_norm_np(x, scale, bias, rm, rv, 1e-5, axis), dtype)


def test_batch_norm_large_mean_is_stable():
    x = rand(36, (256, 8, 8, 4), jnp.float32, offset=1e3)
    y, _, _ = bn_train(x, None, None, None, None)
    mean, var = batch_stats_np(x)
    assert_close(y, batch_norm_np(x, None, None, mean, var, 1e-5), jnp.float32, scale=20)


@pytest.mark.parametrize("axis", [-1, 1])
def test_batch_norm_with_a_mask(axis):
    """Statistics over the True positions only (Flax's mask): padded rows, and
    a mask that differs from channel to channel."""
    shape = (12, 5, 7) if axis == -1 else (12, 7, 5)
    x = rand(43, shape, jnp.float64, offset=3.0)
    scale, bias = params(44, 7, jnp.float64)
    rows = np.arange(12) % 4 != 3
    for mask in (rows.reshape(12, 1, 1),
                 np.asarray(rand(45, shape, jnp.float64)) > -0.5):
        y, rm, rv = jax.jit(functools.partial(
            jaxnorm.batch_norm, training=True, channel_axis=axis, momentum=0.5,
            unbiased_running_var=True))(x, scale, bias, jnp.zeros(7), jnp.ones(7),
                                        mask=jnp.asarray(mask))
        xl = np.moveaxis(np.asarray(x), axis, -1).reshape(-1, 7)
        keep = np.moveaxis(np.broadcast_to(mask, shape), axis, -1).reshape(-1, 7)
        mean = np.array([xl[keep[:, c], c].mean() for c in range(7)])
        var = np.array([xl[keep[:, c], c].var() for c in range(7)])
        n = keep.sum(axis=0)
        np.testing.assert_allclose(y, batch_norm_np(x, scale, bias, mean, var, 1e-5, axis),
                                   rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(rm, 0.5 * mean, rtol=1e-10)
        np.testing.assert_allclose(rv, 0.5 + 0.5 * var * n / (n - 1), rtol=1e-10)
    check_grads(lambda x, s, b: jaxnorm.batch_norm(
        x, s, b, None, None, training=True, channel_axis=axis, mask=jnp.asarray(mask))[0],
        (x, scale, bias), order=1, modes=["rev"])
    with pytest.raises(ValueError, match="does not broadcast"):
        jaxnorm.batch_norm(x, None, None, None, None, training=True, channel_axis=axis,
                           mask=jnp.ones((4,), bool))
    with pytest.raises(TypeError, match="mask must be boolean"):
        jaxnorm.batch_norm(x, None, None, None, None, training=True, channel_axis=axis,
                           mask=jnp.ones(shape))


def _bn_f64(x, scale, bias, axis, act, stats=None):
    xl = jnp.moveaxis(x, axis, -1)
    red = tuple(range(xl.ndim - 1))
    mean, var = (xl.mean(axis=red), xl.var(axis=red)) if stats is None else stats
    y = (xl - mean) / jnp.sqrt(var + 1e-5) * scale + bias
    return jnp.moveaxis(_act_f64(y, act), -1, axis)


@pytest.mark.parametrize("act", [None, "relu"])
def test_batch_norm_gradients_large_mean_are_stable(act):
    """float32 x near 1e3 with a spread near 1: the gradients (through the
    kernels' dx terms where XLA writes dx) against float64."""
    x = rand(38, (64, 8, 8, 4), jnp.float32, offset=1e3)
    scale, bias = params(39, 4, jnp.float32)
    dy = rand(40, x.shape, jnp.float32)
    rm, rv = jnp.zeros(4), jnp.ones(4)

    def f(x, s, b):
        return jaxnorm.batch_norm(x, s, b, rm, rv, training=True, activation=act)[0]

    got = jax.jit(lambda *a: jax.vjp(f, *a[:3])[1](a[3]))(x, scale, bias, dy)
    _, want = value_and_vjp(lambda *a: _bn_f64(*a, -1, act),
                            (as64(x), as64(scale), as64(bias)), as64(dy))
    for g, w in zip(got, want):
        top = float(np.abs(np.asarray(w)).max())
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-4, atol=1e-4 * top)


@pytest.mark.parametrize("act", [None, "silu", "relu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_batch_norm_evaluation_gradients(dtype, act):
    """Evaluation, channels-last (the kernels' y and dx where an activation is
    fused, XLA's without): the gradients of x, scale and bias against float64
    with the running statistics as constants."""
    shape = (16, 5, 7, 24)
    x = rand(42, shape, dtype, offset=0.5)
    scale, bias = params(43, 24, jnp.float32)
    rm, rv = rand(44, (24,), jnp.float32), jnp.abs(rand(45, (24,), jnp.float32)) + 0.5
    dy = rand(46, shape, dtype)

    def f(x, s, b):
        return jaxnorm.batch_norm(x, s, b, rm, rv, training=False, activation=act)[0]

    got = jax.jit(lambda *a: jax.vjp(f, *a[:3])[1](a[3]))(x, scale, bias, dy)
    _, want = value_and_vjp(lambda *a: _bn_f64(*a, -1, act, (as64(rm), as64(rv))),
                            (as64(x), as64(scale), as64(bias)), as64(dy))
    for g, w, like in zip(got, want, (x, scale, bias)):
        assert g.dtype == like.dtype
        assert_close(g, np.asarray(w), dtype, scale=float(np.abs(np.asarray(w)).max()))


@pytest.mark.parametrize("act", [None, "silu", "relu"])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_gradients_float64(training, act):
    shape, axis = (6, 3, 4, 5), 1
    x = rand(37, shape, jnp.float64, offset=0.5)
    scale, bias = params(38, 3, jnp.float64)
    rm, rv = rand(39, (3,), jnp.float64), jnp.abs(rand(40, (3,), jnp.float64)) + 0.5

    def f(x, s, b):
        return jaxnorm.batch_norm(x, s, b, rm, rv, training=training, channel_axis=axis,
                                  activation=act)[0]

    if act != "relu":  # finite differences across ReLU's kink would be wrong
        check_grads(f, (x, scale, bias), order=1, modes=["rev"])
    dy = rand(41, shape, jnp.float64)
    stats = None if training else (rm, rv)
    _, want = value_and_vjp(lambda *a: _bn_f64(*a, axis, act, stats), (x, scale, bias), dy)
    got = jax.vjp(f, x, scale, bias)[1](dy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op,shape,groups", [
    ("group", (4, 32, 32, 320), 32),   # 10 channels a group, two slabs a row
    ("group", (2, 16, 16, 1280), 32),  # 40 channels a group, five slabs
    ("group", (1, 128, 128, 64), 32),  # one sample: its rows in many tiles
    ("batch", (32, 28, 28, 64), 64),   # 25088 rows of one statistic each channel
    # rows that leave the last chunk of rows short, in more chunks than tiles
    # and not a multiple of them: 1001 rows in chunks of 16; 1517 of 10
    ("batch", (7, 13, 11, 64), 64),
    ("group", (3, 37, 41, 96), 32),
    # one channel a group with several samples: the merges' per-channel path,
    # the parameter gradients summed over the samples
    ("instance", (4, 32, 32, 64), 64),
    ("instance", (3, 37, 41, 96), 96),
    # one group of 2048 channels: the forward's merge keeps the channels in
    # shared memory (24 KB), the backward's own-statistics merge (y dead) in
    # global scratch (40 KB, over merge_smem_bytes' 32)
    ("group", (2, 6, 6, 2048), 1),
], ids=str)
def test_many_tiles_match_float64_and_repeat_bitwise(op, shape, groups):
    """Shapes that the CUDA kernels split into many tiles and slabs, merged
    in several steps: y and the gradients against float64, and the same bits
    from one run to the next (no atomics)."""
    x = rand(60, shape, jnp.float32, offset=3.0)
    scale, bias = params(61, shape[-1], jnp.float32)
    dy = rand(62, shape, jnp.float32)
    if op != "batch":
        def f(x, s, b):
            if op == "instance":  # groups == channels
                return jaxnorm.instance_norm(x, s, b)
            return jaxnorm.group_norm(x, groups, s, b)

        def f64(x, s, b):
            return _gn_f64(x, s, b, groups, -1, None)
    else:
        rm, rv = jnp.zeros(shape[-1]), jnp.ones(shape[-1])

        def f(x, s, b):
            return jaxnorm.batch_norm(x, s, b, rm, rv, training=True)[0]

        def f64(x, s, b):
            return _bn_f64(x, s, b, -1, None)

    run = jax.jit(lambda x, s, b, dy: (f(x, s, b), *jax.vjp(f, x, s, b)[1](dy)))
    got = run(x, scale, bias, dy)
    for g, again in zip(got, run(x, scale, bias, dy)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(again))
    want_y, want_grads = value_and_vjp(f64, (as64(x), as64(scale), as64(bias)), as64(dy))
    want = (want_y, *want_grads)
    rows = x.size // shape[-1]
    for g, w, scale_ in zip(got, want, (1, 1, np.sqrt(rows), np.sqrt(rows))):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-4, atol=1e-4 * scale_)
    # With y dead (jax.grad's forward) GroupNorm's backward computes the
    # statistics itself: another pass and merge.
    dead = jax.jit(lambda x, s, b, dy: jax.vjp(f, x, s, b)[1](dy))(x, scale, bias, dy)
    for g, w, scale_ in zip(dead, want[1:], (1, np.sqrt(rows), np.sqrt(rows))):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-4, atol=1e-4 * scale_)


def test_batch_norm_running_statistics_are_state():
    """No gradient reaches x through the updated running statistics, and in
    evaluation y is not differentiated with respect to them."""
    x = rand(42, (8, 3), jnp.float32)
    rm, rv = jnp.zeros(3), jnp.ones(3)

    def updated(x):
        _, new_rm, new_rv = jaxnorm.batch_norm(x, None, None, rm, rv, training=True)
        return jnp.sum(new_rm) + jnp.sum(new_rv)

    np.testing.assert_array_equal(jax.grad(updated)(x), 0)

    def evaluated(rm, rv):
        return jnp.sum(jaxnorm.batch_norm(x, None, None, rm, rv, training=False)[0] ** 2)

    for g in jax.grad(evaluated, argnums=(0, 1))(rm, rv):
        np.testing.assert_array_equal(g, 0)


# -------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x: jaxnorm.group_norm(x, 3), ValueError, "num_groups must be a positive int"),
        (lambda x: jaxnorm.group_norm(x, 0), ValueError, "num_groups"),
        (lambda x: jaxnorm.group_norm(x, 2, channel_axis=0), ValueError, "batch axis"),
        (lambda x: jaxnorm.group_norm(x, 2, channel_axis=4), ValueError, "out of range"),
        (lambda x: jaxnorm.group_norm(x, 2, jnp.ones(3)), ValueError,
         r"scale must have shape \(8,\)"),
        (lambda x: jaxnorm.group_norm(x.astype(jnp.int32), 2), TypeError, "x must have dtype"),
        (lambda x: jaxnorm.group_norm(x[0, 0, 0], 2), ValueError, "batch axis and a channel"),
        (lambda x: jaxnorm.group_norm(x, 2, activation="gelu"), ValueError,
         "activation must be None, 'silu' or 'relu', got 'gelu'"),
        (lambda x: jaxnorm.batch_norm(x, None, None, None, None, training=True,
                                      activation=jax.nn.relu), ValueError, "activation"),
        (lambda x: jaxnorm.group_norm(x, 2, epsilon=-1.0), ValueError, "epsilon"),
        (lambda x: jaxnorm.batch_norm(x, None, None, None, None, training=False), ValueError,
         "needs running_mean"),
        (lambda x: jaxnorm.batch_norm(x, None, None, jnp.zeros(8), None, training=True),
         ValueError, "together"),
        (lambda x: jaxnorm.batch_norm(x, None, None, jnp.zeros(3), jnp.ones(3), training=True),
         ValueError, r"running_mean must have shape \(8,\)"),
        (lambda x: jaxnorm.batch_norm(x, None, None, None, None, training=True, momentum=2.0),
         ValueError, "momentum"),
        (lambda x: jaxnorm.batch_norm(x, None, None, None, None, training=1), TypeError,
         "training must be a static bool"),
        (lambda x: jaxnorm.batch_norm(x[:0], None, None, None, None, training=True), ValueError,
         "more than 0 value"),
    ],
)
def test_bad_input_is_named(call, error, match):
    x = jnp.ones((2, 3, 4, 8), jnp.float32)
    with pytest.raises(error, match=match):
        jax.jit(call)(x)


# ------------------------------------ handlers and the jax.numpy lowering


def _ffi(target, outs, *args, **attrs):
    return jax.ffi.ffi_call("jaxnorm_" + target, outs)(*args, **attrs)


@pytest.mark.skipif(
    "channel_norm_fwd" not in jaxnorm._ffi.KERNELS.get(lowering_platform(), ()),
    reason="no kernel")
@pytest.mark.parametrize(
    "case,match",
    [
        ("x_rank", "x must have rank 4"),
        ("group_size", "group_size 3 does not divide the 8 channels"),
        ("scale_len", r"scale has shape \(5,\), expected \(8,\)"),
        ("mean_without_var", "takes mean and var, or returns mean_out and var_out"),
        ("stats_dtype", "mean has dtype bfloat16, expected float32"),
        ("bwd_dx", r"dx has shape \(2, 3, 8, 7\), expected \(2, 3, 8, 1\)"),
        ("bwd_modes", "channel_norm_bwd returns"),
        ("bwd_var", r"var has shape \(2, 3\), expected \(2, 4\)"),
        ("bwd_terms", r"sums_out has shape \(2, 7, 3\), expected \(2, 8, 3\)"),
        ("activation", r"activation must be 0 \(none\), 1 \(SiLU\) or 2 \(ReLU\), got 3"),
        ("bwd_activation", "activation must be .* got -1"),
        ("bwd_mean_without_var", "takes mean and var, or neither"),
        ("bwd_no_stats_with_silu", "computes its statistics .* only without an activation"),
    ],
)
def test_channel_handlers_reject_inconsistent_buffers(case, match):
    sd, f32 = jax.ShapeDtypeStruct, jnp.float32
    x, e = jnp.ones((2, 3, 8, 1), f32), jnp.zeros((0,), f32)
    stats = jnp.ones((2, 4), f32)
    fwd_args = dict(x=x, scale=e, bias=e, mean=e, var=e)
    fwd_outs = dict(y=sd(x.shape, f32), mean_out=sd((2, 4), f32), var_out=sd((2, 4), f32))
    bwd_args = dict(x=x, scale=e, bias=e, mean=stats, var=stats, dy=x, means=e)
    bwd_outs = dict(dx=sd(x.shape, f32), dscale=sd((0,), f32), dbias=sd((0,), f32),
                    sums_out=sd((0,), f32))
    changes = {
        "x_rank": dict(x=x.reshape(2, 3, 8), y=sd((2, 3, 8), f32)),
        "group_size": dict(group_size=np.int64(3)),
        "scale_len": dict(scale=jnp.ones((5,), f32)),
        "mean_without_var": dict(mean=stats),
        "stats_dtype": dict(mean=stats.astype(jnp.bfloat16), var=stats,
                            mean_out=sd((0,), f32), var_out=sd((0,), f32)),
        "bwd_dx": dict(dx=sd((2, 3, 8, 7), f32)),
        "bwd_modes": dict(means=jnp.ones((2, 4, 2), f32), sums_out=sd((2, 4, 2), f32)),
        "bwd_var": dict(var=jnp.ones((2, 3), f32)),
        "bwd_terms": dict(dx=sd((0,), f32), sums_out=sd((2, 7, 3), f32)),
        "activation": dict(activation=np.int32(3)),
        "bwd_activation": dict(activation=np.int32(-1)),
        "bwd_mean_without_var": dict(mean=e),
        "bwd_no_stats_with_silu": dict(mean=e, var=e, activation=np.int32(1)),
    }[case]
    bwd = case.startswith("bwd")
    args, outs = (bwd_args, bwd_outs) if bwd else (fwd_args, fwd_outs)
    args = {k: changes.get(k, v) for k, v in args.items()}
    outs = tuple(changes.get(k, v) for k, v in outs.items())
    attrs = dict(group_size=changes.get("group_size", np.int64(2)), epsilon=np.float64(1e-5),
                 activation=changes.get("activation", np.int32(0)))
    target = "channel_norm_bwd" if bwd else "channel_norm_fwd"
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(jax.jit(lambda: _ffi(target, outs, *args.values(), **attrs))())


# x as (N, A, C, B): B > 1 is channels-first (CUDA lowers it to the jax.numpy
# reference), B = 1 channels-last (the CUDA kernels: with N > 1, mode "sums"
# takes param_grads' own launch and the others apply_dx's).
@pytest.mark.parametrize("shape", [(2, 3, 8, 5), (3, 7, 8, 1)])
@pytest.mark.parametrize("activation", [0, 1, 2])  # none, SiLU, ReLU
def test_reference_lowering_matches_the_kernels(activation, shape):
    """The jax.numpy implementation that platforms without a kernel lower to
    gives the kernels' results in every mode of the two targets."""
    from jaxnorm import channel_norm as cn

    x = rand(50, shape, jnp.float64)
    scale, bias = params(51, 8, jnp.float64)
    dy = rand(52, x.shape, jnp.float64)
    e = jnp.zeros((0,), jnp.float64)
    common = dict(group_size=2, epsilon=1e-5, activation=activation)
    impls = (cn.channel_norm_fwd_kernel_p.bind, cn._fwd_kernel_reference)
    fwd = [jax.jit(functools.partial(f, **common, out_dtype=jnp.float64, write_output=True))(
        x, scale, bias, e, e) for f in impls]
    _close_all(*fwd)
    _, mean, var = fwd[0]
    given = [jax.jit(functools.partial(f, **common, out_dtype=jnp.float64, write_output=True))(
        x, scale, bias, mean, var) for f in impls]
    _close_all(*given)
    np.testing.assert_allclose(given[0][0], fwd[0][0], rtol=1e-12, atol=1e-12)
    bwd_impls = (cn.channel_norm_bwd_kernel_p.bind, cn._bwd_kernel_reference)
    means = jnp.full((shape[0], 4, 2), 0.25, jnp.float64)
    for mode, m, param_grads in (("full", e, True), ("sums", e, True), ("terms", e, True),
                                 ("dx", means, False), ("dx", means, True)):
        outs = [jax.jit(functools.partial(f, **common, mode=mode, param_grads=param_grads,
                                          param_dtype=jnp.float64))(
            x, scale, bias, mean, var, dy, m) for f in bwd_impls]
        _close_all(*outs)
        if mode == "full" and activation == 0:  # computing the statistics instead
            own = [jax.jit(functools.partial(f, **common, mode=mode, param_grads=param_grads,
                                             param_dtype=jnp.float64))(
                x, scale, bias, e, e, dy, m) for f in bwd_impls]
            _close_all(*own)
            _close_all(own[0], outs[0])


def _close_all(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


def test_batch_norm_elementwise_work_by_mode():
    """BatchNorm without a fused activation leaves y and dx to XLA, which
    fuses them with the ops around them (a residual add, a ReLU): its kernels
    compute the statistics and the backward's sums alone, their y and dx
    results empty. With an activation fused, the kernels write y (in the
    launch that computes the statistics) and dx, as GroupNorm's do. In
    evaluation (the statistics given: nothing to reduce) the same by
    activation: y and dx are jax.numpy without one, the kernels' with one."""
    x = rand(70, (4, 3, 3, 8), jnp.float32)
    scale, bias = params(71, 8, jnp.float32)

    def bn(training, activation=None):
        return lambda x: jaxnorm.batch_norm(x, scale, bias, jnp.zeros(8), jnp.ones(8),
                                            training=training, activation=activation)[0]

    def calls(norm):
        loss = jax.grad(lambda x: jnp.sum(jnp.square(norm(x))))
        hlo = jax.jit(loss).lower(x).compile().as_text()
        return _compiled_calls(hlo, "channel_norm_fwd"), _compiled_calls(hlo, "channel_norm_bwd")

    y, stats = "f32[1,36,8,1]", "f32[1,8]"  # the kernels' (N, A, C, B) and (N, G)
    fwd, (bwd,) = calls(bn(True))
    assert len(fwd) == 1 and y not in fwd[0][0] and stats in fwd[0][0], fwd
    assert y not in bwd[0] and stats in bwd[1], bwd
    fwd, (bwd,) = calls(bn(True, "relu"))
    assert len(fwd) == 1 and y in fwd[0][0] and stats in fwd[0][0], fwd
    assert y in bwd[0] and stats in bwd[1], bwd
    assert calls(bn(False)) == ([], [])  # dx alone: XLA's, no kernel
    fwd, (bwd,) = calls(bn(False, "relu"))
    assert len(fwd) == 1 and y in fwd[0][0] and stats not in fwd[0][0], fwd
    assert y in bwd[0] and stats in bwd[1], bwd


def _compiled_calls(compiled_hlo, name):
    """The compiled program's custom calls to jaxnorm's `name`, split into
    (results, operands)."""
    return [tuple(ln.split("custom-call(", 1)) for ln in compiled_hlo.splitlines()
            if "custom-call(" in ln and f'custom_call_target="jaxnorm_{name}"' in ln]


@pytest.mark.skipif(lowering_platform() not in jaxnorm.kernel_platforms(), reason="no kernels here")
@pytest.mark.parametrize("activation", [None, "silu"])
def test_group_norm_gradients_of_a_dead_y(activation):
    """Forward and backward in one jit with y dead (jax.grad's forward):
    without an activation the backward computes the statistics itself, so
    the forward (one launch for the statistics and y) is dropped; with one,
    the backward takes the forward's statistics, so that launch stays. With
    y used, it runs either way. The gradients agree."""
    x = rand(72, (2, 4, 4, 8), jnp.float32)
    scale, bias = params(73, 8, jnp.float32)

    def norm(x, scale, bias):
        return jaxnorm.group_norm(x, 2, scale, bias, activation=activation)

    def grads_only(x, scale, bias, dy):
        return jax.vjp(norm, x, scale, bias)[1](dy)

    def with_value(x, scale, bias, dy):
        y, pullback = jax.vjp(norm, x, scale, bias)
        return y, pullback(dy)

    args = (x, scale, bias, rand(74, x.shape, jnp.float32))
    y_shape, stats_shape = "f32[2,16,8,1]", "f32[2,2]"  # the kernels' (N, A, C, B), (N, G)
    hlo = jax.jit(grads_only).lower(*args).compile().as_text()
    fwd, (bwd,) = _compiled_calls(hlo, "channel_norm_fwd"), _compiled_calls(hlo, "channel_norm_bwd")
    if activation is None:
        assert not fwd and stats_shape not in bwd[1], (fwd, bwd)
    else:
        assert len(fwd) == 1 and stats_shape in bwd[1], (fwd, bwd)
    hlo = jax.jit(with_value).lower(*args).compile().as_text()
    fwd = _compiled_calls(hlo, "channel_norm_fwd")
    assert len(fwd) == 1 and y_shape in fwd[0][0] and stats_shape in fwd[0][0], fwd
    want = jax.jit(with_value)(*args)[1]
    for a, b in zip(jax.jit(grads_only)(*args), want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Against float64, the statistics as given or as computed in the backward.
    x64 = [np.asarray(a, np.float64) for a in args]
    want64 = jax.vjp(norm, *map(jnp.asarray, x64[:3]))[1](jnp.asarray(x64[3]))
    for a, w in zip(want, want64):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-5, atol=2e-5)
