"""Which launch configuration torch.compile's autotuner picks for the row
norms' forwards (the benchmark's float32-statistics math).

Inductor writes a persistent reduction for rows up to a few thousand
elements and picks XBLOCK (rows a program) and num_warps at run time among a
few candidates; the generated code does not say which won. This prints, for
each shape, each kernel's candidates and the one chosen, and the compiled
function's time a call (CUDA events over a loop of calls: with the host's
cost of each call, which can exceed the kernel's, so not a kernel time).

  python benchmarks/trials/inductor_configs.py [SHAPE ...]   (e.g. 65536x1024)
"""

import gc
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from torch_peers import _reference  # noqa: E402


def autotuners():
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    def is_autotuner(o):
        try:
            return isinstance(o, CachingAutotuner)
        except ReferenceError:  # a dead weak proxy among gc's objects
            return False

    with warnings.catch_warnings():  # (isinstance on torch's deprecated aliases)
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if is_autotuner(o)]


def describe(config):
    """A Triton config's block sizes, warps and stages."""
    return f"{config.kwargs} num_warps={config.num_warps} num_stages={config.num_stages}"


def time_us(fn, *args, iters=200):
    for _ in range(10):
        fn(*args)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1000 / iters


def main(shapes):
    import torch._inductor.config as cfg

    cfg.triton.unique_kernel_names = True
    for op in ("rms_norm", "layer_norm"):
        for rows, hidden in shapes:
            torch._dynamo.reset()
            gc.collect()
            before = {id(a) for a in autotuners()}
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            params = [torch.randn(hidden, device="cuda", dtype=torch.bfloat16)]
            if op == "layer_norm":
                params.append(torch.randn(hidden, device="cuda", dtype=torch.bfloat16))
            fn = torch.compile(_reference(op), dynamic=False)
            us = time_us(fn, x, *params)
            gb = 2 * x.numel() * x.element_size() / us / 1e3
            print(f"{op} {rows}x{hidden}: {us:.1f} us ({gb:.0f} GB/s)")
            for a in autotuners():
                if id(a) in before:
                    continue
                name = getattr(a.fn, "__name__", "?")
                chosen = [describe(launcher.config) for launcher in a.launchers]
                print(f"  kernel {name}: chosen {chosen}")
                for c in a.configs or []:
                    print(f"    candidate {describe(c)}")


if __name__ == "__main__":
    args = sys.argv[1:] or ["65536x1024", "4096x8192", "16384x4096"]
    main([tuple(int(v) for v in s.split("x")) for s in args])
