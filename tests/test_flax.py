"""jaxnorm.linen and jaxnorm.nnx against Flax's own modules: values,
gradients, parameter trees and checkpoints."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, serialization
from reference import rand
from sharding_util import needs_devices

import jaxnorm.linen
import jaxnorm.nnx

TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 3e-2}

# (fields, x shape): Flax's defaults; other dtypes; without parameters; two
# reduction axes with one feature axis; and fields the kernels do not take
# (reduction over a middle axis), which fall back to Flax.
LINEN_CASES = [
    (dict(), (4, 6, 96)),
    (dict(dtype=jnp.bfloat16), (4, 6, 96)),
    (dict(param_dtype=jnp.bfloat16, epsilon=1e-3), (5, 33)),
    (dict(use_scale=False), (5, 33)),
    (dict(reduction_axes=(-2, -1), feature_axes=-1), (3, 8, 40)),
    (dict(reduction_axes=1, feature_axes=1), (3, 8, 40)),
]


def _randomize(tree, seed):
    """Parameters that are neither ones nor zeros."""
    leaves, treedef = jax.tree.flatten(tree)
    new = [rand(seed + i, leaf.shape, leaf.dtype, offset=1.0) for i, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, new)


def _close(a, b, dtype):
    tol = TOL[jnp.dtype(dtype)]
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol)


def _uses_kernel(fn, *args):
    return "jaxnorm_row_norm_fwd" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("name", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("fields,shape", LINEN_CASES, ids=str)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_linen_matches_flax(name, fields, shape, x_dtype):
    if name == "RMSNorm":
        fields = {k: v for k, v in fields.items() if k != "use_bias"}
    ours, theirs = getattr(jaxnorm.linen, name)(**fields), getattr(nn, name)(**fields)
    x = rand(1, shape, x_dtype, offset=0.5)
    variables = jax.jit(theirs.init)(jax.random.key(0), x)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), jax.jit(ours.init)(jax.random.key(0), x)) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), variables)
    variables = _randomize(variables, 10)
    y, y_ref = jax.jit(ours.apply)(variables, x), jax.jit(theirs.apply)(variables, x)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    _close(y, y_ref, y.dtype)
    fallback = fields.get("reduction_axes", -1) == 1
    assert _uses_kernel(lambda v, x: ours.apply(v, x), variables, x) != fallback

    def loss(module):
        return lambda v, x: jnp.sum(jnp.sin(module.apply(v, x).astype(jnp.float32)))

    # Eager: under jit XLA fuses Flax's bfloat16 steps differently, and on a
    # GPU its rounding then moved by more than the tolerance.
    g = jax.grad(loss(ours), argnums=(0, 1))(variables, x)
    g_ref = jax.grad(loss(theirs), argnums=(0, 1))(variables, x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        assert a.dtype == b.dtype
        _close(a, b, jnp.float32 if a.dtype == jnp.float32 and x_dtype == jnp.float32
               else jnp.bfloat16)


def test_linen_mask_falls_back_to_flax():
    x = rand(2, (3, 16), jnp.float32)
    mask = jnp.arange(16) < 10
    ours, theirs = jaxnorm.linen.LayerNorm(), nn.LayerNorm()
    v = _randomize(theirs.init(jax.random.key(0), x), 3)
    np.testing.assert_array_equal(ours.apply(v, x, mask=mask), theirs.apply(v, x, mask=mask))


def test_linen_checkpoint_round_trip():
    """Flax's parameters, saved as bytes, load into the jaxnorm model and back."""

    class Block(nn.Module):
        norm: type

        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(self.norm()(nn.Dense(32)(x)))

    x = rand(3, (4, 16), jnp.float32)
    for norm, ours in ((nn.LayerNorm, jaxnorm.linen.LayerNorm),
                       (nn.RMSNorm, jaxnorm.linen.RMSNorm)):
        theirs_model, our_model = Block(norm), Block(ours)
        v = _randomize(theirs_model.init(jax.random.key(0), x), 20)
        blob = serialization.to_bytes(v)
        template = our_model.init(jax.random.key(1), x)
        restored = serialization.from_bytes(template, blob)
        _close(our_model.apply(restored, x), theirs_model.apply(v, x), jnp.float32)
        back = serialization.from_bytes(v, serialization.to_bytes(restored))
        jax.tree.map(np.testing.assert_array_equal, back, v)


NNX_CASES = [
    dict(),
    dict(dtype=jnp.bfloat16),
    dict(param_dtype=jnp.bfloat16, epsilon=1e-3),
    dict(use_scale=False),
    dict(reduction_axes=(-2, -1), feature_axes=-1),
]


