"""rms_norm and layer_norm against float64 references, on the default device
(the CUDA kernels on a GPU, the CPU kernels elsewhere)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from reference import assert_close, lowering_platform, norm_np, rand, skip_gpu_plan_sizes, vjp64

import jaxnorm

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]
OPS = {
    "rms_norm": (jaxnorm.rms_norm, False, 1e-6),
    "layer_norm": (jaxnorm.layer_norm, True, 1e-5),
}


def call(op, x, scale, bias, **kw):
    fn, centered, _ = OPS[op]
    return fn(x, scale, bias, **kw) if centered else fn(x, scale, **kw)


def params(op, seed, shape, dtype):
    scale = rand(seed + 1, shape, dtype, offset=1.0)
    bias = rand(seed + 2, shape, dtype) if OPS[op][1] else None
    return scale, bias


def check_values(op, x, scale, bias, ndim=1, out_dtype=None, **kw):
    _, centered, eps = OPS[op]
    y = jax.jit(functools.partial(call, op, **kw))(x, scale, bias)
    out_dtype = out_dtype or x.dtype
    assert y.shape == x.shape and y.dtype == out_dtype
    # bf16/f16 inputs are exact in float64, so the reference sees the same x.
    assert_close(y, norm_np(x, scale, bias, eps, centered, ndim), out_dtype)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("hidden", [1, 3, 127, 1024, 4097, 65536])
def test_values(op, dtype, hidden):
    rows = 5 if hidden < 65536 else 3
    x = rand(hidden, (rows, hidden), dtype, offset=0.5)
    scale, bias = params(op, hidden, (hidden,), dtype)
    check_values(op, x, scale, bias)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_very_long_rows(op, dtype):
    x = rand(7, (2, 262144), dtype, offset=2.0)
    scale, bias = params(op, 7, (262144,), dtype)
    check_values(op, x, scale, bias)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("rows", [1, 2, 33, 1000])
def test_row_counts(op, rows):
    x = rand(rows, (rows, 256), jnp.bfloat16)
    scale, bias = params(op, rows, (256,), jnp.bfloat16)
    check_values(op, x, scale, bias)


@pytest.mark.parametrize("op", OPS)
def test_large_mean_is_stable(op):
    # LayerNorm's variance must not cancel when |mean| >> std.
    # x near 1e3 carries float32 rounding of ~6e-5, so the bound is looser than
    # usual; a one-pass E[x^2] - E[x]^2 misses it by orders of magnitude.
    _, centered, eps = OPS[op]
    x = rand(3, (4, 1024), jnp.float32, offset=1e3)
    y = jax.jit(functools.partial(call, op))(x, None, None)
    assert_close(y, norm_np(x, None, None, eps, centered, 1), jnp.float32, scale=20)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "shape", [(64, 1024), (600, 1024), (600, 4096), (540, 12288), (8, 32768), (3, 65536)], ids=str
)
def test_layer_norm_of_16_bit_rows_far_from_zero(dtype, shape):
    # On a GPU the one-block-a-row forwards of 16-bit x (few rows; many rows
    # of 4 and 8 vectors a thread; a cluster a row at 65536) take xhat as
    # x * rstd - mean * rstd: with |mean| = 300 std, a mean * rstd rounded
    # to 16 bits or a cancelling E[x^2] - E[x]^2 would be off by far more
    # than y's rounding.
    x = rand(6, shape, dtype, offset=300.0)
    scale, bias = params("layer_norm", 6, shape[-1:], dtype)
    check_values("layer_norm", x, scale, bias)


# On a GPU: staged rows, rows not a whole number of 16-byte vectors (the
# element-wise path), rows split over a cluster, few rows (the column plan;
# one row, a block compiled for its length).
@pytest.mark.parametrize(
    "shape", [(600, 1024), (600, 1023), (540, 8196), (40, 2052), (1, 4096), (3, 96)], ids=str
)
def test_layer_norm_gradients_of_a_large_mean(shape):
    """The backward that computes LayerNorm's statistics sums x about a shift,
    the row's first element: rows with |mean| >> std, and rows whose first
    element lies far out, must keep their variance (float64 reference).
    float32 x near 1e3 is rounded by ~6e-5, which an element 40 std out turns
    into errors of up to ~7e-3 in any float32 computation (the CPU's two-pass
    one too), hence the bound; sums of x * x not shifted miss by O(1)."""
    x = np.array(rand(4, shape, jnp.float32, offset=1e3))
    x[::2, 0] += 40.0  # the shift 40 std from the rest of its row
    x[1::4, 0] -= 1e3  # and 1000 std
    x = jnp.asarray(x)
    scale, bias = params("layer_norm", 4, shape[-1:], jnp.float32)
    check_grads64("layer_norm", x, scale, bias, rand(5, shape, jnp.float32), tol_scale=100)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(600, 8192), (560, 7176), (600, 4096)], ids=str)
def test_layer_norm_gradients_of_16_bit_rows_far_from_zero(dtype, shape):
    """The same for 16-bit x 300 std from zero (on a GPU, 8192 and 7176 wide:
    the backward in warp roles, whose xhat is x * rstd - mean * rstd)."""
    x = np.array(rand(7, shape, jnp.float32, offset=300.0))
    x[::2, 0] += 40.0
    x = jnp.asarray(x, dtype)
    scale, bias = params("layer_norm", 7, shape[-1:], dtype)
    check_grads64("layer_norm", x, scale, bias, rand(8, shape, dtype))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("hidden", [96, 1024])  # on a GPU, 1024 float32: a fixed-width kernel
def test_without_params(op, hidden):
    x = rand(0, (6, hidden), jnp.float32)
    check_values(op, x, None, None)
    if OPS[op][1]:
        _, bias = params(op, 0, (hidden,), jnp.float32)
        check_values(op, x, None, bias)


@pytest.mark.parametrize("op", OPS)
def test_multidim_normalized_shape(op):
    x = rand(1, (2, 3, 5, 6), jnp.float32)
    scale, bias = params(op, 1, (5, 6), jnp.float32)
    check_values(op, x, scale, bias, ndim=2)
    check_values(op, x, None, None, ndim=2, normalized_shape=(5, 6))
    check_values(op, x, None, None, ndim=3, normalized_shape=(3, 5, 6))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "x_dtype,p_dtype",
    [
        (jnp.bfloat16, jnp.float32),
        (jnp.float16, jnp.float32),
        (jnp.float32, jnp.bfloat16),
        (jnp.float16, jnp.bfloat16),
        (jnp.float64, jnp.float32),
    ],
    ids=str,
)
def test_parameter_dtype(op, x_dtype, p_dtype):
    x = rand(4, (7, 200), x_dtype)
    scale, bias = params(op, 4, (200,), p_dtype)
    check_values(op, x, scale, bias)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "x_dtype,out_dtype",
    [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16), (jnp.float16, jnp.bfloat16)],
    ids=str,
)
def test_output_dtype(op, x_dtype, out_dtype):
    x = rand(5, (3, 512), x_dtype)
    scale, bias = params(op, 5, (512,), x_dtype)
    check_values(op, x, scale, bias, out_dtype=jnp.dtype(out_dtype), dtype=out_dtype)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("hidden", [3, 130])
def test_check_grads(op, dtype, hidden):
    x = rand(11, (4, hidden), dtype)
    scale, bias = params(op, 11, (hidden,), dtype)
    f32 = dtype == jnp.float32
    tol = dict(atol=5e-2, rtol=5e-2, eps=1e-2) if f32 else dict(atol=1e-6, rtol=1e-6)
    if OPS[op][1]:
        check_grads(lambda x, s, b: jaxnorm.layer_norm(x, s, b), (x, scale, bias), 1,
                    modes=["rev"], **tol)
    else:
        check_grads(lambda x, s: jaxnorm.rms_norm(x, s), (x, scale), 1, modes=["rev"], **tol)


# On a GPU, many rows take the persistent backward, which holds the scale in
# registers (ones when there is none).
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape,dtype", [((600, 1024), jnp.bfloat16),
                                         ((300, 4096), jnp.float32)], ids=str)
def test_grads_without_scale(op, shape, dtype):
    """Gradients with no scale (LayerNorm: with and without a bias) against
    float64, from a jitted pullback and from forward and backward in one jit."""
    x = rand(23, shape, dtype, offset=0.5)
    _, bias = params(op, 23, shape[-1:], dtype)
    for b in (None, bias) if OPS[op][1] else (None,):
        check_grads64(op, x, None, b, rand(24, shape, dtype))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(5, 1), (9, 127), (3, 4097), (2, 4, 24)])
def test_grads_against_float64(op, dtype, shape):
    ndim = 2 if len(shape) == 3 else 1
    x = rand(21, shape, dtype)
    scale, bias = params(op, 21, shape[-ndim:], dtype)
    check_grads64(op, x, scale, bias, rand(22, shape, dtype), ndim)


def check_grads64(op, x, scale, bias, dy, ndim=1, tol_scale=1.0):
    """The backward given the forward's statistics (a jitted pullback) and the
    backward that computes them itself (forward and backward in one jit, the
    forward's output dead), against float64."""
    _, centered, eps = OPS[op]
    _, pullback = jax.vjp(lambda *a: call(op, *a), x, scale, bias)
    fused = jax.jit(lambda dy, *a: jax.vjp(lambda *a: call(op, *a), *a)[1](dy))
    expected = vjp64(x, scale, bias, dy, eps, centered, ndim)
    rows = int(np.prod(x.shape[:-ndim]))
    for grads in (jax.jit(pullback)(dy), fused(dy, x, scale, bias)):
        for got, want, arg, sums in zip(grads, expected, (x, scale, bias), (1, rows, rows)):
            if want is None:
                assert got is None
                continue
            assert got.dtype == arg.dtype and got.shape == want.shape
            # dscale/dbias add up `rows` rounded terms
            assert_close(got, want, arg.dtype, scale=float(np.sqrt(sums)) * 4 * tol_scale)


def gpu_only(*cases):
    """Parameter sets skipped unless the default backend is a GPU."""
    mark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="sizes for a GPU plan")
    return [pytest.param(*case, marks=mark) for case in cases]


