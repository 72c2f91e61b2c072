"""Automatic partitioning under jit with sharded inputs: values and gradients
equal the single-device result, and the compiled HLO has exactly the
collectives the design calls for (none gathering x)."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import rand
from sharding_util import collective_sizes, make_mesh, mesh_shapes, row_norm_collectives

import jaxnorm

SHAPE = (8, 4, 64)  # (batch, seq, hidden): every dim divides over 8 devices

# x's partition spec for each mesh rank: rows (batch, or sequence as in
# sequence parallelism), hidden (tensor parallelism), both, or replicated.
X_SPECS = {
    1: [P("a"), P(None, None, "a"), P()],
    2: [P("data"), P(None, "model"), P(None, None, "model"), P("data", None, "model"),
        P(("data", "model"))],
    3: [P("data", "seq", "model"), P("data", None, ("seq", "model")), P(("data", "seq"))],
}

CASES = [
    (mesh, spec, params)
    for mesh in mesh_shapes(len(jax.devices()))
    for spec in X_SPECS[len(mesh)]
    for params in ("replicated", "like_x")
]


def _axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _split(mesh, spec, norm_ndim):
    """(row shards, hidden shards) of x under `spec`."""
    entries = list(spec) + [None] * (len(SHAPE) - len(spec))
    size = dict(zip(mesh.axis_names, mesh.devices.shape))
    shards = [math.prod(size[a] for a in _axes(e)) for e in entries]
    cut = len(SHAPE) - norm_ndim
    return math.prod(shards[:cut]), math.prod(shards[cut:])


def _op(centered, norm_ndim):
    def op(x, scale, bias):
        if centered:
            return jaxnorm.layer_norm(x, scale, bias)
        return jaxnorm.rms_norm(x, scale)

    return op


def _inputs(centered, norm_ndim, dtype=jnp.float32):
    norm = SHAPE[len(SHAPE) - norm_ndim:]
    x = rand(1, SHAPE, dtype, offset=2.0)  # a mean away from zero
    scale = rand(2, norm, jnp.float32, 1.0)
    bias = rand(3, norm, jnp.float32) if centered else None
    return x, scale, bias


def _param_spec(spec, params, norm_ndim):
    if params == "replicated":
        return P()
    entries = list(spec) + [None] * (len(SHAPE) - len(spec))
    return P(*entries[len(SHAPE) - norm_ndim:])


def _run(mesh, spec, params, centered, norm_ndim, dtype=jnp.float32):
    """Forward and gradient, sharded and on one device; and each compiled
    sharded function's collectives."""
    op = _op(centered, norm_ndim)
    x, scale, bias = _inputs(centered, norm_ndim, dtype)

    def loss(x, scale, bias):
        return jnp.sum(jnp.sin(op(x, scale, bias).astype(jnp.float32)))

    grad = jax.grad(loss, argnums=(0, 1, 2) if centered else (0, 1))
    p_spec = _param_spec(spec, params, norm_ndim)
    shardings = (NamedSharding(mesh, spec), NamedSharding(mesh, p_spec),
                 NamedSharding(mesh, p_spec) if centered else None)
    results = {}
    for name, f in (("fwd", op), ("grad", grad)):
        # One compile for both the HLO and the result.
        sharded = jax.jit(f, in_shardings=shardings).lower(x, scale, bias).compile()
        results[name] = (sharded(x, scale, bias), jax.jit(f)(x, scale, bias),
                         collective_sizes(sharded.as_text()))
    return results


def _close(got, want, dtype, rtol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=rtol, atol=rtol)


@pytest.mark.parametrize("centered", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize(("mesh_shape", "spec", "params"), CASES)
def test_partitioned_matches_single_device(mesh_shape, spec, params, centered):
    mesh = make_mesh(mesh_shape)
    results = _run(mesh, spec, params, centered, norm_ndim=1)
    _check_design(results, mesh, spec, centered, norm_ndim=1)


def _check_design(results, mesh, spec, centered, norm_ndim):
    """Values and gradients equal one device's; outputs are sharded like x;
    the collectives are exactly those of `row_norm_collectives`."""
    row_shards, hidden_shards = _split(mesh, spec, norm_ndim)
    cut = len(SHAPE) - norm_ndim
    local_rows = math.prod(SHAPE[:cut]) // row_shards
    local_params = math.prod(SHAPE[cut:]) // hidden_shards
    for name, (got, want, found) in results.items():
        _close(got, want, jnp.float32, 1e-6 if hidden_shards == 1 and name == "fwd" else 2e-5)
        assert found == row_norm_collectives(
            centered, local_rows, row_shards, hidden_shards, local_params, grad=name == "grad"
        )
    y = results["fwd"][0]
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), len(SHAPE))


@pytest.mark.parametrize("centered", [False, True], ids=["rms", "layer"])
def test_partitioned_multi_dim_normalized_shape(centered):
    """Normalizing over (seq, hidden) with the sequence split: the rows are
    split, so one all-reduce of statistics; scale keeps its 2-D sharding."""
    mesh = make_mesh(mesh_shapes(len(jax.devices()))[-1])
    spec = P(mesh.axis_names[0], mesh.axis_names[-1])
    results = _run(mesh, spec, "like_x", centered, norm_ndim=2)
    _check_design(results, mesh, spec, centered, norm_ndim=2)


def test_partitioned_bf16_with_f32_params():
    """Parameter gradients are summed across devices in float32, then cast."""
    mesh = make_mesh(mesh_shapes(len(jax.devices()))[-1])
    spec = P(mesh.axis_names[0], None, mesh.axis_names[-1])
    results = _run(mesh, spec, "replicated", True, norm_ndim=1, dtype=jnp.bfloat16)
    y, y_ref, _ = results["fwd"]
    _close(y, y_ref, jnp.bfloat16, 1e-2)
    g, g_ref, _ = results["grad"]
    for got, want in zip(g, g_ref):
        scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=2e-2 * scale)


@pytest.mark.skipif(len(jax.devices()) == 1, reason="one device splits nothing")
def test_indivisible_hidden_is_gathered_with_a_warning():
    n = len(jax.devices())
    mesh = make_mesh((n,))
    x = rand(4, (2 * n, 8 * n + 1), jnp.float32)  # an odd hidden size

    def f(x):
        x = jax.lax.with_sharding_constraint(2 * x, NamedSharding(mesh, P(None, "a")))
        return jaxnorm.rms_norm(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = jax.jit(f)(x)
    messages = [str(w.message) for w in caught]
    assert any("x dimension 1" in m and "does not divide" in m for m in messages), messages
    _close(y, jax.jit(lambda x: jaxnorm.rms_norm(2 * x))(x), jnp.float32, 1e-6)


@pytest.mark.skipif(not hasattr(jax.config, "jax_use_shardy_partitioner"),
                    reason="this jax has no GSPMD partitioner to fall back to")
@pytest.mark.parametrize("centered", [False, True], ids=["rms", "layer"])
def test_partitioned_under_gspmd(centered):
    """jax configured with the older GSPMD partitioner uses the same partition
    callback, with its own sharding inference."""
    mesh = make_mesh(mesh_shapes(len(jax.devices()))[-1])
    spec = P(mesh.axis_names[0], None, mesh.axis_names[-1])
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        results = _run(mesh, spec, "replicated", centered, norm_ndim=1)
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)
    _check_design(results, mesh, spec, centered, norm_ndim=1)
