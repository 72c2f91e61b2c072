"""The row norms inside shard_map (check_vma on), with and without grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from reference import assert_close

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