# On a GPU where DRAM is slow (an H100), long rows with one parameter
# gradient take a split held in slices of 1024 vectors (rms_held_split):
# LayerNorm with a scale and no bias, or a bias and no scale, as RMSNorm with
# its scale; RMSNorm without one has no gradient to accumulate.
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", gpu_only(((150, 65536),), ((200, 32768),)), ids=str)
def test_long_rows_with_one_parameter_or_none(op, shape):
    x = rand(25, shape, jnp.bfloat16, offset=0.5)
    scale, bias = params(op, 25, shape[-1:], jnp.bfloat16)
    dy = rand(26, shape, jnp.bfloat16)
    for s, b in ((scale, None), (None, bias)) if OPS[op][1] else ((None, None),):
        check_grads64(op, x, s, b, dy)


# Shapes that take each of the CUDA launch plans (row_norm_kernels.cuh,
# row_norm_block.cuh) on a GPU with up to 132 SMs. Few rows (at most 528): a
# forward compiled for the row length where it is 256, 512 or 1024 16-byte
# vectors (4096 and 8192 bf16, 1024 float32, 512 float64), with two blocks a
# row or one (64 rows: two; 100 rows: two for RMSNorm only); one row (one
# block writes the gradients itself); more rows, the column plan
# (row dots, then blocks of 4 column vectors over all rows): a row not a whole
# number of a thread's vectors nor of a column block's (7x2052 float32: 513
# vectors), float16 and float64 rows, 300 rows (each thread of a column block
# takes 5); a block smaller than a warp (generic kernels); rows too long for
# the decode kernels (3x65536: the forward a cluster of 8 blocks of 8
# vectors a thread; the backward a cluster of 8 blocks a row). Over 528 rows:
# one block a row at 1024-32768 wide (4 vectors a thread with y, 2 at 1024
# wide for RMSNorm and the adds, and for LayerNorm where DRAM is slow; 8 for
# statistics only; with y, 8 at 32768, or where DRAM is fast a cluster of 2
# blocks of 8 a row, bf16 and float32: 16384 wide), at 65536 a cluster of 8
# blocks a row; the backward of rows over 2048 vectors in
# clusters of 2-8 blocks, each a slice of the row (LayerNorm bf16: 3 at 32768,
# 8 at 65536; RMSNorm: 4 and 8), slices of unequal length (16392 bf16: 2049
# vectors, LayerNorm 2 slices, RMSNorm 4; 8196 float32); float32 parameters
# of float64 rows too long for 4 vectors a thread (8 bytes a vector through
# shared memory); short rows several to a block
# (statistics of 1024-wide rows); statistics of 2048-wide rows (the generic
# 8-vector plan); parameters of another dtype, staged in shared memory (bf16
# x, f32 scale) or not (f32 x, bf16 scale, rows not whole 16-byte chunks of
# it). The cases of 8-35 M elements (gpu_only where they stand) run on GPUs
# alone: their size only picks a GPU plan, the CPU kernels have one, and on
# two CPU cores they took a fifth of the suite's time; the CPU runs those
# widths at fewer rows (3x65536, 5x131080, 40x49160, 50x40968).
PLAN_CASES = [
    ((1, 4096), jnp.bfloat16, jnp.bfloat16),
    ((40, 1024), jnp.bfloat16, jnp.bfloat16),
    ((5, 4096), jnp.bfloat16, jnp.float32),
    ((16, 1024), jnp.bfloat16, jnp.bfloat16),
    ((5, 16), jnp.bfloat16, jnp.bfloat16),
    ((7, 2052), jnp.float32, jnp.bfloat16),
    ((24, 2048), jnp.float16, jnp.float16),
    ((6, 512), jnp.float64, jnp.float64),
    ((64, 8192), jnp.bfloat16, jnp.bfloat16),
    ((100, 4096), jnp.bfloat16, jnp.float32),
    ((64, 1024), jnp.float32, jnp.float32),
    ((300, 1024), jnp.bfloat16, jnp.bfloat16),
    ((1100, 1024), jnp.bfloat16, jnp.bfloat16),
    ((1100, 4096), jnp.bfloat16, jnp.bfloat16),
    *gpu_only(((1100, 12288), jnp.bfloat16, jnp.bfloat16)),
    ((3, 65536), jnp.bfloat16, jnp.bfloat16),
    ((1100, 1024), jnp.bfloat16, jnp.float32),
    ((1100, 512), jnp.float32, jnp.float32),  # with 1100x1024: rows of a warp at 4 vectors
    ((700, 2052), jnp.float32, jnp.bfloat16),
    *gpu_only(((540, 16384), jnp.bfloat16, jnp.float32)),
    *gpu_only(((540, 32768), jnp.bfloat16, jnp.bfloat16)),
    *gpu_only(((300, 16384), jnp.float32, jnp.float32)),
    *gpu_only(((530, 65536), jnp.bfloat16, jnp.float32)),
    *gpu_only(((600, 16392), jnp.bfloat16, jnp.bfloat16)),
    ((550, 8196), jnp.float32, jnp.float32),
    ((40, 4100), jnp.float64, jnp.float32),
    ((600, 2048), jnp.bfloat16, jnp.bfloat16),
    # the backward's dscale/dbias in registers (LayerNorm; RMSNorm too where
    # a block takes several rows), rows a whole number of a block's vectors
    # or not; several rows a block (12 of 1024, the last block's group five
    # rows; 1100x4096 above takes 3 of 4096)
    ((600, 8192), jnp.bfloat16, jnp.bfloat16),
    ((2201, 1024), jnp.float16, jnp.float32),
    ((560, 7176), jnp.float16, jnp.float32),
    ((560, 10248), jnp.bfloat16, jnp.float32),
    # long rows with a partial last block of vectors; rows beyond a block's
    # reach. The forward of rows of 4097-8192 vectors on sm_90: a cluster of 4
    # blocks a row (9, 40 and 140 rows, 3 float32 rows of 5000 vectors; 8
    # where the row is over 6144 vectors) or 2 (50 rows,
    # the slices 2561 and 2560 vectors; 100 rows); one block a row without
    # clusters. LayerNorm's backward of 50 and 100 bf16 rows in
    # clusters of 4 blocks of up to 384 threads, not 8 (the last slice 1150
    # of 1153 vectors at 36872); of 24576 bf16 in 2 blocks of 384 threads
    # (the kernel's bound), not 4, where DRAM is fast, and in 3 of 256, held
    # (full_held_split), where it is slow or the rows few (78 and 200: at
    # most 8 rows a cluster, fewer_parts; 32: fewer rows than clusters), as
    # 32768 in 4 on both and, where DRAM is fast, 30720 in 4 slices of 960
    # vectors; RMSNorm's held where DRAM is fast and the rows few (64x32768)
    ((9, 40968), jnp.bfloat16, jnp.bfloat16),
    ((40, 49160), jnp.float16, jnp.float16),
    ((3, 20000), jnp.float32, jnp.float32),
    ((50, 40968), jnp.bfloat16, jnp.bfloat16),
    ((100, 36872), jnp.bfloat16, jnp.bfloat16),
    *gpu_only(((140, 49160), jnp.float16, jnp.float16)),
    ((5, 131080), jnp.bfloat16, jnp.float32),
    ((3, 32772), jnp.float64, jnp.float64),
    *gpu_only(((530, 24576), jnp.bfloat16, jnp.bfloat16)),
    *gpu_only(((78, 24576), jnp.bfloat16, jnp.bfloat16)),
    *gpu_only(((200, 24576), jnp.bfloat16, jnp.bfloat16)),
    *gpu_only(((300, 30720), jnp.bfloat16, jnp.bfloat16)),
    *gpu_only(((32, 24576), jnp.bfloat16, jnp.float32)),
    *gpu_only(((64, 32768), jnp.bfloat16, jnp.bfloat16)),
    # The backward of 16-bit rows of 513-1024 vectors computing its
    # statistics on sm_90 (warp roles, row_norm_bwd_roles.cuh): 600x8192 and
    # 560x7176 above; a row's last vectors masked in both roles (625 vectors);
    # float16 with float32 parameters, about 8 rows a block through 3 stages.
    ((700, 5000), jnp.bfloat16, jnp.bfloat16),
    *gpu_only(((1000, 8192), jnp.float16, jnp.float32)),
    # Cases whose size only picks a GPU plan (the CPU kernels have one), run
    # on GPUs alone. Where DRAM feeds an SM under 30 GB/s (an H100):
    # LayerNorm's backward of at least 24 rows an SM in clusters of 2 blocks
    # (511 vectors: slices of 256 and 255; 1025) or 3 (1281 vectors), not one
    # block an SM; 513 vectors keep one block an SM. RMSNorm's of at least 30
    # rows an SM in clusters of blocks of a warp (256, 384 and 512 vectors)
    # or of 8 blocks (1025 vectors: slices of 129, the last 122; 1281; 1793,
    # slices of 225, the last 218, and 2048, both one block of 512 threads a
    # row otherwise); at 3200 rows, not. The warp roles' two stages at 7176
    # and 8192 wide are above. Rows of 128, 192 and 256 vectors, at least 100 an SM, at 2
    # vectors a thread (6, 4 and 3 rows a block, the last block's group
    # partial; RMSNorm's 256 split in 2 instead). RMSNorm's backward of rows
    # of 3585-4096 vectors in clusters of 8 blocks at 2 vectors a thread, not
    # 4 at 4 (3751 vectors: slices of 469, the last 468); of nearly whole
    # slices of 1024 vectors, at most 40 rows a cluster, held in such slices
    # (rms_held_split: 540x32768, 530x24576 and 530x65536 above; 150x65536,
    # 140x65528 and 130x24568 below, the last slices 1023 vectors).
    # The forward of rows of 6145-8192 vectors, on every GPU, in clusters of
    # 8 blocks, not 4 (3x65536 and 530x65536 above; 7501 vectors: slices of
    # 938, the last 935, over and under 132 rows; 40x49160 and 140x49160
    # above, 6145 vectors, take 8 too). LayerNorm's backward split into slices of at most
    # 256 threads holds its first pass's xhat and dy for the second (bwd_regs'
    # kHold): 150x60008 for bfloat16; float16 below, with float16 and float32
    # parameters (8191 vectors: slices of 1024, the last 1023); where DRAM is
    # slow, 3071 vectors in 3 such slices (full_held_split).
    *gpu_only(
        ((3200, 4088), jnp.bfloat16, jnp.float32),
        ((3200, 4104), jnp.bfloat16, jnp.float32),
        ((3200, 10248), jnp.bfloat16, jnp.bfloat16),
        ((3968, 2048), jnp.float16, jnp.float32),
        ((3968, 3072), jnp.bfloat16, jnp.float32),
        ((3968, 4096), jnp.bfloat16, jnp.bfloat16),
        ((3968, 8200), jnp.bfloat16, jnp.bfloat16),
        ((3968, 14344), jnp.bfloat16, jnp.float32),
        ((3968, 16384), jnp.bfloat16, jnp.bfloat16),
        ((13203, 1024), jnp.bfloat16, jnp.bfloat16),
        ((13203, 1536), jnp.float16, jnp.float32),
        ((13203, 2048), jnp.bfloat16, jnp.float32),
        ((64, 30008), jnp.bfloat16, jnp.bfloat16),
        ((7, 60008), jnp.float16, jnp.float32),
        ((150, 60008), jnp.bfloat16, jnp.bfloat16),
        ((150, 65536), jnp.float16, jnp.float16),
        ((140, 65528), jnp.float16, jnp.float32),
        ((130, 24568), jnp.float16, jnp.float32),
    ),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape,x_dtype,p_dtype", PLAN_CASES, ids=str)
def test_every_plan(op, shape, x_dtype, p_dtype):
    skip_gpu_plan_sizes(shape)
    x = rand(31, shape, x_dtype, offset=0.5)
    scale, bias = params(op, 31, shape[-1:], p_dtype)
    check_values(op, x, scale, bias)
    check_grads64(op, x, scale, bias, rand(32, shape, x_dtype))
    # Once more after the statistics-only forward: the same kernel launched
    # with less shared memory must not keep it from launching with more.
    check_values(op, x, scale, bias)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape,x_dtype,p_dtype", PLAN_CASES, ids=str)
def test_backward_handler_without_statistics(op, shape, x_dtype, p_dtype):
    """The backward kernel given no statistics computes them from x, on every
    plan."""
    from jaxnorm import row_norm
    from jaxnorm._stats import param_dtype

    skip_gpu_plan_sizes(shape)
    _, centered, eps = OPS[op]
    x = rand(35, shape, x_dtype, offset=0.5)
    scale, bias = params(op, 35, shape[-1:], p_dtype)
    dy = rand(36, shape, x_dtype)
    none = jnp.zeros((0,), jnp.float32)
    wide = param_dtype(x_dtype, scale)  # what the ops hand the kernels

    def bwd(x, scale, dy):
        return row_norm.row_norm_bwd_kernel_p.bind(
            x, scale.astype(wide), none, none, dy, jnp.zeros((0,), x.dtype),
            jnp.zeros((0,), x.dtype), epsilon=eps, centered=centered, zero_centered=False,
            has_bias=centered, param_dtype=wide)

    dx, dscale, dbias = jax.jit(bwd)(x, scale, dy)
    want = vjp64(x, scale, bias, dy, eps, centered, 1)
    rows = shape[0]
    assert_close(dx, want[0], x_dtype)
    assert_close(dscale, want[1], p_dtype, scale=float(np.sqrt(rows)) * 4)
    if centered:
        assert_close(dbias, want[2], p_dtype, scale=float(np.sqrt(rows)) * 4)


@pytest.mark.parametrize("op", OPS)
def test_float64_x_computes_in_float64(op):
    """float64 x with float32 parameters and output: the kernels read and
    write float64 alone (the parameters are widened, y is cast once), and the
    gradients come back in each argument's dtype."""
    x = rand(37, (5, 33), jnp.float64, offset=0.5)
    scale, bias = params(op, 37, (33,), jnp.float32)
    dy = rand(38, (5, 33), jnp.float32)
    f = functools.partial(call, op, dtype=jnp.float32)
    text = str(jax.make_jaxpr(f)(x, scale, bias))
    (kernel,) = [line for line in text.splitlines() if "= jaxnorm_row_norm_fwd[" in line]
    assert "f32" not in kernel and "out_dtype=float64" in text, text
    y, pullback = jax.vjp(jax.jit(f), x, scale, bias)
    _, centered, eps = OPS[op]
    assert y.dtype == jnp.float32
    assert_close(y, norm_np(x, scale, bias, eps, centered, 1), jnp.float32)
    grads = pullback(dy)
    want = vjp64(x, scale, bias, dy, eps, centered, 1)
    for g, w, arg in zip(grads, want, (x, scale, bias)):
        if arg is None:
            continue
        assert g.dtype == arg.dtype
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(24, 96), (1100, 1024), (40, 1024), (3, 65536)], ids=str)
def test_float32_output_of_bf16_x(op, shape):
    """dtype=float32 for bfloat16 x (Flax's default with float32 parameters):
    the backward then gets a float32 dy, wider than x."""
    x = rand(33, shape, jnp.bfloat16, offset=0.5)
    scale, bias = params(op, 33, shape[-1:], jnp.float32)
    check_values(op, x, scale, bias, out_dtype=jnp.float32, dtype=jnp.float32)
    _, centered, eps = OPS[op]
    dy = rand(34, shape, jnp.float32)
    fn = functools.partial(call, op, dtype=jnp.float32)
    _, pullback = jax.vjp(fn, x, scale, bias)
    # Also with the forward's output dead: the backward computes the statistics.
    fused = jax.jit(lambda dy, *a: jax.vjp(fn, *a)[1](dy))
    want = vjp64(x, scale, bias, dy, eps, centered, 1)
    for got in (jax.jit(pullback)(dy), fused(dy, x, scale, bias)):
        for g, w, arg in zip(got, want, (x, scale, bias)):
            if w is not None:
                assert g.dtype == arg.dtype
                assert_close(g, w, jnp.bfloat16, scale=float(np.sqrt(shape[0])))


