"""BatchNorm's elementwise half (y in the forward and in evaluation, dx in the
backward) in jaxnorm's channel kernels instead of XLA's fusion, on this GPU:
the benchmark's batch_norm rows, XLA's own bfloat16 elementwise ceiling at
the same shapes, and the ResNet training step of bench_unet.py.

    python benchmarks/trials/bn_elementwise_kernels.py [--repeats 2]

Without a fused activation (these rows) jaxnorm hands the elementwise half
to XLA (channel_norm._Config's xla_elementwise) so that XLA fuses it with the
ReLU and residual add that follow; "kernels" rebuilds each call with that
off. With an activation fused jaxnorm takes the kernels' form already.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import bench_row_norm as brn  # noqa: E402
import bench_unet  # noqa: E402
from devtime import kernel_summary, kernel_times  # noqa: E402

from jaxnorm import channel_norm  # noqa: E402


@contextlib.contextmanager
def elementwise_in_kernels(on: bool):
    """While on, BatchNorm's calls traced keep y and dx in the kernels."""
    original = channel_norm._Config
    jax.clear_caches()  # (jit's traces of the same function are shared)
    if on:
        channel_norm._Config = lambda *a, **k: original(*a, **k)._replace(xla_elementwise=False)
    try:
        yield
    finally:
        channel_norm._Config = original
        jax.clear_caches()


def xla_bf16_scale(x):
    """XLA's loop fusion over x's bytes with nothing per channel: its ceiling."""
    return (x.astype(jnp.float32) * 2).astype(x.dtype)


def ops_alone():
    for op in ("batch_norm_eval", "batch_norm"):
        for pass_ in brn.PASSES.get(op, ("fwd", "fwd+bwd")):
            for shape in brn.large_shapes(op):
                t = {}
                for name, impl, kernels in (("xla", "xla", False), ("jaxnorm", "jaxnorm", False),
                                            ("kernels", "jaxnorm", True)):
                    with elementwise_in_kernels(kernels):
                        times = kernel_times(*brn._jax_call(op, impl, pass_, shape,
                                                            jnp.bfloat16))
                    t[name] = sum(times.values())
                    print(f"# {op} {pass_} {shape} {name}: {kernel_summary(times)}", flush=True)
                n = math.prod(shape)
                copy_us = (2 if pass_ == "fwd" else 3) * 2 * n / brn.COPY_GBPS / 1e3
                print(f"{op:16s} {pass_:7s} {'x'.join(map(str, shape)):14s} "
                      f"xla {t['xla']:6.1f}  jaxnorm {t['jaxnorm']:6.1f} "
                      f"({copy_us / t['jaxnorm']:4.0%}, {t['xla'] / t['jaxnorm']:.2f}x)  "
                      f"kernels {t['kernels']:6.1f} ({copy_us / t['kernels']:4.0%}, "
                      f"{t['xla'] / t['kernels']:.2f}x)", flush=True)
    for shape in brn.large_shapes("batch_norm"):
        x, _, _ = brn.inputs("batch_norm", shape, jnp.bfloat16)
        times = kernel_times(jax.jit(xla_bf16_scale), x)
        us = sum(times.values())
        copy_us = 2 * 2 * x.size / brn.COPY_GBPS / 1e3
        print(f"xla bf16 x*2      fwd     {'x'.join(map(str, shape)):14s} {us:6.1f} µs "
              f"({copy_us / us:4.0%})  [{kernel_summary(times)}]", flush=True)


def resnet_steps(repeats: int):
    batch, size, channels = bench_unet.MODELS["resnet"]
    times = {"jaxnorm": [], "kernels": [], "flax": []}
    for r in range(repeats):
        for name in times:
            with elementwise_in_kernels(name == "kernels"):
                variant = "flax" if name == "flax" else "jaxnorm"
                times[name].append(bench_unet.step_time_us("resnet", variant, batch, size,
                                                           channels, top=12 if r == 0 else 0))
            print(f"# resnet [{name}]: {times[name][-1]:.0f} µs", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("resnet step, median µs: " + ", ".join(f"{k} {v:.0f}" for k, v in med.items())
          + f"; flax / jaxnorm {med['flax'] / med['jaxnorm']:.3f}, "
          f"flax / kernels {med['flax'] / med['kernels']:.3f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    brn.COPY_GBPS = brn.copy_bandwidth_gbps()
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"copy {brn.COPY_GBPS:.0f} GB/s", flush=True)
    ops_alone()
    if args.repeats:
        resnet_steps(args.repeats)


if __name__ == "__main__":
    main()
