"""Runs chosen benchmark cases once each inside a CUDA profiler range, for
Nsight Compute to profile only those kernels (compilation and warm-up stay
outside the range):

  ncu --profile-from-start off --set full -o rep \
      python3 ncu_probe.py rms_norm:fwd:1x4096 rms_norm:fwd+bwd:64x4096 ...

Each case runs jaxnorm, then XLA's jnp implementation, then the torch peers
named in PEERS (say PEERS=liger,torch.compile), where they import.
"""

from __future__ import annotations

import ctypes
import os
import sys

import jax
import jax.numpy as jnp
from bench_row_norm import IMPLS, _jax_call


def case_fn(op, impl, pass_, shape, dtype):
    """The benchmark's jitted call of the case and its arguments."""
    fn, *args = _jax_call(op, impl, pass_, shape, dtype)
    return fn, tuple(args)


def main(cases: list[str]) -> None:
    dtype = jnp.dtype(jnp.bfloat16)
    calls = []
    for case in cases:
        op, pass_, shape = case.split(":")
        shape = tuple(int(d) for d in shape.split("x"))
        for impl in IMPLS[op]:
            fn, args = case_fn(op, impl, pass_, shape, dtype)
            jax.block_until_ready(fn(*args))  # compile and warm up
            jax.block_until_ready(fn(*args))
            calls.append((f"{op} {pass_} {shape} {impl}", fn, args))
        calls += peer_calls(op, pass_, shape)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for name, fn, args in calls:
        print("probe:", name, flush=True)
        jax.block_until_ready(fn(*args))
    cuda.cuProfilerStop()


def peer_calls(op, pass_, shape):
    """The PEERS' calls of the case, warmed up, as (name, fn, ())."""
    peers = [p for p in os.environ.get("PEERS", "").split(",") if p]
    if not peers:
        return []
    import torch
    import torch_peers

    calls = []
    available = torch_peers.available()
    for impl in [p for p in peers if p in available]:
        call = torch_peers.peer_call(op, impl, pass_, shape, "bfloat16")
        call()
        call()
        torch.cuda.synchronize()

        def run(call=call):
            call()
            torch.cuda.synchronize()

        calls.append((f"{op} {pass_} {shape} {impl}", run, ()))
    return calls


if __name__ == "__main__":
    main(sys.argv[1:])
