// Kernels of GroupNorm, InstanceNorm and BatchNorm for channels-last x: x is
// (N, A, C), A rows of C channels for each leading index n (its channels
// the last axis: NHWC, or any x whose channel axis is its last).
//
// Every pass over x gives a thread a vector of V channels (16 bytes where C
// and the pointers allow, else one) of one tile of rows, and a set of rows of
// that tile R apart; a block covers up to 32 vectors of a row (a slab) and
// R = 256 / vectors rows at a time (`Tiles`, planned in channel_norm.cu). So
// loads and stores are whole 16-byte vectors, consecutive threads touch
// consecutive bytes of a row, and a thread's channels, hence its per-channel
// terms, stay the same.
//
// Each direction is a pass that reduces per (n, tile, channel) into scratch,
// a small pass that merges those per (n, group) (in a fixed order, so the
// same inputs give the same bits: no atomics), and an elementwise pass:
//   forward:  tile_stats (count, mean, M2, Welford then Chan), group_stats
//             (mean_out, var_out and y's per-channel a, b), apply_affine
//             (y = act(x a + b));
//   backward: tile_sums (sums of dy' and dy' xhat), group_sums (the per-group
//             means of g = dy' scale and g xhat, and dx's per-channel terms),
//             param_grads (dscale, dbias: the sums over n), apply_dx.
// dy' is dy through SiLU's derivative with `silu`.
#pragma once

#include "cuda/common.cuh"

namespace jaxnorm::cuda {

constexpr int kChannelThreads = 256;
constexpr int kRowsInFlight = 4;  // rows a thread loads before it uses them

// The tiling of one launch (see the top of the file).
struct Tiles {
  int64_t n = 0, rows = 0, c = 0;  // x as (N, A, C)
  int vec = 1;                     // channels a thread (V)
  int64_t lanes = 0;               // vectors a row, C / V
  int lanes_per_block = 1;         // vectors a block covers
  int row_sets = 1;                // R: rows a block takes at a time
  int64_t slabs = 1;               // blocks across a row
  int64_t tiles = 1;               // tiles of rows for each n
  int64_t tile_rows = 0;           // rows a tile
  int64_t blocks() const { return n * slabs * tiles; }
};

// What one thread of a Tiles launch works on.
struct TileThread {
  int64_t n, tile, lane;  // lane: the thread's channel vector
  int set;                // its rows: row_begin + set, + R, ...
  int64_t row_begin, row_end;
  bool active;

  __device__ explicit TileThread(const Tiles& t) {
    const int64_t b = blockIdx.x;
    tile = b % t.tiles;
    const int64_t rest = b / t.tiles;
    n = rest / t.slabs;
    const int local = int(threadIdx.x) % t.lanes_per_block;
    set = int(threadIdx.x) / t.lanes_per_block;
    lane = (rest % t.slabs) * t.lanes_per_block + local;
    row_begin = tile * t.tile_rows;
    row_end = min(t.rows, row_begin + t.tile_rows);
    active = set < t.row_sets && lane < t.lanes;
  }
  // Offset of row r's first channel of this thread's vector, in elements.
  __device__ int64_t at(const Tiles& t, int64_t r) const {
    return (n * t.rows + r) * t.c + lane * t.vec;
  }
  // Loads up to kRowsInFlight of the thread's rows, from row r on, of each of
  // the K arrays p[k] (each of x's shape) into v[k][u]; returns how many.
  template <int V, int K, typename A, typename... T>
  __device__ int load_rows(const Tiles& t, int64_t r, A (&v)[K][kRowsInFlight][V],
                           const T*... p) const {
    static_assert(sizeof...(T) == K);
    int got = 0;
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int64_t row = r + u * t.row_sets;
      if (row < row_end) {
        int k = 0;
        (load_vec<V>(v[k++][u], p + at(t, row)), ...);
        got = u + 1;
      }
    }
    return got;
  }
  // f(row, v, u) for each of the thread's rows, v[k][u] the row's vector of
  // the k-th array p[k], kRowsInFlight rows loaded before any is used.
  template <int V, typename A, typename F, typename... T>
  __device__ void for_rows(const Tiles& t, F&& f, const T*... p) const {
    constexpr int K = sizeof...(T);
    for (int64_t r = row_begin + set; r < row_end; r += int64_t(kRowsInFlight) * t.row_sets) {
      A v[K][kRowsInFlight][V];
      const int got = load_rows<V>(t, r, v, p...);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        if (u >= got) break;
        f(r + u * t.row_sets, v, u);
      }
    }
  }
  // Rows the set `s` of this thread's tile visits.
  __device__ int64_t rows_of_set(const Tiles& t, int s) const {
    const int64_t span = row_end - row_begin - s;
    return span > 0 ? (span + t.row_sets - 1) / t.row_sets : 0;
  }
};

