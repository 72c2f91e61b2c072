"""Convolutional models trained with jaxnorm's GroupNorm and BatchNorm modules.

1. A small UNet-style denoiser (GroupNorm + SiLU + 3x3 conv residual blocks,
   one down- and one up-sampling stage), trained for a few steps to predict
   the noise added to synthetic images: the diffusion training objective.
   jaxnorm's GroupNorm fuses the SiLU that follows it.
2. A ResNet-style classifier (conv + BatchNorm + ReLU blocks) trained with
   data parallelism over all local devices: the batch is sharded over a
   `data` mesh axis under jit, and each BatchNorm's statistics are those of
   the whole batch (one all-gather per norm, done by jaxnorm's partitioning
   rule), so batch_stats stay identical on every device. The example checks
   them against the same step run on one device.

Each model is built with jaxnorm's modules or Flax's (`--norms`), the same
parameters either way; with `--norms both` the example trains both and
prints their step times (wall clock; `benchmarks/bench_unet.py` measures
device time on a GPU).

  python examples/unet_train.py [--steps 30] [--norms both]
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxnorm.linen


@dataclass(frozen=True)
class Config:
    norms: str = "jaxnorm"      # or "flax"
    fuse_activations: bool = True  # jaxnorm's norms take the activation after them
    channels: int = 64          # of the first stage; the second has twice as many
    groups: int = 32
    dtype: jnp.dtype = jnp.float32


def group_norm_silu(cfg: Config, name: str):
    """GroupNorm followed by SiLU: one kernel with jaxnorm, two ops with Flax."""
    if cfg.norms == "jaxnorm" and cfg.fuse_activations:
        return jaxnorm.linen.GroupNorm(num_groups=cfg.groups, dtype=cfg.dtype,
                                       activation="silu", name=name)
    group_norm = jaxnorm.linen.GroupNorm if cfg.norms == "jaxnorm" else nn.GroupNorm
    norm = group_norm(num_groups=cfg.groups, dtype=cfg.dtype, name=name)
    return lambda x: nn.silu(norm(x))


class ResBlock(nn.Module):
    cfg: Config
    features: int

    @nn.compact
    def __call__(self, x):
        h = group_norm_silu(self.cfg, "norm1")(x)
        h = nn.Conv(self.features, (3, 3), dtype=self.cfg.dtype, name="conv1")(h)
        h = group_norm_silu(self.cfg, "norm2")(h)
        h = nn.Conv(self.features, (3, 3), dtype=self.cfg.dtype, name="conv2")(h)
        if x.shape[-1] != self.features:
            x = nn.Conv(self.features, (1, 1), dtype=self.cfg.dtype, name="skip")(x)
        return x + h


class UNet(nn.Module):
    """Predicts the noise in x_t (NHWC)."""

    cfg: Config

    @nn.compact
    def __call__(self, x):
        c = self.cfg.channels
        h = nn.Conv(c, (3, 3), dtype=self.cfg.dtype, name="conv_in")(x)
        skip = ResBlock(self.cfg, c, name="down")(h)
        h = nn.Conv(2 * c, (3, 3), strides=2, dtype=self.cfg.dtype, name="downsample")(skip)
        h = ResBlock(self.cfg, 2 * c, name="mid")(h)
        h = jax.image.resize(h, skip.shape[:3] + (h.shape[-1],), "nearest")
        h = ResBlock(self.cfg, c, name="up")(jnp.concatenate([h, skip], axis=-1))
        h = group_norm_silu(self.cfg, "norm_out")(h)
        return nn.Conv(x.shape[-1], (3, 3), dtype=jnp.float32, name="conv_out")(h)


def images(key, batch: int, size: int, channels: int = 3):
    """Smooth synthetic images: a few random Gaussian blobs each."""
    k1, k2, k3 = jax.random.split(key, 3)
    centers = jax.random.uniform(k1, (batch, 4, 2)) * size
    widths = 2.0 + jax.random.uniform(k2, (batch, 4, 1)) * size / 6
    colors = jax.random.normal(k3, (batch, 4, channels))
    grid = jnp.stack(jnp.meshgrid(jnp.arange(size), jnp.arange(size), indexing="ij"), -1)
    d2 = jnp.sum((grid[None, None] - centers[:, :, None, None]) ** 2, -1)  # (B, 4, S, S)
    blobs = jnp.exp(-d2 / (2 * widths[..., None] ** 2))
    return jnp.einsum("bkhw,bkc->bhwc", blobs, colors)


def make_denoise_step(model, tx):
    @jax.jit
    def step(params, opt_state, x0, key):
        k1, k2 = jax.random.split(key)
        t = jax.random.uniform(k1, (x0.shape[0], 1, 1, 1), minval=0.05, maxval=0.95)
        noise = jax.random.normal(k2, x0.shape)
        xt = jnp.sqrt(1 - t) * x0 + jnp.sqrt(t) * noise

        def loss_fn(p):
            return jnp.mean((model.apply(p, xt.astype(model.cfg.dtype)) - noise) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


class ResNet(nn.Module):
    """conv + BatchNorm + ReLU blocks with residual connections, then a linear
    classifier on the pooled features. jaxnorm's BatchNorm takes a ReLU that
    follows it as its fused activation (the same parameters and statistics)."""

    cfg: Config
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool):
        batch_norm = (jaxnorm.linen.BatchNorm if self.cfg.norms == "jaxnorm"
                      else nn.BatchNorm)
        norm = functools.partial(batch_norm, use_running_average=not train, momentum=0.9,
                                 dtype=self.cfg.dtype)

        def norm_relu(name, h):
            if self.cfg.norms == "jaxnorm" and self.cfg.fuse_activations:
                return norm(name=name, activation="relu")(h)
            return nn.relu(norm(name=name)(h))

        # No conv bias: the BatchNorm after each conv subtracts any per-channel
        # constant, so a bias there would be a parameter without effect (as in
        # Flax's and torchvision's ResNets).
        conv = functools.partial(nn.Conv, self.cfg.channels, (3, 3), use_bias=False,
                                 dtype=self.cfg.dtype)
        h = norm_relu("bn_in", conv()(x))
        for i in range(2):
            r = norm_relu(f"bn{i}a", conv()(h))
            r = norm(name=f"bn{i}b")(conv()(r))
            h = nn.relu(h + r)
        return nn.Dense(self.classes, dtype=jnp.float32)(jnp.mean(h, axis=(1, 2)))


def labelled_images(key, batch: int, size: int):
    """Images whose label is the position (of 10) of their brightest blob's centre."""
    x = images(key, batch, size, channels=3)
    energy = jnp.sum(x ** 2, axis=-1).reshape(batch, -1)
    labels = (jnp.argmax(energy, axis=-1) * 10) // (size * size)
    return x, labels


