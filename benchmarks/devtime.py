"""Device kernel time of a jitted JAX call, read from a profiler trace.

Wall-clock timing of a jitted call measures dispatch for anything below tens of
microseconds. Instead, run the call `iters` times under jax.profiler, and sum,
over the kernels one call launches, each kernel's median duration on the GPU.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import statistics
import tempfile

import jax


def kernel_events(fn, *args, iters: int = 20, warmup: int = 3) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of each GPU kernel that `iters` calls launch,
    in order of start, read from a profiler trace (memory copies left out)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as logdir:
        jax.profiler.start_trace(logdir)
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        profile = jax.profiler.ProfileData.from_file(path)
    events = []
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                events += [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events
                           if "Memcpy" not in e.name]
    return sorted(events)


def calls_of(events: list, iters: int) -> list[list]:
    """kernel_events of `iters` calls split into each call's events (every
    call launches as many kernels); [] where they do not split evenly."""
    per_call = len(events) // iters
    if per_call == 0 or per_call * iters != len(events):
        return []
    return [events[i * per_call:(i + 1) * per_call] for i in range(iters)]


def span_us(call: list) -> float:
    """A call's span: from its first kernel's start to its last kernel's end."""
    return (max(e[1] for e in call) - call[0][0]) / 1e3


def kernel_times(fn, *args, iters: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median device duration (µs) per kernel name, times its launches per call."""
    durations = collections.defaultdict(list)
    for start, end, name in kernel_events(fn, *args, iters=iters, warmup=warmup):
        durations[name].append((end - start) / 1e3)
    return sum_kernel_medians(durations, iters)


def sum_kernel_medians(durations: dict[str, list[float]], iters: int) -> dict[str, float]:
    """Per kernel name: its median duration times its launches per call."""
    return {
        name: statistics.median(d) * round(len(d) / iters)
        for name, d in durations.items()
        if round(len(d) / iters) > 0
    }


def kernel_summary(kernels: dict[str, float]) -> str:
    """The kernels of a call, longest first: 'name µs, ...' (names cut to 40)."""
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name[:40]} {us:.1f}" for name, us in ranked)


def kernel_times_or_wall(fn, *args, iters: int = 20, warmup: int = 3) -> dict[str, float]:
    """kernel_times, or where there is no GPU plane (a CPU run), the wall-clock
    time of a call as one entry."""
    times = kernel_times(fn, *args, iters=iters, warmup=warmup)
    if times:
        return times
    import time
    t0 = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(fn(*args))
    return {"wall clock (no GPU)": (time.perf_counter() - t0) / iters * 1e6}


def device_time_us(fn, *args, iters: int = 20) -> float:
    return sum(kernel_times_or_wall(fn, *args, iters=iters).values())


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Read + write bandwidth of a large element-wise kernel (the memory ceiling)."""
    x = jax.numpy.ones((nbytes // 4,), jax.numpy.float32) + jax.numpy.arange(nbytes // 4) % 7
    t = device_time_us(jax.jit(lambda a: a * 2), x, iters=10)
    return 2 * nbytes / t / 1e3


def results_stem(out_dir: str, name: str, device: str) -> str:
    return os.path.join(out_dir, f"{name}_" + device.replace(" ", "_"))


def write_results(out_dir: str, name: str, device: str, meta: dict, records: list,
                  table: str) -> None:
    """Prints the markdown table and writes it and the records (JSON) as
    out_dir/<name>_<device>.{md,json}."""
    print(table)
    os.makedirs(out_dir, exist_ok=True)
    stem = results_stem(out_dir, name, device)
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
