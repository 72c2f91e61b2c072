// Kernels of GroupNorm, InstanceNorm and BatchNorm for channels-last x: x is
// (N, A, C), A rows of C channels for each leading index n (its channels
// the last axis: NHWC, or any x whose channel axis is its last).
//
// Every pass over x gives a thread a vector of V channels (16 bytes where C
// and the pointers allow, else one); a block covers up to 32 vectors of a row
// (a slab) and R = 256 / vectors rows at a time, a chunk (`Tiles`, planned in
// channel_norm.cu). So loads and stores are whole 16-byte vectors,
// consecutive threads touch consecutive bytes of a row, and a thread's
// channels, hence its per-channel terms, stay the same. The passes over x
// launch one wave: as many blocks (tiles) as fit on the GPU at once (a
// second, partial wave ran the first build's elementwise pass at 2.5 TB/s
// where XLA's ran at 3.3, notes v46).
//
// A tile is every T-th chunk of rows (T tiles), so that at any moment the
// blocks read neighbouring chunks: the wave sweeps x as one front. The
// reducing passes sweep down from x's last rows, the elementwise passes up
// from its first (`Sweep`): the op that wrote x (XLA's, or ours) wrote its
// last rows last, which L2 may still hold, and a reducing pass that ends on
// x's first rows leaves those in L2 for the elementwise pass that follows
// it (ours or, for BatchNorm, XLA's) to start on.
//
// Each direction is a pass that reduces per (n, tile, channel) into scratch,
// a small pass that merges those per (n, group) (in a fixed order, so the
// same inputs give the same bits: no atomics), and an elementwise pass:
//   forward:  tile_stats (count, mean, M2, Welford then Chan), group_stats
//             (mean_out, var_out), apply_affine (y = act(x a + b), a and b
//             per channel from the statistics, given or just computed);
//   backward: tile_sums (sums of dy' and dy' xhat; or tile_moments_sums,
//             x's moments and dy's sums, where it computes the statistics),
//             group_sums (the per-group means of g = dy' scale and g xhat,
//             and dx's per-channel terms), apply_dx (dx, and dscale and
//             dbias: the sums over n, ParamGrads).
// dy' is dy through the fused activation's derivative (common/activation.h).
#pragma once

#include "common/activation.h"
#include "common/channel_args.h"  // kDxTerms
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
  int row_sets = 1;                // R: rows a block takes at a time, a chunk
  int64_t slabs = 1;               // blocks across a row
  int64_t tiles = 1;               // T: blocks for each (n, slab)
  int64_t chunk_count = 0;         // chunks of R rows in a sample's rows
  // Divisions by tiles, slabs and lanes_per_block for TileThread's index math.
  FastDiv by_tiles, by_slabs, by_lanes;
  int64_t blocks() const { return n * slabs * tiles; }
  __host__ __device__ int64_t chunks() const { return chunk_count; }
  // TileThread's and channel_stats' 32-bit index math holds: blocks, chunks
  // and channels below 2^31 (a sample of 2^34 rows or more would not fit in
  // any GPU's memory).
  bool fits_index_math() const {
    const int64_t limit = int64_t(1) << 31;
    return blocks() < limit && chunk_count < limit && c < limit;
  }
};

// The tiling of x (N, A, C) = (n, rows, c) with V channels a thread for a
// pass of `kernel`. A block covers at most 32 vectors of a row, split
// evenly, so that it takes at least 8 rows at a time. The tiles make one wave
// of blocks, as many as fit on the GPU at once (or one a (n, slab) where
// there are more), held for the reducing passes to a sixteenth of x's bytes
// of per-tile results (`result_bytes` a channel and tile; 0 for the
// elementwise passes).
template <typename K>
Tiles plan_tiles(int64_t n, int64_t rows, int64_t c, int vec, size_t x_bytes,
                 size_t result_bytes, const DeviceInfo& dev, K kernel) {
  Tiles t;
  t.n = n, t.rows = rows, t.c = c, t.vec = vec;
  t.lanes = c / vec;
  t.slabs = (t.lanes + 31) / 32;
  t.lanes_per_block = int((t.lanes + t.slabs - 1) / t.slabs);
  t.row_sets = kChannelThreads / t.lanes_per_block;
  t.chunk_count = (rows + t.row_sets - 1) / t.row_sets;
  const int64_t wave = int64_t(blocks_per_sm(kernel, kChannelThreads, 0, dev)) * dev.sms;
  int64_t tiles = wave / (t.n * t.slabs);
  tiles = tiles > t.chunks() ? t.chunks() : tiles;
  if (result_bytes > 0) {
    const int64_t by_bytes = int64_t(t.rows * x_bytes / (16 * result_bytes));
    tiles = tiles > by_bytes ? by_bytes : tiles;
  }
  t.tiles = tiles < 1 ? 1 : tiles;
  t.by_tiles = FastDiv(uint32_t(t.tiles));
  t.by_slabs = FastDiv(uint32_t(t.slabs));
  t.by_lanes = FastDiv(uint32_t(t.lanes_per_block));
  return t;
}

// Which way a pass's blocks walk x's rows (the top of the file).
enum class Sweep { kUp, kDown };

// What one thread of a Tiles launch works on: `count` rows, the first
// `first`, then `stride` rows apart (negative sweeping down), in the chunks
// of its tile, all but perhaps the last chunk full.
struct TileThread {
  int64_t n, tile, lane;  // lane: the thread's channel vector
  int set;                // its row of each chunk
  int64_t first, stride, count;
  bool active;