@pytest.mark.parametrize("name", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("fields", NNX_CASES, ids=str)
def test_nnx_matches_flax(name, fields):
    x = rand(4, (3, 8, 40), jnp.bfloat16, offset=0.5)
    ours = getattr(jaxnorm.nnx, name)(40, rngs=nnx.Rngs(0), **fields)
    theirs = getattr(nnx, name)(40, rngs=nnx.Rngs(0), **fields)
    state = _randomize(nnx.state(theirs, nnx.Param), 30)
    nnx.update(theirs, state)
    nnx.update(ours, state)
    y, y_ref = ours(x), theirs(x)
    assert y.dtype == y_ref.dtype
    _close(y, y_ref, y.dtype)
    assert _uses_kernel(lambda x: ours(x), x)

    def loss(m, x):
        return jnp.sum(jnp.sin(m(x).astype(jnp.float32)))

    g = nnx.grad(loss)(ours, x)
    g_ref = nnx.grad(loss)(theirs, x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        _close(a, b, jnp.bfloat16)


def test_nnx_state_round_trip():
    """A Flax nnx model's state, saved as bytes, loads into the same model
    built with jaxnorm modules, and back."""

    class Block(nnx.Module):
        def __init__(self, norms, rngs):
            self.dense = nnx.Linear(16, 32, rngs=rngs)
            self.ln = norms.LayerNorm(32, rngs=rngs)
            self.rms = norms.RMSNorm(32, rngs=rngs)

        def __call__(self, x):
            return self.rms(self.ln(self.dense(x)))

    theirs, ours = Block(nnx, nnx.Rngs(0)), Block(jaxnorm.nnx, nnx.Rngs(1))
    nnx.update(theirs, _randomize(nnx.state(theirs), 40))
    blob = serialization.to_bytes(nnx.to_pure_dict(nnx.state(theirs)))
    restored = serialization.from_bytes(nnx.to_pure_dict(nnx.state(ours)), blob)
    state = nnx.state(ours)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(ours, state)
    x = rand(5, (4, 16), jnp.float32)
    _close(ours(x), theirs(x), jnp.float32)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(ours)),
                 nnx.to_pure_dict(nnx.state(theirs)))


@needs_devices(8)
def test_linen_axis_name_in_shard_map():
    """Flax's axis_name (statistics combined over a mapped axis): here the
    hidden dim split over 'model', against Flax's module on the same split."""
    from jax.sharding import PartitionSpec as P
    from sharding_util import make_mesh

    mesh = make_mesh((4, 2))
    x = rand(6, (8, 64), jnp.float32, offset=1.0)
    ours, theirs = jaxnorm.linen.LayerNorm(axis_name="model"), nn.LayerNorm(axis_name="model")
    v = _randomize(nn.LayerNorm().init(jax.random.key(0), x), 50)

    def run(module):
        def local(v, x):
            return module.apply(v, x)

        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("model"), P("data", "model")),
                                     out_specs=P("data", "model")))(v, x)

    _close(run(ours), run(theirs), jnp.float32)
    _close(run(ours), nn.LayerNorm().apply(v, x), jnp.float32)


@pytest.mark.parametrize("fields", [dict(), dict(dtype=jnp.bfloat16), dict(reduction_axes=0)],
                         ids=str)
def test_add_rms_norm_modules(fields):
    """AddRMSNorm against a residual add and Flax's RMSNorm (the last case
    falls back to exactly that)."""
    x, r = rand(7, (6, 64), jnp.bfloat16), rand(8, (6, 64), jnp.bfloat16, offset=0.5)
    h_ref = x + r
    theirs = nn.RMSNorm(**fields)
    v = _randomize(theirs.init(jax.random.key(0), x), 60)
    ours = jaxnorm.linen.AddRMSNorm(**fields)
    assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x, r)) == jax.tree.map(jnp.shape, v)
    y, h = ours.apply(v, x, r)
    np.testing.assert_array_equal(h, h_ref)
    y_ref = theirs.apply(v, h_ref)
    assert y.dtype == y_ref.dtype
    _close(y, y_ref, jnp.bfloat16)
    g = jax.grad(lambda v, x, r: jnp.sum(ours.apply(v, x, r)[0]), argnums=(0, 1, 2))(v, x, r)
    g_ref = jax.grad(lambda v, x, r: jnp.sum(theirs.apply(v, x + r)), argnums=(0, 1, 2))(v, x, r)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        _close(a, b, jnp.bfloat16)

    n_ours = jaxnorm.nnx.AddRMSNorm(64, rngs=nnx.Rngs(0), **fields)
    n_theirs = nnx.RMSNorm(64, rngs=nnx.Rngs(0), **fields)
    state = _randomize(nnx.state(n_theirs, nnx.Param), 70)
    nnx.update(n_ours, state)
    nnx.update(n_theirs, state)
    y, h = n_ours(x, r)
    np.testing.assert_array_equal(h, h_ref)
    y_ref = n_theirs(h_ref)
    assert y.dtype == y_ref.dtype
    _close(y, y_ref, jnp.bfloat16)
