"""Trace-time argument checks shared by the public ops. Each error names the
argument, what was expected and what was given."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

KERNEL_DTYPES = tuple(jnp.dtype(d) for d in ("float32", "bfloat16", "float16", "float64"))


def floating_array(name: str, op: str, x) -> jnp.ndarray:
    """`x` as an array of a supported floating dtype."""
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
        raise TypeError(
            f"{op}: {name} must have dtype float32, bfloat16, float16 or float64, "
            f"got {jnp.dtype(x.dtype).name}"
        )
    return x


def static_float(op: str, name: str, value) -> float:
    """`value` as a finite Python float (a static argument, not a traced one)."""
    try:
        out = float(value)
    except Exception as e:
        raise TypeError(
            f"{op}: {name} must be a static Python or NumPy float, got {type(value).__name__}"
        ) from e
    if not math.isfinite(out):
        raise ValueError(f"{op}: {name} must be finite, got {value!r}")
    return out


def epsilon(op: str, value) -> float:
    eps = static_float(op, "epsilon", value)
    if eps < 0:
        raise ValueError(f"{op}: epsilon must be finite and >= 0, got {value!r}")
    return eps


def output_dtype(op: str, dtype, default) -> np.dtype:
    out = jnp.dtype(default if dtype is None else dtype)
    if out not in KERNEL_DTYPES:
        raise TypeError(
            f"{op}: dtype must be float32, bfloat16, float16 or float64, got {out.name}"
        )
    return out


def normalized_shape(
    op: str, x, params: dict[str, object], explicit: Sequence[int] | int | None
) -> tuple[int, ...]:
    """The trailing shape of `x` to normalize over: `explicit` if given, else
    the shape of the first parameter given, else x's last axis. Every given
    parameter must have exactly that shape."""
    if explicit is not None:
        shape = (int(explicit),) if np.ndim(explicit) == 0 else tuple(int(d) for d in explicit)
        source = "normalized_shape"
    else:
        given = [(n, p) for n, p in params.items() if p is not None]
        if not given and x.ndim == 0:
            raise ValueError(f"{op}: x must have rank >= 1, got a scalar")
        shape = tuple(given[0][1].shape) if given else tuple(x.shape[-1:])
        source = given[0][0] if given else "the last axis of x"
    if len(shape) == 0:
        raise ValueError(f"{op}: the normalized shape must have at least one axis, got ()")
    if x.ndim < len(shape):
        raise ValueError(
            f"{op}: x must have rank >= {len(shape)} to normalize over shape {shape} "
            f"(from {source}), got x of shape {tuple(x.shape)}"
        )
    if tuple(x.shape[x.ndim - len(shape):]) != shape:
        raise ValueError(
            f"{op}: the trailing dimensions of x {tuple(x.shape)} must equal the normalized "
            f"shape {shape} (from {source})"
        )
    for n, p in params.items():
        if p is not None and tuple(p.shape) != shape:
            raise ValueError(
                f"{op}: {n} must have shape {shape} (the normalized shape, from {source}), "
                f"got {tuple(p.shape)}"
            )
    return shape


def same_shape(op: str, name: str, a, other_name: str, other) -> None:
    if tuple(a.shape) != tuple(other.shape):
        raise ValueError(
            f"{op}: {name} must have the shape of {other_name} {tuple(other.shape)}, "
            f"got {tuple(a.shape)}"
        )


def parameter(op: str, name: str, p):
    if p is None:
        return None
    return floating_array(name, op, p)


def rows_and_size(x_shape: Sequence[int], norm_shape: Sequence[int]) -> tuple[int, int]:
    k = len(norm_shape)
    return math.prod(x_shape[: len(x_shape) - k]), math.prod(norm_shape)


def axis_name(op: str, value) -> tuple[str, ...]:
    """`axis_name` as a tuple of mesh axis names (empty for None)."""
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, tuple | list) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{op}: axis_name must be a mesh axis name or a tuple of them, got {value!r}"
        )
    return tuple(names)
