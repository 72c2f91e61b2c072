"""jaxnorm.linen and jaxnorm.nnx GroupNorm and BatchNorm against Flax's own
modules: values, gradients, parameter and batch_stats trees, running
statistics, train/eval, checkpoints, and synchronized statistics."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, serialization
from jax.sharding import PartitionSpec as P
from reference import rand
from sharding_util import make_mesh, needs_devices

import jaxnorm.linen
import jaxnorm.nnx

TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 3e-2}


def _randomize(tree, seed):
    leaves, treedef = jax.tree.flatten(tree)
    new = [rand(seed + i, leaf.shape, leaf.dtype, offset=1.0) for i, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, new)


def _close(a, b, dtype, scale=1.0):
    tol = TOL[jnp.dtype(dtype)] * scale
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(u, np.float32), np.asarray(v, np.float32),
                                   rtol=tol, atol=tol)


def _structure(tree):
    return jax.tree.map(lambda a: (a.shape, a.dtype), tree)


def _uses_kernel(fn, *args):
    return "jaxnorm_channel_norm_fwd" in str(jax.make_jaxpr(fn)(*args))


# (fields, x shape, falls back to Flax)
GROUP_CASES = [
    (dict(), (2, 5, 6, 64), False),
    (dict(num_groups=None, group_size=3), (2, 7, 12), False),
    (dict(num_groups=4, dtype=jnp.bfloat16, epsilon=1e-3), (3, 4, 4, 8), False),
    (dict(num_groups=2, use_bias=False, param_dtype=jnp.bfloat16), (2, 3, 8), False),
    (dict(num_groups=2, reduction_axes=(2, 3, 4)), (2, 3, 4, 5, 8), False),  # two batch axes
    (dict(num_groups=2, reduction_axes=(1, 3)), (2, 3, 4, 8), True),  # not trailing axes
]


@pytest.mark.parametrize("fields,shape,fallback", GROUP_CASES, ids=str)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_linen_group_norm_matches_flax(fields, shape, fallback, x_dtype):
    ours, theirs = jaxnorm.linen.GroupNorm(**fields), nn.GroupNorm(**fields)
    x = rand(1, shape, x_dtype, offset=0.5)
    variables = jax.jit(theirs.init)(jax.random.key(0), x)
    assert _structure(jax.jit(ours.init)(jax.random.key(0), x)) == _structure(variables)
    variables = _randomize(variables, 10)
    y, y_ref = jax.jit(ours.apply)(variables, x), jax.jit(theirs.apply)(variables, x)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    _close(y, y_ref, y.dtype)
    assert _uses_kernel(lambda v, x: ours.apply(v, x), variables, x) != fallback

    def loss(module):
        return lambda v, x: jnp.sum(jnp.sin(module.apply(v, x).astype(jnp.float32)))

    g = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(variables, x)
    g_ref = jax.jit(jax.grad(loss(theirs), argnums=(0, 1)))(variables, x)
    precise = x_dtype == jnp.float32 and y.dtype == jnp.float32
    _close(g, g_ref, jnp.float32 if precise else jnp.bfloat16, scale=1 if precise else 4)


def test_linen_group_norm_invalid_fields_raise_flax_errors():
    x = jnp.ones((2, 4, 6))
    with pytest.raises(ValueError, match="Either `num_groups` or `group_size`"):
        jaxnorm.linen.GroupNorm(num_groups=2, group_size=3).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="does not divide"):
        jaxnorm.linen.GroupNorm(num_groups=4).init(jax.random.key(0), x)


BATCH_CASES = [
    (dict(), (8, 5, 5, 16)),
    (dict(axis=1, momentum=0.9, epsilon=1e-3), (8, 16, 3, 3)),
    (dict(dtype=jnp.bfloat16, use_bias=False), (16, 12)),
    (dict(param_dtype=jnp.bfloat16, use_scale=False), (6, 4, 10)),
]


@pytest.mark.parametrize("fields,shape", BATCH_CASES, ids=str)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_linen_batch_norm_matches_flax(fields, shape, x_dtype):
    ours = jaxnorm.linen.BatchNorm(use_running_average=False, **fields)
    theirs = nn.BatchNorm(use_running_average=False, **fields)
    x = rand(2, shape, x_dtype, offset=2.0)
    variables = theirs.init(jax.random.key(0), x)
    ours_init = ours.init(jax.random.key(0), x)
    assert _structure(ours_init) == _structure(variables)
    _close(ours_init, variables, jnp.float32)  # init leaves batch_stats alone
    variables = {"params": _randomize(variables["params"], 20),
                 "batch_stats": _randomize(variables["batch_stats"], 30)}
    (y, stats), (y_ref, stats_ref) = (
        m.apply(variables, x, mutable=["batch_stats"]) for m in (ours, theirs))
    assert y.dtype == y_ref.dtype
    _close(y, y_ref, y.dtype)
    _close(stats, stats_ref, jnp.float32, scale=10)
    assert _uses_kernel(lambda v, x: ours.apply(v, x, mutable=["batch_stats"]), variables, x)

    def loss(module):
        def f(params, x):
            v = {"params": params, "batch_stats": variables["batch_stats"]}
            y, _ = module.apply(v, x, mutable=["batch_stats"])
            return jnp.sum(jnp.sin(y.astype(jnp.float32)))
        return f

    g = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(variables["params"], x)
    g_ref = jax.jit(jax.grad(loss(theirs), argnums=(0, 1)))(variables["params"], x)
    precise = x_dtype == jnp.float32 and y.dtype == jnp.float32
    _close(g, g_ref, jnp.float32 if precise else jnp.bfloat16, scale=10 if precise else 4)
    # evaluation: the running statistics, untouched
    evaluated = [m.apply(variables, x, use_running_average=True) for m in (
        jaxnorm.linen.BatchNorm(**fields), nn.BatchNorm(**fields))]
    _close(evaluated[0], evaluated[1], y.dtype)


def test_linen_batch_norm_with_several_feature_axes_or_a_mask():
    x = rand(3, (4, 5, 6), jnp.float32)
    for fields, kwargs in ((dict(axis=(1, 2)), {}), (dict(), dict(mask=jnp.ones((4, 5, 6)) > 0))):
        ours = jaxnorm.linen.BatchNorm(use_running_average=False, **fields)
        theirs = nn.BatchNorm(use_running_average=False, **fields)
        v = theirs.init(jax.random.key(0), x)
        got = ours.apply(v, x, mutable=["batch_stats"], **kwargs)
        want = theirs.apply(v, x, mutable=["batch_stats"], **kwargs)
        _close(got, want, jnp.float32)


def test_linen_checkpoints_round_trip():
    x = rand(4, (4, 6, 6, 32), jnp.float32)
    model = nn.Sequential([nn.GroupNorm(num_groups=8), nn.BatchNorm(use_running_average=False)])
    ours = nn.Sequential([jaxnorm.linen.GroupNorm(num_groups=8),
                          jaxnorm.linen.BatchNorm(use_running_average=False)])
    variables = _randomize(model.init(jax.random.key(1), x), 40)
    restored = serialization.from_bytes(ours.init(jax.random.key(2), x),
                                        serialization.to_bytes(variables))
    _close(ours.apply(restored, x, mutable=["batch_stats"]),
           model.apply(variables, x, mutable=["batch_stats"]), jnp.float32, scale=10)


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nnx_group_norm_matches_flax(x_dtype):
    x = rand(5, (2, 5, 7, 24), x_dtype)
    ours = jaxnorm.nnx.GroupNorm(24, num_groups=6, rngs=nnx.Rngs(0))
    theirs = nnx.GroupNorm(24, num_groups=6, rngs=nnx.Rngs(0))
    assert _structure(nnx.state(ours)) == _structure(nnx.state(theirs))
    nnx.update(theirs, _randomize(nnx.state(theirs), 50))
    nnx.update(ours, nnx.state(theirs))
    y, y_ref = ours(x), theirs(x)
    assert y.dtype == y_ref.dtype
    _close(y, y_ref, y.dtype)

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x).astype(jnp.float32)))

    g, g_ref = nnx.grad(loss)(ours, x), nnx.grad(loss)(theirs, x)
    _close(nnx.state(g), nnx.state(g_ref), jnp.float32 if x_dtype == jnp.float32
           else jnp.bfloat16, scale=4)


def test_nnx_batch_norm_train_and_eval_views():
    x = rand(6, (8, 4, 4, 12), jnp.float32, offset=1.5)
    ours = jaxnorm.nnx.BatchNorm(12, momentum=0.9, rngs=nnx.Rngs(0))
    theirs = nnx.BatchNorm(12, momentum=0.9, rngs=nnx.Rngs(0))
    assert _structure(nnx.state(ours)) == _structure(nnx.state(theirs))
    nnx.update(theirs, _randomize(nnx.state(theirs, nnx.Param), 60))
    nnx.update(ours, nnx.state(theirs))
    for _ in range(2):  # training updates batch_stats
        _close(ours(x), theirs(x), jnp.float32)
        _close(nnx.state(ours, nnx.BatchStat), nnx.state(theirs, nnx.BatchStat), jnp.float32,
               scale=10)
    ours.eval()
    theirs.eval()
    before = nnx.state(ours, nnx.BatchStat)
    _close(ours(x), theirs(x), jnp.float32)
    _close(nnx.state(ours, nnx.BatchStat), before, jnp.float32, scale=0)
    ours.train()
    _close(ours(x, use_running_average=True), theirs(x), jnp.float32)  # the call's flag wins
    # nnx.view's train/eval views
    evaluating = nnx.view(ours, use_running_average=True)
    _close(evaluating(x), theirs(x), jnp.float32)
    _close(nnx.state(ours, nnx.BatchStat), before, jnp.float32, scale=0)

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x)))

    ours.train()
    theirs.train()
    g, g_ref = nnx.grad(loss)(ours, x), nnx.grad(loss)(theirs, x)
    _close(nnx.state(g, nnx.Param), nnx.state(g_ref, nnx.Param), jnp.float32, scale=10)


@needs_devices(8)
def test_linen_batch_norm_synchronized_in_shard_map():
    """axis_name: the batch split over 8 devices gives one device's output
    and batch_stats."""
    mesh = make_mesh((8,))
    x = rand(7, (16, 4, 4, 8), jnp.float32, offset=1.0)
    ours = jaxnorm.linen.BatchNorm(use_running_average=False, axis_name="a")
    single = jaxnorm.linen.BatchNorm(use_running_average=False)
    variables = _randomize(single.init(jax.random.key(0), x), 70)

    def step(v, x):
        return ours.apply(v, x, mutable=["batch_stats"])

    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("a")),
                            out_specs=(P("a"), P()))
    got = jax.jit(sharded)(variables, x)
    want = single.apply(variables, x, mutable=["batch_stats"])
    _close(got, want, jnp.float32, scale=10)


def test_group_norm_with_fused_silu():
    """The one field beyond Flax's: silu(GroupNorm(x)) in one kernel, also
    on the fallback path."""
    x = rand(8, (2, 4, 4, 16), jnp.float32)
    theirs = nn.GroupNorm(num_groups=4)
    variables = _randomize(theirs.init(jax.random.key(0), x), 80)
    want = jax.nn.silu(theirs.apply(variables, x))
    ours = jaxnorm.linen.GroupNorm(num_groups=4, activation="silu")
    _close(ours.apply(variables, x), want, jnp.float32)
    mask = jnp.ones(x.shape, bool)
    _close(ours.apply(variables, x, mask=mask), want, jnp.float32)
    module = jaxnorm.nnx.GroupNorm(16, num_groups=4, activation="silu", rngs=nnx.Rngs(0))
    reference = nnx.GroupNorm(16, num_groups=4, rngs=nnx.Rngs(0))
    _close(module(x), jax.nn.silu(reference(x)), jnp.float32)
    with pytest.raises(ValueError, match="GroupNorm: activation must be None, 'silu' or 'relu'"):
        jaxnorm.nnx.GroupNorm(16, num_groups=4, activation="gelu", rngs=nnx.Rngs(0))


def test_batch_norm_with_fused_relu():
    """The one field beyond Flax's: relu(BatchNorm(x)) fused, in training
    (with its batch_stats and gradients) and evaluation, also on the fallback
    path (two feature axes)."""
    x = rand(9, (8, 4, 4, 16), jnp.float32, offset=0.5)
    theirs = nn.BatchNorm(use_running_average=False)
    ours = jaxnorm.linen.BatchNorm(use_running_average=False, activation="relu")
    variables = _randomize(theirs.init(jax.random.key(0), x), 90)

    def loss(module, act, params, x):
        y, upd = module.apply({**variables, "params": params}, x, mutable=["batch_stats"])
        return jnp.sum(jnp.sin(act(y))), upd

    grad = jax.grad(loss, argnums=(2, 3), has_aux=True)
    want = grad(theirs, jax.nn.relu, variables["params"], x)
    got = grad(ours, lambda y: y, variables["params"], x)
    _close(got, want, jnp.float32, scale=10)
    evaluating = {"use_running_average": True}
    _close(ours.copy(**evaluating).apply(variables, x),
           jax.nn.relu(theirs.copy(**evaluating).apply(variables, x)), jnp.float32)
    two_axes = dict(axis=(-2, -1), use_running_average=True)
    v2 = nn.BatchNorm(**two_axes).init(jax.random.key(1), x)
    _close(jaxnorm.linen.BatchNorm(**two_axes, activation="relu").apply(v2, x),
           jax.nn.relu(nn.BatchNorm(**two_axes).apply(v2, x)), jnp.float32)
    module = jaxnorm.nnx.BatchNorm(16, activation="relu", rngs=nnx.Rngs(0))
    reference = nnx.BatchNorm(16, rngs=nnx.Rngs(0))
    _close(module(x), jax.nn.relu(reference(x)), jnp.float32)
    _close(module.mean[...], reference.mean[...], jnp.float32)
    with pytest.raises(ValueError, match="BatchNorm: activation must be None, 'silu' or 'relu'"):
        jaxnorm.nnx.BatchNorm(16, activation="tanh", rngs=nnx.Rngs(0))
