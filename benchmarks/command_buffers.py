"""What XLA's command buffers (CUDA graphs) make of jaxnorm's CUDA handlers
in a model's step. XLA captures a custom call in a command buffer only where
its handler allows it (kCmdBufferCompatible): the row norms' forward, LRN's
and the channel softmax's do; the channel norms and the row norms' backward
allocate scratch and do not (trials/command_buffer_workspace.patch made them
capturable, their scratch a workspace result sized at trace time: slower,
notes v83). Each (mode, model, norms) runs in a fresh process (XLA reads its
flags once), the modes taking turns:

- captured: XLA's defaults;
- host-launched: `--xla_gpu_enable_command_buffer` without CUSTOM_CALL, so
  every custom call is launched by the host, between command buffers;

and a step is timed four ways:

- kernels: the sum of its kernels' durations (the other tables' measure);
- span: from its first kernel's start to its last kernel's end, a step at a
  time (the gaps between kernels counted), median of 10;
- blocking: wall-clock time of a step whose output is read before the next
  step starts (a loop that logs every step), median of 30;
- pipelined: wall-clock time a step of 20 steps dispatched back to back
  (the host free to run ahead), median of 5 such runs.

Models: bench_unet.py's training steps (GroupNorm, BatchNorm), its UNet at a
batch of 2 of 32x32 images, where the host's launches weigh more, and
bench_llama.py's decode step (4 layers, the row norms' forward).

  python benchmarks/command_buffers.py --out DIR [--repeats 2] [--models 'unet;resnet']
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import jax
from bench_llama import TINY as LLAMA_TINY
from bench_llama import WIDE, build_decode_step
from bench_unet import MODELS, TINY, build_step
from devtime import calls_of, kernel_events, kernel_times_or_wall, span_us, write_results

MODES = {  # name: XLA flags
    "captured": "",
    "host-launched": "--xla_gpu_enable_command_buffer="
                     "FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION",
}
NORMS = ("jaxnorm", "flax")
CASES = {  # name: (model, its build_step or build_decode_step arguments)
    "unet": ("unet", MODELS["unet"]),
    "resnet": ("resnet", MODELS["resnet"]),
    "unet, batch 2": ("unet", (2, 32, 128)),
    "llama decode, batch 8": ("decode", (WIDE, 4, 8, 1000)),
}
TINY_CASES = {"unet": ("unet", TINY["unet"]), "resnet": ("resnet", TINY["resnet"]),
              "llama decode": ("decode", (LLAMA_TINY, 2, 2, 10))}


def step_span_us(step, args: tuple, iters: int = 10) -> float:
    """Median span of a step on the GPU, each step waited for (the top of the
    file); NaN without a GPU trace."""
    events = kernel_events(lambda *a: jax.block_until_ready(step(*a)), *args, iters=iters)
    steps = calls_of(events, iters)
    return statistics.median(span_us(st) for st in steps) if steps else float("nan")


def wall_us(advance, state) -> tuple[float, float]:
    """(blocking, pipelined) wall-clock µs a step (the top of the file);
    advance(state) runs a step and returns the next state and an output."""
    blocking = []
    for _ in range(30):
        t0 = time.perf_counter()
        state, out = advance(state)
        jax.block_until_ready(out)
        blocking.append(time.perf_counter() - t0)
    pipelined = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            state, out = advance(state)
        jax.block_until_ready(out)
        pipelined.append((time.perf_counter() - t0) / 20)
    return 1e6 * statistics.median(blocking), 1e6 * statistics.median(pipelined)


def child(case: str, norms: str, cases: dict) -> dict:
    model, dims = cases[case]
    if model == "decode":  # state: the tokens and caches
        step, args = build_decode_step(norms, *dims)
        params, pos = args[0], args[3]

        def advance(state):
            tokens, caches = step(params, *state, pos)
            return (tokens, caches), tokens
    else:  # state: the parameters and optimizer state; the loss out
        step, args = build_step(model, norms, *dims)

        def advance(state):
            *new, loss = step(*state, *args[2:])
            return tuple(new), loss

    kernels = sum(kernel_times_or_wall(step, *args, iters=10, warmup=2).values())
    span = step_span_us(step, args)
    blocking, pipelined = wall_us(advance, args[1:3] if model == "decode" else args[:2])
    return dict(model=case, norms=norms, kernels_us=kernels, span_us=span,
                blocking_us=blocking, pipelined_us=pipelined)


def in_child(mode: str, model: str, norms: str, tiny: bool) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + MODES[mode]).strip()
    cmd = [sys.executable, __file__, "--child", model, norms] + ["--tiny"] * tiny
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    (record,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    record["mode"] = mode
    print(f"# {mode} {model} [{norms}]: {record}", flush=True)
    return record


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def table(records: list[dict], meta: dict) -> str:
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault((r["model"], r["norms"], r["mode"]), []).append(r)
    lines = [
        f"Device: {meta['device']}; date {meta['date']}; jax {meta['jax']}; bf16; µs a "
        f"step, median over {meta['repeats']} processes (range); custom calls in XLA's "
        "command buffers where their handlers allow it (captured) or never (host-launched).",
        "",
        "| model | norms | mode | kernels | span | blocking | pipelined |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for (model, norms, mode), rs in groups.items():
        cells = [_median_range([r[k] for r in rs]) for k in (
            "kernels_us", "span_us", "blocking_us", "pipelined_us")]
        lines.append(f"| {model} | {norms} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="small models, to check the script")
    ap.add_argument("--models", default=";".join(CASES), help="e.g. 'unet;resnet'")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    cases = TINY_CASES if args.tiny else CASES
    if args.child:
        print(json.dumps(child(*args.child, cases)))
        return
    device = jax.devices()[0].device_kind
    meta = dict(device=device, date=datetime.date.today().isoformat(), jax=jax.__version__,
                repeats=args.repeats, modes=MODES)
    records = []
    for _ in range(args.repeats):
        for model in args.models.split(";"):
            for norms in NORMS:
                for mode in MODES:
                    records.append(in_child(mode, model, norms, args.tiny))
                    # Written after each, so that a run cut short leaves its table.
                    write_results(args.out, "command_buffers", device, meta, records,
                                  table(records, meta))


if __name__ == "__main__":
    main()