  // All in 32 bits (Tiles::fits_index_math) with FastDiv: six 64-bit
  // divisions in turn before a block's first load cost 0.2-0.9 us a launch
  // of the tile kernels on an H200 (notes v77).
  __device__ TileThread(const Tiles& t, Sweep sweep) {
    const uint32_t b = blockIdx.x, rest = t.by_tiles.div(b), nn = t.by_slabs.div(rest);
    tile = b - rest * uint32_t(t.tiles);
    n = nn;
    const uint32_t slab = rest - nn * uint32_t(t.slabs), tid = threadIdx.x;
    set = int(t.by_lanes.div(tid));
    const int local = int(tid) - set * t.lanes_per_block;
    lane = int64_t(slab) * t.lanes_per_block + local;
    active = set < t.row_sets && lane < t.lanes;
    // Its chunks: tile, tile + T, ... up, or counted from the last chunk
    // down; the same number either way.
    const int64_t chunks = t.chunks(), top = chunks - 1 - tile;
    const uint32_t above = top >= 0 ? t.by_tiles.div(uint32_t(top)) : 0;  // top / T
    count = active && top >= 0 ? int64_t(above) + 1 : 0;
    const int64_t low =  // its lowest chunk
        sweep == Sweep::kUp ? tile : top - int64_t(above) * t.tiles;
    stride = (sweep == Sweep::kUp ? 1 : -1) * t.tiles * t.row_sets;
    first = (sweep == Sweep::kUp ? low : low + (count - 1) * t.tiles) * t.row_sets + set;
    // The last chunk may be short of rows: its missing row is this thread's
    // last row sweeping up, its first sweeping down.
    const bool has_top = count > 0 && low + (count - 1) * t.tiles == chunks - 1;
    if (has_top && (chunks - 1) * t.row_sets + set >= t.rows) {
      --count;
      if (sweep == Sweep::kDown) first += stride;
    }
  }
  __device__ int64_t row(int64_t k) const { return first + k * stride; }
  // Offset of row r's first channel of this thread's vector, in elements.
  __device__ int64_t at(const Tiles& t, int64_t r) const {
    return (n * t.rows + r) * t.c + lane * t.vec;
  }
  // f(k, got, a, b) for each batch of the thread's rows row(k), ...,
  // row(k + got - 1): got (1 to kR) rows of the arrays p (one or two, each of
  // x's shape) loaded as packed words into a[u] and b[u] before any is used.
  // Packed, a 16-bit row costs 4 registers where converted it cost 8: the
  // first build held its loads converted and ran its backward passes at one
  // block an SM (157 registers). start() runs once, after the first batch's
  // loads are issued and before f: what a pass loads of its per-channel
  // terms there travels with the first rows instead of a round trip ahead
  // of them.
  template <int V, int kR = kRowsInFlight, bool kLastUse = false, typename S, typename F,
            typename... T>
  __device__ void for_batches(const Tiles& t, S&& start, F&& f, const T*... p) const {
    constexpr int K = sizeof...(T);
    static_assert(K == 1 || K == 2);
    using V0 = RegVec<std::tuple_element_t<0, std::tuple<T...>>, V>;
    using V1 = RegVec<std::tuple_element_t<K - 1, std::tuple<T...>>, V>;
    for (int64_t k = 0; k < count; k += kR) {
      V0 a[kR];
      V1 b[kR];
#pragma unroll
      for (int u = 0; u < kR; ++u) {
        if (k + u < count) load_rows<kLastUse>(t, row(k + u), a[u], b[u], p...);
      }
      if (k == 0) start();
      f(k, count - k < kR ? int(count - k) : kR, a, b);
    }
  }
  // f(row, a, b) for each of the thread's rows, kRowsInFlight loaded at a
  // time, start() as for_batches.
  template <int V, bool kLastUse = false, typename S, typename F, typename... T>
  __device__ void for_rows(const Tiles& t, S&& start, F&& f, const T*... p) const {
    for_batches<V, kRowsInFlight, kLastUse>(t, start, [&](int64_t k, int got, const auto& a,
                                                          const auto& b) {
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        if (u < got) f(row(k + u), a[u], b[u]);
      }
    }, p...);
  }

 private:
  template <bool kLastUse, typename V0, typename V1, typename T0>
  __device__ void load_rows(const Tiles& t, int64_t row, V0& a, V1&, const T0* p0) const {
    a.template load<kLastUse>(p0 + at(t, row));
  }
  template <bool kLastUse, typename V0, typename V1, typename T0, typename T1>
  __device__ void load_rows(const Tiles& t, int64_t row, V0& a, V1& b, const T0* p0,
                            const T1* p1) const {
    a.template load<kLastUse>(p0 + at(t, row));
    b.template load<kLastUse>(p1 + at(t, row));
  }
};

// b's share of the counts in a merge: float32 through the fast reciprocal
// (2 ulp; counts are far below 2^126). An IEEE division's Newton steps were
// the hottest arithmetic of the merge kernels' dependent chains (notes v51),
// and of tile_stats' tree over its rows.
__device__ __forceinline__ float share_of(float count_b, float total) {
  return __fdividef(count_b, total);
}
__device__ __forceinline__ double share_of(double count_b, double total) {
  return count_b / total;
}

// Chan's merge of (count, mean, M2) b into a.
template <typename A>
__device__ __forceinline__ void chan_merge(A& count, A& mean, A& m2, A count_b, A mean_b,
                                           A m2_b) {
  if (count_b == A(0)) return;
  const A total = count + count_b;
  const A delta = mean_b - mean, w = share_of(count_b, total);
  mean += delta * w;
  m2 += m2_b + delta * delta * count * w;
  count = total;
}

// Sums of dy and of dy (x - mean) over a's rows, (s0, s1), moved from a's
// mean `from` to `to`: s1 is about the mean it is kept with. The move is
// the difference of the two stored means, exact where they are within a
// factor of two (Sterbenz), so s1 follows the mean as stored.
template <typename A>
__device__ __forceinline__ void move_sums(A s0, A& s1, A from, A to) {
  s1 -= (to - from) * s0;
}

// What a thread's tree step adds of its partner's K values: Chan's merge
// (K = 3: count, mean, M2), that and the sums of dy and dy (x - mean) about
// each side's mean (K = 5: tile_moments_sums), or sums.
template <int K, typename A>
__device__ __forceinline__ void combine(A (&a)[K], const A (&b)[K]) {
  if constexpr (K == 3) {
    chan_merge(a[0], a[1], a[2], b[0], b[1], b[2]);
  } else if constexpr (K == 5) {
    if (b[0] == A(0)) return;
    const A mean_a = a[1];
    chan_merge(a[0], a[1], a[2], b[0], b[1], b[2]);
    A s1_b = b[4];
    move_sums(a[3], a[4], mean_a, a[1]);
    move_sums(b[3], s1_b, b[1], a[1]);
    a[3] += b[3], a[4] += s1_b;
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) a[k] += b[k];
  }
}

