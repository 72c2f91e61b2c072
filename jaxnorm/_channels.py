"""What the channel ops share: the channel axis and the views of x around it,
and the primitives of the ops that work along the channels at each position
(local response normalization, the channel softmax).

A channel op's x has one channel axis, kept as a negative index so that vmap,
which adds leading axes, leaves it alone. The kernels see x as (N, A, C, B):
N the product of the op's independent leading dims, C the channels, A and B
the products of the dims before and after C.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import numpy as np

from jaxnorm._partition import ROW, WHOLE, Layout, lower_partitioned
from jaxnorm._primitive import aval_of, define_kernel_primitive, define_row_primitive, like


def channel_axis(op: str, x, axis, *, lead_ndim: int = 0) -> int:
    """`axis` of x checked and as a negative index; it may not be one of the
    `lead_ndim` leading (batch) axes."""
    if not isinstance(axis, int | np.integer) or isinstance(axis, bool):
        raise TypeError(f"{op}: channel_axis must be an int, got {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"{op}: channel_axis {axis} is out of range for x of shape {tuple(x.shape)}"
        )
    if axis % x.ndim < lead_ndim:
        raise ValueError(
            f"{op}: channel_axis {axis} is the batch axis of x of shape {tuple(x.shape)}; "
            "the channels must come after it"
        )
    return int(axis % x.ndim - x.ndim)


def view(x, lead_ndim: int, axis: int):
    """x as (N, A, C, B) for `lead_ndim` leading dims and channel axis `axis`."""
    c = x.ndim + axis
    shape = x.shape
    return x.reshape(math.prod(shape[:lead_ndim]), math.prod(shape[lead_ndim:c]), shape[c],
                     math.prod(shape[c + 1:]))


# ------------------------------------------------- along-channel ops


def _along_layout(x, axis, n_in):
    """Every dim independent but the channels, which the op needs whole."""
    roles = [ROW] * x.ndim
    roles[x.ndim + axis] = WHOLE
    every = tuple(range(x.ndim))
    return Layout(roles=tuple(roles), ins=(every,) * n_in, outs=(every,))


_LINE_DTYPES = {np.dtype(np.float32), np.dtype(jax.numpy.bfloat16), np.dtype(np.float16)}


def cuda_line_fits(x, *, min_vec: int = 1, min_bytes: int = 1) -> bool:
    """Whether the CUDA kernels along the channels take x viewed as (M, C, B)
    (cpp/cuda/channel_lines.cuh): channels last (B == 1), a 16- or 32-bit
    float dtype, and a line of C channels that a team of at most 32 lanes
    holds in registers, at most 3 vectors a lane, in vectors (the widest of
    16, 8, 4 or 2 bytes that divides the line) of at least `min_vec` channels
    and `min_bytes` bytes."""
    if x.shape[2] != 1 or np.dtype(x.dtype) not in _LINE_DTYPES:
        return False
    itemsize = np.dtype(x.dtype).itemsize
    c, wide, least = x.shape[1], 16 // itemsize, max(min_vec, min_bytes // itemsize, 1)
    vec = next((v for v in (wide, wide // 2, wide // 4, wide // 8)
                if v >= least and c % v == 0), None)
    if vec is None:
        return False
    vecs, lanes = c // vec, 1
    while lanes < 32 and lanes * 3 < vecs:
        lanes *= 2
    return -(-vecs // lanes) <= 3


def cuda_positions_fit(x) -> bool:
    """Whether the CUDA kernels that walk each position's channels take x
    viewed as (M, C, B): channels not last (B > 1) and a 16- or 32-bit float
    dtype (local response normalization's lrn_positions), and lines of
    fewer than 2^31 elements (C * B: its offsets within a line are 32-bit)."""
    return (x.shape[2] > 1 and np.dtype(x.dtype) in _LINE_DTYPES
            and x.shape[1] * x.shape[2] < 2**31)


# Channels the CUDA softmax's tiles of positions hold in registers
# (kTileChannels in cpp/cuda/channel_softmax.cu).
_TILE_CHANNELS = 256


def cuda_position_tiles_fit(x) -> bool:
    """Whether the channel softmax's CUDA kernel for channels-first x takes x
    viewed as (M, C, B): as cuda_positions_fit, and at most 256 channels (a
    tile's threads hold a position's channels in registers)."""
    return cuda_positions_fit(x) and x.shape[1] <= _TILE_CHANNELS


def define_along_channels(
    name: str,
    *,
    fwd_reference: Callable,
    bwd_reference: Callable,
    attributes: Callable[..., dict],
    supports: Callable[..., bool] | None = None,
) -> Callable:
    """The differentiable op `apply(x, axis, **attrs)` of the FFI targets
    `<name>_fwd` (x -> y) and `<name>_bwd` ((x, dy) -> dx), which work
    along the channels at each position of x viewed as (M, C, B). The
    references are the same math in jax.numpy on (M, C, B). The backward
    takes x, not y: under grad with y dead, the forward is not run at all.
    x is never split on its channel axis (a sharded one is gathered).
    `supports(platform, x, **attrs)` says where a platform's handlers take x
    (M, C, B); elsewhere the reference runs."""

    def kernel(suffix, reference):
        return define_kernel_primitive(
            f"{name}_{suffix}",
            abstract_eval=lambda x, *_, **__: (like(x, x.shape, x.dtype, (0, 1, 2)),),
            reference=lambda *a, **p: (reference(*a, **p),),
            attributes=attributes,
            supports=None if supports is None else lambda platform, x, *_, **p: supports(
                platform, x, **p),
        )

    references = {"fwd": fwd_reference, "bwd": bwd_reference}
    kernels = {k: kernel(k, ref) for k, ref in references.items()}

    def local(*arrays, axes, kernel, axis, **attrs):
        del axes  # the channels are whole on every device; every other dim is free
        x = arrays[0]
        views = [view(a, 0, axis)[0] for a in arrays]
        return [kernel(*views, **attrs)[0].reshape(x.shape)]

    def user_primitive(suffix, n_in):
        on_device = functools.partial(local, kernel=kernels[suffix].bind)

        def lower(*arrays, **params):
            layout = _along_layout(arrays[0], params["axis"], n_in)
            return lower_partitioned(name, on_device, layout, arrays, params)

        def reference(*arrays, **params):
            def by_reference(*views, **attrs):
                return (references[suffix](*views, **attrs),)

            return local(*arrays, axes=None, kernel=by_reference, **params)

        return define_row_primitive(
            f"{name}_{suffix}",
            abstract_eval=lambda x, *_, **__: (aval_of(x, tuple(range(x.ndim)), x.dtype),),
            reference=reference,
            lower=lower,
            unsplit=functools.partial(on_device, axes=None),
            row_args=(True,) * n_in,
            row_outs=(True,),
        )

    fwd_p, bwd_p = user_primitive("fwd", 1), user_primitive("bwd", 2)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def apply(x, axis, attrs):
        return fwd_p.bind(x, axis=axis, **dict(attrs))[0]

    def apply_fwd(x, axis, attrs):
        return fwd_p.bind(x, axis=axis, **dict(attrs))[0], x

    def apply_bwd(axis, attrs, saved, dy):
        return (bwd_p.bind(saved, dy, axis=axis, **dict(attrs))[0],)

    apply.defvjp(apply_fwd, apply_bwd)
    return apply
