"""Automatic partitioning of row ops under `jit` with sharded operands.

A row op works on x of shape ``(*rows, *normalized)``. Each of its operands and
results has one of four layouts relative to x:

- ``ROWS_NORM``: x's own shape (x, y, dy, dx);
- ``NORM``: the normalized dims (scale, bias, dscale, dbias);
- ``ROWS``: the row dims (per-row statistics);
- ``ABSENT``: a ``(0,)`` placeholder for an argument or result the call lacks.

The partitioner reads x's sharding as XLA hands it over. Mesh axes on row dims
(the *row axes*) give each device whole rows; axes on normalized dims (the
*hidden axes*) give each device a slice of every row. Every other operand is
sharded to match x (a parameter sharded differently is resliced, a cheap copy
of a small array), and the op's per-device function does the collectives the
two sets of axes call for: a psum of per-row partial statistics over the hidden
axes, a psum of parameter gradients over the row axes. x itself is never
gathered, except for a dimension that does not divide evenly over its mesh
axes, which is gathered with a warning.

Under Shardy the `sharding_rule` drives propagation and `partition` does the
work; the GSPMD callback `infer_sharding_from_operands` serves jax configured
with the older partitioner.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

ROWS_NORM, NORM, ROWS, ABSENT = "rows+norm", "norm", "rows", "absent"


@dataclass(frozen=True)
class ShardAxes:
    """How x is split over the mesh, as a per-device function sees it.

    rows: mesh axes that split the row dims (each device has whole rows).
    hidden: mesh axes that split the normalized dims (each device has a slice
      of every row); per-row sums must be combined over them.
    hidden_shards: how many slices each row is cut into.
    """

    rows: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    hidden_shards: int = 1


UNSHARDED = ShardAxes()


@dataclass(frozen=True)
class RowLayout:
    """Which layout each operand and result of one call has, and x's rank split."""

    ins: tuple[str, ...]
    outs: tuple[str, ...]
    row_ndim: int
    norm_ndim: int

    def dims(self, layout: str) -> tuple[int, ...]:
        """The dims of x that an array of `layout` has, in order."""
        rows = tuple(range(self.row_ndim))
        norm = tuple(range(self.row_ndim, self.row_ndim + self.norm_ndim))
        return {ROWS_NORM: rows + norm, NORM: norm, ROWS: rows, ABSENT: ()}[layout]

    def sharding_rule(self) -> str:
        """Shardy's einsum-like rule: one factor per dim of x, shared by every
        array with that dim; each placeholder gets a factor of its own."""
        names = [f"r{i}" for i in range(self.row_ndim)]
        names += [f"n{i}" for i in range(self.norm_ndim)]
        placeholders = iter(range(len(self.ins) + len(self.outs)))

        def term(layout):
            if layout == ABSENT:
                return f"z{next(placeholders)}"
            return " ".join(names[d] for d in self.dims(layout))

        ins = ", ".join(term(x) for x in self.ins)
        outs = ", ".join(term(x) for x in self.outs)
        return f"{ins} -> {outs}"


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _x_spec(op: str, mesh, x) -> list:
    """x's partition spec, one entry per dim, with the entries of dimensions
    that do not divide over their mesh axes dropped (so gathered), with a
    warning that says which and why."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        warnings.warn(
            f"jaxnorm.{op}: x has a sharding without mesh axes ({sharding}); "
            "computing on a replicated x",
            stacklevel=1,
        )
        return [None] * len(x.shape)
    spec = list(sharding.spec) + [None] * (len(x.shape) - len(sharding.spec))
    for d, entry in enumerate(spec):
        axes = _axes_of(entry)
        shards = math.prod(mesh.shape[a] for a in axes)
        if axes and x.shape[d] % shards:
            warnings.warn(
                f"jaxnorm.{op}: x dimension {d} (size {x.shape[d]}) does not divide "
                f"over mesh axes {axes} ({shards} shards); gathering that dimension",
                stacklevel=1,
            )
            spec[d] = None
    return spec


def _plan(op: str, layout: RowLayout, mesh, x):
    spec = _x_spec(op, mesh, x)
    row_axes = sum((_axes_of(spec[d]) for d in layout.dims(ROWS)), ())
    hidden_axes = sum((_axes_of(spec[d]) for d in layout.dims(NORM)), ())
    axes = ShardAxes(row_axes, hidden_axes, math.prod(mesh.shape[a] for a in hidden_axes))

    def sharding(kind):
        return NamedSharding(mesh, PartitionSpec(*(spec[d] for d in layout.dims(kind))))

    return axes, sharding


def lowers_unsplit(ctx) -> bool:
    """Whether a call lowered in `ctx` runs on whole arrays, where
    custom_partitioning would lower it unsplit too: one device, or inside
    `shard_map` with every mesh axis manual. (Reads the lowering context as
    custom_partitioning does; where it cannot, the call is left to
    custom_partitioning.)"""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    mesh = getattr(axis_context, "mesh", None)
    manual = getattr(axis_context, "manual_axes", None)
    if mesh is not None and manual is not None:
        return set(manual) == set(mesh.axis_names) or mesh.size == 1
    devices = getattr(axis_context, "device_assignment", None)
    return devices is not None and len(devices) == 1


def row_partitioned(
    op: str, layout: RowLayout, local: Callable[..., Sequence], *, x_arg: int = 0
) -> Callable[..., Sequence]:
    """`local(*arrays, axes=ShardAxes)`, partitioned automatically under jit.

    Single-device and fully manual (`shard_map`) calls run `local` unsplit.
    `x_arg` is the position of the operand whose sharding decides the split.
    """
    def unsplit(*arrays):  # positional only: custom_partitioning binds by position
        return local(*arrays, axes=UNSHARDED)

    fn = custom_partitioning(unsplit)

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        axes, sharding = _plan(op, layout, mesh, arg_shapes[x_arg])
        args = tuple(sharding(k) for k in layout.ins)
        outs = tuple(sharding(k) for k in layout.outs)
        return mesh, functools.partial(local, axes=axes), outs, args

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        del result_shape
        _, sharding = _plan(op, layout, mesh, arg_shapes[x_arg])
        return tuple(sharding(k) for k in layout.outs)

    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=layout.sharding_rule(),
    )
    return fn
