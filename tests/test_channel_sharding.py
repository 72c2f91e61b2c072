"""The channel norms over several devices (8 virtual CPU devices in the test
run): synchronized BatchNorm inside shard_map and under jit with sharded
inputs, GroupNorm with its samples, spatial dims or channels split; values,
running statistics and gradients equal one device's, and the compiled HLO
holds exactly the collectives the design calls for."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import rand
from sharding_util import collective_sizes, make_mesh, needs_devices

import jaxnorm

pytestmark = needs_devices(8)

SHAPE = (8, 4, 6, 16)  # NHWC; every dim but W divides over 8 devices
C, GROUPS = SHAPE[-1], 4


def _inputs():
    x = rand(1, SHAPE, jnp.float32, offset=3.0)
    scale, bias = rand(2, (C,), jnp.float32, 1.0), rand(3, (C,), jnp.float32)
    return x, scale, bias


def _close(got, want, rtol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol)


def _shards(mesh, entry):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[a] for a in axes)


def _split(mesh, spec):
    entries = list(spec) + [None] * (len(SHAPE) - len(spec))
    return [_shards(mesh, e) for e in entries]


def _compare(op, mesh, spec, params_like_x):
    """op(x, scale, bias) -> (y, ...) and the gradient of a loss of y, sharded
    and on one device; returns each sharded function's collectives."""
    x, scale, bias = _inputs()
    p_spec = P(spec[3]) if params_like_x and len(spec) > 3 else P()

    def loss(x, scale, bias):
        return jnp.sum(jnp.sin(op(x, scale, bias)[0]))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    shardings = (NamedSharding(mesh, spec), NamedSharding(mesh, p_spec),
                 NamedSharding(mesh, p_spec))
    # Results sharded as the arguments (y as x; running statistics and
    # gradients as the parameters), so that only the op's collectives remain.
    n_out = len(op(x, scale, bias))
    found = {}
    for name, f, outs in (("fwd", op, shardings[:n_out]), ("grad", grad, shardings)):
        sharded = jax.jit(f, in_shardings=shardings, out_shardings=outs).lower(
            x, scale, bias).compile()
        _close(sharded(x, scale, bias), jax.jit(f)(x, scale, bias))
        found[name] = collective_sizes(sharded.as_text())
    return found


def _batch_norm(x, scale, bias):
    return jaxnorm.batch_norm(x, scale, bias, jnp.zeros(C), jnp.ones(C), training=True,
                              momentum=0.9)


def _batch_norm_relu(x, scale, bias):
    return jaxnorm.batch_norm(x, scale, bias, jnp.zeros(C), jnp.ones(C), training=True,
                              momentum=0.9, activation="relu")


BN_SPECS = [P("data"), P(("data", "model")), P("data", "model"), P(None, "data"),
            P("data", None, None, "model"), P(None, None, None, ("data", "model")), P()]


@pytest.mark.parametrize("spec", BN_SPECS, ids=str)
def test_batch_norm_partitioned(spec):
    """Batch and spatial dims split: one all-gather of each device's (mean,
    M2) per channel in the forward, one all-reduce of the two per-channel
    sums and the parameter gradients in the backward. Channels split: none."""
    mesh = make_mesh((2, 4))
    found = _compare(_batch_norm, mesh, spec, params_like_x=True)
    split = _split(mesh, spec)
    reduce_shards, local_c = math.prod(split[:3]), C // split[3]
    fwd = [("all-gather", reduce_shards * local_c * 2)] if reduce_shards > 1 else []
    assert found["fwd"] == fwd
    bwd = [("all-reduce", 4 * local_c)] if reduce_shards > 1 else []
    assert found["grad"] == sorted(fwd + bwd)


@pytest.mark.parametrize("spec", [P("data"), P("data", None, None, "model")], ids=str)
def test_batch_norm_relu_partitioned(spec):
    """ReLU fused (y and dx from the kernels, not XLA): the same collectives
    as without it."""
    mesh = make_mesh((2, 4))
    found = _compare(_batch_norm_relu, mesh, spec, params_like_x=True)
    split = _split(mesh, spec)
    reduce_shards, local_c = math.prod(split[:3]), C // split[3]
    fwd = [("all-gather", reduce_shards * local_c * 2)]
    assert found["fwd"] == fwd
    assert found["grad"] == sorted(fwd + [("all-reduce", 4 * local_c)])