@pytest.mark.parametrize("op", OPS)
def test_vmap_over_axes(op):
    x = rand(31, (3, 4, 64), jnp.float32)
    scale, bias = params(op, 31, (64,), jnp.float32)
    expected = call(op, x, scale, bias)
    for axis in (0, 1):
        got = jax.vmap(lambda xi: call(op, xi, scale, bias), in_axes=axis, out_axes=axis)(x)
        assert_close(got, expected, jnp.float32)
    # batching over the normalized axis: each slice x[:, :, j] is normalized over its last axis
    xt = jnp.swapaxes(x, 1, 2)  # (3, 64, 4)
    s4, b4 = params(op, 32, (4,), jnp.float32)
    got = jax.vmap(lambda xi: call(op, xi, s4, b4), in_axes=1, out_axes=1)(xt)
    assert_close(got, call(op, xt, s4, b4), jnp.float32)


@pytest.mark.parametrize("op", OPS)
def test_vmap_batched_params(op):
    _, centered, eps = OPS[op]
    x = rand(41, (3, 5, 32), jnp.float32)
    scale, bias = params(op, 41, (3, 32), jnp.float32)
    got = jax.vmap(lambda *a: call(op, *a))(x, scale, bias)
    b = [None if bias is None else bias[i] for i in range(3)]
    want = np.stack([norm_np(x[i], scale[i], b[i], eps, centered, 1) for i in range(3)])
    assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("op", OPS)
