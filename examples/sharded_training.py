"""Train a small Flax model with data and tensor parallelism, jaxnorm norms inside.

The mesh is (data, model) over all local devices. The batch is split over
`data`; the residual stream's hidden dim and the MLP weights are split over
`model`, so every norm normalizes rows whose hidden dim is spread over several
devices: jaxnorm combines per-row statistics with one small all-reduce instead
of gathering the activations. Runs on GPUs, or on CPU with virtual devices:

    python examples/sharded_training.py                  # 8 CPU devices on a CPU machine
    python examples/sharded_training.py --steps 50
"""

from __future__ import annotations

import argparse
import re

import jax


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--cpu-devices", type=int, default=8,
                   help="virtual CPU devices (used when the backend is CPU)")
    return p.parse_args()


ARGS = parse_args()
jax.config.update("jax_num_cpu_devices", ARGS.cpu_devices)  # before any jax use

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxnorm  # noqa: E402

HIDDEN, LAYERS, BATCH, SEQ, FEATURES = 256, 4, 32, 16, 32


def mesh_of_local_devices() -> Mesh:
    n = jax.local_device_count()
    model = 2 if n % 2 == 0 else 1
    return Mesh(np.array(jax.local_devices()).reshape(n // model, model), ("data", "model"))


def residual_constraint(x):
    """The residual stream: batch over 'data', hidden over 'model'."""
    return jax.lax.with_sharding_constraint(x, P("data", None, "model"))


class Block(nn.Module):
    """Pre-norm MLP block: x + W2 gelu(W1 rms_norm(x))."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("norm_scale", nn.with_partitioning(nn.initializers.ones, ("model",)),
                           (HIDDEN,))
        h = jaxnorm.rms_norm(x, scale)
        h = nn.Dense(4 * HIDDEN, use_bias=False,
                     kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                      (None, "model")))(h)
        h = nn.Dense(HIDDEN, use_bias=False,
                     kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                      ("model", None)))(nn.gelu(h))
        return residual_constraint(x + h)


class Model(nn.Module):
    @nn.compact
    def __call__(self, inputs):
        x = residual_constraint(nn.Dense(HIDDEN, use_bias=False)(inputs))
        for _ in range(LAYERS):
            x = Block()(x)
        scale = self.param("final_scale", nn.with_partitioning(nn.initializers.ones, ("model",)),
                           (HIDDEN,))
        bias = self.param("final_bias", nn.with_partitioning(nn.initializers.zeros, ("model",)),
                          (HIDDEN,))
        return nn.Dense(1)(jaxnorm.layer_norm(x, scale, bias))[..., 0]


def make_data(key):
    """A fixed nonlinear target, so the loss has something to learn."""
    k_in, k_teacher = jax.random.split(key)
    inputs = jax.random.normal(k_in, (BATCH, SEQ, FEATURES))
    teacher = jax.random.normal(k_teacher, (FEATURES,)) / np.sqrt(FEATURES)
    return inputs, jnp.sin(3 * inputs @ teacher)


def main():
    mesh = mesh_of_local_devices()
    print(f"devices: {jax.local_device_count()} x {jax.devices()[0].device_kind}, "
          f"mesh {dict(mesh.shape)}")
    model = Model()
    optimizer = optax.adam(3e-4)
    inputs, targets = make_data(jax.random.key(0))

    with jax.set_mesh(mesh):
        data_sharding = NamedSharding(mesh, P("data"))
        inputs, targets = jax.device_put((inputs, targets), data_sharding)

        @jax.jit
        def init(key):
            params = model.init(key, inputs)
            return params, optimizer.init(params)

        @jax.jit
        def train_step(params, opt_state, inputs, targets):
            def loss_fn(params):
                return jnp.mean((model.apply(params, inputs) - targets) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        params, opt_state = init(jax.random.key(1))
        compiled = train_step.lower(params, opt_state, inputs, targets).compile()
        ops = re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all)\(",
                         compiled.as_text())
        # The norms add all-reduces of a few floats per row; the all-gathers
        # are the column-parallel Dense layers collecting whole rows of their
        # inputs.
        print("collectives in one step:", {k: ops.count(k) for k in sorted(set(ops))})
        for step in range(ARGS.steps):
            params, opt_state, loss = train_step(params, opt_state, inputs, targets)
            if step % 5 == 0 or step == ARGS.steps - 1:
                print(f"step {step:3d}  loss {float(loss):.5f}")


if __name__ == "__main__":
    main()