// A fixed tree over the `parts` threads p * stride + i (p < parts) of the
// block, each holding v[e][0..K) for e < E: part p takes part p + h's values
// for h = the largest power of two below parts, then half that, ..., so part
// 0 ends with the combination of all in an order set by `parts` alone. Every
// thread of the block calls it (it synchronizes); `part` is the caller's p,
// or -1 for threads outside the tree. `shared` holds 256 * E * K values,
// value j of every thread side by side (slot j * 256 + thread), so that a
// warp's accesses fall in 32 banks: a thread's E * K values side by side
// put its neighbours E * K words apart, 8 or 16 to a bank for E = 8 and
// K = 2, 3 or 5.
template <int E, int K, typename A>
__device__ void tree_combine(A (&v)[E][K], int part, int parts, int stride, A* shared) {
  auto slot = [](int thread, int e, int k) { return (e * K + k) * kChannelThreads + thread; };
  int h = 1;
  while (2 * h < parts) h *= 2;
  for (; h >= 1; h /= 2) {
    __syncthreads();  // the previous step's reads of the slots it rewrites
    if (part >= h && part < 2 * h) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
#pragma unroll
        for (int k = 0; k < K; ++k) shared[slot(int(threadIdx.x), e, k)] = v[e][k];
      }
    }
    __syncthreads();
    if (part >= 0 && part < h && part + h < parts) {
      const int from = int(threadIdx.x) + h * stride;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        A other[K];
#pragma unroll
        for (int k = 0; k < K; ++k) other[k] = shared[slot(from, e, k)];
        combine<K>(v[e], other);
      }
    }
  }
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

// What add_batch's merge of a batch of `got` rows (all kR with kFull) into
// `count` takes, the same for every channel.
template <typename A>
struct BatchShare {
  A w, count_w, inv_g;
  template <bool kFull, int kR>
  __device__ __forceinline__ static BatchShare of(A count, int got) {
    const A g = kFull ? A(kR) : A(got);
    const A w = g / (count + g);
    return {w, count * w, A(1) / g};
  }
};

// add_batch for channel e: its (mean, M2) m.
template <bool kFull, int kR, typename Vec, typename A>
__device__ __forceinline__ void add_batch_channel(A (&m)[2], const BatchShare<A>& b,
                                                  const Vec (&v)[kR], int e, int got) {
  A s1 = 0, s2 = 0;
#pragma unroll
  for (int u = 0; u < kR; ++u) {
    const A d = kFull || u < got ? v[u].get(e) - m[0] : A(0);
    s1 += d;
    s2 += d * d;
  }
  const A delta = s1 * b.inv_g;  // the batch's mean less the running one
  m[1] += (s2 - s1 * delta) + delta * delta * b.count_w;
  m[0] += delta * b.w;
}

// One batch of `got` rows (all kR with kFull) merged into a thread's running
// (mean, M2) of each channel, `count` rows before it: the sums of d and d^2,
// d = v - mean its deviation from the running mean (the first row's value
// for the first batch, so that a large mean never meets a square of itself),
// then Chan's merge of the batch, whose mean is mean + sum d / got. Three
// instructions an element and no selects in a full batch. (The batch's own
// mean and M2 with a select a row took about 12 instructions an element,
// notes v46/v47.)
template <bool kFull, int kR, int V, typename Vec, typename A>
__device__ __forceinline__ void add_batch(A (&m)[V][2], A count, const Vec (&v)[kR], int got) {
  if (count == A(0)) {
#pragma unroll
    for (int e = 0; e < V; ++e) m[e][0] = v[0].get(e);
  }
  const auto b = BatchShare<A>::template of<kFull, kR>(count, got);
#pragma unroll
  for (int e = 0; e < V; ++e) add_batch_channel<kFull, kR>(m[e], b, v, e, got);
}

// add_batch, with the sums s[e] = (sum dy, sum dy (x - mean)) of the rows
// so far kept about the running mean as it moves (tile_moments_sums).
template <bool kFull, int kR, int V, typename Vec, typename DyVec, typename A>
__device__ __forceinline__ void add_batch_sums(A (&m)[V][2], A (&s)[V][2], A count,
                                               const Vec (&v)[kR], const DyVec (&dy)[kR],
                                               int got) {
  const auto b = BatchShare<A>::template of<kFull, kR>(count, got);
#pragma unroll
  for (int e = 0; e < V; ++e) {
    if (count == A(0)) m[e][0] = v[0].get(e);  // add_batch's first shift
    const A before = m[e][0];
#pragma unroll
    for (int u = 0; u < kR; ++u) {
      if (!kFull && u >= got) continue;
      const A g = dy[u].get(e);
      s[e][0] += g;
      s[e][1] += g * (v[u].get(e) - before);
    }
    add_batch_channel<kFull, kR>(m[e], b, v, e, got);
    move_sums(s[e][0], s[e][1], before, m[e][0]);
  }
}

// Per (n, tile, channel): count, mean and M2 of the tile's rows, into
// partial[((n * tiles + tile) * C + c) * 3 + k]. A thread takes its rows kR
// at a time (add_batch), its last (fewer than kR) as one batch too, all of a
// batch's loads in flight at once (a row at a time, each of the last few
// took a round trip with nothing else in flight). kR and the blocks an SM
// are benchmarks/kernels/channel_plans.cu's to compare: for bf16 on an H100,
// 8 rows at 2 blocks an SM ran 1-8% faster than 4 or 6 rows at 3 or 4
// blocks; the next batch's loads issued before the current one is added up
// gained nothing more. After other kernels' writes the pass runs at the
// copy rate, reading x while L2 writes theirs back (notes v48).
template <typename X, int V, int kR = (sizeof(X) == 2 ? 8 : 4),
          int kMinBlocks = (sizeof(X) == 2 ? 2 : 3), Sweep kSweep = Sweep::kDown>