def test_batch_norm_partitioned_with_replicated_params():
    mesh = make_mesh((2, 4))
    _compare(_batch_norm, mesh, P("data", None, None, "model"), params_like_x=False)


def _group_norm(x, scale, bias):
    return (jaxnorm.group_norm(x, GROUPS, scale, bias, activation="silu"),)


GN_SPECS = [P("data"), P(None, "data"), P("data", "model"), P(("data", "model")),
            P("data", None, None, "model"), P(None, "data", None, "model")]


@pytest.mark.parametrize("spec", GN_SPECS, ids=str)
def test_group_norm_partitioned(spec):
    """Samples split: only the parameter gradients are summed. Spatial dims
    split: one all-gather of (mean, M2) per local sample and group, and the
    backward's sums added up. Channels split in whole groups: nothing."""
    mesh = make_mesh((2, 4))
    found = _compare(_group_norm, mesh, spec, params_like_x=True)
    n_sh, h_sh, _, c_sh = _split(mesh, spec)
    local_n, local_c = SHAPE[0] // n_sh, C // c_sh
    local_groups = GROUPS // c_sh
    fwd = [("all-gather", h_sh * local_n * local_groups * 2)] if h_sh > 1 else []
    assert found["fwd"] == fwd
    sums, params = local_n * local_groups * 2, 2 * local_c
    if h_sh > 1 and n_sh > 1:
        bwd = [("all-reduce", sums), ("all-reduce", params)]
    elif h_sh > 1:
        bwd = [("all-reduce", sums + params)]
    else:
        bwd = [("all-reduce", params)] if n_sh > 1 else []
    assert found["grad"] == sorted(fwd + bwd)


def test_group_norm_channels_cut_inside_a_group_are_gathered():
    mesh = make_mesh((8,))
    x, scale, bias = _inputs()
    f = jax.jit(lambda x: jaxnorm.group_norm(x, 2, scale, bias),  # 8 channels a group
                in_shardings=NamedSharding(mesh, P(None, None, None, "a")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = f(x)
    messages = [str(w.message) for w in caught]
    assert any("x dimension 3" in m and "cut a group of 8" in m for m in messages), messages
    _close(y, jaxnorm.group_norm(x, 2, scale, bias))


# ------------------------------------------------------------ shard_map


@pytest.mark.parametrize("activation", [None, "relu"])
def test_synchronized_batch_norm_in_shard_map(activation):
    """axis_name: the batch split over 'data' (and 'model' replicates) gives
    the single-device statistics, running statistics and gradients; the
    forward has one all-gather, the backward one all-reduce (y and dx XLA's
    without an activation, the kernels' with ReLU fused)."""
    mesh = make_mesh((4, 2))
    x, scale, bias = _inputs()
    rm, rv = rand(4, (C,), jnp.float32), jnp.ones(C) * 2

    def body(x, scale, bias):
        return jaxnorm.batch_norm(x, scale, bias, rm, rv, training=True, momentum=0.8,
                                  axis_name="data", unbiased_running_var=True,
                                  activation=activation)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P()),
                      out_specs=(P("data"), P(), P()))

    def single(x, scale, bias):
        return jaxnorm.batch_norm(x, scale, bias, rm, rv, training=True, momentum=0.8,
                                  unbiased_running_var=True, activation=activation)

    _close(jax.jit(f)(x, scale, bias), jax.jit(single)(x, scale, bias))
    assert collective_sizes(jax.jit(f).lower(x, scale, bias).compile().as_text()) == [
        ("all-gather", 4 * C * 2)]

    def grad(op):
        return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(op(*a)[0])), argnums=(0, 1, 2)))

    _close(grad(f)(x, scale, bias), grad(single)(x, scale, bias))
    found = collective_sizes(grad(f).lower(x, scale, bias).compile().as_text())
    assert found == [("all-gather", 4 * C * 2), ("all-reduce", 4 * C)]