// Chan's merge of (count, mean, M2) b into a.
template <typename A>
__device__ __forceinline__ void chan_merge(A& count, A& mean, A& m2, A count_b, A mean_b,
                                           A m2_b) {
  if (count_b == A(0)) return;
  const A total = count + count_b;
  const A delta = mean_b - mean, w = count_b / total;
  mean += delta * w;
  m2 += m2_b + delta * delta * count * w;
  count = total;
}

template <typename A>
__device__ __forceinline__ A sigmoid(A z) {
  return A(1) / (A(1) + exp(-z));
}

// d silu(z) / dz.
template <typename A>
__device__ __forceinline__ A silu_grad(A z) {
  const A s = sigmoid(z);
  return s * (A(1) + z * (A(1) - s));
}

// The channel parameters, as read by the kernels (scale 1 and bias 0 where
// absent).
template <typename W>
struct ChannelParams {
  const W* scale;
  const W* bias;
  template <typename A>
  __device__ A w(int64_t c) const { return scale ? A(to_acc(scale[c])) : A(1); }
  template <typename A>
  __device__ A b(int64_t c) const { return bias ? A(to_acc(bias[c])) : A(0); }
};

// Per (n, tile, channel): count, mean and M2 of the tile's rows, into
// partial[((n * tiles + tile) * C + c) * 3 + k].
template <typename X, int V>
__global__ void __launch_bounds__(kChannelThreads) tile_stats(const X* x, Tiles t,
                                                              acc_t<X>* partial) {
  using A = acc_t<X>;
  __shared__ A s_mean[kChannelThreads * V], s_m2[kChannelThreads * V];
  const TileThread me(t);
  A mean[V] = {}, m2[V] = {};
  if (me.active) {
    int count = 0;
    me.for_rows<V, A>(t, [&](int64_t, const auto& v, int u) {
      const A inv = A(1) / A(++count);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A d = v[0][u][e] - mean[e];
        mean[e] += d * inv;
        m2[e] += d * (v[0][u][e] - mean[e]);
      }
    }, x);
  }
#pragma unroll
  for (int e = 0; e < V; ++e) {
    s_mean[threadIdx.x * V + e] = mean[e];
    s_m2[threadIdx.x * V + e] = m2[e];
  }
  __syncthreads();
  if (!me.active || me.set != 0) return;
  A out[V][3];
#pragma unroll
  for (int e = 0; e < V; ++e) out[e][0] = out[e][1] = out[e][2] = A(0);
  for (int s = 0; s < t.row_sets; ++s) {  // the sets in order
    const A count_s = A(me.rows_of_set(t, s));
    const int from = (s * t.lanes_per_block + int(threadIdx.x)) * V;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      chan_merge(out[e][0], out[e][1], out[e][2], count_s, s_mean[from + e], s_m2[from + e]);
    }
  }
  A* dst = partial + ((me.n * t.tiles + me.tile) * t.c + me.lane * V) * 3;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    dst[3 * e] = out[e][0], dst[3 * e + 1] = out[e][1], dst[3 * e + 2] = out[e][2];
  }
}

