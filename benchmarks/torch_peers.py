"""The PyTorch-side peers of the row-norm benchmark: torch's own kernels
(eager), torch.compile of the same float32-statistics math as the XLA
reference, and Liger-Kernel's Triton kernels (with float32 math throughout,
its "gemma" casting mode). All optional: `available()` lists what imports.

Times are device kernel time, as for JAX: the call runs `iters` times under
torch.profiler, and each kernel's median duration is summed over the kernels
one call launches (devtime.sum_kernel_medians). Both profilers use CUPTI, which
one process cannot hand from one to the other: `run` times each peer in a
process of its own.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile

from devtime import kernel_summary, sum_kernel_medians

EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5, "add_rms_norm": 1e-6, "group_norm": 1e-5,
       "batch_norm": 1e-5, "batch_norm_relu": 1e-5, "batch_norm_eval": 1e-5,
       "batch_norm_relu_eval": 1e-5}
GROUPS = 32  # as bench_row_norm.py's
CHANNEL_OPS = ("group_norm", "batch_norm", "batch_norm_relu", "batch_norm_eval",
               "batch_norm_relu_eval")
ALONG_OPS = ("channel_softmax", "channel_softmax_nchw", "local_response_norm",
             "local_response_norm_nchw")
LRN = dict(size=5, alpha=1e-4, beta=0.75, k=2.0)  # as bench_row_norm.py


def available() -> list[str]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    impls = ["torch", "torch.compile"]
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
        impls.append("liger")
    except ImportError:
        pass
    return impls


def _reference(op):
    """The math of the XLA reference, for torch.compile."""
    import torch

    def rms(x, w):
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS["rms_norm"])
        return (xf * rstd * w.float()).to(x.dtype)

    def layer(x, w, b):
        xf = x.float()
        xc = xf - xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt(xc.square().mean(-1, keepdim=True) + EPS["layer_norm"])
        return (xc * rstd * w.float() + b.float()).to(x.dtype)

    def add_rms(x, r, w):
        h = x + r
        return rms(h, w), h

    def group(x, w, b):  # x NHWC
        n, c = x.shape[0], x.shape[-1]
        xg = x.float().reshape(n, -1, GROUPS, c // GROUPS)
        mean = xg.mean((1, 3), keepdim=True)
        var = (xg - mean).square().mean((1, 3), keepdim=True)
        y = ((xg - mean) * torch.rsqrt(var + EPS["group_norm"])).reshape(x.shape)
        return (y * w + b).to(x.dtype)

    def batch(x, w, b, rm, rv):  # x NHWC; y and the updated running statistics
        xf = x.float()
        mean = xf.mean((0, 1, 2))
        var = (xf - mean).square().mean((0, 1, 2))
        y = ((xf - mean) * torch.rsqrt(var + EPS["batch_norm"]) * w + b).to(x.dtype)
        return y, 0.99 * rm + 0.01 * mean, 0.99 * rv + 0.01 * var

    def batch_relu(x, w, b, rm, rv):
        y, mean, var = batch(x, w, b, rm, rv)
        return torch.relu(y), mean, var

    def batch_eval(x, w, b, rm, rv):
        y = (x.float() - rm) * torch.rsqrt(rv + EPS["batch_norm_eval"])
        return (y * w + b).to(x.dtype)

    def batch_relu_eval(x, w, b, rm, rv):
        return torch.relu(batch_eval(x, w, b, rm, rv))

    def softmax(x, dim=-1):
        return torch.softmax(x.float(), dim).to(x.dtype)

    def lrn(x, dim=-1):  # x NHWC
        size = LRN["size"]
        xf = x.float().movedim(dim, -1)
        sq = torch.nn.functional.pad(xf * xf, (size // 2, (size - 1) // 2))
        sums = sq.unfold(-1, size, 1).sum(-1)
        y = xf * (LRN["k"] + LRN["alpha"] / size * sums) ** -LRN["beta"]
        return y.movedim(-1, dim).to(x.dtype)

    return {"rms_norm": rms, "layer_norm": layer, "add_rms_norm": add_rms, "group_norm": group,
            "batch_norm": batch, "batch_norm_relu": batch_relu, "batch_norm_eval": batch_eval,
            "batch_norm_relu_eval": batch_relu_eval,
            "channel_softmax": softmax, "channel_softmax_nchw": lambda x: softmax(x, dim=1),
            "local_response_norm": lrn, "local_response_norm_nchw": lambda x: lrn(x, dim=1)}[op]


def _eager(op):
    import torch.nn.functional as F

    def rms(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, EPS["rms_norm"])

    def layer(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, EPS["layer_norm"])

    def add_rms(x, r, w):
        h = x + r
        return rms(h, w), h

    def group(x, w, b):  # x NCHW, contiguous
        return F.group_norm(x, GROUPS, w, b, EPS["group_norm"])

    def batch(x, w, b, rm, rv):  # x NCHW, channels-last (cuDNN's NHWC kernels)
        return F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.01,
                            eps=EPS["batch_norm"])

    def batch_relu(x, w, b, rm, rv):
        return F.relu(batch(x, w, b, rm, rv))

    def batch_eval(x, w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=False, eps=EPS["batch_norm_eval"])

    def batch_relu_eval(x, w, b, rm, rv):
        return F.relu(batch_eval(x, w, b, rm, rv))

    def softmax(x, dim=-1):  # x NHWC (dim -1) or NCHW (dim 1)
        return F.softmax(x, dim)

    def lrn(x):  # x NCHW, contiguous
        return F.local_response_norm(x, **LRN)

    return {"rms_norm": rms, "layer_norm": layer, "add_rms_norm": add_rms, "group_norm": group,
            "batch_norm": batch, "batch_norm_relu": batch_relu, "batch_norm_eval": batch_eval,
            "batch_norm_relu_eval": batch_relu_eval,
            "channel_softmax": softmax, "channel_softmax_nchw": lambda x: softmax(x, dim=1),
            "local_response_norm": lrn, "local_response_norm_nchw": lrn}[op]


def _liger(op):
    if op == "rms_norm":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS[op], 0.0, "gemma", False)
    if op == "layer_norm":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS[op])
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    return lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS[op], 0.0, "gemma",
                                                              False)


def _function(op, impl):
    import torch
    if impl == "torch":
        return _eager(op)
    if impl == "liger":
        return _liger(op)
    torch._dynamo.reset()  # a fresh static-shape compilation for each case
    return torch.compile(_reference(op), dynamic=False)


def _channel_inputs(op, impl, shape, dtype, grad):
    """NHWC `shape`: x as the implementation takes it (torch.compile NHWC,
    torch's GroupNorm NCHW, its BatchNorm channels-last), float32 parameters
    (x's dtype for torch's GroupNorm, which takes no other) with grad where
    asked, and running statistics; and dy."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*s, dt=torch.float32):
        return torch.randn(*s, generator=g, device="cuda", dtype=torch.float32).to(dt)

    x, dy = randn(*shape, dt=dtype), randn(*shape, dt=dtype)
    if impl == "torch":  # to NCHW
        x, dy = x.permute(0, 3, 1, 2), dy.permute(0, 3, 1, 2)
        layout = torch.channels_last if op.startswith("batch") else torch.contiguous_format
        x, dy = x.contiguous(memory_format=layout), dy.contiguous(memory_format=layout)
    c = shape[-1]
    # torch's GroupNorm takes parameters of x's dtype only.
    pdt = dtype if impl == "torch" and op == "group_norm" else torch.float32
    params = [randn(c, dt=pdt) + 1, randn(c, dt=pdt)]
    args = [a.requires_grad_(grad) for a in (x, *params)]
    if op.startswith("batch"):
        args += [randn(c), randn(c).abs() + 0.5]  # running statistics
    return args, [dy]


def _inputs(op, impl, shape, dtype, grad):
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*s):
        return torch.randn(*s, generator=g, device="cuda", dtype=torch.float32).to(dtype)

    x = randn(*shape)
    if op in ALONG_OPS:  # x alone; torch's LRN takes NCHW
        dy = randn(*shape)
        if op == "local_response_norm" and impl == "torch":
            x, dy = (a.permute(0, 3, 1, 2).contiguous() for a in (x, dy))
        return [x.requires_grad_(grad)], [dy]
    params = [randn(shape[-1]) + 1]
    if op == "add_rms_norm":
        params.insert(0, randn(*shape))
    if op == "layer_norm":
        params.append(randn(shape[-1]))
    args = [a.requires_grad_(grad) for a in (x, *params)]
    cotangents = [randn(*shape) for _ in range(2 if op == "add_rms_norm" else 1)]
    return args, cotangents