def test_vmap_of_grad(op):
    _, centered, eps = OPS[op]
    x = rand(51, (4, 6, 40), jnp.float64)
    scale, bias = params(op, 51, (40,), jnp.float64)
    dy = rand(52, (4, 6, 40), jnp.float64)

    def per_example(xi, dyi):
        _, pullback = jax.vjp(lambda *a: call(op, *a), xi, scale, bias)
        return pullback(dyi)

    got = jax.jit(jax.vmap(per_example))(x, dy)
    for i in range(4):
        want = vjp64(x[i], scale, bias, dy[i], eps, centered, 1)
        for g, w in zip(got, want):
            if w is not None:
                assert_close(g[i], w, jnp.float64)


@pytest.mark.parametrize("op", OPS)
def test_checkpoint_and_eager(op):
    x = rand(61, (8, 48), jnp.float32)
    scale, bias = params(op, 61, (48,), jnp.float32)

    def loss(*a):
        return jnp.sum(jnp.sin(call(op, *a)))

    want = jax.grad(loss, argnums=(0, 1))(x, scale, bias)
    got = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(x, scale, bias)
    for g, w in zip(got, want):
        assert_close(g, w, jnp.float32)
    with jax.disable_jit():
        eager = call(op, x, scale, bias)
    assert_close(eager, call(op, x, scale, bias), jnp.float32)


