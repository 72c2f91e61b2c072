"""The row norms inside shard_map (check_vma on), with and without grad."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from reference import assert_close, norm_np, rand
from sharding_util import collective_sizes, make_mesh, mesh_shapes, row_norm_collectives

import jaxnorm


@pytest.mark.parametrize("centered", [False, True])
def test_rows_sharded_with_replicated_params(centered):
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("data",))
    n = len(devices)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4 * n, 64)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal(64) + 1, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(64), jnp.float32)

    def norm(x, s, b):
        return jaxnorm.layer_norm(x, s, b) if centered else jaxnorm.rms_norm(x, s) + 0 * b

    def loss(x, s, b):
        return jnp.sum(jnp.sin(norm(x, s, b)))

    def local(x, s, b):
        y = norm(x, s, b)
        g = jax.grad(lambda s, b: jax.lax.psum(loss(x, s, b), "data"), argnums=(0, 1))(s, b)
        return y, g

    sharded = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=(P("data"), P()))
    )
    y, (ds, db) = sharded(x, scale, bias)
    assert_close(y, norm(x, scale, bias), jnp.float32)
    want = jax.grad(loss, argnums=(1, 2))(x, scale, bias)
    assert_close(ds, want[0], jnp.float32, scale=10)
    assert_close(db, want[1], jnp.float32, scale=10)


# ------------------------------------ normalized dims split over axis_name


def _split_case(mesh_shape, norm_ndim):
    """x (8, 4, 64) with rows over the mesh's first axis and the hidden dim
    over the others, named by `axis_name`."""
    mesh = make_mesh(mesh_shape)
    hidden_axes = mesh.axis_names[1:]
    axis_name = hidden_axes[0] if len(hidden_axes) == 1 else tuple(hidden_axes)
    x = rand(11, (8, 4, 64), jnp.float32, offset=2.0)
    norm = x.shape[3 - norm_ndim:]
    scale = rand(12, norm, jnp.float32, 1.0)
    bias = rand(13, norm, jnp.float32)
    x_spec = P(mesh.axis_names[0], None, axis_name)
    p_spec = P(*[None] * (norm_ndim - 1), axis_name)
    return mesh, axis_name, x, scale, bias, x_spec, p_spec


def _norm(centered, **kw):
    def f(x, s, b):
        return jaxnorm.layer_norm(x, s, b, **kw) if centered else jaxnorm.rms_norm(x, s, **kw)

    return f


@pytest.mark.parametrize("norm_ndim", [1, 2])
@pytest.mark.parametrize("centered", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("mesh_shape", [s for s in mesh_shapes(len(jax.devices())) if len(s) > 1])
def test_axis_name_splits_normalized_dims(mesh_shape, centered, norm_ndim):
    mesh, axis_name, x, scale, bias, x_spec, p_spec = _split_case(mesh_shape, norm_ndim)
    rows_axis = mesh.axis_names[0]
    local_norm = _norm(centered, axis_name=axis_name)
    whole_norm = _norm(centered)

    def loss(norm, x, s, b):
        return jnp.sum(jnp.sin(norm(x, s, b)))

    def local(x, s, b):
        y = local_norm(x, s, b)
        # The loss sums over every device's block, as a global loss would.
        g = jax.grad(
            lambda x, s, b: jax.lax.psum(loss(local_norm, x, s, b), mesh.axis_names),
            argnums=(0, 1, 2),
        )(x, s, b)
        return y, g

    sharded = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(x_spec, p_spec, p_spec),
        out_specs=(x_spec, (x_spec, p_spec, p_spec)),
    ))
    y, grads = sharded(x, scale, bias)
    assert_close(y, whole_norm(x, scale, bias), jnp.float32)
    want = jax.grad(lambda *a: loss(whole_norm, *a), argnums=(0, 1, 2))(x, scale, bias)
    for got, w in zip(grads, want):
        assert_close(got, w, jnp.float32, scale=10)

    # The forward alone: one collective of per-row statistics; with the
    # gradient also the backward's dots and (rows split) parameter gradients.
    fwd = jax.jit(jax.shard_map(lambda x, s, b: local_norm(x, s, b), mesh=mesh,
                                in_specs=(x_spec, p_spec, p_spec), out_specs=x_spec))
    row_shards = mesh.shape[rows_axis]
    hidden_shards = len(jax.devices()) // row_shards
    local_rows = (8 * 4 if norm_ndim == 1 else 8) // row_shards
    params = math.prod(scale.shape) // hidden_shards
    for f, grad in ((fwd, False), (sharded, True)):
        found = collective_sizes(f.lower(x, scale, bias).compile().as_text())
        assert found == row_norm_collectives(
            centered, local_rows, row_shards, hidden_shards, params, grad
        ), found


@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_axis_name_layer_norm_is_exact_for_large_means(offset):
    """Split rows whose mean is far from zero against their spread: the split
    statistics are as accurate as one device's two-pass statistics (summing
    raw moments across slices instead would lose everything at 1e3)."""
    n = len(jax.devices())
    mesh = make_mesh((n,))
    x = rand(21, (64, 128 * n), jnp.float32, offset=offset)
    split = jax.jit(jax.shard_map(
        lambda x: jaxnorm.layer_norm(x, axis_name="a"), mesh=mesh,
        in_specs=P(None, "a"), out_specs=P(None, "a"),
    ))(x)
    want = norm_np(x, None, None, 1e-5, True, 1)
    single_err = np.max(np.abs(np.asarray(jaxnorm.layer_norm(x), np.float64) - want))
    split_err = np.max(np.abs(np.asarray(split, np.float64) - want))
    assert split_err <= 2 * single_err + 1e-6, (split_err, single_err)


def test_axis_name_rejects_non_names():
    with pytest.raises(TypeError, match="axis_name must be a mesh axis name"):
        jaxnorm.rms_norm(jnp.ones((2, 4)), axis_name=3)


@pytest.mark.parametrize("split_hidden", [False, True], ids=["rows", "rows+hidden"])
@pytest.mark.parametrize("centered", [False, True], ids=["rms", "layer"])
def test_grad_outside_shard_map(centered, split_hidden):
    """jax.grad of a function that calls shard_map (the transpose runs outside)."""
    mesh, axis_name, x, scale, bias, x_spec, p_spec = _split_case(
        [s for s in mesh_shapes(len(jax.devices())) if len(s) > 1][0], 1
    )
    if not split_hidden:
        axis_name, x_spec, p_spec = None, P(mesh.axis_names[0]), P()
    sharded = jax.shard_map(_norm(centered, axis_name=axis_name), mesh=mesh,
                            in_specs=(x_spec, p_spec, p_spec), out_specs=x_spec)

    def loss(norm, x, s, b):
        return jnp.sum(jnp.sin(norm(x, s, b)))

    got = jax.jit(jax.grad(lambda *a: loss(sharded, *a), argnums=(0, 1, 2)))(x, scale, bias)
    want = jax.grad(lambda *a: loss(_norm(centered), *a), argnums=(0, 1, 2))(x, scale, bias)
    for g, w in zip(got, want):
        assert_close(g, w, jnp.float32, scale=10)