// Per (n, tile, channel): the sums of dy' and of dy' xhat over the tile's
// rows, into partial[((n * tiles + tile) * C + c) * 2 + k].
template <typename X, typename G, typename W, int V>
__global__ void __launch_bounds__(kChannelThreads) tile_sums(
    const X* x, const G* dy, ChannelParams<W> p, const acc_t<X>* mean,
    const acc_t<X>* var, int64_t group_size, double epsilon, bool silu, Tiles t,
    acc_t<X>* partial) {
  using A = acc_t<X>;
  __shared__ A s_d[kChannelThreads * V], s_dx[kChannelThreads * V];
  const TileThread me(t);
  A sum_d[V] = {}, sum_dx[V] = {};
  if (me.active) {
    const int64_t groups = t.c / group_size;
    A mu[V], rstd[V], w[V], b[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int64_t c = me.lane * V + e, g = me.n * groups + c / group_size;
      mu[e] = mean[g];
      rstd[e] = rsqrt_acc(var[g] + A(epsilon));
      w[e] = p.template w<A>(c);
      b[e] = p.template b<A>(c);
    }
    me.for_rows<V, A>(t, [&](int64_t, const auto& v, int u) {  // v: x, dy
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A xhat = (v[0][u][e] - mu[e]) * rstd[e];
        const A d = silu ? v[1][u][e] * silu_grad(xhat * w[e] + b[e]) : v[1][u][e];
        sum_d[e] += d;
        sum_dx[e] += d * xhat;
      }
    }, x, dy);
  }
#pragma unroll
  for (int e = 0; e < V; ++e) {
    s_d[threadIdx.x * V + e] = sum_d[e];
    s_dx[threadIdx.x * V + e] = sum_dx[e];
  }
  __syncthreads();
  if (!me.active || me.set != 0) return;
  A* dst = partial + ((me.n * t.tiles + me.tile) * t.c + me.lane * V) * 2;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    A total_d = 0, total_dx = 0;
    for (int s = 0; s < t.row_sets; ++s) {  // the sets in order
      const int from = (s * t.lanes_per_block + int(threadIdx.x)) * V + e;
      total_d += s_d[from];
      total_dx += s_dx[from];
    }
    dst[2 * e] = total_d, dst[2 * e + 1] = total_dx;
  }
}

// The warp's merge of channel c's K-value tile results (lanes take the tiles
// 32 apart, then a butterfly; lane 0's result depends only on the data), into
// out[0..K).
template <int K, typename A>
__device__ void merge_tiles(const A* partial, int64_t n, int64_t c, const Tiles& t,
                            A (&out)[K]) {
  const int lane = int(threadIdx.x % 32);
#pragma unroll
  for (int k = 0; k < K; ++k) out[k] = A(0);
  for (int64_t tile = lane; tile < t.tiles; tile += 32) {
    const A* src = partial + ((n * t.tiles + tile) * t.c + c) * K;
    if constexpr (K == 3) {
      chan_merge(out[0], out[1], out[2], src[0], src[1], src[2]);
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) out[k] += src[k];
    }
  }
  for (int off = 16; off > 0; off /= 2) {
    A other[K];
#pragma unroll
    for (int k = 0; k < K; ++k) other[k] = __shfl_xor_sync(0xffffffffu, out[k], off);
    if constexpr (K == 3) {
      chan_merge(out[0], out[1], out[2], other[0], other[1], other[2]);
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) out[k] += other[k];
    }
  }
}

// The groups a block of group_stats or group_sums covers: blocks are
// (n, chunk of groups), `groups_per_block` groups each.
struct GroupChunk {
  int64_t n, first, count;  // the chunk's groups [first, first + count)
  __device__ GroupChunk(int64_t groups, int64_t groups_per_block) {
    const int64_t chunks = (groups + groups_per_block - 1) / groups_per_block;
    n = blockIdx.x / chunks;
    first = (blockIdx.x % chunks) * groups_per_block;
    count = min(groups_per_block, groups - first);
  }
};

