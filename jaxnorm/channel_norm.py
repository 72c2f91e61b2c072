"""GroupNorm, InstanceNorm and BatchNorm: normalization over groups of
channels, with one forward and one backward primitive for all three.

x has a channel axis; the dims before it are `lead_ndim` independent leading
dims (GroupNorm's and InstanceNorm's samples; none for BatchNorm, whose
statistics span the batch; vmap adds one) and the rest. Each group of
`group_size` consecutive channels of each leading index has a mean and a
biased variance over everything else (the kernels' (N, A, C, B) view:
`_channels.view`). GroupNorm has C / group_size groups, InstanceNorm and
BatchNorm one a channel.

    y = act((x - mean) * rsqrt(var + epsilon) * scale + bias),  act: none, SiLU, ReLU

The forward returns the statistics (mean, variance) and y from one launch
(BatchNorm without an activation: the statistics alone, y being jax.numpy
that XLA fuses with the ops that follow). The backward reads x and the
statistics (and scale and bias, to recompute the activation's input);
without an activation GroupNorm and InstanceNorm save none, and the
backward computes them in its pass over x and dy. Given statistics
(BatchNorm's running averages, in evaluation), the forward only
normalizes (jax.numpy without an activation, as in training), and the
backward takes them as constants.

Split over devices, the reduced dims (A and B) combine per-device statistics
with one all-gather of each device's (mean, M2) per group, merged with Chan's
formula (`_stats.merge_moments`), between a statistics-only launch and a
normalizing one; the backward's per-group sums are added up with one
all-reduce (with the parameter gradients) between a sums-only launch and a
dx one. Leading dims need only the parameter gradients summed; channels split
in whole groups need nothing.

Dtype rule as the row norms': statistics in float32 (float64 for float64 x),
output in x's dtype unless `dtype` is given, scale and bias read in x's dtype
or, for 16-bit x, float32 (other dtypes are cast to the statistics dtype),
gradients in each argument's dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxnorm import _checks
from jaxnorm._channels import channel_axis as _channel_axis
from jaxnorm._channels import view
from jaxnorm._partition import FREE, REDUCED, ROW, UNSHARDED, Layout, lower_partitioned
from jaxnorm._primitive import (
    _is_placeholder,
    aval_of,
    define_kernel_primitive,
    define_row_primitive,
    like,
    match_varying,
)
from jaxnorm._stats import (
    empty,
    kernel_out_dtype,
    manual_axes,
    merge_moments,
    or_empty,
    param_dtype,
    psum_concat,
    stats_dtype,
)

AxisName = str | tuple[str, ...]

# ------------------------------------------ kernels: x as (N, A, C, B)


def _groups(x4, group_size):
    """x (N, A, C, B) in the statistics dtype as (N, A, G, group_size, B)."""
    n, a, c, b = x4.shape
    return x4.astype(stats_dtype(x4.dtype)).reshape(n, a, c // group_size, group_size, b)


def _per_channel(stat, group_size):
    """A (N, G) statistic broadcast against (N, A, C, B)."""
    return jnp.repeat(stat, group_size, axis=1)[:, None, :, None]


def _xhat(x4, mean, var, group_size, epsilon):
    acc = stats_dtype(x4.dtype)
    rstd = lax.rsqrt(var + jnp.asarray(epsilon, acc))
    return (x4.astype(acc) - _per_channel(mean, group_size)) * _per_channel(rstd, group_size)


def _affine(xhat, scale, bias):
    w = scale.astype(xhat.dtype)[None, None, :, None] if scale.size else 1
    b = bias.astype(xhat.dtype)[None, None, :, None] if bias.size else 0
    return xhat * w + b


def _fwd_kernel_abstract(x, scale, bias, mean, var, *, group_size, out_dtype, write_output,
                         **_):
    del scale, bias, var
    n, _, c, _ = x.shape
    stats = stats_dtype(x.dtype)
    y = like(x, x.shape if write_output else (0,), out_dtype,
             (0, 1, 2, 3) if write_output else (None,))
    given = not _is_placeholder(mean)
    stat = like(x, (0,) if given else (n, c // group_size), stats, (None,) if given else (0, 2))
    return y, stat, stat


# The kernels' codes of the fused activations (cpp/common/activation.h).
ACTIVATIONS = {None: 0, "silu": 1, "swish": 1, "relu": 2}


def _activate(z, activation):
    """act(z) for an activation code."""
    if activation == ACTIVATIONS["silu"]:
        return z * jax.nn.sigmoid(z)
    if activation == ACTIVATIONS["relu"]:
        return jnp.maximum(z, 0)  # NaN stays NaN
    return z


def _activation_backward(dy, z, activation):
    """dy act'(z), the cotangent of act's input (ReLU's: dy where z > 0, else
    0, as jax.nn.relu's)."""
    if activation == ACTIVATIONS["silu"]:
        s = jax.nn.sigmoid(z)
        return dy * s * (1 + z * (1 - s))
    if activation == ACTIVATIONS["relu"]:
        return jnp.where(z > 0, dy, 0)
    return dy


def _group_moments(x, group_size):
    """Each (sample, group)'s mean and biased variance of x (N, A, C, B)."""
    xg = _groups(x, group_size)
    mean = jnp.mean(xg, axis=(1, 3, 4))
    return mean, jnp.mean(jnp.square(xg - mean[:, None, :, None, None]), axis=(1, 3, 4))


def _fwd_kernel_reference(x, scale, bias, mean, var, *, group_size, epsilon, activation,
                          out_dtype, write_output):
    given = not _is_placeholder(mean)
    stats = stats_dtype(x.dtype)
    if not given:
        mean, var = _group_moments(x, group_size)
    out_stats = (empty(stats), empty(stats)) if given else (mean, var)
    if not write_output:
        return (empty(out_dtype), *out_stats)
    z = _affine(_xhat(x, mean, var, group_size, epsilon), scale, bias)
    return (_activate(z, activation).astype(out_dtype), *out_stats)


def _attributes(*, group_size, epsilon, activation, **_):
    return {"group_size": np.int64(group_size), "epsilon": np.float64(epsilon),
            "activation": np.int32(activation)}


def _supports(platform, x, *_, **__):
    """The CUDA kernels take channels-last x only (B == 1); other layouts run
    as jax.numpy there."""
    return platform != "cuda" or x.shape[3] == 1


channel_norm_fwd_kernel_p = define_kernel_primitive(
    "channel_norm_fwd",
    abstract_eval=_fwd_kernel_abstract,
    reference=_fwd_kernel_reference,
    attributes=_attributes,
    supports=_supports,
)


def _bwd_kernel_abstract(x, scale, bias, mean, var, dy, means, *, group_size, mode,
                         param_grads, param_dtype, **_):
    del mean, var, dy, means
    n, _, c, _ = x.shape
    dx = (aval_of(x, None, x.dtype) if mode in ("sums", "terms")
          else like(x, x.shape, x.dtype, (0, 1, 2, 3)))

    def grad_of(p):
        return like(x, (c,), param_dtype, (2,)) if p.size and param_grads else aval_of(
            x, None, param_dtype)

    stats = stats_dtype(x.dtype)
    sums = (like(x, (n, c // group_size, 2), stats, (0, 2, None)) if mode == "sums"
            else like(x, (n, c, DX_TERMS), stats, (0, 2, None)) if mode == "terms"
            else aval_of(x, None, stats))
    return dx, grad_of(scale), grad_of(bias), sums


def _grad_terms(x, scale, bias, mean, var, dy, group_size, epsilon, activation):
    """xhat and dy through the activation's derivative, in the statistics dtype."""
    xhat = _xhat(x, mean, var, group_size, epsilon)
    d = dy.astype(xhat.dtype)
    if activation:
        d = _activation_backward(d, _affine(xhat, scale, bias), activation)
    return xhat, d


def _bwd_kernel_reference(x, scale, bias, mean, var, dy, means, *, group_size, epsilon,
                          activation, mode, param_grads, param_dtype):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) over each group,
    g = dy' * scale; mode "full" computes the means, "sums" returns their sums
    (no dx), "terms" dx's per-channel terms (no dx: _dx_terms), "dx" takes
    the means. Mode "full" without an activation may take no statistics
    (placeholders) and compute them."""
    n, a, c, b = x.shape
    if _is_placeholder(mean):
        mean, var = _group_moments(x, group_size)
    xhat, d = _grad_terms(x, scale, bias, mean, var, dy, group_size, epsilon, activation)
    g = d * scale.astype(d.dtype)[None, None, :, None] if scale.size else d

    def group_sum(v):
        return jnp.sum(v.reshape(n, a, c // group_size, group_size, b), axis=(1, 3, 4))

    sums = jnp.stack([group_sum(g), group_sum(g * xhat)], axis=-1)
    dscale = jnp.sum(d * xhat, axis=(0, 1, 3)) if scale.size and param_grads else empty(d.dtype)
    dbias = jnp.sum(d, axis=(0, 1, 3)) if bias.size and param_grads else empty(d.dtype)
    grads = (dscale.astype(param_dtype), dbias.astype(param_dtype))
    if mode == "sums":
        return (empty(x.dtype), *grads, sums)
    if mode in ("full", "terms"):
        means = sums / (a * group_size * b)
    rstd = lax.rsqrt(var + jnp.asarray(epsilon, var.dtype))
    if mode == "terms":
        terms = _dx_terms(scale, rstd, means, group_size)
        return (empty(x.dtype), *grads, terms)
    dx = _per_channel(rstd, group_size) * (
        g - _per_channel(means[..., 0], group_size) - xhat * _per_channel(means[..., 1],
                                                                          group_size))
    return (dx.astype(x.dtype), *grads, empty(sums.dtype))


# dx's terms a channel, as the kernels' "terms" mode returns them (N, C,
# DX_TERMS): a = rstd * scale, k_x, k_0, about the group's mean.
DX_TERMS = 3


def _dx_terms(scale, rstd, means, group_size):
    """(N, C, DX_TERMS) with dx = a dy' + k_x (x - mean) + k_0, from
    rstd (g - mean_g - xhat mean_gx), xhat = (x - mean) rstd; rstd (N, G),
    means (N, G, 2)."""
    r = jnp.repeat(rstd, group_size, axis=1)
    mean_g, mean_gx = (jnp.repeat(means[..., k], group_size, axis=1) for k in (0, 1))
    a = r * scale.astype(r.dtype)[None] if scale.size else r
    return jnp.stack([a, -r * r * mean_gx, -r * mean_g], axis=-1)


def _dx_from_terms(x4, bias, mean, dy4, terms, group_size, activation):
    """dx of x4's shape (N, A, C, B), in the statistics dtype, from
    _dx_terms' (N, C, DX_TERMS) and the (N, G) mean."""
    a, k_x, k_0 = (terms[:, None, :, None, k] for k in range(DX_TERMS))
    xc = x4.astype(terms.dtype) - _per_channel(mean, group_size)
    d = dy4.astype(terms.dtype)
    if activation:
        z = xc * a + (bias.astype(a.dtype)[None, None, :, None] if bias.size else 0)
        d = _activation_backward(d, z, activation)
    return a * d + k_x * xc + k_0


channel_norm_bwd_kernel_p = define_kernel_primitive(
    "channel_norm_bwd",
    abstract_eval=_bwd_kernel_abstract,
    reference=_bwd_kernel_reference,
    attributes=_attributes,
    supports=_supports,
)


# ---------------------------------------------- per device: x as given
#
# Outside the kernels the statistics have one entry per channel (each group's
# repeated over its channels), shaped (*leading dims, C): then every array's
# dims are x's own, which the partitioner splits alike. BatchNorm's and
# InstanceNorm's groups are single channels, so for them this costs nothing.


def _per_channel_stats(stat, x, lead_ndim, group_size):
    """A kernel's (N, G) statistic as (*leading dims, C)."""
    if group_size > 1:
        stat = jnp.repeat(stat, group_size, axis=1)
    return stat.reshape(tuple(x.shape[:lead_ndim]) + (stat.shape[1],))


def _per_group_stats(stat, n, group_size):
    """A (*leading dims, C) statistic as the kernels' (N, G)."""
    stat = stat.reshape(n, -1)
    return stat[:, ::group_size] if group_size > 1 else stat


def _local_stats(run, x4, scale, bias, axes, group_size):
    """The (N, G) mean and variance of x4 (N, A, C, B) from the statistics
    launch `run`, merged across the devices that split the reduced dims."""
    _, a, _, b = x4.shape
    none = empty(stats_dtype(x4.dtype))
    _, m, v = run(x4, scale, bias, none, none, write_output=False)
    if axes.hidden:
        count = a * group_size * b
        total, m, m2 = merge_moments(count, m, v * count, axes.hidden, invariant=axes.manual)
        v = m2 / total
    return m, v


def _fwd_local(x, scale, bias, mean, var, *, axes, kernel, lead_ndim, axis, group_size,
               xla_elementwise=False, **params):
    """The forward on one device's block: one launch for the statistics and
    y, which on H100/H200 reads x once where it fits the SMs' shared memory,
    and the part that does not fit twice (cpp/cuda/channel_norm_cluster.cuh).
    With the reduced dims split,
    a first launch computes the statistics, one all-gather merges the
    blocks', and a second normalizes with them. With `xla_elementwise` y is
    jax.numpy, which XLA fuses with what surrounds it (BatchNorm's ReLU and
    residual add), after a launch for the statistics."""
    x4 = view(x, lead_ndim, axis)
    n = x4.shape[0]
    run = functools.partial(kernel, group_size=group_size, **params)
    normalize = functools.partial(_fwd_kernel_reference, group_size=group_size,
                                  **params) if xla_elementwise else run
    stats = stats_dtype(x.dtype)
    if not _is_placeholder(mean):  # given
        y, _, _ = normalize(x4, scale, bias, _per_group_stats(mean, n, group_size),
                            _per_group_stats(var, n, group_size), write_output=True)
        return y.reshape(x.shape), empty(stats), empty(stats)
    if axes.hidden or xla_elementwise:
        m, v = _local_stats(run, x4, scale, bias, axes, group_size)
        y, _, _ = normalize(x4, scale, bias, m, v, write_output=True)
    else:
        none = empty(stats)
        y, m, v = run(x4, scale, bias, none, none, write_output=True)
    return (y.reshape(x.shape), _per_channel_stats(m, x, lead_ndim, group_size),
            _per_channel_stats(v, x, lead_ndim, group_size))


def _bwd_local(x, scale, bias, mean, var, dy, *, axes, kernel, stats_kernel, lead_ndim, axis,
               group_size, epsilon, activation, frozen, param_dtype, xla_elementwise=False):
    """The backward on one device's block. With the reduced dims split, a
    first launch returns this block's per-group sums, one all-reduce adds them
    up (with the parameter gradients) and a second launch writes dx. Frozen
    (given) statistics have no gradient: the group means are zero. With
    `xla_elementwise` dx is jax.numpy: from the kernel's per-channel terms
    (mode "terms"), or, with the reduced dims split, from the summed sums.
    Without statistics saved (placeholders: _saves_no_stats) the "full" launch
    computes them; with the reduced dims split, `stats_kernel` (the forward's)
    does, with their merge."""
    x4, dy4 = view(x, lead_ndim, axis), view(dy, lead_ndim, axis)
    n, a, c, b = x4.shape
    groups = c // group_size
    stats = stats_dtype(x.dtype)
    if not _is_placeholder(mean):
        m2, v2 = _per_group_stats(mean, n, group_size), _per_group_stats(var, n, group_size)
    elif axes.hidden or frozen or xla_elementwise or activation:
        run_stats = functools.partial(stats_kernel, group_size=group_size, epsilon=epsilon,
                                      activation=activation, out_dtype=x.dtype)
        m2, v2 = _local_stats(run_stats, x4, scale, bias, axes, group_size)
    else:
        m2 = v2 = empty(stats)
    # Partial sums travel in float32 (float64 for float64 parameters).
    param_axes = axes.param_axes()
    wide = jnp.promote_types(param_dtype, jnp.float32) if param_axes else param_dtype
    s, bi = scale.astype(wide), bias.astype(wide)
    args = (x4, s, bi, m2, v2, dy4)
    params = dict(group_size=group_size, epsilon=epsilon, activation=activation,
                  param_dtype=wide)
    run = functools.partial(kernel, *args, **params)
    dx_of = functools.partial(_bwd_kernel_reference, *args, **params) if xla_elementwise else run
    if frozen and xla_elementwise:
        _, dscale, dbias, _ = run(empty(stats), mode="sums", param_grads=True)
        dx = dx_of(jnp.zeros((n, groups, 2), stats), mode="dx", param_grads=False)[0]
    elif frozen:
        zero = jnp.zeros((n, groups, 2), stats)
        dx, dscale, dbias, _ = run(zero, mode="dx", param_grads=True)
    elif not axes.hidden and not xla_elementwise:
        dx, dscale, dbias, _ = run(empty(stats), mode="full", param_grads=True)
    elif not axes.hidden:
        # dx's terms from the kernel: XLA's dx pass then needs no per-channel
        # kernels of its own (an rsqrt, the means; notes v66).
        _, dscale, dbias, terms = run(empty(stats), mode="terms", param_grads=True)
        dx = _dx_from_terms(x4, bi, m2, dy4, terms, group_size, activation).astype(x.dtype)
    else:
        _, dscale, dbias, sums = run(empty(stats), mode="sums", param_grads=True)
        if param_axes and param_axes == axes.hidden:  # one all-reduce for all three
            sums, dscale, dbias = psum_concat(axes.hidden, sums, dscale, dbias)
            param_axes = ()
        elif axes.hidden:
            sums = lax.psum(sums, axes.hidden)
        means = sums / (a * group_size * b * axes.hidden_shards)
        dx = dx_of(means, mode="dx", param_grads=False)[0]
    if param_axes:
        dscale, dbias = psum_concat(param_axes, dscale, dbias)
    return dx.reshape(x.shape), dscale.astype(param_dtype), dbias.astype(param_dtype)


# ------------------------------------------- user-facing: x as given


def _layout(x, lead_ndim, axis, group_size, ins, outs) -> Layout:
    """Leading dims independent, channels split in whole groups, the rest
    reduced over. ins/outs name each array's dims: "x", "channels", "stats"
    (the leading dims, then the channels) or None."""
    c = x.ndim + axis
    roles = [ROW] * lead_ndim + [REDUCED] * (x.ndim - lead_ndim)
    roles[c] = FREE
    quanta = [1] * x.ndim
    quanta[c] = group_size
    dims = {"x": tuple(range(x.ndim)), "channels": (c,),
            "stats": tuple(range(lead_ndim)) + (c,), None: None}
    return Layout(roles=tuple(roles), ins=tuple(dims[k] for k in ins),
                  outs=tuple(dims[k] for k in outs), quanta=tuple(quanta))


def _param_or_none(p):
    return None if _is_placeholder(p) else "channels"


def _stats_or_none(p):
    return None if _is_placeholder(p) else "stats"


def _fwd_layout(x, scale, bias, mean, *, lead_ndim, axis, group_size, **_):
    given = not _is_placeholder(mean)
    stats = None if given else "stats"
    return _layout(x, lead_ndim, axis, group_size,
                   ins=("x", _param_or_none(scale), _param_or_none(bias), _stats_or_none(mean),
                        _stats_or_none(mean)),
                   outs=("x", stats, stats))


def _fwd_abstract(x, scale, bias, mean, var, *, lead_ndim, axis, out_dtype, **_):
    del scale, bias, var
    stats = stats_dtype(x.dtype)
    y = aval_of(x, tuple(range(x.ndim)), out_dtype)
    if not _is_placeholder(mean):
        return y, aval_of(x, None, stats), aval_of(x, None, stats)
    stat = aval_of(x, tuple(range(lead_ndim)) + (x.ndim + axis,), stats)
    return y, stat, stat


def _lower(local, layout, args, params):
    return lower_partitioned("channel_norm", local, layout, args, params)


def _fwd_lower(x, scale, bias, mean, var, **params):
    layout = _fwd_layout(x, scale, bias, mean, **params)
    return _lower(_fwd_on_device, layout, (x, scale, bias, mean, var), params)


def _with_leading_dim(params):
    """vmap's batch axis, in front, is one more independent leading dim."""
    return dict(params, lead_ndim=params["lead_ndim"] + 1)


_fwd_on_device = functools.partial(_fwd_local, kernel=channel_norm_fwd_kernel_p.bind)

channel_norm_fwd_p = define_row_primitive(
    "channel_norm_fwd",
    abstract_eval=_fwd_abstract,
    reference=functools.partial(_fwd_local, axes=UNSHARDED, kernel=_fwd_kernel_reference),
    lower=_fwd_lower,
    unsplit=functools.partial(_fwd_on_device, axes=UNSHARDED),
    row_args=(True, False, False, True, True),
    row_outs=(True, True, True),
    batched_params=_with_leading_dim,
)


def _bwd_layout(x, scale, bias, mean, *, lead_ndim, axis, group_size, **_):
    return _layout(x, lead_ndim, axis, group_size,
                   ins=("x", _param_or_none(scale), _param_or_none(bias), _stats_or_none(mean),
                        _stats_or_none(mean), "x"),
                   outs=("x", _param_or_none(scale), _param_or_none(bias)))


def _bwd_abstract(x, scale, bias, mean, var, dy, *, axis, param_dtype, **_):
    del mean, var, dy

    def grad_of(p):  # split as x's channels
        return aval_of(x, None if _is_placeholder(p) else (x.ndim + axis,), param_dtype)

    return aval_of(x, tuple(range(x.ndim)), x.dtype), grad_of(scale), grad_of(bias)


def _bwd_lower(x, scale, bias, mean, var, dy, **params):
    layout = _bwd_layout(x, scale, bias, mean, **params)
    return _lower(_bwd_on_device, layout, (x, scale, bias, mean, var, dy), params)


_bwd_on_device = functools.partial(_bwd_local, kernel=channel_norm_bwd_kernel_p.bind,
                                   stats_kernel=channel_norm_fwd_kernel_p.bind)

channel_norm_bwd_p = define_row_primitive(
    "channel_norm_bwd",
    abstract_eval=_bwd_abstract,
    reference=functools.partial(_bwd_local, axes=UNSHARDED, kernel=_bwd_kernel_reference,
                                stats_kernel=_fwd_kernel_reference),
    lower=_bwd_lower,
    unsplit=functools.partial(_bwd_on_device, axes=UNSHARDED),
    row_args=(True, False, False, True, True, True),
    row_outs=(True, False, False),
    batched_params=_with_leading_dim,
)


# ------------------------------------------------------------ autodiff


class _Config(NamedTuple):
    lead_ndim: int
    axis: int              # the channel axis, negative
    group_size: int
    epsilon: float
    activation: int        # the fused activation's code (ACTIVATIONS)
    out_dtype: np.dtype    # what the kernel writes: one of kernel_dtypes
    param_dtype: np.dtype  # scale/bias dtype as the kernel reads them
    given: bool            # statistics given (BatchNorm's evaluation), not computed
    axis_name: tuple       # shard_map axes that split the reduced dims
    xla_elementwise: bool  # kernels for the reductions only (_fwd_local)

    def kernel_params(self):
        return dict(lead_ndim=self.lead_ndim, axis=self.axis, group_size=self.group_size,
                    epsilon=self.epsilon, activation=self.activation,
                    xla_elementwise=self.xla_elementwise)


def _forward(x, scale, bias, mean, var, cfg: _Config):
    params = dict(cfg.kernel_params(), out_dtype=cfg.out_dtype)
    if cfg.axis_name:
        return _fwd_local(x, scale, bias, mean, var, axes=manual_axes(cfg.axis_name),
                          kernel=channel_norm_fwd_kernel_p.bind, **params)
    return channel_norm_fwd_p.bind(x, scale, bias, mean, var, **params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _channel_norm(x, scale, bias, mean, var, cfg: _Config):
    """(y, batch mean, batch variance); with given statistics (cfg.given) the
    statistics returned are placeholders."""
    return tuple(_forward(x, scale, bias, mean, var, cfg))


def _saves_no_stats(cfg: _Config) -> bool:
    """Whether the backward computes the statistics itself: without an
    activation (dy' = dy) the kernel takes them from the pass over x and dy
    its sums make anyway. Nothing is saved then, and under jax.grad, where y
    is dead, the forward has nothing left to do (XLA drops both its
    launches). BatchNorm's (whose statistics the running averages use),
    given statistics and shard_map's split dims keep the forward's."""
    return not (cfg.given or cfg.activation or cfg.xla_elementwise or cfg.axis_name)


def _channel_norm_fwd(x, scale, bias, mean, var, cfg):
    y, m, v = _forward(x, scale, bias, mean, var, cfg)
    if _saves_no_stats(cfg):
        stats = (empty(m.dtype), empty(v.dtype))
    else:
        stats = (mean, var) if cfg.given else (m, v)
    return (y, m, v), (x, scale, bias, *stats)


def _channel_norm_bwd(cfg, res, cotangents):
    """The statistics returned are not differentiated (their cotangents are
    dropped), and given statistics are constants (no gradient)."""
    x, scale, bias, mean, var = res
    params = dict(cfg.kernel_params(), frozen=cfg.given, param_dtype=cfg.param_dtype)
    if cfg.axis_name:
        dx, dscale, dbias = _bwd_local(x, scale, bias, mean, var, cotangents[0],
                                       axes=manual_axes(cfg.axis_name),
                                       kernel=channel_norm_bwd_kernel_p.bind,
                                       stats_kernel=channel_norm_fwd_kernel_p.bind, **params)
    else:
        dx, dscale, dbias = channel_norm_bwd_p.bind(x, scale, bias, mean, var, cotangents[0],
                                                    **params)
    return dx, dscale, dbias, None, None


_channel_norm.defvjp(_channel_norm_fwd, _channel_norm_bwd)


def _activation(op: str, activation) -> int:
    """The code of the fused activation `activation` names."""
    if isinstance(activation, str | None) and activation in ACTIVATIONS:
        return ACTIVATIONS[activation]
    raise ValueError(f"{op}: activation must be None, 'silu' or 'relu', got {activation!r}")


def _per_channel_args(op, channels, channel_axis, **arrays):
    """The optional float arrays given, each checked to have shape (C,): one
    entry per channel of x along `channel_axis`."""
    out = []
    for name, a in arrays.items():
        a = _checks.parameter(op, name, a)
        if a is not None and tuple(a.shape) != (channels,):
            raise ValueError(
                f"{op}: {name} must have shape ({channels},) (the channels of x along axis "
                f"{channel_axis}), got {tuple(a.shape)}"
            )
        out.append(a)
    return out


def _normalize(op, x, scale, bias, *, lead_ndim, channel_axis, group_size, epsilon,
               activation, dtype, axis_name, stats=None):
    """The public ops' shared checks, dtype rules and dispatch: returns
    (y, mean, var), the statistics of shape (*leading dims, C) (each group's
    repeated over its channels); or, given `stats` (mean, var) of that shape,
    (y, None, None)."""
    axis = _channel_axis(op, x, channel_axis, lead_ndim=lead_ndim)
    channels = x.shape[x.ndim + axis]
    scale, bias = _per_channel_args(op, channels, channel_axis, scale=scale, bias=bias)
    eps = _checks.epsilon(op, epsilon)
    out_dtype = _checks.output_dtype(op, dtype, x.dtype)
    params_dt = param_dtype(x.dtype, scale, bias)
    # BatchNorm's normalize and dx are elementwise over x, which XLA fuses with
    # the network's next ops (a residual add, ReLU), unless an activation is
    # fused: then y and dx are the kernels', in training and evaluation alike.
    # A ResNet's training step ran 2-3% faster so with its ReLUs fused than
    # with every BatchNorm's y and dx in either place, and with them apart 4%
    # faster than with the kernels' (benchmarks/NOTES.md v90); evaluation's
    # kernel writes y at a higher rate than XLA's fusion on an H200 (v85, v91).
    act = _activation(op, activation)
    cfg = _Config(lead_ndim, axis, group_size, eps, act,
                  kernel_out_dtype(x.dtype, out_dtype), params_dt, stats is not None,
                  _checks.axis_name(op, axis_name),
                  xla_elementwise=op == "batch_norm" and act == 0)
    s = or_empty(None if scale is None else scale.astype(params_dt), params_dt)
    b = or_empty(None if bias is None else bias.astype(params_dt), params_dt)
    acc = stats_dtype(x.dtype)
    m, v = (empty(acc), empty(acc)) if stats is None else (a.astype(acc) for a in stats)
    x, s, b, m, v = match_varying(x, s, b, m, v)
    if x.size == 0:  # nothing to launch; keeps gradients' shapes and dtypes
        y, mean, var = _fwd_local(x, s, b, m, v, axes=UNSHARDED, kernel=_fwd_kernel_reference,
                                  **cfg.kernel_params(), out_dtype=cfg.out_dtype)
    else:
        y, mean, var = _channel_norm(x, s, b, m, v, cfg)
    y = y.astype(out_dtype)
    return (y, None, None) if stats is not None else (y, mean, var)


def group_norm(
    x: jax.typing.ArrayLike,
    num_groups: int,
    scale: jax.typing.ArrayLike | None = None,
    bias: jax.typing.ArrayLike | None = None,
    *,
    epsilon: float = 1e-5,
    channel_axis: int = -1,
    activation: str | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    axis_name: AxisName | None = None,
) -> jax.Array:
    """Group normalization: each sample's channels in ``num_groups`` groups
    of consecutive channels, each group normalized over its channels and all
    spatial positions, then ``scale`` and ``bias`` per channel.

    Args:
      x: array of shape ``(N, *spatial, C)`` (``channel_axis=-1``, Flax's
        layout) or ``(N, C, *spatial)`` (``channel_axis=1``, PyTorch's), any
        number of spatial dims (none too); axis 0 is the batch.
      num_groups: groups of channels; must divide C.
      scale, bias: optional arrays of shape ``(C,)``.
      epsilon: added to the variance; a static float >= 0.
      channel_axis: the axis of the channels (any but the batch axis 0).
      activation: None, ``"silu"`` to return ``silu(y)`` (as diffusion
        models apply right after) or ``"relu"`` for ``relu(y)``; fused, with
        its gradient. The CUDA kernels take SiLU's sigmoid from the GPU's
        fast exp2 and reciprocal, within 2 ulp of float32.
      dtype: output dtype (default: ``x.dtype``).
      axis_name: inside ``shard_map``, the mesh axis name (or tuple of names)
        over which the spatial dims are split: each group's statistics are
        combined across it with one all-gather of (count, mean, M2) per
        sample and group, and the backward's sums with one all-reduce.

    Returns:
      Array of ``x``'s shape and dtype ``dtype``. Statistics are computed in
      float32 (float64 for float64 ``x``).
    """
    op = "group_norm"
    x = _checks.floating_array("x", op, x)
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have a batch axis and a channel axis, got shape "
                         f"{tuple(x.shape)}")
    axis = _channel_axis(op, x, channel_axis, lead_ndim=1)
    channels = x.shape[axis]
    if (not isinstance(num_groups, int | np.integer) or isinstance(num_groups, bool)
            or num_groups < 1 or channels % num_groups):
        raise ValueError(
            f"{op}: num_groups must be a positive int that divides the {channels} channels, "
            f"got {num_groups!r}"
        )
    return _normalize(op, x, scale, bias, lead_ndim=1, channel_axis=channel_axis,
                      group_size=channels // int(num_groups), epsilon=epsilon,
                      activation=activation, dtype=dtype, axis_name=axis_name)[0]


def instance_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None = None,
    bias: jax.typing.ArrayLike | None = None,
    *,
    epsilon: float = 1e-5,
    channel_axis: int = -1,
    activation: str | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    axis_name: AxisName | None = None,
) -> jax.Array:
    """Instance normalization: `group_norm` with one group per channel (each
    sample's channel normalized over its spatial positions).

    Args and returns as `group_norm`, without ``num_groups``.
    """
    op = "instance_norm"
    x = _checks.floating_array("x", op, x)
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have a batch axis and a channel axis, got shape "
                         f"{tuple(x.shape)}")
    return _normalize(op, x, scale, bias, lead_ndim=1, channel_axis=channel_axis,
                      group_size=1, epsilon=epsilon, activation=activation, dtype=dtype,
                      axis_name=axis_name)[0]