__global__ void __launch_bounds__(kChannelThreads, kMinBlocks) tile_stats(const X* x, Tiles t,
                                                                          acc_t<X>* partial) {
  using A = acc_t<X>;
  using Vec = RegVec<X, V>;
  __shared__ A shared[kChannelThreads * V * 3];
  const TileThread me(t, kSweep);
  A m[V][2];  // mean, M2 of each channel
#pragma unroll
  for (int e = 0; e < V; ++e) m[e][0] = m[e][1] = A(0);
  A count = 0;
  if (me.count > 0) {
    const int64_t step = me.stride * t.c;  // elements between a thread's rows
    int64_t left = me.count;
    const X* p = x + me.at(t, me.first);
    auto load = [&](Vec(&v)[kR], const X* q, int got) {
#pragma unroll
      for (int u = 0; u < kR; ++u) {
        if (u < got) v[u].load(q + u * step);
      }
    };
    Vec a[kR];
    for (; left >= kR; left -= kR, p += kR * step) {
      load(a, p, kR);
      add_batch<true, kR>(m, count, a, kR);
      count += A(kR);
    }
    if (left > 0) {
      load(a, p, int(left));
      add_batch<false, kR>(m, count, a, int(left));
      count += A(left);
    }
  }
  A out[V][3];
#pragma unroll
  for (int e = 0; e < V; ++e) out[e][0] = count, out[e][1] = m[e][0], out[e][2] = m[e][1];
  tree_combine<V, 3>(out, me.active ? me.set : -1, t.row_sets, t.lanes_per_block, shared);
  if (!me.active || me.set != 0) return;
  A* dst = partial + ((me.n * t.tiles + me.tile) * t.c + me.lane * V) * 3;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    dst[3 * e] = out[e][0], dst[3 * e + 1] = out[e][1], dst[3 * e + 2] = out[e][2];
  }
}

// Per (n, tile, channel), for a backward that computes its statistics (no
// activation, so dy' = dy): the count, mean and M2 of x (as tile_stats) and
// the sums of dy and of dy (x - mean) about that mean, into
// partial[((n * tiles + tile) * C + c) * 5 + k]. One pass over x and dy
// where the forward's statistics would take one more over x. kR rows a batch
// and kMinBlocks blocks an SM: on an H200 (bf16, the benchmark's GroupNorm
// shapes, notes v75) 2 rows at 3 blocks (80 registers) ran 2-14% slower; 8
// rows at 1 block (168) 6-8% faster at 8x32x32x1280 alone, with the
// forward+backward no faster, and 2-5% slower at the other three.
template <typename X, typename G, int V, int kR = 4, int kMinBlocks = 2>
__global__ void __launch_bounds__(kChannelThreads, kMinBlocks)
    tile_moments_sums(const X* x, const G* dy, Tiles t, acc_t<X>* partial) {
  using A = acc_t<X>;
  __shared__ A shared[kChannelThreads * V * 5];
  const TileThread me(t, Sweep::kDown);
  A m[V][2], s[V][2];  // x's mean and M2; dy's sums
#pragma unroll
  for (int e = 0; e < V; ++e) m[e][0] = m[e][1] = s[e][0] = s[e][1] = A(0);
  A count = 0;
  me.for_batches<V, kR>(t, [] {}, [&](int64_t, int got, const auto& a, const auto& b) {
    if (got == kR) {
      add_batch_sums<true, kR>(m, s, count, a, b, got);
    } else {
      add_batch_sums<false, kR>(m, s, count, a, b, got);
    }
    count += A(got);
  }, x, dy);
  A out[V][5];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    out[e][0] = count, out[e][1] = m[e][0], out[e][2] = m[e][1];
    out[e][3] = s[e][0], out[e][4] = s[e][1];
  }
  tree_combine<V, 5>(out, me.active ? me.set : -1, t.row_sets, t.lanes_per_block, shared);
  if (!me.active || me.set != 0) return;
  A* dst = partial + ((me.n * t.tiles + me.tile) * t.c + me.lane * V) * 5;
#pragma unroll
  for (int e = 0; e < V; ++e) {
#pragma unroll
    for (int k = 0; k < 5; ++k) dst[5 * e + k] = out[e][k];
  }
}

// The mean and rstd of the groups of sample n's channels c0, ..., c0 + V - 1
// (a thread's vector), as the elementwise and backward passes read them: the
// group of c0 by one division (FastDiv: C < 2^31), the others' by counting
// on, and every load issued before any is used. A division and the loads a
// channel in turn (v75) kept each warp from its first load of x for ~790
// instructions with the loads' round trips among them: 0.4-1.3 us a launch
// of apply_affine on an H200 (notes v76).
template <int V, typename A>
__device__ __forceinline__ void channel_stats(const A* mean, const A* var, int64_t n,
                                              int64_t c0, int64_t c, const FastDiv& by_group,
                                              double epsilon, A (&mu)[V], A (&rstd)[V]) {
  const int64_t group_size = by_group.d, groups = by_group.div(uint32_t(c));
  int64_t g = by_group.div(uint32_t(c0)), r = c0 - g * group_size;
  int64_t at[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    at[e] = n * groups + g;
    if (++r == group_size) r = 0, ++g;
  }
#pragma unroll
  for (int e = 0; e < V; ++e) mu[e] = mean[at[e]], rstd[e] = var[at[e]];
#pragma unroll
  for (int e = 0; e < V; ++e) rstd[e] = rsqrt_acc(rstd[e] + A(epsilon));
}