def test_group_norm_with_spatial_dims_split_in_shard_map():
    mesh = make_mesh((4, 2))
    x, scale, bias = _inputs()

    def body(x, scale, bias):
        return jaxnorm.group_norm(x, GROUPS, scale, bias, axis_name="model", activation="silu")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"), P(), P()),
                      out_specs=P("data", "model"))

    def single(x, scale, bias):
        return jaxnorm.group_norm(x, GROUPS, scale, bias, activation="silu")

    _close(jax.jit(f)(x, scale, bias), single(x, scale, bias))
    def grad(op):
        return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(op(*a))), argnums=(0, 1, 2)))

    _close(grad(f)(x, scale, bias), grad(single)(x, scale, bias))
    local_n = SHAPE[0] // 4
    assert collective_sizes(jax.jit(f).lower(x, scale, bias).compile().as_text()) == [
        ("all-gather", 2 * local_n * GROUPS * 2)]


@pytest.mark.parametrize("activation", [None, "relu"])
def test_batch_norm_evaluation_needs_no_collective(activation):
    """Evaluation's forward needs no collective; its gradients one all-reduce
    of the parameters' (the kernels' y and dx with an activation fused,
    XLA's without)."""
    mesh = make_mesh((8,))
    x, scale, bias = _inputs()
    rm, rv = rand(5, (C,), jnp.float32), jnp.ones(C)

    def f(x, scale, bias):
        return jaxnorm.batch_norm(x, scale, bias, rm, rv, training=False,
                                  activation=activation)[0]

    shardings = (NamedSharding(mesh, P("a")), None, None)
    sharded = jax.jit(f, in_shardings=shardings)
    _close(sharded(x, scale, bias), f(x, scale, bias))
    assert collective_sizes(sharded.lower(x, scale, bias).compile().as_text()) == []

    def grad(**kw):
        return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)), **kw)

    sharded_grad = grad(in_shardings=shardings)
    _close(sharded_grad(x, scale, bias), grad()(x, scale, bias))
    assert collective_sizes(sharded_grad.lower(x, scale, bias).compile().as_text()) == [
        ("all-reduce", 2 * C)]


def test_synchronized_batch_norm_with_uneven_device_batches():
    """Devices holding 1-5 valid examples of their 4-8 (a mask): the statistics,
    running statistics and gradients of all the valid examples together, as
    PyTorch's SyncBatchNorm gives; each device's counts travel with its means
    and M2s in the one all-gather."""
    mesh = make_mesh((8,))
    x = rand(6, (32, 3, C), jnp.float32, offset=20.0)
    scale, bias = rand(7, (C,), jnp.float32, 1.0), rand(8, (C,), jnp.float32)
    valid = np.arange(4)[None] < (np.arange(1, 9) % 5 + 1)[:, None]  # (device, row)
    mask = jnp.asarray(valid.reshape(32, 1, 1))
    rm, rv = jnp.zeros(C), jnp.ones(C)

    def bn(x, scale, bias, mask, **kw):
        return jaxnorm.batch_norm(x, scale, bias, rm, rv, training=True, mask=mask,
                                  unbiased_running_var=True, **kw)

    f = jax.shard_map(lambda *a: bn(*a, axis_name="a"), mesh=mesh,
                      in_specs=(P("a"), P(), P(), P("a")), out_specs=(P("a"), P(), P()))
    _close(jax.jit(f)(x, scale, bias, mask), bn(x, scale, bias, mask))
    assert collective_sizes(jax.jit(f).lower(x, scale, bias, mask).compile().as_text()) == [
        ("all-gather", 8 * C * 3)]

    def grad(op):
        return jax.jit(jax.grad(lambda x, s, b: jnp.sum(jnp.sin(op(x, s, b, mask)[0])),
                                argnums=(0, 1, 2)))

    # Float32 sums over x - mean with mean ~20 in two orders (per device, then
    # across; and over all rows at once): dscale differs by ~2e-5 relative.
    _close(grad(f)(x, scale, bias), grad(bn)(x, scale, bias), rtol=1e-4)