def batch_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None,
    bias: jax.typing.ArrayLike | None,
    running_mean: jax.typing.ArrayLike | None,
    running_var: jax.typing.ArrayLike | None,
    *,
    training: bool,
    momentum: float = 0.99,
    epsilon: float = 1e-5,
    axis_name: AxisName | None = None,
    channel_axis: int = -1,
    unbiased_running_var: bool = False,
    activation: str | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Batch normalization: each channel normalized over every other axis.

    Training uses the batch's statistics (merged with Chan's formula in
    float32, stable for means far from zero) and returns the running
    statistics updated as Flax does: ``momentum * running + (1 - momentum) *
    batch``, with the biased batch variance, or with
    ``unbiased_running_var=True`` the unbiased one, as PyTorch keeps (whose
    ``momentum=0.1`` is this ``momentum=0.9``). Evaluation normalizes with the
    running statistics (elementwise) and returns them unchanged.

    Args:
      x: array of shape ``(N, *spatial, C)`` (``channel_axis=-1``) or
        ``(N, C, *spatial)`` (``channel_axis=1``).
      scale, bias: arrays of shape ``(C,)``, or None.
      running_mean, running_var: arrays of shape ``(C,)`` (float32, as Flax
        keeps them), or None in training (then None is returned for them).
      training: batch statistics (True) or the running ones (False); static.
      momentum: the running statistics' decay, in [0, 1].
      epsilon: added to the variance; a static float >= 0.
      axis_name: inside ``shard_map``, the mesh axis name (or tuple of names)
        over which the batch is split (synchronized BatchNorm): the
        per-device (count, mean, M2) of each channel are merged with one
        all-gather, and the backward's two per-channel sums are added with
        one all-reduce. Under ``jit`` with x sharded over its batch, the same
        happens without it.
      channel_axis: the axis of the channels.
      unbiased_running_var: keep the unbiased batch variance in the running
        variance (PyTorch's convention); normalization always uses the biased
        one.
      activation: None, ``"silu"`` for ``silu(y)`` or ``"relu"`` for
        ``relu(y)`` (a ResNet's BatchNorm then ReLU), fused: y and dx are
        then the kernels', in training and evaluation (the backward takes
        the activation's derivative from x and the cotangent of its
        output); without one they are jax.numpy, which XLA fuses with the
        ops that follow.
      dtype: output dtype (default: ``x.dtype``).
      mask: in training, an optional boolean array broadcastable to ``x``:
        the statistics cover the True positions only (padding, or devices
        holding different numbers of examples; as Flax's ``mask``). Every
        position is normalized. With ``axis_name`` each device's counts
        travel with its means and M2s (one all-gather), so devices may hold
        different numbers of valid examples, as with PyTorch's
        SyncBatchNorm. Computed as XLA-fused jax.numpy, differentiated by
        JAX.

    Returns:
      ``(y, new_running_mean, new_running_var)``: y of ``x``'s shape and
      dtype ``dtype``; the running statistics in their own dtypes. They carry
      no gradient: running statistics are state (in training the batch's are
      not differentiated through them; in evaluation they are constants).
    """
    op = "batch_norm"
    x = _checks.floating_array("x", op, x)
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have a channel axis, got a scalar")
    if not isinstance(training, bool | np.bool_):
        raise TypeError(f"{op}: training must be a static bool, got {type(training).__name__}")
    m = _checks.static_float(op, "momentum", momentum)
    if not 0.0 <= m <= 1.0:
        raise ValueError(f"{op}: momentum must be in [0, 1], got {momentum!r}")
    axis = _channel_axis(op, x, channel_axis)
    channels = x.shape[axis]
    rm, rv = _per_channel_args(op, channels, channel_axis, running_mean=running_mean,
                               running_var=running_var)
    if (rm is None) != (rv is None):
        raise ValueError(f"{op}: give running_mean and running_var together, or neither")
    common = dict(lead_ndim=0, channel_axis=channel_axis, group_size=1, epsilon=epsilon,
                  activation=activation, dtype=dtype, axis_name=axis_name)
    if not training:
        if rm is None:
            raise ValueError(f"{op}: evaluation (training=False) needs running_mean and "
                             "running_var")
        y, _, _ = _normalize(op, x, scale, bias, stats=(lax.stop_gradient(rm),
                                                        lax.stop_gradient(rv)), **common)
        return y, rm, rv
    count = x.size // channels * _axis_size(axis_name)
    if count == 0 or (unbiased_running_var and count == 1):
        raise ValueError(
            f"{op}: training needs more than {int(unbiased_running_var)} value(s) per channel, "
            f"got x of shape {tuple(x.shape)}"
        )
    if mask is None:
        y, mean, var = _normalize(op, x, scale, bias, **common)
    else:
        y, mean, var, count = _masked_batch_norm(op, x, scale, bias, mask, **common)
    if rm is None:
        return y, None, None
    mean, var = lax.stop_gradient(mean), lax.stop_gradient(var)
    if unbiased_running_var:
        var = var * (count / (count - 1))
    new_rm = (m * rm.astype(mean.dtype) + (1 - m) * mean).astype(rm.dtype)
    new_rv = (m * rv.astype(var.dtype) + (1 - m) * var).astype(rv.dtype)
    return y, new_rm, new_rv


def _masked_batch_norm(op, x, scale, bias, mask, *, channel_axis, epsilon, activation, dtype,
                       axis_name, **_):
    """BatchNorm's training over the True positions of `mask`, in jax.numpy:
    (y, mean, var, count), each channel's count an array (it differs from
    device to device with the mask)."""
    axis = _channel_axis(op, x, channel_axis)
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"{op}: mask must be boolean, got {mask.dtype}")
    try:
        mask = jnp.broadcast_to(mask, x.shape)
    except ValueError as e:
        raise ValueError(f"{op}: mask of shape {mask.shape} does not broadcast to x's "
                         f"{tuple(x.shape)}") from e
    channels = x.shape[axis]
    scale, bias = _per_channel_args(op, channels, channel_axis, scale=scale, bias=bias)
    epsilon = _checks.epsilon(op, epsilon)
    acc = stats_dtype(x.dtype)
    xf = jnp.moveaxis(x, axis, -1).astype(acc).reshape(-1, channels)
    keep = jnp.moveaxis(mask, axis, -1).reshape(-1, channels).astype(acc)
    count = jnp.sum(keep, axis=0)
    mean = jnp.sum(xf * keep, axis=0) / jnp.maximum(count, 1)
    m2 = jnp.sum(jnp.square((xf - mean) * keep), axis=0)
    names = _checks.axis_name(op, axis_name)
    if names:
        count, mean, m2 = merge_moments(count, mean, m2, names, invariant=True)
    var = m2 / count
    shape = [1] * x.ndim
    shape[axis] = channels
    y = (x.astype(acc) - mean.reshape(shape)) * lax.rsqrt(var.reshape(shape) + epsilon)
    if scale is not None:
        y = y * scale.astype(acc).reshape(shape)
    if bias is not None:
        y = y + bias.astype(acc).reshape(shape)
    y = _activate(y, _activation(op, activation))
    out = _checks.output_dtype(op, dtype, x.dtype)
    return y.astype(out), mean, var, count


def _axis_size(axis_name) -> int:
    """Devices across the shard_map axes `axis_name` (1 without)."""
    names = _checks.axis_name("batch_norm", axis_name)
    return int(np.prod([lax.axis_size(a) for a in names])) if names else 1
