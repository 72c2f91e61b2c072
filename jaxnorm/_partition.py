"""Automatic partitioning of jaxnorm's ops under `jit` with sharded operands.

Each op works on an x whose dims each play one role:

- ``ROW``: independent slices (a row norm's rows, GroupNorm's samples). A
  device holds whole ones; partial parameter gradients are summed over the
  mesh axes on these dims (the *row axes*).
- ``FREE``: independent too, with the parameters split alongside (GroupNorm's
  channels, in whole groups): nothing to combine.
- ``REDUCED``: dims the op reduces over (a row norm's hidden dims, BatchNorm's
  batch and spatial dims). A device holds a part of each reduction, and the
  op's per-device function combines partial results over the mesh axes on
  these dims (the *hidden axes*) with a small collective.
- ``WHOLE``: dims the op needs whole on every device (the channels of local
  response normalization, whose window crosses any cut): gathered.

Every operand and result has some of x's dims (`Layout`), and is sharded to
match x: a parameter sharded differently is resliced, a cheap copy of a small
array. x itself is gathered only on ``WHOLE`` dims and on dims that do not
divide evenly over their mesh axes (or into whole quanta, such as groups),
with a warning that says which and why.

Under Shardy the `sharding_rule` drives propagation and `partition` does the
work; the GSPMD callback `infer_sharding_from_operands` serves jax configured
with the older partitioner.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

ROW, FREE, REDUCED, WHOLE = "row", "free", "reduced", "whole"


Dims = tuple[int, ...]


@dataclass(frozen=True)
class ShardAxes:
    """How x is split over the mesh, as a per-device function sees it.

    rows: mesh axes on ``ROW`` dims (each device has whole slices).
    hidden: mesh axes on ``REDUCED`` dims; per-device partial reductions must
      be combined over them.
    hidden_shards: how many parts each reduction is cut into.
    manual: inside `shard_map`, where parameter gradients stay per-device
      partial sums: shard_map's own transposes sum them.
    """

    rows: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    hidden_shards: int = 1
    manual: bool = False

    def param_axes(self) -> tuple[str, ...]:
        """The mesh axes to sum parameter gradients over, for parameters
        split like neither rows nor reduced dims (BatchNorm's scale)."""
        return () if self.manual else self.rows + self.hidden


UNSHARDED = ShardAxes()


@dataclass(frozen=True)
class Layout:
    """The roles of x's dims, and which of x's dims each operand and result
    has, in order (None: a ``(0,)`` placeholder for what the call lacks).

    quanta: for each dim of x, a number a device's block of it must be a
    multiple of (GroupNorm's channels: the group size); empty for all 1.
    """

    roles: tuple[str, ...]
    ins: tuple[Dims | None, ...]
    outs: tuple[Dims | None, ...]
    quanta: tuple[int, ...] = ()

    def dims(self, *roles: str) -> tuple[int, ...]:
        """x's dims that have one of `roles`, in order."""
        return tuple(d for d, r in enumerate(self.roles) if r in roles)

    def sharding_rule(self) -> tuple[str, tuple[str, ...]]:
        """Shardy's einsum-like rule: one factor per dim of x, shared by every
        array with that dim; each placeholder gets a factor of its own. Also
        the factors that must not be split (``WHOLE``)."""
        names = [f"d{i}" for i in range(len(self.roles))]
        own = itertools.count()

        def term(dims):
            return f"z{next(own)}" if dims is None else " ".join(names[d] for d in dims)

        ins = ", ".join(term(x) for x in self.ins)
        outs = ", ".join(term(x) for x in self.outs)
        whole = tuple(names[d] for d in self.dims(WHOLE))
        return f"{ins} -> {outs}", whole


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _x_spec(op: str, layout: Layout, mesh, x) -> list:
    """x's partition spec, one entry per dim, with the entries of dims that
    must be whole, or that do not divide over their mesh axes (or into whole
    quanta), dropped (so gathered), with a warning that says which and why."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        warnings.warn(
            f"jaxnorm.{op}: x has a sharding without mesh axes ({sharding}); "
            "computing on a replicated x",
            stacklevel=1,
        )
        return [None] * len(x.shape)
    spec = list(sharding.spec) + [None] * (len(x.shape) - len(sharding.spec))
    quanta = layout.quanta or (1,) * len(x.shape)
    for d, entry in enumerate(spec):
        axes = _axes_of(entry)
        if not axes:
            continue
        shards = math.prod(mesh.shape[a] for a in axes)
        why = None
        if layout.roles[d] == WHOLE:
            why = f"{op} needs it whole on every device"
        elif x.shape[d] % shards:
            why = f"it does not divide over them ({shards} shards)"
        elif (x.shape[d] // shards) % quanta[d]:
            why = f"a shard of it would cut a group of {quanta[d]}"
        if why:
            warnings.warn(
                f"jaxnorm.{op}: x dimension {d} (size {x.shape[d]}) is split over mesh "
                f"axes {axes}, but {why}; gathering that dimension",
                stacklevel=1,
            )
            spec[d] = None
    return spec


def _plan(op: str, layout: Layout, mesh, x):
    spec = _x_spec(op, layout, mesh, x)
    row_axes = sum((_axes_of(spec[d]) for d in layout.dims(ROW)), ())
    hidden_axes = sum((_axes_of(spec[d]) for d in layout.dims(REDUCED)), ())
    axes = ShardAxes(row_axes, hidden_axes, math.prod(mesh.shape[a] for a in hidden_axes))

    def sharding(dims):
        entries = () if dims is None else (spec[d] for d in dims)
        return NamedSharding(mesh, PartitionSpec(*entries))

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


def partitioned(
    op: str, layout: Layout, local: Callable[..., Sequence], *, x_arg: int = 0
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

    rule, whole = layout.sharding_rule()
    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=rule,
        need_replication_factors=whole,
    )
    return fn


def lower_partitioned(op: str, local: Callable[..., Sequence], layout: Layout, args,
                      params: dict):
    """Lowers `local(*args, axes=ShardAxes, **params)` through automatic
    partitioning: it runs on each device's block."""
    return _partitioned(op, local, layout, tuple(sorted(params.items())))(*args)


@functools.cache
def _partitioned(op, local, layout, params):
    return partitioned(op, layout, functools.partial(local, **dict(params)))

