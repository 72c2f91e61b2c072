"""A call's device time two ways, for a trial of launch overlap: the sum of
its kernels' median durations (bench_row_norm.py's measure) and its span,
from its first kernel's start to its last kernel's end (median over calls),
which also counts the gaps between its kernels and no overlap twice.

  IMPLS=jaxnorm,xla python benchmarks/trials/call_span.py [OP ...]   (group_norm batch_norm)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_row_norm as bench  # noqa: E402
import devtime  # noqa: E402


def sums_and_span(fn, *args, iters: int = 30) -> tuple[float, float, int]:
    """The summed medians of the kernels of a call, the median span of a
    call, and the kernels a call launches."""
    events = devtime.kernel_events(fn, *args, iters=iters)
    calls = devtime.calls_of(events, iters)
    assert calls, (len(events), iters)
    spans = [devtime.span_us(c) for c in calls]
    by_name: dict[str, list[float]] = {}
    for c in calls:
        for s, e, name in c:
            by_name.setdefault(name, []).append((e - s) / 1e3)
    summed = sum(devtime.sum_kernel_medians(by_name, iters).values())
    return summed, statistics.median(spans), len(calls[0])


def chained_us(fn, *args, calls: int = 32, reps: int = 15) -> float:
    """Wall-clock time a call of `calls` calls chained in one jit (each call's
    first output is the next one's first argument; an optimization barrier
    between them keeps XLA from fusing across calls), per call: the GPU's
    gaps between kernels counted, the host's dispatch spread over the chain."""
    def chain(first, *rest):
        for _ in range(calls):
            out = fn(first, *rest)
            first = out[0] if isinstance(out, tuple) else out
            first = jax.lax.optimization_barrier(first).astype(args[0].dtype)
        return first

    f = jax.jit(chain)
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / calls * 1e6


def main():
    ops = sys.argv[1:] or ["group_norm", "batch_norm"]
    dtype = jax.numpy.dtype("bfloat16")
    tag = "no overlap" if os.environ.get("JAXNORM_TRIAL_NO_PDL") == "1" else "overlap"
    print(f"# {jax.devices()[0].device_kind}; jaxnorm launches: {tag}")
    print("| op | pass | shape | impl | kernels | sum µs | span µs | chained µs |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for op in ops:
        for pass_ in bench.PASSES.get(op, ("fwd", "fwd+bwd")):
            for shape in bench.shapes_for(op, pass_, None):
                for impl in os.environ.get("IMPLS", "jaxnorm,xla").split(","):
                    call = bench._jax_call(op, impl, pass_, shape, dtype)
                    summed, span, k = sums_and_span(*call)
                    chained = chained_us(*call)
                    print(f"| {op} | {pass_} | {bench._shape(shape)} | {impl} | {k} | "
                          f"{summed:.1f} | {span:.1f} | {chained:.1f} |", flush=True)


if __name__ == "__main__":
    main()