@pytest.mark.parametrize("op", OPS)
def test_empty_rows(op):
    x = jnp.ones((0, 4096), jnp.bfloat16)
    scale, bias = params(op, 0, (4096,), jnp.bfloat16)
    y = call(op, x, scale, bias)
    assert y.shape == (0, 4096) and y.dtype == jnp.bfloat16
    grads = jax.grad(lambda *a: jnp.sum(call(op, *a)), argnums=(0, 1, 2))(x, scale, bias)
    for g, p in zip(grads, (x, scale, bias)):
        if p is not None:
            assert g.shape == p.shape and g.dtype == p.dtype
            assert not np.any(np.asarray(g, np.float32))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("hidden", [300, 20000])  # 20000: a cluster of blocks a row on sm_90
def test_nonfinite_rows_stay_in_their_row(op, hidden):
    _, centered, eps = OPS[op]
    x = np.array(rand(71, (6, hidden), jnp.float32))
    x[1, 7] = np.nan
    x[4, hidden - 1] = np.inf
    scale, bias = params(op, 71, (hidden,), jnp.float32)
    y = np.asarray(jax.jit(functools.partial(call, op))(jnp.asarray(x), scale, bias))
    bad = ~np.isfinite(y)
    assert bad[1].any() and bad[4].any()
    good = [0, 2, 3, 5]
    assert not bad[good].any()
    assert_close(y[good], norm_np(x[good], scale, bias, eps, centered, 1), jnp.float32)


