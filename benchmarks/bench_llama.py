"""A Llama-style model of real width (examples/llama_train.py) with jaxnorm's
norms against the same model with Flax's: device time of a training step and
of a decode step (sum of kernel durations, as devtime.py measures them).

XLA picks each GEMM's cuBLAS algorithm by timing candidates while it compiles,
and those timings vary: two compilations of the same model in two processes
ran 44.2 and 45.2 ms a training step on an H200 (benchmarks/NOTES.md, v12).
So every measurement here is a fresh process (a fresh compilation), the
variants take turns, and the table gives the median over `--repeats` of them
with its range. Two controls separate the norms from that noise:
- the time outside GEMM kernels (cuBLAS and XLA's Triton GEMM fusions),
  where the norms run;
- one more compilation of each variant with XLA's autotuning off
  (--xla_gpu_autotune_level=0), where cuBLAS's own heuristic picks each GEMM's
  algorithm from its shape and layout alone, the same in every variant.

  python benchmarks/bench_llama.py --out DIR [--repeats 3]
      [--hidden 1024 --batch 64 --seq 1024 --param-dtype bfloat16 --train-only --no-control]

--hidden scales the model as Llama does (heads of 128, ffn 8/3 of hidden
rounded up to 256); --batch and --seq shape the training step's tokens;
--param-dtype bfloat16 trains bfloat16 parameters (float32 by default).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
from devtime import kernel_times_or_wall, write_results

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


def llama_dims(hidden: int) -> dict:
    """A Llama-style model of this width: heads of 128, and an ffn of 8/3 of
    hidden rounded up to a multiple of 256."""
    ffn = 256 * -(-8 * hidden // (3 * 256))  # ceil(8 * hidden / 768) * 256
    return dict(vocab=32000, hidden=hidden, heads=max(1, hidden // 128), ffn=ffn, max_len=2048)


WIDE = llama_dims(4096)  # ffn 11008, as Llama's
TINY = dict(vocab=256, hidden=128, heads=4, ffn=344, max_len=2048)  # --tiny: checks the script

VARIANTS = {  # name: Config fields
    "jaxnorm": dict(norms="jaxnorm"),
    "jaxnorm, add unfused": dict(norms="jaxnorm", fuse_add=False),
    "flax": dict(norms="flax"),
}
GEMM_KERNELS = ("nvjet", "gemm", "xmma", "cutlass", "cublas")
NO_AUTOTUNE = "--xla_gpu_autotune_level=0"


def summary(kernels: dict[str, float]) -> dict:
    """Total, jaxnorm-kernel and GEMM-kernel µs of one step, and its largest kernels."""
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])
    return dict(
        us=sum(kernels.values()),
        jaxnorm_us=sum(us for n, us in kernels.items() if "jaxnorm" in n),
        gemm_us=sum(us for n, us in kernels.items() if any(g in n for g in GEMM_KERNELS)),
        top=", ".join(f"{n[:50]} {us:.1f}" for n, us in ranked[:12]),
        jaxnorm_kernels={n: us for n, us in ranked if "jaxnorm" in n},
    )


def train_step_time(variant: str, dims: dict, layers: int, batch: int, seq: int,
                    param_dtype: str = "float32") -> dict:
    cfg = Config(**dims, layers=layers, **VARIANTS[variant])
    model = Llama(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))
    params = jax.tree.map(lambda p: p.astype(param_dtype), params)
    tx = optax.adamw(1e-4)
    opt_state = tx.init(params)
    step = make_train_step(model, tx)
    tokens = batch_of(jax.random.key(1), cfg, batch, seq + 1)
    return summary(kernel_times_or_wall(step, params, opt_state, tokens, iters=5, warmup=2))


def build_decode_step(variant: str, dims: dict, layers: int, batch: int, pos: int):
    """The jitted decode step and its arguments (params, tokens, caches, pos):
    step(*args) returns the next tokens and caches."""
    cfg = Config(**dims, layers=layers, **VARIANTS[variant])
    model = Llama(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)  # served in bf16
    tok = jnp.zeros((batch, 1), jnp.int32)
    return make_decode_step(model), (params, tok, empty_caches(cfg, batch), jnp.int32(pos))


def decode_step_time(variant: str, dims: dict, layers: int, batch: int, pos: int) -> dict:
    step, args = build_decode_step(variant, dims, layers, batch, pos)
    return summary(kernel_times_or_wall(step, *args, iters=20))


def cases(dims: dict, layers: int, batch: int, seq: int, param_dtype: str) -> dict:
    params = "" if param_dtype == "float32" else f", {param_dtype} parameters"
    return {
        ("train step", f"batch {batch} x seq {seq}, {layers} layers{params}"):
            lambda v: train_step_time(v, dims, layers, batch, seq, param_dtype),
        ("decode step", f"batch 8, position 1000, {layers} layers"):
            lambda v: decode_step_time(v, dims, layers, 8, 1000),
        ("decode step", f"batch 64, position 1000, {layers} layers"):
            lambda v: decode_step_time(v, dims, layers, 64, 1000),
    }


def measure_in_child(variant: str, args, train_only: bool, no_autotune: bool) -> list:
    """Runs this script's --child mode in a fresh process; its records."""
    env = dict(os.environ)
    if no_autotune:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + NO_AUTOTUNE).strip()
    cmd = [sys.executable, __file__, "--child", variant, "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--batch", str(args.batch), "--seq", str(args.seq),
           "--param-dtype", args.param_dtype]
    cmd += ["--train-only"] * train_only + ["--tiny"] * args.tiny
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for r in records:
        r["autotuning"] = "off" if no_autotune else "on"
        for name, us in r["jaxnorm_kernels"].items():
            print(f"#   {us:8.1f} µs  {name[:160]}")
        print(f"# {r['norms']} ({r['step']}, autotuning {r['autotuning']}): "
              f"{r['us']:.1f} µs, outside GEMMs {r['us'] - r['gemm_us']:.1f}; {r.pop('top')}",
              flush=True)
    return records


