"""RMSNorm, LayerNorm, fused add+RMSNorm, GroupNorm, BatchNorm, the channel
softmax and local response normalization: jaxnorm
against XLA's fused jnp implementation of the same math (same dtypes, float32
statistics), Flax's own LayerNorm, GroupNorm and BatchNorm modules (their
one-pass variance) and, where they import, PyTorch eager, torch.compile and
Liger-Kernel (torch_peers.py), as device kernel time, forward and
forward+backward, on the large shapes and the decode shapes (more decode
shapes for the forwards of RMSNorm and add+RMSNorm). GroupNorm (32 groups)
and BatchNorm (training; evaluation, forward only; each also followed by
ReLU, jaxnorm's fused) take NHWC bf16 x with
float32 scale and bias, as in a Flax convolutional model; the softmax and
LRN NHWC bf16 x, along the channels.

add+RMSNorm forward, jaxnorm: the fused kernel's time, as in a model or with x
and residual donated, where it works in place; a standalone call on inputs that
stay live adds XLA's copies of them first (listed in the log, not counted).

Prints a markdown table and writes it, the records (JSON) and a chart of the
bandwidth each implementation reaches (PNG, with matplotlib):
  python benchmarks/bench_row_norm.py --out DIR
--ops and --shapes measure some cases only; --update then keeps the other
cases' records from an earlier run's JSON in DIR (and says so in the table).
--standing JSON prints an earlier run's standing against the bars (also at the
end of the table) without measuring.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import torch_peers
from devtime import (
    copy_bandwidth_gbps,
    kernel_summary,
    kernel_times,
    results_stem,
    write_results,
)

import jaxnorm

try:  # a peer where it imports
    import flax.linen as flax_nn
except ImportError:
    flax_nn = None

LARGE = [(16384, 4096), (4096, 8192), (65536, 1024), (8192, 12288), (2048, 32768),
         (512, 65536)]
DECODE = [(1, 4096), (64, 4096), (256, 4096)]
DECODE_FWD = [(t, h) for h in (4096, 8192) for t in (1, 8, 64, 256)]


def xla_rms_norm(x, scale, epsilon=1e-6):
    xf = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + epsilon)
    return (xf * rstd * scale.astype(jnp.float32)).astype(x.dtype)


def xla_layer_norm(x, scale, bias, epsilon=1e-5):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xc = xf - mean
    rstd = jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + epsilon)
    y = xc * rstd * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def xla_add_rms_norm(x, residual, scale, epsilon=1e-6):
    h = x + residual
    return xla_rms_norm(h, scale, epsilon), h


GROUPS = 32
GROUP_SHAPES = [(16, 64, 64, 320), (8, 32, 32, 1280), (4, 128, 128, 128), (1, 512, 512, 64)]
# Smaller batches, outside the bars: a sample a cluster of blocks on H100/H200.
GROUP_BATCHES = [(4, 32, 32, 1280), (16, 16, 16, 1280)]
BATCH_SHAPES = [(256, 56, 56, 64), (128, 28, 28, 256), (64, 14, 14, 1024)]


def xla_group_norm(x, scale, bias, epsilon=1e-5):
    """NHWC GroupNorm as Flax's GroupNorm computes it (float32 statistics)."""
    n, c = x.shape[0], x.shape[-1]
    xg = x.astype(jnp.float32).reshape(n, -1, GROUPS, c // GROUPS)
    mean = jnp.mean(xg, axis=(1, 3), keepdims=True)
    var = jnp.mean(jnp.square(xg - mean), axis=(1, 3), keepdims=True)
    y = ((xg - mean) * jax.lax.rsqrt(var + epsilon)).reshape(x.shape)
    return (y * scale + bias).astype(x.dtype)


def xla_batch_norm(x, scale, bias, running_mean, running_var, epsilon=1e-5, momentum=0.99):
    """NHWC BatchNorm in training as Flax's computes it: (y, new running mean,
    new running variance)."""
    xf = x.astype(jnp.float32)
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(xf, axis=axes)
    var = jnp.mean(jnp.square(xf - mean), axis=axes)
    y = ((xf - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias).astype(x.dtype)
    return (y, momentum * running_mean + (1 - momentum) * mean,
            momentum * running_var + (1 - momentum) * var)


def xla_batch_norm_relu(x, scale, bias, running_mean, running_var):
    """xla_batch_norm then ReLU, as a ResNet's block applies them."""
    y, mean, var = xla_batch_norm(x, scale, bias, running_mean, running_var)
    return jax.nn.relu(y), mean, var


def xla_batch_norm_eval(x, scale, bias, running_mean, running_var, epsilon=1e-5):
    y = (x.astype(jnp.float32) - running_mean) * jax.lax.rsqrt(running_var + epsilon)
    return (y * scale + bias).astype(x.dtype)


def xla_batch_norm_relu_eval(x, scale, bias, running_mean, running_var):
    return jax.nn.relu(xla_batch_norm_eval(x, scale, bias, running_mean, running_var))


# Softmax over classes at each pixel (segmentation: 21 and 150 classes) and
# over 1000 ImageNet classes; LRN as in AlexNet (size 5) on its first two
# feature maps. NHWC: the channels last, as in Flax.
ALONG_SHAPES = {"channel_softmax": [(16, 128, 128, 21), (16, 64, 64, 150), (16384, 1000)],
                "channel_softmax_nchw": [(16, 150, 64, 64)],
                "local_response_norm": [(128, 55, 55, 96), (128, 27, 27, 256)],
                "local_response_norm_nchw": [(128, 96, 55, 55)]}
LRN = dict(size=5, alpha=1e-4, beta=0.75, k=2.0)


def xla_channel_softmax(x, axis=-1):
    return jax.nn.softmax(x.astype(jnp.float32), axis=axis).astype(x.dtype)


def xla_local_response_norm(x, axis=-1):
    """PyTorch's LRN: the window sums as a reduce_window over the channels,
    zero padded."""
    size, axis = LRN["size"], axis % x.ndim
    xf = x.astype(jnp.float32)
    window = tuple(size if d == axis else 1 for d in range(x.ndim))
    pads = tuple((size // 2, (size - 1) // 2) if d == axis else (0, 0) for d in range(x.ndim))
    sums = jax.lax.reduce_window(xf * xf, 0.0, jax.lax.add, window, (1,) * x.ndim, pads)
    return (xf * (LRN["k"] + LRN["alpha"] / size * sums) ** -LRN["beta"]).astype(x.dtype)


def jaxnorm_channel_softmax(x, axis=-1):
    return jaxnorm.channel_softmax(x, channel_axis=axis)


def jaxnorm_local_response_norm(x, axis=-1):
    return jaxnorm.local_response_norm(x, channel_axis=axis, **LRN)


def jaxnorm_group_norm(x, scale, bias):
    return jaxnorm.group_norm(x, GROUPS, scale, bias)


def jaxnorm_batch_norm(x, scale, bias, running_mean, running_var):
    return jaxnorm.batch_norm(x, scale, bias, running_mean, running_var, training=True)


def jaxnorm_batch_norm_relu(x, scale, bias, running_mean, running_var):
    return jaxnorm.batch_norm(x, scale, bias, running_mean, running_var, training=True,
                              activation="relu")


def jaxnorm_batch_norm_eval(x, scale, bias, running_mean, running_var):
    return jaxnorm.batch_norm(x, scale, bias, running_mean, running_var, training=False)[0]


def jaxnorm_batch_norm_relu_eval(x, scale, bias, running_mean, running_var):
    return jaxnorm.batch_norm(x, scale, bias, running_mean, running_var, training=False,
                              activation="relu")[0]


# Flax's own modules, as a model applies them (dtype x's, float32 statistics):
# their defaults compute the variance in one pass, E[x^2] - E[x]^2
# (use_fast_variance), where the xla_* forms above subtract the mean first.
# Faster where XLA reduces over columns (GroupNorm, BatchNorm: x read once
# for both moments), but it cancels where |mean| >> std, which jaxnorm's
# shifted sums do not.


def flax_layer_norm(x, scale, bias, epsilon=1e-5):
    return flax_nn.LayerNorm(epsilon=epsilon, dtype=x.dtype).apply(
        {"params": {"scale": scale, "bias": bias}}, x)


def flax_group_norm(x, scale, bias, epsilon=1e-5):
    return flax_nn.GroupNorm(GROUPS, epsilon=epsilon, dtype=x.dtype).apply(
        {"params": {"scale": scale, "bias": bias}}, x)


def _flax_batch_norm(x, scale, bias, running_mean, running_var, *, training,
                     epsilon=1e-5, momentum=0.99):
    """Flax's BatchNorm on x: y and the running statistics after the call."""
    stats = {"mean": running_mean, "var": running_var}
    y, state = flax_nn.BatchNorm(use_running_average=not training, momentum=momentum,
                                 epsilon=epsilon, dtype=x.dtype).apply(
        {"params": {"scale": scale, "bias": bias}, "batch_stats": stats}, x,
        mutable=["batch_stats"])
    stats = state.get("batch_stats", stats)
    return y, stats["mean"], stats["var"]


def flax_batch_norm(x, scale, bias, running_mean, running_var):
    return _flax_batch_norm(x, scale, bias, running_mean, running_var, training=True)


def flax_batch_norm_relu(x, scale, bias, running_mean, running_var):
    y, mean, var = flax_batch_norm(x, scale, bias, running_mean, running_var)
    return jax.nn.relu(y), mean, var


def flax_batch_norm_relu_eval(x, scale, bias, running_mean, running_var):
    y = _flax_batch_norm(x, scale, bias, running_mean, running_var, training=False)[0]
    return jax.nn.relu(y)


IMPLS = {
    "rms_norm": {"jaxnorm": jaxnorm.rms_norm, "xla": xla_rms_norm},
    "layer_norm": {"jaxnorm": jaxnorm.layer_norm, "xla": xla_layer_norm,
                   "flax": flax_layer_norm},
    "add_rms_norm": {"jaxnorm": jaxnorm.add_rms_norm, "xla": xla_add_rms_norm},
    "group_norm": {"jaxnorm": jaxnorm_group_norm, "xla": xla_group_norm,
                   "flax": flax_group_norm},
    "batch_norm": {"jaxnorm": jaxnorm_batch_norm, "xla": xla_batch_norm,
                   "flax": flax_batch_norm},
    "batch_norm_relu": {"jaxnorm": jaxnorm_batch_norm_relu, "xla": xla_batch_norm_relu,
                        "flax": flax_batch_norm_relu},
    "batch_norm_eval": {"jaxnorm": jaxnorm_batch_norm_eval, "xla": xla_batch_norm_eval},
    "batch_norm_relu_eval": {"jaxnorm": jaxnorm_batch_norm_relu_eval,
                             "xla": xla_batch_norm_relu_eval, "flax": flax_batch_norm_relu_eval},
    "channel_softmax": {"jaxnorm": jaxnorm_channel_softmax, "xla": xla_channel_softmax},
    "channel_softmax_nchw": {
        "jaxnorm": functools.partial(jaxnorm_channel_softmax, axis=1),
        "xla": functools.partial(xla_channel_softmax, axis=1)},
    "local_response_norm": {"jaxnorm": jaxnorm_local_response_norm,
                            "xla": xla_local_response_norm},
    "local_response_norm_nchw": {
        "jaxnorm": functools.partial(jaxnorm_local_response_norm, axis=1),
        "xla": functools.partial(xla_local_response_norm, axis=1)},
}
if flax_nn is None:
    for impls in IMPLS.values():
        impls.pop("flax", None)
# The tables' columns in this order; others after.
IMPL_ORDER = ("jaxnorm", "xla", "flax", "torch", "torch.compile", "liger")
CHANNEL_OPS = ("group_norm", "batch_norm", "batch_norm_relu", "batch_norm_eval",
               "batch_norm_relu_eval")
PASSES = {"batch_norm_eval": ("fwd",), "batch_norm_relu_eval": ("fwd",)}  # others: both
# The bars: percent of the measured copy bandwidth on the large shapes, and
# jaxnorm's speed-up over XLA on every shape.
BARS = {("fwd", "rms_norm"): 90, ("fwd", "layer_norm"): 90, ("fwd", "add_rms_norm"): 90,
        ("fwd+bwd", "rms_norm"): 85, ("fwd+bwd", "layer_norm"): 85,
        ("fwd", "group_norm"): 75, ("fwd+bwd", "group_norm"): 65,
        ("fwd", "batch_norm_eval"): 85, ("fwd", "batch_norm_relu_eval"): 85}
XLA_BARS = {("fwd", "group_norm"): 2.0, ("fwd+bwd", "group_norm"): 2.0,
            ("fwd", "batch_norm"): 1.5, ("fwd+bwd", "batch_norm"): 1.5}


def bytes_per_element(op, pass_):
    """Bytes each op must move per element of x, at the least (in x's dtype):
    read x and write y; forward+backward read x and dy and write dx; the
    residual add reads and writes one more."""
    return (2 if pass_ == "fwd" else 3) + (2 if op.startswith("add") else 0)


def large_shapes(op):
    return {"group_norm": GROUP_SHAPES, "batch_norm": BATCH_SHAPES,
            "batch_norm_relu": BATCH_SHAPES, "batch_norm_eval": BATCH_SHAPES,
            "batch_norm_relu_eval": BATCH_SHAPES,
            **ALONG_SHAPES}.get(op, LARGE)


def inputs(op, shape, dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    dy = jnp.asarray(rng.standard_normal(shape), dtype)
    if op in ALONG_SHAPES:
        return x, [], dy
    if op in CHANNEL_OPS:  # float32 parameters (and running statistics)
        c = shape[-1]
        params = [jnp.asarray(rng.standard_normal(c) + 1, jnp.float32),
                  jnp.asarray(rng.standard_normal(c), jnp.float32)]
        if op.startswith("batch_norm"):
            params += [jnp.asarray(rng.standard_normal(c), jnp.float32),
                       jnp.asarray(np.abs(rng.standard_normal(c)) + 0.5, jnp.float32)]
        return x, params, dy
    params = [jnp.asarray(rng.standard_normal(shape[-1]) + 1, dtype)]
    if op == "add_rms_norm":  # residual first; dy: the cotangents of y and h
        params.insert(0, jnp.asarray(rng.standard_normal(shape), dtype))
        dy = (dy, jnp.asarray(rng.standard_normal(shape), dtype))
    if op == "layer_norm":
        params.append(jnp.asarray(rng.standard_normal(shape[-1]), dtype))
    return x, params, dy


def timed(op, impl, pass_, shape, dtype):
    kernels = kernel_times(*_jax_call(op, impl, pass_, shape, dtype))
    print(f"# {op} {pass_} {shape} {impl}: {kernel_summary(kernels)}", flush=True)
    if op == "add_rms_norm" and pass_ == "fwd" and impl == "jaxnorm":
        return sum(us for name, us in kernels.items() if "jaxnorm" in name)
    return sum(kernels.values())


def _jax_call(op, impl, pass_, shape, dtype):
    f = IMPLS[op][impl]
    x, params, dy = inputs(op, shape, dtype)
    if pass_ == "fwd":
        return jax.jit(f), x, *params
    if op in ("batch_norm", "batch_norm_relu"):  # the gradients of x, scale and bias through y
        def f(x, scale, bias, *running, f=f):
            return f(x, scale, bias, *running)[0]

        differentiable = 3
    else:
        differentiable = 1 + len(params)

    # the primal output is unused, as under jax.grad
    def grads(x, dy, *p):
        fixed = p[differentiable - 1:]
        return jax.vjp(lambda *a: f(*a, *fixed), x, *p[:differentiable - 1])[1](dy)

    return jax.jit(grads), x, dy, *params


def shapes_for(op, pass_, shapes):
    """The op's shapes: its defaults, or those of `shapes` of a rank among
    the defaults' (so one --shapes list serves row and channel ops)."""
    if op in CHANNEL_OPS or op in ALONG_SHAPES:
        defaults = large_shapes(op) + (GROUP_BATCHES if op == "group_norm" else [])
    else:
        defaults = LARGE + (DECODE_FWD if pass_ == "fwd" and op != "layer_norm" else DECODE)
    if shapes is None:
        return defaults
    ranks = {len(s) for s in defaults}
    return [s for s in shapes if len(s) in ranks]


def measure(ops, shapes, dtype, peers):
    cases = [(op, pass_, shape) for op in ops for pass_ in PASSES.get(op, ("fwd", "fwd+bwd"))
             for shape in shapes_for(op, pass_, shapes)]
    times = {(op, pass_, shape): {impl: timed(op, impl, pass_, shape, dtype)
                                  for impl in IMPLS[op]}
             for op, pass_, shape in cases}
    if peers:
        for case, peer_times in torch_peers.run(cases, peers, dtype.name).items():
            times[case].update(peer_times)
    records = []
    for (op, pass_, shape), by_impl in times.items():
        nbytes = bytes_per_element(op, pass_) * int(np.prod(shape)) * dtype.itemsize
        for impl, us in by_impl.items():
            records.append(dict(
                op=op, **{"pass": pass_}, shape=list(shape), dtype=dtype.name, impl=impl,
                us=round(us, 2), gbps=round(nbytes / us / 1e3, 1),
                vs_xla=round(by_impl["xla"] / us, 3),
            ))
    return records


def _impls(records):
    """The implementations in the records, in IMPL_ORDER."""
    found = list(dict.fromkeys(r["impl"] for r in records))
    return sorted(found, key=lambda i: IMPL_ORDER.index(i) if i in IMPL_ORDER else len(IMPL_ORDER))


def _by_case(records):
    """{(op, pass, shape): {impl: record}}, in the records' order."""
    cases = {}
    for r in records:
        cases.setdefault((r["op"], r["pass"], tuple(r["shape"])), {})[r["impl"]] = r
    return cases


def table(records, copy):
    """The markdown table: one line per case, with jaxnorm's speed-up over
    each other implementation."""
    impls = _impls(records)
    cases = _by_case(records)
    head = ["op", "pass", "shape", *[f"{i} µs" for i in impls], "jaxnorm % of copy",
            *[f"vs {i}" for i in impls if i != "jaxnorm"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    for (op, pass_, shape), by_impl in cases.items():
        ours = by_impl.get("jaxnorm")
        cells = [op, pass_, _shape(shape)]
        cells += [f"{by_impl[i]['us']:.1f}" if i in by_impl else "-" for i in impls]
        cells.append(f"{100 * ours['gbps'] / copy:.0f}%" if ours else "-")
        cells += [f"{by_impl[i]['us'] / ours['us']:.2f}" if ours and i in by_impl else "-"
                  for i in impls if i != "jaxnorm"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _against(fmt, value, bar):
    """value in fmt, with more decimals where fmt would round it up to the bar
    it misses (89.96% shown as 89.96, not 90)."""
    text, digits = fmt.format(value), int(fmt.split(".")[1][0]) if "." in fmt else 0
    while value < bar and float(text.rstrip("x")) >= bar and digits < 4:
        digits += 1
        text = f"{value:.{digits}f}" + ("x" if fmt.endswith("x") else "")
    return text


def standing(records, copy):
    """Markdown lines: jaxnorm's percent of copy on the large shapes against
    the bars, and every case where a peer is faster."""
    cases = _by_case(records)
    lines = ["Against the bars (percent of copy on the large shapes):", ""]
    def speed_up_over(peer):
        return lambda c: c[peer]["us"] / c["jaxnorm"]["us"] if peer in c else None

    measures = (  # bars, jaxnorm's figure of a case's records, its unit
        (BARS, lambda c: 100 * c["jaxnorm"]["gbps"] / copy, "{:.0f}", "{}%"),
        (XLA_BARS, speed_up_over("xla"), "{:.2f}x", "{:.1f}x XLA"),
        (XLA_BARS, speed_up_over("flax"), "{:.2f}x", "{:.1f}x XLA, Flax's module"),
    )
    for bars, figure, fmt, bar_fmt in measures:
        for (pass_, op), bar in bars.items():
            got = [(shape, figure(cases[op, pass_, shape])) for shape in large_shapes(op)
                   if "jaxnorm" in cases.get((op, pass_, shape), {})]
            got = [(shape, value) for shape, value in got if value is not None]
            if not got:
                continue
            below = [_shape(shape) for shape, value in got if value < bar]
            lines.append(f"- {op} {pass_} (bar {bar_fmt.format(bar)}): "
                         + ", ".join(_against(fmt, value, bar) for _, value in got)
                         + (f"; below: {', '.join(below)}" if below else "; all above"))
    slower = []
    for (op, pass_, shape), by_impl in cases.items():
        ours = by_impl.get("jaxnorm")
        losses = [f"{i} {r['us'] / ours['us']:.2f}" for i, r in by_impl.items()
                  if ours and i != "jaxnorm" and r["us"] < ours["us"]]
        if losses:
            slower.append(f"{op} {pass_} {_shape(shape)} ({', '.join(losses)})")
    lines += ["", "Faster than jaxnorm (their time over jaxnorm's below 1): "
              + ("; ".join(slower) if slower else "none") + "."]
    return lines


def chart(records, copy, title, path):
    """Bandwidth reached per op, pass, shape and implementation, with the copy
    ceiling, as a PNG (skipped without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# no matplotlib: no chart")
        return
    impls = _impls(records)
    panels = list(dict.fromkeys((r["op"], r["pass"]) for r in records))
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 3.6 * len(panels)), squeeze=False)
    width = 0.8 / len(impls)
    for ax, (op, pass_) in zip(axes[:, 0], panels):
        rs = [r for r in records if (r["op"], r["pass"]) == (op, pass_)]
        shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rs))
        for k, impl in enumerate(impls):
            xs, ys = [], []
            for j, shape in enumerate(shapes):
                for r in rs:
                    if r["impl"] == impl and tuple(r["shape"]) == shape:
                        xs.append(j + (k - (len(impls) - 1) / 2) * width)
                        ys.append(r["gbps"])
            ax.bar(xs, ys, width, label=impl)
        ax.axhline(copy, color="black", linestyle="--", linewidth=1)
        ax.text(len(shapes) - 0.5, copy, f"copy {copy:.0f} GB/s", ha="right", va="bottom")
        ax.set_xticks(range(len(shapes)), [_shape(s) for s in shapes], fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_ylim(0, copy * 1.15)
        ax.set_title(f"{op} {pass_}", loc="left")
    axes[0, 0].legend(ncol=len(impls), loc="upper right", bbox_to_anchor=(1, 1.35))
    fig.suptitle(title, y=0.995)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"# chart: {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default=None,
                    help="e.g. 64x256,16x64x64x320: each op takes those of its shapes' rank "
                         "(default: the full set)")
    ap.add_argument("--ops", default=",".join(IMPLS))
    ap.add_argument("--no-peers", action="store_true", help="jaxnorm and XLA only")
    ap.add_argument("--update", action="store_true",
                    help="keep the records of cases not measured now from DIR's JSON")
    ap.add_argument("--standing", metavar="JSON",
                    help="print the standing against the bars of an earlier run; measure nothing")
    ap.add_argument("--render", metavar="JSON",
                    help="write the table and chart of an earlier run's JSON into --out; "
                         "measure nothing")
    args = ap.parse_args()
    if args.standing:
        with open(args.standing) as f:
            earlier = json.load(f)
        print("\n".join(standing(earlier["records"], earlier["meta"]["copy_gbps"])))
        return
    if args.render:
        with open(args.render) as f:
            earlier = json.load(f)
        render(args.out, earlier["meta"], earlier["records"], jnp.dtype(args.dtype))
        return
    dtype = jnp.dtype(args.dtype)
    shapes = None
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    ops = args.ops.split(",")
    device = jax.devices()[0].device_kind
    copy = copy_bandwidth_gbps()
    peers = [] if args.no_peers else torch_peers.available()
    print(f"# peers: {peers or 'none'}", flush=True)
    records = measure(ops, shapes, dtype, peers)
    stem = results_stem(args.out, "row_norm", device)
    earlier = None
    if args.update and os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            earlier = json.load(f)
        new = {_case(r) for r in records}
        kept = [r for r in earlier["records"] if _case(r) not in new]
        records = _in_order(kept + records)
    meta = dict(
        device=device, date=datetime.date.today().isoformat(), copy_gbps=round(copy, 1),
        jax=jax.__version__, jaxnorm=jaxnorm.__version__, python=platform.python_version(),
        peers=peers, torch=_torch_version(),
        bytes="fwd: read x + write y; fwd+bwd: read x, dy + write dx (primal output unused); "
              "add_rms_norm fwd: read x, residual + write y, h; fwd+bwd: read x, residual, "
              "dy, dh + write dx (= dresidual). torch's forward+backward also writes y. "
              "GroupNorm and BatchNorm: NHWC x, float32 parameters (the bytes of x only); "
              "torch's GroupNorm takes NCHW, its BatchNorm channels-last NCHW. "
              "batch_norm_relu: BatchNorm then ReLU (jaxnorm's fused: activation='relu'), "
              "whose forward+backward keeps the forward's launch (its statistics give "
              "ReLU's derivative), y written with them; batch_norm_relu_eval: the same in "
              "evaluation (the running statistics given). "
              "channel_softmax and local_response_norm (size 5): NHWC x, over the channels "
              "(torch's LRN takes NCHW); channel_softmax_nchw, local_response_norm_nchw: "
              "NCHW x.",
    )
    if earlier is not None:
        base = earlier["meta"]
        meta["updated"] = base.get("updated", []) + [dict(
            date=meta["date"], copy_gbps=meta["copy_gbps"], ops=ops,
            shapes=[list(s) for s in shapes] if shapes else "all")]
        meta.update(date=base["date"], copy_gbps=base["copy_gbps"])
    render(args.out, meta, records, dtype)


def render(out: str, meta: dict, records: list, dtype) -> None:
    """Writes the records' table (markdown), JSON and chart into `out`."""
    device, copy = meta["device"], meta["copy_gbps"]
    title = (f"{device}, {dtype.name}, {meta['date']}: bandwidth = fewest bytes / device "
             f"kernel time")
    lines = [
        f"Device: {device}; date {meta['date']}; jax {meta['jax']}; torch "
        f"{meta['torch']}; measured copy bandwidth {copy:.0f} GB/s; dtype {dtype.name}; "
        "device kernel time (µs); vs X: X's time over jaxnorm's (above 1: jaxnorm faster).",
        *[f"Re-measured later ({u['date']}, copy {u['copy_gbps']:.0f} GB/s): ops "
          f"{', '.join(u['ops'])} at shapes {u['shapes']}." for u in meta.get("updated", [])],
        "", meta["bytes"], "", *table(records, copy), "", *standing(records, copy),
    ]
    write_results(out, "row_norm", device, meta, records, "\n".join(lines))
    chart(records, copy, title, results_stem(out, "row_norm", device) + ".png")


def _shape(shape):
    return "x".join(str(d) for d in shape)


def _case(r):
    return r["op"], r["pass"], tuple(r["shape"]), r["impl"]


def _in_order(records):
    """Records in the order of a full run: ops, passes, shapes."""
    ops, passes = list(IMPLS), ["fwd", "fwd+bwd"]
    def key(r):
        shapes = shapes_for(r["op"], r["pass"], None)
        shape = tuple(r["shape"])
        return (ops.index(r["op"]), passes.index(r["pass"]),
                shapes.index(shape) if shape in shapes else len(shapes))
    return sorted(records, key=key)


def _torch_version():
    try:
        import torch
        return torch.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
