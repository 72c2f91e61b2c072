"""The convolutional models of examples/unet_train.py with jaxnorm's GroupNorm
and BatchNorm against the same models with Flax's: device time of a training
step (sum of kernel durations, as devtime.py measures them), bf16.

- unet: the UNet-style denoiser (GroupNorm + SiLU + conv blocks), batch 16 of
  64x64 images, 128 channels in its first stage;
- resnet: the conv + BatchNorm + ReLU classifier, batch 128 of 56x56 images,
  64 channels, on one device;
- resnet_eval: the same classifier's inference (BatchNorm with the running
  statistics), its forward alone.

Three variants: jaxnorm's norms with the activation that follows each fused
into it (GroupNorm + SiLU, BatchNorm + ReLU), the same norms with the
activations apart (as Flax's model applies them), and Flax's norms. They
take turns, `--repeats` times each (a fresh compilation each time), and the
table gives the median with its range; the first round prints each
variant's longest kernels.

  python benchmarks/bench_unet.py --out DIR [--repeats 3] [--dump DUMP]

--dump writes each variant's every kernel (µs a step) and its compiled HLO
into DUMP, to tell which fusion does what.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import optax
from devtime import kernel_times_or_wall, write_results

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from unet_train import (  # noqa: E402
    Config,
    ResNet,
    UNet,
    images,
    labelled_images,
    make_classify_step,
    make_denoise_step,
)

MODELS = {  # name: (batch, image size, channels)
    "unet": (16, 64, 128),
    "resnet": (128, 56, 64),
    "resnet_eval": (128, 56, 64),
}
TINY = {"unet": (2, 16, 32), "resnet": (4, 16, 32),  # --tiny: checks the script
        "resnet_eval": (4, 16, 32)}


VARIANTS = {  # name: Config fields
    "jaxnorm": dict(norms="jaxnorm"),
    "jaxnorm, activations apart": dict(norms="jaxnorm", fuse_activations=False),
    "flax": dict(norms="flax"),
}


def build_step(model_name: str, variant: str, batch: int, size: int, channels: int):
    """The jitted step of a model and variant, and its arguments: a training
    step (state, then data: it returns the new state and the loss), or for
    resnet_eval the model's inference (variables and images: the logits)."""
    cfg = Config(**VARIANTS[variant], channels=channels, dtype=jnp.bfloat16)
    if model_name == "unet":
        model = UNet(cfg)
        x0 = images(jax.random.key(0), batch, size)
        params = model.init(jax.random.key(1), x0.astype(cfg.dtype))
        tx = optax.adam(1e-3)
        return make_denoise_step(model, tx), (params, tx.init(params), x0, jax.random.key(2))
    model = ResNet(cfg)
    x, labels = labelled_images(jax.random.key(3), batch, size)
    variables = model.init(jax.random.key(4), x.astype(cfg.dtype), train=False)
    if model_name == "resnet_eval":
        infer = jax.jit(lambda v, x: model.apply(v, x.astype(cfg.dtype), train=False))
        return infer, (variables, x)
    tx = optax.adam(1e-3)
    step = jax.jit(make_classify_step(model, tx))
    return step, (variables, tx.init(variables["params"]), x, labels)


def step_time_us(model_name: str, variant: str, batch: int, size: int, channels: int,
                 top: int = 0, dump: str | None = None) -> float:
    """The step's device time; with `top`, prints its `top` longest kernels;
    with `dump`, writes there every kernel's time and the compiled HLO."""
    step, args = build_step(model_name, variant, batch, size, channels)
    kernels = kernel_times_or_wall(step, *args, iters=10, warmup=2)
    if dump:
        os.makedirs(dump, exist_ok=True)
        stem = os.path.join(dump, f"{model_name}_{variant.replace(', ', '_').replace(' ', '_')}")
        with open(stem + "_kernels.txt", "w") as f:
            for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]):
                f.write(f"{v:9.1f}  {k}\n")
        with open(stem + "_hlo.txt", "w") as f:
            f.write(step.lower(*args).compile().as_text())
    if top:
        longest = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
        print(f"# {model_name} [{variant}] kernels (µs a step): "
              + ", ".join(f"{k[:40]} {v:.1f}" for k, v in longest), flush=True)
    return sum(kernels.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="small models, to check the script")
    ap.add_argument("--models", default=",".join(MODELS), help="e.g. resnet")
    ap.add_argument("--variants", default=";".join(VARIANTS), help="e.g. 'jaxnorm;flax'")
    ap.add_argument("--dump", default=None,
                    help="a directory for every kernel's time and the compiled HLO (first round)")
    args = ap.parse_args()
    device = jax.devices()[0].device_kind
    sizes = TINY if args.tiny else MODELS
    variants = args.variants.split(";")
    records, lines = [], []
    for name in args.models.split(","):
        batch, size, channels = sizes[name]
        times = {v: [] for v in variants}
        for r in range(args.repeats):
            for v in times:
                times[v].append(step_time_us(name, v, batch, size, channels,
                                             top=25 if r == 0 else 0,
                                             dump=args.dump if r == 0 else None))
                print(f"# {name} [{v}]: {times[v][-1]:.0f} µs", flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["flax"] / med["jaxnorm"] if {"flax", "jaxnorm"} <= med.keys() else float("nan")
        records.append(dict(model=name, batch=batch, size=size, channels=channels,
                            us={k: [round(t, 1) for t in v] for k, v in times.items()},
                            median_us={k: round(v, 1) for k, v in med.items()},
                            flax_over_jaxnorm=round(ratio, 3)))
        lines.append(f"| {name} | {batch}x{size}x{size}, {channels} ch | "
                     + " | ".join(f"{med[k]:.0f} ({min(v):.0f}-{max(v):.0f})"
                                  for k, v in times.items())
                     + f" | {ratio:.2f} |")
    table = "\n".join([
        f"Device: {device}; date {datetime.date.today().isoformat()}; jax {jax.__version__}; "
        f"bf16; device time of a training step (resnet_eval: of an inference forward), µs: "
        f"median of {args.repeats} compilations (range).",
        "",
        "| model | batch | " + " | ".join(variants) + " | flax / jaxnorm |",
        "|---|---|" + "---:|" * (len(variants) + 1),
        *lines,
    ])
    meta = dict(device=device, date=datetime.date.today().isoformat(), jax=jax.__version__,
                repeats=args.repeats)
    write_results(args.out, "unet", device, meta, records, table)


if __name__ == "__main__":
    main()