def table_rows(records: list) -> list[dict]:
    """Median and range of each (step, shape, autotuning, norms) over its runs,
    and Flax's median over this one's."""
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault((r["step"], r["shape"], r["autotuning"], r["norms"]), []).append(r)
    rows = []
    for (what, shape, tuning, norms), rs in groups.items():
        us = [r["us"] for r in rs]
        rows.append(dict(step=what, shape=shape, autotuning=tuning, norms=norms, runs=len(rs),
                         us=statistics.median(us), us_min=min(us), us_max=max(us),
                         outside_gemm_us=statistics.median(r["us"] - r["gemm_us"] for r in rs),
                         jaxnorm_us=statistics.median(r["jaxnorm_us"] for r in rs)))
    for row in rows:
        flax = next(f for f in rows if f["norms"] == "flax" and all(
            f[k] == row[k] for k in ("step", "shape", "autotuning")))
        row["flax_over_this"] = flax["us"] / row["us"]
        row["flax_over_this_outside_gemm"] = flax["outside_gemm_us"] / row["outside_gemm_us"]
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    m = meta["model"]
    lines = [
        f"Device: {meta['device']}; date {meta['date']}; jax {meta['jax']}; Llama-style model, "
        f"hidden {m['hidden']}, ffn {m['ffn']}, {m['layers']} layers; device time per step"
        " (µs), median over fresh compilations (runs), with its range.",
        "",
        "| step | shape | XLA autotuning | norms | runs | µs | range | outside GEMMs "
        "| of which jaxnorm kernels | Flax time / this | the same, outside GEMMs |",
        "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['shape']} | {r['autotuning']} | {r['norms']} | {r['runs']} "
            f"| {r['us']:.1f} | {r['us_min']:.1f}-{r['us_max']:.1f} | {r['outside_gemm_us']:.1f} "
            f"| {r['jaxnorm_us']:.1f} | {r['flax_over_this']:.3f} "
            f"| {r['flax_over_this_outside_gemm']:.3f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=WIDE["hidden"])
    ap.add_argument("--batch", type=int, default=4, help="the training step's sequences")
    ap.add_argument("--seq", type=int, default=1024, help="the training step's length")
    ap.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the training step's parameters")
    ap.add_argument("--train-only", action="store_true", help="no decode steps")
    ap.add_argument("--no-control", action="store_true",
                    help="no compilations with XLA's autotuning off")
    ap.add_argument("--tiny", action="store_true", help="a small model, to check the script")
    args = ap.parse_args()
    dims = TINY if args.tiny else llama_dims(args.hidden)
    if args.child:  # one variant, every case, one compilation each: JSON lines
        for (what, shape), run in cases(dims, args.layers, args.batch, args.seq,
                                        args.param_dtype).items():
            if args.train_only and what != "train step":
                continue
            print(json.dumps(dict(step=what, shape=shape, norms=args.child,
                                  device=jax.devices()[0].device_kind, **run(args.child))),
                  flush=True)
        return
    records = []
    for i in range(args.repeats):  # variants take turns, so drift hits them alike
        for variant in VARIANTS:  # decode steps once: their GEMMs are a small share
            records += measure_in_child(variant, args, args.train_only or i > 0, False)
    for variant in VARIANTS if not args.no_control else ():
        records += measure_in_child(variant, args, True, True)
    # The children hold the GPU; this process never touches it.
    meta = dict(device=records[0]["device"], date=datetime.date.today().isoformat(),
                jax=jax.__version__, jaxnorm=jaxnorm.__version__,
                model=dict(dims, layers=args.layers), repeats=args.repeats,
                dtype=f"bfloat16 activations, {args.param_dtype} parameters (bfloat16 for decode)")
    rows = table_rows(records)
    write_results(args.out, "llama", meta["device"], dict(meta, runs=records), rows,
                  markdown(rows, meta))


if __name__ == "__main__":
    main()