// Per (n, tile, channel): the sums of dy' and of dy' xhat over the tile's
// rows, into partial[((n * tiles + tile) * C + c) * 2 + k].
template <typename X, typename G, typename W, int V>
__global__ void __launch_bounds__(kChannelThreads) tile_sums(
    const X* x, const G* dy, ChannelParams<W> p, const acc_t<X>* mean,
    const acc_t<X>* var, FastDiv by_group, double epsilon, Activation act, Tiles t,
    acc_t<X>* partial) {
  using A = acc_t<X>;
  __shared__ A shared[kChannelThreads * V * 2];
  const TileThread me(t, Sweep::kDown);
  A sums[V][2];  // dy', dy' xhat
#pragma unroll
  for (int e = 0; e < V; ++e) sums[e][0] = sums[e][1] = A(0);
  if (me.active) {
    A mu[V], rstd[V], w[V], b[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      w[e] = act != Activation::kNone ? p.template w<A>(me.lane * V + e) : A(0);
      b[e] = act != Activation::kNone ? p.template b<A>(me.lane * V + e) : A(0);
    }
    channel_stats<V>(mean, var, me.n, me.lane * V, t.c, by_group, epsilon, mu, rstd);
    // Its terms before its rows: loaded after the first rows' loads (as
    // apply_affine's), the UNet's tile_sums with SiLU ran 16% slower (notes
    // v76).
    me.for_rows<V>(t, [] {}, [&](int64_t, const auto& xv, const auto& dyv) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A xhat = (xv.get(e) - mu[e]) * rstd[e];
        const A d = act != Activation::kNone
                        ? activation_backward(act, A(dyv.get(e)), xhat * w[e] + b[e])
                        : A(dyv.get(e));
        sums[e][0] += d;
        sums[e][1] += d * xhat;
      }
    }, x, dy);
  }
  tree_combine<V, 2>(sums, me.active ? me.set : -1, t.row_sets, t.lanes_per_block, shared);
  if (!me.active || me.set != 0) return;
  A* dst = partial + ((me.n * t.tiles + me.tile) * t.c + me.lane * V) * 2;
#pragma unroll
  for (int e = 0; e < V; ++e) dst[2 * e] = sums[e][0], dst[2 * e + 1] = sums[e][1];
}

// Groups a group_stats / group_sums block covers for x (n, ., c): whole
// groups, about as many channels as give each of twice the SMs' blocks a
// share, at most kGroupsPerBlock (the merges of one channel's tiles spread
// over the block's threads: merge_channel_tiles).
constexpr int kGroupsPerBlock = 64;
__host__ inline int64_t groups_per_block(int64_t n, int64_t c, int64_t group_size,
                                         const DeviceInfo& dev) {
  const int64_t channels = (n * c + 2 * dev.sms - 1) / (2 * dev.sms);
  const int64_t groups = (channels + group_size - 1) / group_size;
  return groups < 1 ? 1 : groups > kGroupsPerBlock ? kGroupsPerBlock : groups;
}

// How group_stats and group_sums split x's (n, group) over their blocks:
// (n, chunk of `per` groups), the chunks of a sample divided by FastDiv as
// TileThread's rows are (64-bit divisions before a merge's first load, notes
// v78).
struct GroupChunks {
  int64_t groups = 1, group_size = 1, per = 1;
  FastDiv by_chunks;  // chunks a sample
  int64_t blocks(int64_t n) const { return n * int64_t(by_chunks.d); }
};

__host__ inline GroupChunks plan_group_chunks(int64_t n, int64_t c, int64_t group_size,
                                              const DeviceInfo& dev) {
  GroupChunks g;
  g.group_size = group_size;
  g.groups = c / group_size;
  g.per = groups_per_block(n, c, group_size, dev);
  g.by_chunks = FastDiv(uint32_t((g.groups + g.per - 1) / g.per));
  return g;
}

// The groups [first, first + count) of sample n a merge block covers.
struct GroupChunk {
  int64_t n, first, count;
  __device__ explicit GroupChunk(const GroupChunks& g) {
    const uint32_t b = blockIdx.x, nn = g.by_chunks.div(b);
    n = nn;
    first = int64_t(b - nn * g.by_chunks.d) * g.per;
    count = min(g.per, g.groups - first);
  }
};

// The tiles' K-value results of the chunk's `channels` channels from
// `first_c` on, each merged over the tiles in a fixed order and handed to
// done(c, merged) by one thread. Threads take (channel, split): a split
// merges the tiles split, split + splits, ... (four loads in flight), and a
// tree merges the splits. Every thread of the block calls it. A split takes
// at least four tiles: where the tiles are few (GroupNorm's, a few a
// sample), a tree of fewer levels, each two block barriers.
template <int K, typename A, typename F>
__device__ void merge_channel_tiles(const A* partial, int64_t n, int64_t first_c,
                                    int64_t channels, const Tiles& t, A* shared, F&& done) {
  const int per = channels < kChannelThreads ? int(channels) : kChannelThreads;
  const int64_t batches = (t.tiles + 3) / 4;
  const int splits = batches < kChannelThreads / per ? int(batches) : kChannelThreads / per;
  const int cl = int(threadIdx.x) % per, split = int(threadIdx.x) / per;
  const bool on = split < splits;
  for (int64_t c0 = 0; c0 < channels; c0 += per) {  // the same trips in every thread
    const int64_t c = first_c + c0 + cl;
    A out[1][K];
#pragma unroll
    for (int k = 0; k < K; ++k) out[0][k] = A(0);
    if (on && c0 + cl < channels) {
      for (int64_t tile = split; tile < t.tiles; tile += 4 * int64_t(splits)) {
        A in[4][K];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t at = tile + u * int64_t(splits);
#pragma unroll
          for (int k = 0; k < K; ++k) {
            in[u][k] = at < t.tiles ? partial[((n * t.tiles + at) * t.c + c) * K + k] : A(0);
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) combine<K>(out[0], in[u]);
      }
    }
    if (splits > 1) tree_combine<1, K>(out, on ? split : -1, splits, per, shared);
    if (on && split == 0 && c0 + cl < channels) done(c, out[0]);
  }
}

// merge_channel_tiles into chan[(n * C + c) * K + k].
template <int K, typename A>
__device__ void merge_channel_tiles(const A* partial, int64_t n, int64_t first_c,
                                    int64_t channels, const Tiles& t, A* chan, A* shared) {
  merge_channel_tiles<K>(partial, n, first_c, channels, t, shared,
                         [&](int64_t c, const A (&merged)[K]) {
#pragma unroll
    for (int k = 0; k < K; ++k) chan[(n * t.c + c) * K + k] = merged[k];
  });
}