def op_inputs(op, seed, shape, dtype):
    """(fn, args, row_args) for op in OPS or "add_rms_norm": args' first
    row_args have x's shape (x, and residual for add_rms_norm)."""
    x = rand(seed, shape, dtype, offset=0.5)
    scale, bias = params("layer_norm" if op == "layer_norm" else "rms_norm", seed, shape[-1:],
                         dtype)
    if op == "add_rms_norm":
        return jaxnorm.add_rms_norm, (x, rand(seed + 3, shape, dtype), scale), 2
    return OPS[op][0], (x, scale) if bias is None else (x, scale, bias), 1


@pytest.mark.parametrize("op", [*OPS, "add_rms_norm"])
@pytest.mark.parametrize("hidden,dtype", [(4096, jnp.bfloat16), (2052, jnp.float32)], ids=str)
def test_rows_keep_their_bits_in_any_batch(op, hidden, dtype):
    # On a GPU, 1-300 rows take the decode kernels, with one block a row or
    # two (each reducing the whole row: RMSNorm up to 264 rows, LayerNorm up
    # to 66), which add up a row's sums in the same tree.
    fn, args, row_args = op_inputs(op, 91, (300, hidden), dtype)
    f = jax.jit(fn)
    whole = jax.tree.map(np.asarray, f(*args))
    for rows in (1, 8, 64, 256):
        part = f(*[a[:rows] for a in args[:row_args]], *args[row_args:])
        for got, want in zip(jax.tree.leaves(part), jax.tree.leaves(whole)):
            np.testing.assert_array_equal(np.asarray(got), want[:rows])


# On a GPU: partial rows of the persistent kernel (4096x512, and 600x8192 with
# the scale read from global memory; 2200x1024, the accumulators in
# registers for 12 rows a block), the column plan (100x512), a cluster of
# blocks a row (600x32768).
@pytest.mark.parametrize("op", [*OPS, "add_rms_norm"])
@pytest.mark.parametrize("shape,dtype", [((4096, 512), jnp.float32), ((100, 512), jnp.float32),
                                         ((600, 8192), jnp.bfloat16),
                                         ((2200, 1024), jnp.bfloat16),
                                         ((600, 32768), jnp.bfloat16)], ids=str)