// Forward, per (n, group): the tiles' statistics merged per channel (into
// chan, K = 3 a channel), then the group's channels merged in order; writes
// mean_out, var_out (none when `given`: then mean and var are read) and y's
// per-channel terms coef[(n * C + c) * 2 + {0, 1}] = (a, b).
template <typename X, typename W>
__global__ void __launch_bounds__(kChannelThreads) group_stats(
    const acc_t<X>* partial, acc_t<X>* chan, ChannelParams<W> p, Tiles t, int64_t group_size,
    int64_t groups_per_block, double epsilon, bool given, acc_t<X>* mean, acc_t<X>* var,
    acc_t<X>* coef) {
  using A = acc_t<X>;
  const int64_t groups = t.c / group_size;
  const GroupChunk chunk(groups, groups_per_block);
  if (!given) {
    const int64_t first_c = chunk.first * group_size, channels = chunk.count * group_size;
    for (int64_t k = threadIdx.x / 32; k < channels; k += kChannelThreads / 32) {
      A s[3];
      merge_tiles(partial, chunk.n, first_c + k, t, s);
      if (threadIdx.x % 32 == 0) {
        A* dst = chan + (chunk.n * t.c + first_c + k) * 3;
        dst[0] = s[0], dst[1] = s[1], dst[2] = s[2];
      }
    }
    __syncthreads();  // chan, written by the block's warps above
  }
  for (int64_t k = threadIdx.x; k < chunk.count; k += kChannelThreads) {
    const int64_t g = chunk.first + k, at = chunk.n * groups + g;
    A mu, v;
    if (given) {
      mu = mean[at], v = var[at];
    } else {
      A count = 0, m2 = 0;
      mu = 0;
      for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c) {
        const A* s = chan + (chunk.n * t.c + c) * 3;
        chan_merge(count, mu, m2, s[0], s[1], s[2]);
      }
      v = count > A(0) ? m2 / count : A(0);
      mean[at] = mu, var[at] = v;
    }
    const A rstd = rsqrt_acc(v + A(epsilon));
    for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c) {
      const A a = rstd * p.template w<A>(c);
      coef[(chunk.n * t.c + c) * 2] = a;
      coef[(chunk.n * t.c + c) * 2 + 1] = p.template b<A>(c) - mu * a;
    }
  }
}

// y = act(x a + b), a and b per (n, channel).
template <typename X, typename Y, int V>
__global__ void __launch_bounds__(kChannelThreads) apply_affine(const X* x, const acc_t<X>* coef,
                                                                bool silu, Tiles t, Y* y) {
  using A = acc_t<X>;
  const TileThread me(t);
  if (!me.active) return;
  A a[V], b[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int64_t at = (me.n * t.c + me.lane * V + e) * 2;
    a[e] = coef[at], b[e] = coef[at + 1];
  }
  me.for_rows<V, A>(t, [&](int64_t r, const auto& v, int u) {
    A out[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A z = v[0][u][e] * a[e] + b[e];
      out[e] = silu ? z * sigmoid(z) : z;
    }
    store_vec<V>(y + me.at(t, r), out);
  }, x);
}

// The backward's modes (channel_args.h): what group_sums computes.
struct GroupSumsMode {
  bool from_tiles;   // the tiles' sums are there (not with means given alone)
  bool write_sums;   // into sums_out, for the caller to add up across devices
  bool dx_terms;     // coef: dx's per-channel terms
};