def make_classify_step(model, tx):
    def step(variables, opt_state, x, labels):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": variables["batch_stats"]},
                x.astype(model.cfg.dtype), train=True, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        return {"params": params, "batch_stats": stats}, opt_state, loss

    return step


def median_step_ms(step, state: tuple, data: tuple, steps: int):
    """Runs `steps` steps of step(*state, *data) -> (*state, loss); the
    median wall-clock time of the steps after the first (compilation), and
    the losses."""
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        *state, loss = step(*state, *data)
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times[1:])), losses


def train_unet(cfg: Config, args):
    model = UNet(cfg)
    x0 = images(jax.random.key(0), args.batch, args.size)
    params = model.init(jax.random.key(1), x0.astype(cfg.dtype))
    tx = optax.adam(2e-3)
    step = make_denoise_step(model, tx)
    keys = iter(jax.random.split(jax.random.key(2), args.steps))

    def one(params, opt_state):
        return step(params, opt_state, x0, next(keys))

    ms, losses = median_step_ms(one, (params, tx.init(params)), (), args.steps)
    for i in range(0, args.steps, max(1, args.steps // 5)):
        print(f"  unet [{cfg.norms}] step {i:3d}  loss {losses[i]:.4f}")
    print(f"  unet [{cfg.norms}] loss {losses[-1]:.4f} at the last step; {ms:.1f} ms a step")
    return ms


def train_resnet(cfg: Config, args):
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    batch = args.batch * len(devices)
    model = ResNet(cfg)
    x, labels = labelled_images(jax.random.key(3), batch, args.size)
    variables = model.init(jax.random.key(4), x.astype(cfg.dtype), train=False)
    tx = optax.adam(3e-3)
    opt_state = tx.init(variables["params"])
    step = make_classify_step(model, tx)
    replicated = NamedSharding(mesh, P())
    data = NamedSharding(mesh, P("data"))
    sharded_step = jax.jit(step, in_shardings=(replicated, replicated, data, data),
                           out_shardings=(replicated, replicated, replicated))
    x_sh, labels_sh = jax.device_put(x, data), jax.device_put(labels, data)
    # One step on one device from the same state: batch_stats must agree.
    one_device = jax.jit(step)(variables, opt_state, x, labels)[0]["batch_stats"]
    first = sharded_step(variables, opt_state, x_sh, labels_sh)[0]["batch_stats"]
    gap = max(float(jnp.max(jnp.abs(a - b)))
              for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(one_device)))
    ms, losses = median_step_ms(sharded_step, (variables, opt_state), (x_sh, labels_sh),
                                args.steps)
    for i in range(0, args.steps, max(1, args.steps // 5)):
        print(f"  resnet [{cfg.norms}] step {i:3d}  loss {losses[i]:.4f}")
    print(f"  resnet [{cfg.norms}] data parallel over {len(devices)} devices "
          f"(mesh {dict(mesh.shape)}), batch {batch}; batch_stats after one step differ from "
          f"one device's by at most {gap:.2g}; loss {losses[-1]:.4f} at the last step; "
          f"{ms:.1f} ms a step")
    assert gap < 1e-4 * (1 if cfg.dtype == jnp.float32 else 100), gap
    return ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="per device for the ResNet")
    parser.add_argument("--size", type=int, default=32, help="image height and width")
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--norms", choices=["jaxnorm", "flax", "both"], default="jaxnorm")
    parser.add_argument("--bf16", action="store_true", help="compute in bfloat16")
    parser.add_argument("--cpu-devices", type=int, default=8,
                        help="virtual CPU devices (used when the backend is CPU)")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before any computation
    print(f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind}")
    dtype = jnp.bfloat16 if args.bf16 else jnp.float32
    norms = ["jaxnorm", "flax"] if args.norms == "both" else [args.norms]
    times = {}
    for which in norms:
        cfg = Config(norms=which, channels=args.channels, dtype=dtype)
        times[which] = (train_unet(cfg, args), train_resnet(cfg, args))
    if len(times) == 2:
        for i, name in enumerate(("unet", "resnet")):
            ratio = times["flax"][i] / times["jaxnorm"][i]
            print(f"{name}: Flax's norms {times['flax'][i]:.1f} ms a step, jaxnorm's "
                  f"{times['jaxnorm'][i]:.1f} ms: {ratio:.2f}x (wall clock)")


if __name__ == "__main__":
    main()