// Over a group's channels, warp by warp: lane l combines the channels l,
// l + 32, ... of chan (K values each, through `load`), then an xor butterfly
// in which both lanes of a pair combine the lower lane's values with the
// higher's, so every lane ends with the same bits.
template <int K, typename A, typename F>
__device__ void warp_combine(int64_t group_size, F&& load, A (&out)[K]) {
  const int lane = int(threadIdx.x % 32);
#pragma unroll
  for (int k = 0; k < K; ++k) out[k] = A(0);
  for (int64_t c = lane; c < group_size; c += 32) {
    A in[K];
    load(c, in);
    combine<K>(out, in);
  }
  for (int off = 1; off < 32; off *= 2) {
    A other[K];
#pragma unroll
    for (int k = 0; k < K; ++k) other[k] = __shfl_xor_sync(0xffffffffu, out[k], off);
    if (lane & off) {
      A mine[K];
#pragma unroll
      for (int k = 0; k < K; ++k) mine[k] = out[k], out[k] = other[k];
      combine<K>(out, mine);
    } else {
      combine<K>(out, other);
    }
  }
}

// Dynamic shared memory a merge block's for_groups_merged keeps its
// channels' K values in (merge_smem_bytes), if it fits beside the kernels'
// static arrays in the 48 KB a block gets without opting in; 0: they go
// through global scratch.
template <typename A>
__host__ inline size_t merge_smem_bytes(const GroupChunks& g, int k) {
  const size_t bytes = size_t(g.per * g.group_size) * k * sizeof(A);
  return g.group_size > 1 && bytes <= 32 * 1024 ? bytes : 0;
}

// The chunk's groups of several channels, a warp each: their tiles merged
// per channel into a buffer of the chunk's channels (K values a channel):
// global scratch at chan's (n, first channel) where chan is given, else the
// block's dynamic shared memory (merge_smem_bytes), which saves the warps'
// reads a round trip to L2 (notes v76). Then body(at, c0, src, m) for group
// at, its first channel c0 and its channels' merged values src, m the warp's
// combination over the group's channels c of in(c, merged values of c, K
// values out) (warp_combine: every lane holds the same bits). Every thread of
// the block calls it.
template <int K, typename A, typename In, typename Body>
__device__ void for_groups_merged(const A* partial, A* chan, const GroupChunk& chunk,
                                  const Tiles& t, const GroupChunks& chunks, A* shared, In&& in,
                                  Body&& body) {
  extern __shared__ __align__(kDynSmemAlign) unsigned char dyn[];
  const int64_t group_size = chunks.group_size, first_c = chunk.first * group_size;
  A* buf = chan ? chan + (chunk.n * t.c + first_c) * K : reinterpret_cast<A*>(dyn);
  merge_channel_tiles<K>(partial, chunk.n, first_c, chunk.count * group_size, t, shared,
                         [&](int64_t c, const A (&merged)[K]) {
#pragma unroll
    for (int k = 0; k < K; ++k) buf[(c - first_c) * K + k] = merged[k];
  });
  __syncthreads();  // buf, written by the block's threads above
  for (int64_t k = threadIdx.x / 32; k < chunk.count; k += kChannelThreads / 32) {
    const int64_t at = chunk.n * chunks.groups + chunk.first + k, c0 = first_c + k * group_size;
    const A* src = buf + k * group_size * K;
    A m[K];
    warp_combine<K>(group_size, [&](int64_t c, A (&v)[K]) { in(c0 + c, src + K * c, v); }, m);
    body(at, c0, src, m);
  }
}

// Forward, per (n, group): the tiles' statistics merged per channel (K = 3
// a channel, in chan or, null, shared memory: for_groups_merged), then each
// group's channels by a warp, into mean and var. Groups of one channel
// (BatchNorm, InstanceNorm) are done where their tiles' merge ends: no
// chan, no warps' combine, two block barriers and two global round trips
// fewer in a kernel that is a dependent chain (notes v51).
template <typename X>
__global__ void __launch_bounds__(kChannelThreads) group_stats(
    const acc_t<X>* partial, acc_t<X>* chan, Tiles t, GroupChunks chunks, acc_t<X>* mean,
    acc_t<X>* var) {
  using A = acc_t<X>;
  __shared__ A shared[kChannelThreads * 3];
  const int64_t groups = chunks.groups, group_size = chunks.group_size;
  const GroupChunk chunk(chunks);
  const int64_t first_c = chunk.first * group_size, channels = chunk.count * group_size;
  if (group_size == 1) {
    merge_channel_tiles<3>(partial, chunk.n, first_c, channels, t, shared,
                           [&](int64_t c, const A (&m)[3]) {
      const int64_t at = chunk.n * groups + c;
      mean[at] = m[1], var[at] = m[0] > A(0) ? m[2] / m[0] : A(0);
    });
    return;
  }
  for_groups_merged<3>(partial, chan, chunk, t, chunks, shared,
                       [](int64_t, const A* src, A (&in)[3]) {
    in[0] = src[0], in[1] = src[1], in[2] = src[2];
  }, [&](int64_t at, int64_t, const A*, const A (&m)[3]) {
    if (threadIdx.x % 32 == 0) mean[at] = m[1], var[at] = m[0] > A(0) ? m[2] / m[0] : A(0);
  });
}

// y = act(x a + b), a = rstd scale and b = bias - mean a per (n, channel),
// each thread's from the statistics (given, or group_stats'): a forward given
// its statistics is this one launch.
template <typename X, typename Y, typename W, int V, bool kEvictFirst = true>
__global__ void __launch_bounds__(kChannelThreads) apply_affine(
    const X* x, const acc_t<X>* mean, const acc_t<X>* var, ChannelParams<W> p,
    FastDiv by_group, double epsilon, Activation act, Tiles t, Y* y) {
  using A = acc_t<X>;
  const TileThread me(t, Sweep::kUp);
  if (!me.active) return;
  A a[V], b[V];
  auto terms = [&] {
    A mu[V], rstd[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      a[e] = p.template w<A>(me.lane * V + e), b[e] = p.template b<A>(me.lane * V + e);
    }
    channel_stats<V>(mean, var, me.n, me.lane * V, t.c, by_group, epsilon, mu, rstd);
#pragma unroll
    for (int e = 0; e < V; ++e) a[e] *= rstd[e], b[e] -= mu[e] * a[e];
  };
  // x's last read and y: evict-first (load_global), so that neither pushes out
  // of L2 the rows of x this pass has yet to read, which tile_stats left there.
  me.for_rows<V, kEvictFirst>(t, terms, [&](int64_t r, const auto& v, const auto&) {
    A out[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      out[e] = activate(act, v.get(e) * a[e] + b[e]);
    }
    store_vec<V, kEvictFirst>(y + me.at(t, r), out);
  }, x);
}

