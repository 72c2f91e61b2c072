"""Machinery every jaxnorm op shares: defining primitives, output avals that
keep the operands' sharding and manual-axis information, and lining up the
varying manual axes of operands inside `shard_map`.

Each op has two layers of primitives. The user-facing one works on x of shape
(*rows, *normalized) and is what jaxprs contain: it has the abstract eval, the
vmap rule and the eager impl, and its lowering goes through automatic
partitioning (`_partition.partitioned`). That lowering binds the kernel
primitive, which sees the kernel's own (rows, hidden) operands on one device
and lowers to the FFI handler, or to a jax.numpy reference of the same math on
platforms without a compiled kernel (TPU, ROCm, a build without CUDA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import PartitionSpec

from jaxnorm._ffi import KERNELS, TARGET_PREFIX
from jaxnorm._partition import lowers_unsplit


def define_kernel_primitive(
    name: str,
    *,
    abstract_eval: Callable[..., Sequence[Any]],
    reference: Callable[..., Sequence[jax.Array]],
    attributes: Callable[..., dict[str, Any]],
    aliases: Callable[..., dict[int, int]] | None = None,
    rewrite_operands: Callable[..., tuple[Any, Sequence[Any]]] | None = None,
    supports: Callable[..., bool] | None = None,
) -> Primitive:
    """The primitive of one FFI target `name`, on the kernel's own operands.

    It lowers to the compiled handler on the platforms this build has one for
    and to `reference` (the same math in jax.numpy) everywhere else. It is only
    bound from inside the lowering of a user-facing primitive (see
    `define_row_primitive`), after vmap, autodiff and partitioning are done.
    `aliases(avals_in, **params)` gives the operands whose buffers results
    reuse ({operand: result}); XLA copies an operand that is still live.
    `rewrite_operands(ctx, operands, **params)` may swap the handler's MLIR
    operands (and ctx's avals) for others it accepts, from what produced them.
    `supports(platform, *avals, **params)` says whether a platform's handler
    takes a call (some take one layout only); where not, it lowers to
    `reference`.
    """
    prim = Primitive(TARGET_PREFIX + name + "_kernel")
    prim.multiple_results = True
    prim.def_abstract_eval(abstract_eval)
    cacheable = rewrite_operands is None  # else lowered where it is
    by_reference = mlir.lower_fun(reference, multiple_results=True)
    mlir.register_lowering(prim, by_reference, cacheable=cacheable)
    for platform, names in KERNELS.items():
        if name in names:
            rule = _ffi_lowering(TARGET_PREFIX + name, attributes, aliases, rewrite_operands)
            if supports is not None:
                rule = _kernel_where_supported(rule, by_reference,
                                               functools.partial(supports, platform))
            mlir.register_lowering(prim, rule, platform=platform, cacheable=cacheable)
    return prim


def _kernel_where_supported(kernel_rule, reference_rule, supported):
    def rule(ctx, *args, **params):
        use = kernel_rule if supported(*ctx.avals_in, **params) else reference_rule
        return use(ctx, *args, **params)

    return rule


def define_row_primitive(
    name: str,
    *,
    abstract_eval: Callable[..., Sequence[Any]],
    reference: Callable[..., Sequence[jax.Array]],
    lower: Callable[..., Sequence[jax.Array]],
    row_args: Sequence[bool],
    row_outs: Sequence[bool],
    unsplit: Callable[..., Sequence[jax.Array]] | None = None,
    in_place: bool = False,
    batched_params: Callable[[dict], dict] | None = None,
) -> Primitive:
    """A user-facing multiple-result primitive on x of shape (*rows, *normalized).

    `lower(*arrays, **params)` is its lowering on every platform, written in
    JAX: it goes through automatic partitioning and binds kernel primitives.
    `reference` is the same math in jax.numpy, used by vmap where a kernel
    cannot batch. `row_args`/`row_outs` flag the operands and results whose
    leading dims are x's row dims: vmap makes its batch axis one more row dim.
    Other results (reductions over rows, such as dscale) come from the vmapped
    reference in that case. A ``(0,)`` array stands for an argument or result
    the call lacks (a RMSNorm's mean, a forward without bias).
    `unsplit` (same signature) is the lowering where the call runs on whole
    arrays (`lowers_unsplit`), with no custom_partitioning around it. With
    `in_place` the lowering is emitted where the call is rather than as a
    cached function, so that kernel lowerings inside it see what produced
    their operands (`define_kernel_primitive`'s rewrite_operands).
    `batched_params(params)` gives the parameters of the call that vmap binds
    with its batch axis in front (where that axis changes what they mean).
    """
    prim = Primitive(TARGET_PREFIX + name)
    prim.multiple_results = True
    prim.def_abstract_eval(abstract_eval)
    prim.def_impl(functools.partial(_eager_impl, prim))

    def rule(ctx, *args, **params):
        fn = unsplit if unsplit is not None and lowers_unsplit(ctx) else lower
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args, **params)

    mlir.register_lowering(prim, rule, cacheable=not in_place)
    # The lowering emits custom_partitioning, which needs the device assignment;
    # jit hands it to lowering only for primitives listed here (JAX internals,
    # as TransformerEngine's primitives use them too).
    dispatch.prim_requires_devices_during_lowering.add(prim)
    batching.primitive_batchers[prim] = functools.partial(
        _batch_rows, prim, reference, tuple(row_args), tuple(row_outs),
        batched_params or (lambda params: params),
    )
    return prim


def _ffi_lowering(target: str, attributes: Callable[..., dict[str, Any]], aliases,
                  rewrite_operands):
    def rule(ctx, *args, **params):
        if rewrite_operands:
            ctx, args = rewrite_operands(ctx, args, **params)
        alias = aliases(ctx.avals_in, **params) if aliases else None
        lower = jax.ffi.ffi_lowering(target, operand_output_aliases=alias or None)
        return lower(ctx, *args, **attributes(**params))

    return rule


@functools.cache
def _jitted_bind(prim: Primitive, params: tuple[tuple[str, Any], ...]):
    return jax.jit(lambda *args: prim.bind(*args, **dict(params)))


def _eager_impl(prim: Primitive, *args, **params):
    # A primitive only runs compiled, also under jax.disable_jit().
    with jax.disable_jit(False):
        return _jitted_bind(prim, tuple(sorted(params.items())))(*args)


def _is_placeholder(a) -> bool:
    """Whether `a` is the ``(0,)`` stand-in for an absent argument or result."""
    return tuple(a.shape) == (0,)


def _batch_rows(prim, reference, row_args, row_outs, batched_params, args, dims, **params):
    not_mapped = getattr(batching, "not_mapped", None)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
    ref_axes = tuple(None if d is not_mapped else d for d in dims)

    def vmapped_reference():
        return jax.vmap(functools.partial(reference, **params), in_axes=ref_axes)(*args)

    if size == 0 or any(d is not not_mapped and not row for d, row in zip(dims, row_args)):
        outs = vmapped_reference()
        return list(outs), [0] * len(outs)

    moved = []
    for a, d, row in zip(args, dims, row_args):
        if row and not _is_placeholder(a):
            a = jnp.broadcast_to(a, (size, *a.shape)) if d is not_mapped else jnp.moveaxis(a, d, 0)
        moved.append(a)
    outs = list(prim.bind(*moved, **batched_params(params)))
    out_dims = []
    per_example = []
    for i, (o, row) in enumerate(zip(outs, row_outs)):
        if _is_placeholder(o):
            out_dims.append(not_mapped)
        elif row:
            out_dims.append(0)
        else:
            per_example.append(i)
            out_dims.append(0)
    if per_example:
        ref = vmapped_reference()
        for i in per_example:
            outs[i] = ref[i]
    return outs, out_dims


def like(aval, shape: tuple[int, ...], dtype, dims: Sequence[int | None]):
    """An aval of `shape` and `dtype` that keeps `aval`'s manual axes and mesh.

    `dims[i]` names the dimension of `aval` whose sharding the new dimension i
    inherits (None: not sharded).
    """
    spec = tuple(aval.sharding.spec) + (None,) * aval.ndim
    new_spec = PartitionSpec(*(None if d is None else spec[d] for d in dims))
    sharding = aval.sharding.update(spec=new_spec)
    return aval.update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False, sharding=sharding)


def aval_of(x, dims: Sequence[int] | None, dtype):
    """An aval of x's sizes on `dims` (None: the ``(0,)`` placeholder), split
    as x is on them, with x's manual axes."""
    if dims is None:
        return like(x, (0,), dtype, (None,))
    return like(x, tuple(x.shape[d] for d in dims), dtype, tuple(dims))


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _pvary(x, axes: tuple):
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)


def match_varying(*arrays):
    """Inside `shard_map`, mark every array as varying over the union of the
    manual axes any of them varies over (None entries pass through).

    Kernels mix their operands, so their results vary wherever any operand
    does; the transpose of this marking is the psum that, e.g., sums a
    replicated scale's gradient over the devices.
    """
    present = [a for a in arrays if a is not None]
    axes = frozenset().union(*(_varying_axes(a) for a in present))
    if not axes:
        return arrays
    out = []
    for a in arrays:
        missing = () if a is None else tuple(sorted(axes - _varying_axes(a), key=str))
        out.append(_pvary(a, missing) if missing else a)
    return tuple(out)


def register_dce_rewrite(prim: Primitive, rewrite: Callable[[list[bool], dict], dict | None]):
    """Lets jit's dead-code elimination swap `prim`'s parameters when only some
    of its results are used (e.g. a forward whose output is dead but whose
    statistics feed the backward). `rewrite(used, params)` returns new params or
    None to keep the equation. Uses JAX's internal DCE hook; without it (a
    future JAX that moved it) the equation is simply kept whole.
    """
    try:
        from jax._src import core
        from jax._src.interpreters import partial_eval as pe
    except ImportError:  # pragma: no cover
        return

    def rule(used_outputs, eqn):
        n = len(eqn.invars)
        if not any(used_outputs):
            return [False] * n, None
        params = rewrite(list(used_outputs), dict(eqn.params))
        if params is None:
            return [True] * n, eqn
        avals, _ = prim.abstract_eval(*(v.aval for v in eqn.invars), **params)
        outvars = [
            v if used else core.DropVar(aval)
            for v, used, aval in zip(eqn.outvars, used_outputs, avals)
        ]
        new_eqn = core.new_jaxpr_eqn(
            eqn.invars, outvars, prim, params, eqn.effects, eqn.source_info, eqn.ctx
        )
        return [True] * n, new_eqn

    pe.dce_rules[prim] = rule
