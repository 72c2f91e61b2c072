"""One process of the two-process test (test_multiprocess.py): joins the job
with jax.distributed, builds a mesh over both processes' CPU devices, runs a
sharded forward and backward, and checks its own shards against the same
computation on one local device.

Usage: python multiprocess_worker.py COORDINATOR_ADDRESS PROCESS_ID NUM_PROCESSES
"""

import sys

import jax

address, process_id, num_processes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxnorm  # noqa: E402


def loss(x, scale, bias):
    return jnp.sum(jnp.sin(jaxnorm.layer_norm(x, scale, bias)))


def main():
    devices = np.array(jax.devices()).reshape(2, len(jax.devices()) // 2)
    mesh = Mesh(devices, ("data", "model"))  # 'data' spans the two processes
    rng = np.random.default_rng(0)  # the same global inputs in every process
    x = rng.standard_normal((8, 16, 64)).astype(np.float32) + 1
    scale = rng.standard_normal(64).astype(np.float32)
    bias = rng.standard_normal(64).astype(np.float32)

    def global_array(a, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    for x_spec, p_spec in [(P("data"), P()), (P("data", None, "model"), P("model"))]:
        args = (global_array(x, x_spec), global_array(scale, p_spec), global_array(bias, p_spec))
        value, grads = step(*args)
        with jax.default_device(jax.local_devices()[0]):
            want_value, want_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
                x, scale, bias
            )
        np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
        for got, want in zip(grads, want_grads):
            for shard in got.addressable_shards:
                np.testing.assert_allclose(
                    np.asarray(shard.data), np.asarray(want)[shard.index], rtol=1e-4, atol=1e-4
                )
        print(f"process {process_id}: {x_spec} ok, loss {float(value):.6f}", flush=True)


main()
jax.distributed.shutdown()