// The backward's modes (channel_args.h): what group_sums computes.
struct GroupSumsMode {
  bool from_tiles;   // the tiles' sums are there (not with means given alone)
  bool write_sums;   // into sums_out, for the caller to add up across devices
  bool dx_terms;     // coef: dx's per-channel terms
  bool xla_terms;    // ... as returned to XLA (kDxTerms a channel), not apply_dx's
  bool own_stats;    // the tiles' are tile_moments_sums' (K = 5): no statistics given
};

// Backward, per (n, group): the tiles' sums merged per channel (into chan,
// 2 a channel: sum dy', sum dy' xhat); the group's means of g = dy' scale
// and g xhat (or, given, `means`); and dx's per-channel terms
// coef[(n * C + c) * 5 + k] = (a, b, k_d, k_x, k_0): the activation's input
// is x a + b, dx = k_d dy' + k_x x + k_0; or, for XLA (mode.xla_terms),
// coef[(n * C + c) * 3 + k] = (a, k_x, k_0') about the mean: the activation's
// input (x - mean) a + bias, dx = a dy' + k_x (x - mean) + k_0' (no
// cancellation for means far from zero). Where N is 1 (BatchNorm) the
// channels' sums are dscale and dbias, written here when asked for (not
// null) instead of by a launch of param_grads. Groups of one channel are
// done where their tiles' merge ends, as in group_stats.
// With mode.own_stats (mode "full" without an activation) the statistics
// come from the tiles' moments (tile_moments_sums) instead of mean and var:
// a group of one channel where its tiles' merge ends, a group of several
// by a warp over its channels' merged tiles (K = 5, in own or, null, shared
// memory: for_groups_merged), which yields
// the group's moments and its sums of g and g (x - mean) at once.
template <typename X, typename W>
__global__ void __launch_bounds__(kChannelThreads) group_sums(
    const acc_t<X>* partial, acc_t<X>* chan, ChannelParams<W> p, const acc_t<X>* mean,
    const acc_t<X>* var, const acc_t<X>* means, Tiles t, GroupChunks chunks, double epsilon,
    GroupSumsMode mode, acc_t<X>* sums_out, acc_t<X>* coef, W* dscale, W* dbias,
    acc_t<X>* own) {
  using A = acc_t<X>;
  __shared__ A shared[kChannelThreads * 5];
  const int64_t groups = chunks.groups, group_size = chunks.group_size;
  const GroupChunk chunk(chunks);
  const int64_t first_c = chunk.first * group_size, channels = chunk.count * group_size;
  const A count = A(t.rows * group_size);
  auto rstd_of = [&](A v) { return rsqrt_acc(v + A(epsilon)); };
  // The group at's sums of g and g xhat, (sum dy', sum dy' xhat) scaled
  // channel by channel: into sums_out, and as means into m.
  auto finish_sums = [&](int64_t at, A (&m)[2]) {
    if (mode.write_sums) sums_out[2 * at] = m[0], sums_out[2 * at + 1] = m[1];
    m[0] /= count, m[1] /= count;
  };
  auto write_params = [&](int64_t c, const A* sums) {
    if (dscale) dscale[c] = from_acc<W>(sums[1]);
    if (dbias) dbias[c] = from_acc<W>(sums[0]);
  };
  auto write_dx_terms = [&](int64_t c, A mu, A rstd, A mean_g, A mean_gx) {
    // dx = rstd (w dy' - mean_g - xhat mean_gx), xhat = (x - mu) rstd
    const A w = p.template w<A>(c), a = rstd * w;
    if (mode.xla_terms) {
      A* dst = coef + (chunk.n * t.c + c) * kDxTerms;
      dst[0] = a, dst[1] = -rstd * rstd * mean_gx, dst[2] = -rstd * mean_g;
      return;
    }
    A* dst = coef + (chunk.n * t.c + c) * 5;
    dst[0] = a, dst[1] = p.template b<A>(c) - mu * a;
    dst[2] = a, dst[3] = -rstd * rstd * mean_gx, dst[4] = rstd * (rstd * mean_gx * mu - mean_g);
  };
  // A group of one channel, its sums merged, with its statistics.
  auto finish_channel = [&](int64_t c, const A (&sums)[2], A mu, A rstd) {
    chan[(chunk.n * t.c + c) * 2] = sums[0], chan[(chunk.n * t.c + c) * 2 + 1] = sums[1];
    write_params(c, sums);
    const A w = p.template w<A>(c);
    A m[2] = {w * sums[0], w * sums[1]};
    finish_sums(chunk.n * groups + c, m);
    if (mode.dx_terms) write_dx_terms(c, mu, rstd, m[0], m[1]);
  };
  if (mode.own_stats && group_size == 1) {
    merge_channel_tiles<5>(partial, chunk.n, first_c, channels, t, shared,
                           [&](int64_t c, const A (&m)[5]) {
      const A rstd = rstd_of(m[0] > A(0) ? m[2] / m[0] : A(0));
      const A sums[2] = {m[3], rstd * m[4]};
      finish_channel(c, sums, m[1], rstd);
    });
    return;
  }
  if (mode.from_tiles && !means && group_size == 1) {
    merge_channel_tiles<2>(partial, chunk.n, first_c, channels, t, shared,
                           [&](int64_t c, const A (&sums)[2]) {
      const int64_t at = chunk.n * groups + c;
      finish_channel(c, sums, mean[at], rstd_of(var[at]));
    });
    return;
  }
  if (mode.own_stats) {  // groups of several channels
    // The group's moments, and its sums of g and g (x - mean) (scaled
    // channel by channel before the merge moves them to the group's mean).
    for_groups_merged<5>(partial, own, chunk, t, chunks, shared,
                         [&](int64_t c, const A* src, A (&in)[5]) {
      const A w = p.template w<A>(c);
      in[0] = src[0], in[1] = src[1], in[2] = src[2], in[3] = w * src[3], in[4] = w * src[4];
    }, [&](int64_t at, int64_t c0, const A* src, const A (&m)[5]) {
      const A mu = m[1], rstd = rstd_of(m[0] > A(0) ? m[2] / m[0] : A(0));
      A means_g[2] = {m[3], rstd * m[4]};
      finish_sums(at, means_g);
      // Each channel's own sums about the group's mean: dscale and dbias.
      for (int64_t c = threadIdx.x % 32; c < group_size; c += 32) {
        A sums[2] = {src[5 * c + 3], src[5 * c + 4]};
        move_sums(sums[0], sums[1], src[5 * c + 1], mu);
        sums[1] *= rstd;
        chan[(chunk.n * t.c + c0 + c) * 2] = sums[0];
        chan[(chunk.n * t.c + c0 + c) * 2 + 1] = sums[1];
        write_params(c0 + c, sums);
        write_dx_terms(c0 + c, mu, rstd, means_g[0], means_g[1]);
      }
    });
    return;
  }
  if (mode.from_tiles) {
    merge_channel_tiles<2>(partial, chunk.n, first_c, channels, t, chan, shared);
    __syncthreads();  // chan, written by the block's threads above
    for (int64_t k = threadIdx.x; k < channels && (dscale || dbias); k += kChannelThreads) {
      const int64_t c = first_c + k;
      write_params(c, chan + c * 2);
    }
  }
  for (int64_t k = threadIdx.x / 32; k < chunk.count; k += kChannelThreads / 32) {
    const int64_t at = chunk.n * groups + chunk.first + k;
    A m[2];
    if (means) {
      m[0] = means[2 * at], m[1] = means[2 * at + 1];
    } else {
      const int64_t c0 = first_c + k * group_size;
      const A* src = chan + (chunk.n * t.c + c0) * 2;
      warp_combine<2>(group_size, [&](int64_t c, A (&in)[2]) {
        const A w = p.template w<A>(c0 + c);
        in[0] = w * src[2 * c], in[1] = w * src[2 * c + 1];
      }, m);
      if (threadIdx.x % 32 == 0) {
        finish_sums(at, m);
      } else {
        m[0] /= count, m[1] /= count;
      }
    }
    // Every lane holds the group's means (warp_combine): the warp writes its
    // channels' terms.
    const A mu = mean[at], rstd = rstd_of(var[at]);
    for (int64_t c = threadIdx.x % 32; c < group_size && mode.dx_terms; c += 32) {
      write_dx_terms(first_c + k * group_size + c, mu, rstd, m[0], m[1]);
    }
  }
}

