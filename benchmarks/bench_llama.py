"""A Llama-style model of real width (examples/llama_train.py) with jaxnorm's
norms against the same model with Flax's: device time of a training step and
of a decode step (sum of kernel durations, as devtime.py measures them).

  python benchmarks/bench_llama.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp
import optax
from devtime import kernel_times, write_results

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from llama_train import (  # noqa: E402
    Config,
    Llama,
    batch_of,
    empty_caches,
    make_decode_step,
    make_train_step,
)

import jaxnorm  # noqa: E402

WIDE = dict(vocab=32000, hidden=4096, heads=32, ffn=11008, max_len=2048)


VARIANTS = {  # name: Config fields
    "jaxnorm": dict(norms="jaxnorm"),
    "jaxnorm, add unfused": dict(norms="jaxnorm", fuse_add=False),
    "flax": dict(norms="flax"),
}


def summary(variant: str, kernels: dict[str, float]):
    """(total µs, µs in jaxnorm's kernels); prints the largest kernels."""
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])
    print(f"# {variant}: " + ", ".join(f"{n[:50]} {us:.1f}" for n, us in ranked[:25]),
          flush=True)
    return sum(kernels.values()), sum(us for n, us in kernels.items() if "jaxnorm" in n)


def train_time(variant: str, layers: int, batch: int, seq: int):
    cfg = Config(**WIDE, layers=layers, **VARIANTS[variant])
    model = Llama(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))
    tx = optax.adamw(1e-4)
    opt_state = tx.init(params)
    step = make_train_step(model, tx)
    tokens = batch_of(jax.random.key(1), cfg, batch, seq + 1)
    kernels = kernel_times(step, params, opt_state, tokens, iters=5, warmup=2)
    return summary(variant, kernels)


def decode_time(variant: str, layers: int, batch: int, pos: int):
    cfg = Config(**WIDE, layers=layers, **VARIANTS[variant])
    model = Llama(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)  # served in bf16
    step = make_decode_step(model)
    caches = empty_caches(cfg, batch)
    tok = jnp.zeros((batch, 1), jnp.int32)
    kernels = kernel_times(step, params, tok, caches, jnp.int32(pos), iters=20)
    return summary(variant, kernels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    device = jax.devices()[0].device_kind
    cases = [
        ("train step", f"batch 4 x seq 1024, {args.layers} layers",
         lambda n: train_time(n, args.layers, 4, 1024)),
        ("decode step", f"batch 8, position 1000, {args.layers} layers",
         lambda n: decode_time(n, args.layers, 8, 1000)),
        ("decode step", f"batch 64, position 1000, {args.layers} layers",
         lambda n: decode_time(n, args.layers, 64, 1000)),
    ]
    records = []
    for what, shape, run in cases:
        times = {variant: run(variant) for variant in VARIANTS}
        for norms, (us, in_norms) in times.items():
            records.append(dict(step=what, shape=shape, norms=norms, us=round(us, 1),
                                jaxnorm_kernels_us=round(in_norms, 1),
                                flax_over_this=round(times["flax"][0] / us, 4)))
            print(records[-1], flush=True)
    meta = dict(device=device, date=datetime.date.today().isoformat(), jax=jax.__version__,
                jaxnorm=jaxnorm.__version__, model=dict(WIDE, layers=args.layers),
                dtype="bfloat16 activations, float32 parameters (bfloat16 for decode)")
    lines = [
        f"Device: {device}; date {meta['date']}; jax {jax.__version__}; Llama-style model, "
        f"hidden {WIDE['hidden']}, ffn {WIDE['ffn']}, {args.layers} layers; device time per step.",
        "",
        "| step | shape | norms | µs | of which jaxnorm kernels | Flax time / this |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in records:
        lines.append(f"| {r['step']} | {r['shape']} | {r['norms']} | {r['us']:.1f} | "
                     f"{r['jaxnorm_kernels_us']:.1f} | {r['flax_over_this']:.3f} |")
    write_results(args.out, "llama", device, meta, records, "\n".join(lines))


if __name__ == "__main__":
    main()