def test_backward_is_deterministic(op, shape, dtype):
    """The same inputs give bitwise the same gradients, dscale/dbias included."""
    fn, args, row_args = op_inputs(op, 81, shape, dtype)
    dy = rand(82, shape, dtype)
    f = jax.jit(lambda *a: jax.vjp(fn, *a)[1]((dy, dy) if row_args == 2 else dy))
    first = f(*args)
    for _ in range(3):
        for a, b in zip(first, f(*args)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(x=jnp.ones((4, 8), jnp.int32)), TypeError, "x must have dtype float32"),
        (dict(x=jnp.ones((4, 8), jnp.complex64)), TypeError, "x must have dtype"),
        (dict(scale=jnp.ones((7,))), ValueError, r"trailing dimensions of x \(4, 8\)"),
        (dict(scale=jnp.ones((2, 4, 8))), ValueError, "x must have rank >= 3"),
        (dict(scale=jnp.ones((8,), jnp.int32)), TypeError, "scale must have dtype"),
        (dict(scale=jnp.ones((8,)), bias=jnp.ones((5,))), ValueError,
         r"bias must have shape \(8,\)"),
        (dict(epsilon=-1e-5), ValueError, "epsilon must be finite and >= 0"),
        (dict(epsilon=float("nan")), ValueError, "epsilon must be finite"),
        (dict(epsilon=float("inf")), ValueError, "epsilon must be finite"),
        (dict(normalized_shape=(3, 8)), ValueError, "trailing dimensions"),
        (dict(normalized_shape=()), ValueError, "at least one axis"),
        (dict(dtype=jnp.int8), TypeError, "dtype must be float32"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = dict(x=jnp.ones((4, 8), jnp.float32), scale=None, bias=None)
    args.update(kwargs)
    x, scale, bias = args.pop("x"), args.pop("scale"), args.pop("bias")
    with pytest.raises(error, match=match):
        jaxnorm.layer_norm(x, scale, bias, **args)


def test_rank_zero_and_traced_epsilon():
    with pytest.raises(ValueError, match="rank >= 1"):
        jaxnorm.rms_norm(jnp.float32(1.0))
    with pytest.raises(TypeError, match="epsilon must be a static"):
        jax.jit(lambda e: jaxnorm.rms_norm(jnp.ones((2, 4)), epsilon=e))(1e-5)


# ------------------------------------------------ kernels and handlers


def test_default_platform_uses_its_kernels():
    hlo = jax.jit(jaxnorm.rms_norm).lower(jnp.ones((4, 8), jnp.float32)).as_text()
    has_kernel = lowering_platform() in jaxnorm.kernel_platforms()
    assert ("jaxnorm_row_norm_fwd" in hlo) == has_kernel


def test_dead_output_computes_statistics_only():
    x = jnp.ones((16, 32), jnp.float32)
    f = jax.jit(lambda x, s, dy: jax.vjp(jaxnorm.rms_norm, x, s)[1](dy))
    hlo = f.lower(x, x[0], x).as_text()
    fwd = [line for line in hlo.splitlines() if "@jaxnorm_row_norm_fwd" in line]
    if lowering_platform() in jaxnorm.kernel_platforms():
        assert len(fwd) == 1 and "tensor<16x0xf32>" in fwd[0]


def _custom_calls(compiled_hlo, name):
    return [ln for ln in compiled_hlo.splitlines()
            if "custom-call(" in ln and f'custom_call_target="jaxnorm_{name}"' in ln]


@pytest.mark.skipif(lowering_platform() not in jaxnorm.kernel_platforms(), reason="no kernels here")
@pytest.mark.parametrize("op", OPS)
def test_backward_computes_statistics_of_a_dead_forward(op):
    """Forward and backward in one jit with the forward's output dead: the
    backward computes the statistics from x, and no forward is left in the
    compiled program. With the output used, the forward runs and the backward
    reads its statistics."""
    fn = OPS[op][0]
    x = rand(95, (2, 8, 32), jnp.float32)
    s = rand(96, (32,), jnp.float32, 1.0)

    def grads_only(x, s, dy):
        return jax.vjp(fn, x, s)[1](dy)

    def with_value(x, s, dy):
        y, pullback = jax.vjp(fn, x, s)
        return y, pullback(dy)

    hlo = jax.jit(grads_only).lower(x, s, x).compile().as_text()
    (bwd,) = _custom_calls(hlo, "row_norm_bwd")
    assert not _custom_calls(hlo, "row_norm_fwd")
    assert "f32[16]" not in bwd  # no mean or rstd operand
    hlo = jax.jit(with_value).lower(x, s, x).compile().as_text()
    assert len(_custom_calls(hlo, "row_norm_fwd")) == 1
    (bwd,) = _custom_calls(hlo, "row_norm_bwd")
    assert "f32[16]" in bwd  # the forward's rstd
    for a, b in zip(jax.jit(grads_only)(x, s, x), jax.jit(with_value)(x, s, x)[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _ffi(target, outs, *args, **attrs):
    return jax.ffi.ffi_call("jaxnorm_" + target, outs)(*args, **attrs)


@pytest.mark.skipif(lowering_platform() not in jaxnorm.kernel_platforms(), reason="no kernels here")
@pytest.mark.parametrize(
    "case,match",
    [
        ("rstd_rows", r"rstd has shape \(3,\), expected \(4,\)"),
        ("scale_len", r"scale has shape \(5,\), expected \(8,\)"),
        ("x_rank", "x must have rank 2"),
        ("x_int", "x has dtype"),
        ("scale_dtype", "parameters of dtype bfloat16 are not supported with x of dtype float32"),
        ("f64_x_f32_y", "output dtype float32 is not supported with x of dtype float64"),
        ("residual_shape", r"residual has shape \(4, 7\), expected \(4, 8\)"),
        ("residual_dtype", "residual has dtype bfloat16, expected float32"),
        ("new_residual_missing", "new_residual must be present exactly when residual is"),
        ("bwd_dx", r"dx has shape \(4, 7\), expected \(4, 8\)"),
        ("bwd_dres", r"dres has shape \(3, 8\), expected \(4, 8\)"),
        ("bwd_mean_without_rstd", r"mean has shape \(4,\), expected \(0,\)"),
        ("bwd_residual_shape", r"residual has shape \(4, 7\), expected \(4, 8\)"),
        ("bwd_residual_with_stats", "a backward given residual takes no mean or rstd"),
    ],
)
def test_handlers_reject_inconsistent_buffers(case, match):
    sd = jax.ShapeDtypeStruct
    f32 = jnp.float32
    x, e = jnp.ones((4, 8), f32), jnp.zeros((0,), f32)
    fwd_args = dict(x=x, scale=e, bias=e, residual=e)
    fwd_outs = dict(y=sd((4, 8), f32), mean=sd((0,), f32), rstd=sd((4,), f32),
                    new_residual=sd((0,), f32))
    bwd_args = dict(x=x, scale=e, mean=e, rstd=jnp.ones((4,), f32), dy=x, dres=e, residual=e)
    bwd_outs = dict(dx=sd((4, 8), f32), dscale=sd((0,), f32), dbias=sd((0,), f32))
    changes = {
        "rstd_rows": dict(rstd=sd((3,), f32)),
        "scale_len": dict(scale=jnp.ones((5,), f32)),
        "x_rank": dict(x=x.reshape(32), y=sd((32,), f32)),
        "x_int": dict(x=jnp.ones((4, 8), jnp.int32)),
        "scale_dtype": dict(scale=jnp.ones((8,), jnp.bfloat16)),
        "f64_x_f32_y": dict(x=jnp.ones((4, 8), jnp.float64), rstd=sd((4,), jnp.float64),
                            mean=sd((0,), jnp.float64)),
        "residual_shape": dict(residual=jnp.ones((4, 7), f32), new_residual=sd((4, 7), f32)),
        "residual_dtype": dict(residual=jnp.ones((4, 8), jnp.bfloat16),
                               new_residual=sd((4, 8), jnp.bfloat16)),
        "new_residual_missing": dict(residual=x),
        "bwd_dx": dict(dx=sd((4, 7), f32)),
        "bwd_dres": dict(dres=jnp.ones((3, 8), f32)),
        "bwd_mean_without_rstd": dict(mean=jnp.ones((4,), f32), rstd=e),
        "bwd_residual_shape": dict(residual=jnp.ones((4, 7), f32), rstd=e),
        "bwd_residual_with_stats": dict(residual=x),
    }[case]
    bwd = case.startswith("bwd")
    args, outs = (bwd_args, bwd_outs) if bwd else (fwd_args, fwd_outs)
    args = {k: changes.get(k, v) for k, v in args.items()}
    outs = tuple(changes.get(k, v) for k, v in outs.items())
    attrs = dict(epsilon=np.float64(1e-5), centered=np.bool_(False),
                 zero_centered=np.bool_(False))
    target = "row_norm_bwd" if bwd else "row_norm_fwd"
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(jax.jit(lambda: _ffi(target, outs, *args.values(), **attrs))())


# ------------------------------------------------ reference lowering


@pytest.mark.parametrize("centered", [False, True])
def test_reference_implementation(centered):
    """The jnp lowering used on platforms without kernels computes the same math."""
    from jaxnorm import row_norm

    x = rand(91, (6, 50), jnp.float32)
    scale = rand(92, (50,), jnp.float32, 1.0)
    bias = rand(93, (50,), jnp.float32) if centered else jnp.zeros((0,), jnp.float32)
    y, mean, rstd, _ = row_norm._fwd_kernel_reference(
        x, scale, bias, jnp.zeros((0,), jnp.float32), epsilon=1e-5, centered=centered,
        zero_centered=False, out_dtype=jnp.float32, write_output=True, alias_residual=False,
    )
    b = bias if centered else None
    assert_close(y, norm_np(x, scale, b, 1e-5, centered, 1), jnp.float32)
    dy = rand(94, (6, 50), jnp.float32)
    want = vjp64(x, scale, b, dy, 1e-5, centered, 1)
    no_stats = jnp.zeros((0,), jnp.float32)
    for stats in ((mean, rstd), (no_stats, no_stats)):  # kept by the forward, or not
        dx, ds, db = row_norm._bwd_kernel_reference(
            x, scale, *stats, dy, no_stats, no_stats, epsilon=1e-5, centered=centered,
            zero_centered=False, has_bias=centered, param_dtype=jnp.float32,
        )
        assert_close(dx, want[0], jnp.float32)
        assert_close(ds, want[1], jnp.float32, scale=10)
        if centered:
            assert_close(db, want[2], jnp.float32, scale=10)