// dscale and dbias: the channels' sums over n of group_sums' per-(n, channel)
// sums (chan), in order, so the same inputs give the same bits. Null
// dscale and dbias: none asked for.
template <typename A, typename W>
struct ParamGrads {
  const A* chan = nullptr;
  int64_t n = 0, c = 0;
  W* dscale = nullptr;
  W* dbias = nullptr;
  // Channels blockIdx.x * 256 + threadIdx.x, and every grid's worth on;
  // kLoads of a channel's n sums in flight at once (one at a time, a round
  // trip to L2 each: param_grads took 5 us over 16, notes v92).
  static constexpr int kLoads = 16;
  __device__ void write() const {
    if (!dscale && !dbias) return;
    for (int64_t ch = int64_t(blockIdx.x) * kChannelThreads + threadIdx.x; ch < c;
         ch += int64_t(gridDim.x) * kChannelThreads) {
      A d = 0, dx = 0;
      for (int64_t i0 = 0; i0 < n; i0 += kLoads) {
        Packed<A, 2> q[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const A* at = chan + ((i0 + u) * c + ch) * 2;
          if (i0 + u < n) q[u] = *reinterpret_cast<const Packed<A, 2>*>(at);
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          if (i0 + u < n) d += q[u].v[0], dx += q[u].v[1];
        }
      }
      if (dscale) dscale[ch] = from_acc<W>(dx);
      if (dbias) dbias[ch] = from_acc<W>(d);
    }
  }
};

// ParamGrads alone, where no apply_dx follows group_sums to write them.
template <typename A, typename W>
__global__ void __launch_bounds__(kChannelThreads) param_grads(ParamGrads<A, W> grads) {
  grads.write();
}

// dx = k_d dy' + k_x x + k_0, the terms per (n, channel) (group_sums); and
// dscale/dbias where asked for (`grads`: a launch fewer than param_grads
// after it, 1.0-1.9 us on an H200).
template <typename X, typename G, typename W, int V>
__global__ void __launch_bounds__(kChannelThreads) apply_dx(const X* x, const G* dy,
                                                            const acc_t<X>* coef,
                                                            Activation act, Tiles t, X* dx,
                                                            ParamGrads<acc_t<X>, W> grads) {
  using A = acc_t<X>;
  grads.write();
  const TileThread me(t, Sweep::kUp);
  if (!me.active) return;
  A k[V][5];
#pragma unroll
  for (int e = 0; e < V; ++e) {
#pragma unroll
    for (int j = 0; j < 5; ++j) {
      k[e][j] = j >= 2 || act != Activation::kNone
                    ? coef[(me.n * t.c + me.lane * V + e) * 5 + j]
                    : A(0);
    }
  }
  // As apply_affine: the last reads of x and dy and dx's stores evict-first.
  // Its terms before its rows, as tile_sums: loaded after the first rows'
  // loads, the UNet's apply_dx ran 6-24% slower (notes v76).
  me.for_rows<V, true>(t, [] {}, [&](int64_t r, const auto& xv, const auto& dyv) {
    A out[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A xe = xv.get(e), g = dyv.get(e);
      const A d =
          act != Activation::kNone ? activation_backward(act, g, xe * k[e][0] + k[e][1]) : g;
      out[e] = k[e][2] * d + k[e][3] * xe + k[e][4];
    }
    store_vec<V, true>(dx + me.at(t, r), out);
  }, x, dy);
}

}  // namespace jaxnorm::cuda