def kernel_times(fn, iters: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median device duration (µs) per kernel name, times its launches per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    durations = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset"):
            durations[e["name"]].append(e["dur"])
    return sum_kernel_medians(durations, iters)


def timed(op: str, impl: str, pass_: str, shape, dtype_name: str) -> dict[str, float]:
    """Kernel times of one peer call: the forward, or the forward and the
    gradients of every input (torch's forward also writes y)."""
    return kernel_times(peer_call(op, impl, pass_, shape, dtype_name))


def peer_call(op: str, impl: str, pass_: str, shape, dtype_name: str):
    """The call that `timed` times, on fresh inputs."""
    import torch
    dtype = getattr(torch, dtype_name)
    f = _function(op, impl)
    grad = pass_ != "fwd"
    if op in CHANNEL_OPS:
        args, cotangents = _channel_inputs(op, impl, shape, dtype, grad)
    else:
        args, cotangents = _inputs(op, impl, shape, dtype, grad)
    wrt = [a for a in args if a.requires_grad]
    if pass_ == "fwd":
        def call():
            with torch.no_grad():
                return f(*args)
    else:
        def call():
            out = f(*args)
            out = out if isinstance(out, tuple) else (out,)
            return torch.autograd.grad(out[:len(cotangents)], wrt, cotangents)
    return call


def run(cases, impls, dtype_name: str) -> dict:
    """Times `impls` on each (op, pass, shape) case, each implementation in a
    child process of its own: {case: {impl: µs}}; a case an implementation
    cannot run is left out. One process for all of them timed Liger's
    RMSNorm forward at 4096x8192 at 43.5-44.4 µs after torch.compile's
    calls and at 46.0-47.1 alone, the same Triton binary
    (benchmarks/NOTES.md, v56)."""
    times = collections.defaultdict(dict)
    for impl in impls:
        request = json.dumps(dict(cases=cases, impls=[impl], dtype=dtype_name))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__)], input=request,
                              stdout=subprocess.PIPE, text=True, check=True)
        for op, pass_, shape, impl_, us in json.loads(proc.stdout):
            times[op, pass_, tuple(shape)][impl_] = us
    return times


def main():
    request = json.load(sys.stdin)
    out = []
    for op, pass_, shape in request["cases"]:
        for impl in request["impls"]:
            if impl == "liger" and (op in CHANNEL_OPS or op in ALONG_OPS):
                continue  # Liger's norms here are the row norms
            try:
                kernels = timed(op, impl, pass_, tuple(shape), request["dtype"])
            except Exception as e:  # a peer that cannot run a case
                print(f"# {op} {pass_} {tuple(shape)} {impl} failed: {e!r}"[:400],
                      file=sys.stderr, flush=True)
                continue
            print(f"# {op} {pass_} {tuple(shape)} {impl}: {kernel_summary(kernels)}",
                  file=sys.stderr, flush=True)
            out.append((op, pass_, shape, impl, sum(kernels.values())))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