// Backward, per (n, group): the tiles' sums merged per channel (into chan,
// 2 a channel: sum dy', sum dy' xhat); the group's means of g = dy' scale
// and g xhat (or, given, `means`); and dx's per-channel terms
// coef[(n * C + c) * 5 + k] = (a, b, k_d, k_x, k_0): SiLU's input is x a + b,
// dx = k_d dy' + k_x x + k_0.
template <typename X, typename W>
__global__ void __launch_bounds__(kChannelThreads) group_sums(
    const acc_t<X>* partial, acc_t<X>* chan, ChannelParams<W> p, const acc_t<X>* mean,
    const acc_t<X>* var, const acc_t<X>* means, Tiles t, int64_t group_size,
    int64_t groups_per_block, double epsilon, GroupSumsMode mode, acc_t<X>* sums_out,
    acc_t<X>* coef) {
  using A = acc_t<X>;
  const int64_t groups = t.c / group_size;
  const GroupChunk chunk(groups, groups_per_block);
  if (mode.from_tiles) {
    const int64_t first_c = chunk.first * group_size, channels = chunk.count * group_size;
    for (int64_t k = threadIdx.x / 32; k < channels; k += kChannelThreads / 32) {
      A s[2];
      merge_tiles(partial, chunk.n, first_c + k, t, s);
      if (threadIdx.x % 32 == 0) {
        A* dst = chan + (chunk.n * t.c + first_c + k) * 2;
        dst[0] = s[0], dst[1] = s[1];
      }
    }
    __syncthreads();  // chan, written by the block's warps above
  }
  const A count = A(t.rows * group_size);
  for (int64_t k = threadIdx.x; k < chunk.count; k += kChannelThreads) {
    const int64_t g = chunk.first + k, at = chunk.n * groups + g;
    A mean_g, mean_gx;
    if (means) {
      mean_g = means[2 * at], mean_gx = means[2 * at + 1];
    } else {
      A sum_g = 0, sum_gx = 0;
      for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c) {
        const A* s = chan + (chunk.n * t.c + c) * 2;
        const A w = p.template w<A>(c);
        sum_g += w * s[0];
        sum_gx += w * s[1];
      }
      if (mode.write_sums) sums_out[2 * at] = sum_g, sums_out[2 * at + 1] = sum_gx;
      mean_g = sum_g / count, mean_gx = sum_gx / count;
    }
    if (!mode.dx_terms) continue;
    const A mu = mean[at], rstd = rsqrt_acc(var[at] + A(epsilon));
    // dx = rstd (w dy' - mean_g - xhat mean_gx), xhat = (x - mu) rstd
    const A k_x = -rstd * rstd * mean_gx, k_0 = rstd * (rstd * mean_gx * mu - mean_g);
    for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c) {
      const A w = p.template w<A>(c), a = rstd * w;
      A* dst = coef + (chunk.n * t.c + c) * 5;
      dst[0] = a, dst[1] = p.template b<A>(c) - mu * a;
      dst[2] = a, dst[3] = k_x, dst[4] = k_0;
    }
  }
}

// dscale and dbias: the channels' sums over n, in order.
template <typename X, typename W>
__global__ void __launch_bounds__(kChannelThreads) param_grads(const acc_t<X>* chan, int64_t n,
                                                               int64_t c, W* dscale, W* dbias) {
  using A = acc_t<X>;
  const int64_t ch = int64_t(blockIdx.x) * kChannelThreads + threadIdx.x;
  if (ch >= c) return;
  A d = 0, dx = 0;
  for (int64_t i = 0; i < n; ++i) {
    d += chan[(i * c + ch) * 2];
    dx += chan[(i * c + ch) * 2 + 1];
  }
  if (dscale) dscale[ch] = from_acc<W>(dx);
  if (dbias) dbias[ch] = from_acc<W>(d);
}

// dx = k_d dy' + k_x x + k_0, the terms per (n, channel) (group_sums).
template <typename X, typename G, int V>
__global__ void __launch_bounds__(kChannelThreads) apply_dx(const X* x, const G* dy,
                                                            const acc_t<X>* coef, bool silu,
                                                            Tiles t, X* dx) {
  using A = acc_t<X>;
  const TileThread me(t);
  if (!me.active) return;
  A k[V][5];
#pragma unroll
  for (int e = 0; e < V; ++e) {
#pragma unroll
    for (int j = 0; j < 5; ++j) k[e][j] = coef[(me.n * t.c + me.lane * V + e) * 5 + j];
  }
  me.for_rows<V, A>(t, [&](int64_t r, const auto& v, int u) {  // v: x, dy
    A out[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A xv = v[0][u][e];
      const A d = silu ? v[1][u][e] * silu_grad(xv * k[e][0] + k[e][1]) : v[1][u][e];
      out[e] = k[e][2] * d + k[e][3] * xv + k[e][4];
    }
    store_vec<V>(dx + me.at(t, r), out);
  }, x, dy);
}

}  // namespace jaxnorm::cuda
