// GroupNorm's forward with x read once, for samples that fit in the shared
// memory of a cluster of blocks (sm_90): a cluster a sample, each block a
// contiguous run of the sample's rows, copied in by bulk copies (TMA).
//
// The passes (tile_stats, group_stats, apply_affine) read x twice and launch
// three kernels; an earlier one-read design (notes v49) kept a round of
// samples in the shared memory of the whole grid and met through counters in
// global memory, and its barriers and merges (6-8 us a round) cost what the
// second read saves. Here a group's statistics never leave the cluster: each
// block sums its rows' deviations from a shift per group (the group's first
// value in the sample's first row, which every block reads), so that the
// blocks' sums merge by adding them, in rank order, through distributed
// shared memory after one cluster barrier.
//
// Shifted sums: var = E[d^2] - E[d]^2 with d = x - shift loses nothing to a
// large mean (shift is one of the group's values, so d is of the size of the
// group's spread), unlike x's raw moments.
//
// A sample may also take several clusters (clusters_per_sample), so that a
// batch spreads over every SM: their blocks must all be resident at once,
// which the launch asks of the runtime (cooperative). Each cluster's rank 0
// publishes its sums to global memory and counts itself in; every block waits
// for its sample's count, then adds the clusters' sums in cluster order. The
// counters are kept per stream and left at zero by each launch (a memset
// before it cost 1.1-1.3 us a call, notes v86).
//
// Where the batch is more than the SMs' shared memory holds, each block holds
// the first rows of its run and streams the rest (kStream): they pass through
// its shared memory first, in a ring of bulk copies whose last lap is the held
// rows, and are read again from global memory (L2, where they were kept) for
// y (notes v87).
#pragma once

#include "cuda/channel_norm_kernels.cuh"

namespace jaxnorm::cuda {

// Phase stamps a harness may define (benchmarks/kernels/gn_cluster.cu); no
// code otherwise.
#ifndef JAXNORM_GN_CLUSTER_STAMP
#define JAXNORM_GN_CLUSTER_STAMP(i)
#endif

constexpr int kClusterGnThreads = 512;
constexpr int kClusterGnStages = 8;  // bulk copies a block, each its own mbarrier
constexpr int kMeetLoads = 16;       // a sample's clusters' sums in flight a thread

// One launch: x (N, A, C) channels-last, a cluster of `parts` blocks a sample.
struct ClusterGnArgs {
  int64_t rows = 0;        // A, a sample's rows
  int c = 0, group_size = 1;
  int clusters_per_sample = 1;
  int rows_per_block = 0;  // ceil(A / (parts * clusters_per_sample))
  int held_rows = 0;       // of them, the first in shared memory; the rest streamed
  int stage_rows = 0;      // rows a bulk copy
  double epsilon = 0;
  Activation act = Activation::kNone;
};

// The float2s a row set of the threads' sums takes: its `width` and 4 more,
// so that consecutive sets start 8 banks apart (a width that is a multiple of
// 16 put every set's entry k on the same banks: 8-way conflicts in sum_groups).
__host__ __device__ inline int sums_stride(int width) { return width + 4; }

// A thread's sums of each of its V channels (where a group does not hold
// whole vectors) in a row set of the threads' sums: entry e of lane l at
// e * (lanes + 4) + l, so that a warp's store of its lanes' entry e is
// contiguous (at l * V + e, 64 bytes apart, it was a 16-way bank conflict,
// V stores a thread: notes v93). A set takes V (lanes + 4) + 1 float2s, so
// that consecutive sets start on other banks too.
__host__ __device__ inline int lane_sums_stride(int lanes) { return lanes + 4; }
template <int V>
__host__ __device__ inline int lane_sums_at(int channel, int lanes) {
  return channel % V * lane_sums_stride(lanes) + channel / V;
}
__host__ __device__ inline int lane_sums_set(int c, int vec) {
  return vec * lane_sums_stride(c / vec) + 1;
}

// The float2s a row set of the threads' sums takes: where a group holds
// whole vectors a thread adds its V channels itself, a float2 a lane; else a
// float2 a channel, lane-major.
__host__ __device__ inline int set_sums_stride(int c, int vec, int group_size) {
  return group_size % vec == 0 ? sums_stride(c / vec) : lane_sums_set(c, vec);
}

// `bytes` of shared memory rounded up to 16, so that the next region starts
// where a float4 may (the threads' sums may take an odd number of float2s).
__host__ __device__ inline size_t round16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// The dynamic shared memory of a launch: the block's held rows of x, then the
// threads' sums (a float2 a row set and lane or channel), the block's sums and
// the statistics (a float2 a group each), and the shifts (a float a group).
struct ClusterGnSmem {
  size_t slice = 0, partial = 0, block_sums = 0, stats = 0, shift = 0, total = 0;
  __host__ __device__ static ClusterGnSmem of(int threads, int held_rows, int c, int vec,
                                              int group_size, size_t x_bytes) {
    ClusterGnSmem s;
    const int sets = threads / (c / vec), groups = c / group_size;
    s.slice = size_t(held_rows) * c * x_bytes;  // a multiple of 16: c % vec == 0
    s.partial = s.slice;
    s.block_sums =
        s.partial + round16(size_t(sets) * set_sums_stride(c, vec, group_size) * sizeof(float2));
    s.stats = s.block_sums + size_t(groups) * sizeof(float2);
    s.shift = s.stats + size_t(groups) * sizeof(float2);
    s.total = s.shift + size_t(groups) * sizeof(float);
    return s;
  }
};

// K floats (2 or 4) of the shared memory of the cluster's block of rank r.
template <int K>
__device__ __forceinline__ Packed<float, K> load_cluster(const Packed<float, K>* local,
                                                         uint32_t r) {
  static_assert(K == 2 || K == 4);
  Packed<float, K> v{};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t at = cluster_addr(shared_addr(local), r);
  if constexpr (K == 2) {
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];"
                 : "=f"(v.v[0]), "=f"(v.v[1])
                 : "r"(at)
                 : "memory");
  } else {
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.v[0]), "=f"(v.v[1]), "=f"(v.v[2]), "=f"(v.v[3])
                 : "r"(at)
                 : "memory");
  }
#endif
  return v;
}

// K floats of global memory, cached in L2 only (another SM wrote them).
template <int K>
__device__ __forceinline__ Packed<float, K> load_cg(const Packed<float, K>* p) {
  Packed<float, K> v;
  if constexpr (K == 2) {
    const float2 u = __ldcg(reinterpret_cast<const float2*>(p));
    v.v[0] = u.x, v.v[1] = u.y;
  } else {
    static_assert(K == 4);
    const float4 u = __ldcg(reinterpret_cast<const float4*>(p));
    v.v[0] = u.x, v.v[1] = u.y, v.v[2] = u.z, v.v[3] = u.w;
  }
  return v;
}

template <int K>
__device__ __forceinline__ void add_to(Packed<float, K>& t, const Packed<float, K>& q) {
#pragma unroll
  for (int i = 0; i < K; ++i) t.v[i] += q.v[i];
}

// Where the clusters of a sample meet (clusters_per_sample > 1): each
// cluster's group sums (N, clusters_per_sample, G), and per sample the
// clusters that have published theirs and the blocks done waiting for them
// (N each; zero at the launch, left at zero by it: meeting_counters). Where
// the whole grid meets (the backward's dscale and dbias), the blocks that
// have published their part and those done waiting for the others (one
// each, kept the same way).
struct ClusterGnExchange {
  void* sums = nullptr;  // Packed<float, K> a group
  unsigned* arrived = nullptr;
  unsigned* departed = nullptr;
  unsigned* grid_arrived = nullptr;
  unsigned* grid_departed = nullptr;
};

// Thread 0, after a barrier that orders its block's writes before it: counts
// the block (or its cluster) in, releasing those writes.
__device__ __forceinline__ void count_in(unsigned* arrived) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrived) : "memory");
#endif
}

// Thread 0: waits until `expected` have counted themselves in; what they
// wrote before is then visible to the block after a barrier.
__device__ __forceinline__ void wait_for_count(const unsigned* arrived, unsigned expected) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  unsigned seen = 0;
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrived) : "memory");
  } while (seen < expected);
#endif
}

// Waits until `expected` clusters have counted themselves in at `arrived`,
// counting this block's cluster in first where `arrive`: the block's earlier
// writes, ordered by the barrier, go out with thread 0's release, and what
// the others published is visible to the block after its acquire and the
// barrier (a grid barrier's pattern, without its fences: notes v86).
__device__ __forceinline__ void arrive_and_wait(unsigned* arrived, unsigned expected,
                                                bool arrive) {
  __syncthreads();  // the block's writes of its cluster's sums
  if (threadIdx.x == 0) {
    if (arrive) count_in(arrived);
    wait_for_count(arrived, expected);
  }
  __syncthreads();
}

// A block counts itself out of its sample's meeting once it no longer reads
// it (atomicAdd on `departed`, its answer awaited only after the block's
// stores are issued); the last of the sample's blocks then leaves both
// counters at zero for the next launch on the stream.
__device__ __forceinline__ void reset_if_last(unsigned before, unsigned blocks,
                                              unsigned* arrived, unsigned* departed) {
  if (before == blocks - 1) *arrived = 0, *departed = 0;
}

// The sum of a group's items first, first + step, ... below `items`, in that
// order: item i is entry(set, j), entry j = i % per of row set = i / per,
// stepped without a division an item, kSumLoads loads in flight.
// A division an item and one load at a time (and rows a multiple of 128 B
// apart) took the block's sums 1.3 us at 128 channels, against 0.86 (notes
// v89).
constexpr int kSumLoads = 4;
template <typename Entry>
__device__ __forceinline__ float2 sum_items(Entry&& entry, int per, int items, int first,
                                            int step) {
  int set = first / per, j = first - set * per;
  const int dset = step / per, dj = step - dset * per;
  float2 t = make_float2(0.0f, 0.0f);
  for (int i0 = first; i0 < items; i0 += step * kSumLoads) {
    float2 q[kSumLoads];
#pragma unroll
    for (int u = 0; u < kSumLoads; ++u) {
      q[u] = i0 + u * step < items ? entry(set, j) : make_float2(0.0f, 0.0f);
      set += dset, j += dj;
      if (j >= per) j -= per, ++set;
    }
#pragma unroll
    for (int u = 0; u < kSumLoads; ++u) {
      if (i0 + u * step < items) t.x += q[u].x, t.y += q[u].y;
    }
  }
  return t;
}

// Sums of the block's float2s over group k's `per` entries in each of
// `sets` row sets, entry(k, set, j), in a fixed order: a warp a group where a
// group has many of them, else a thread a group.
template <typename Entry>
__device__ __forceinline__ void sum_groups(Entry&& entry, int sets, int per, int groups,
                                           float2* block_sums) {
  const int items = sets * per;
  const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32;
  if (items >= 64) {
    for (int k = warp; k < groups; k += kClusterGnThreads / 32) {
      const float2 t = sum_items([&](int set, int j) { return entry(k, set, j); }, per, items,
                                 lane, 32);
      float v[2] = {t.x, t.y};
      warp_sum(v);
      if (lane == 0) block_sums[k] = make_float2(v[0], v[1]);
    }
    return;
  }
  for (int k = tid; k < groups; k += kClusterGnThreads) {
    block_sums[k] = sum_items([&](int set, int j) { return entry(k, set, j); }, per, items, 0, 1);
  }
}

// The order in which a block's rows pass through the kClusterGnStages stages
// of its slice, in chunks of stage_rows: first the streamed rows [held, rows),
// in laps of a chunk a stage (the last lap padded with empty chunks), then
// the held rows [0, held), which stay, held row r at slice row r. The ring
// keeps the whole slice's bytes in flight while the streamed rows pass;
// loaded by the threads instead, into the L1 that the slice leaves, they came
// at 1-2.4 TB/s (benchmarks/NOTES.md v87).
struct RowChunks {
  int held, rows, stage_rows, laps;
  __device__ __forceinline__ RowChunks(int held_, int rows_, int stage_rows_)
      : held(held_), rows(rows_), stage_rows(stage_rows_), laps(0) {
    const int lap_rows = stage_rows * kClusterGnStages;
    if (rows > held && lap_rows > 0) laps = (rows - held + lap_rows - 1) / lap_rows;
  }
  // Chunk j: rows [r0, r1), empty where r0 >= r1.
  __device__ __forceinline__ void range(int j, int& r0, int& r1) const {
    const int streamed = laps * kClusterGnStages;
    const int end = j < streamed ? rows : held;
    r0 = j < streamed ? held + j * stage_rows : (j - streamed) * stage_rows;
    r1 = r0 + stage_rows < end ? r0 + stage_rows : end;
  }
  // Chunk j's first row r0 and its bytes, rows of `row_bytes`.
  __device__ __forceinline__ uint32_t bytes(int j, uint32_t row_bytes, int& r0) const {
    int r1;
    range(j, r0, r1);
    return r0 < r1 ? uint32_t(r1 - r0) * row_bytes : 0;
  }
  // The L2 policy of chunk j's copy: the streamed rows stay in L2, where
  // they are read again; the held rows need not.
  __device__ __forceinline__ uint64_t policy(int j) const {
    return j < laps * kClusterGnStages ? l2_policy<true>() : l2_policy<false>();
  }
};

// Where a block's rows lie: sample n's cluster `sub` (of m), rank `rank` of
// its `parts` blocks, rows [first_row, first_row + rows) of the sample, the
// first `held` of them held in shared memory.
struct ClusterBlock {
  uint32_t parts, rank, m;
  int64_t n, first_row;
  int sub, rows, held;
  __device__ explicit ClusterBlock(const ClusterGnArgs& g)
      : parts(cluster_blocks()), rank(cluster_rank()), m(uint32_t(g.clusters_per_sample)) {
    const uint32_t cluster = blockIdx.x / parts;
    n = cluster / m;
    sub = int(cluster % m);
    first_row = (int64_t(sub) * parts + rank) * g.rows_per_block;
    const int64_t left = g.rows - first_row;
    rows = left <= 0 ? 0 : left < g.rows_per_block ? int(left) : g.rows_per_block;
    held = rows < g.held_rows ? rows : g.held_rows;
  }
};

// The block's sums of its threads' (s1, s2) a channel, a float2 a group
// (out): an active thread holds V channels at `lane` in row set `set`, and
// where a group holds whole vectors it adds its V channels first.
template <int V>
__device__ __forceinline__ void block_group_sums(float2* partial, const float (&s1)[V],
                                                 const float (&s2)[V], bool active, int set,
                                                 int lane, int sets, int c, int group_size,
                                                 float2* out) {
  const bool whole = group_size % V == 0;
  const int lanes = c / V, stride = set_sums_stride(c, V, group_size);
  if (active) {
    if (whole) {  // one group: its channels' sums added
      float t1 = s1[0], t2 = s2[0];
#pragma unroll
      for (int e = 1; e < V; ++e) t1 += s1[e], t2 += s2[e];
      partial[set * stride + lane] = make_float2(t1, t2);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        partial[set * stride + e * lane_sums_stride(lanes) + lane] = make_float2(s1[e], s2[e]);
      }
    }
  }
  __syncthreads();
  JAXNORM_GN_CLUSTER_STAMP(2);
  if (whole) {
    const int per = group_size / V;
    sum_groups([&](int k, int s, int j) { return partial[s * stride + k * per + j]; }, sets, per,
               c / group_size, out);
  } else {
    sum_groups([&](int k, int s, int j) {
      return partial[s * stride + lane_sums_at<V>(k * group_size + j, lanes)];
    }, sets, group_size, c / group_size, out);
  }
}

// The meeting of a cluster's blocks (and of a sample's clusters, m > 1):
// each block's sums, K floats a group (block_sums, in its shared memory),
// added over the cluster's blocks in rank order, then over the sample's
// clusters in cluster order, so that every block gets the same bits;
// finish(k, sums) for each group k, a thread a group, then a block barrier.
// after_reads() runs once the block has read the other blocks' sums (the
// arrival of the cluster barrier that keeps a block from leaving while
// another reads its shared memory, where nothing else is read there later).
template <int K, typename AfterReads, typename Finish>
__device__ __forceinline__ void meet_groups(const Packed<float, K>* block_sums, int groups,
                                            const ClusterGnExchange& ex, int64_t n, uint32_t m,
                                            int sub, AfterReads&& after_reads, Finish&& finish) {
  const uint32_t parts = cluster_blocks(), rank = cluster_rank();
  const int tid = int(threadIdx.x);
  auto* sums = static_cast<Packed<float, K>*>(ex.sums);
  cluster_arrive_release_shared();  // block_sums, read by the cluster's blocks
  cluster_wait();
  JAXNORM_GN_CLUSTER_STAMP(4);
  for (int k = tid; k < groups; k += kClusterGnThreads) {
    Packed<float, K> q[kMaxWideClusterParts];
#pragma unroll
    for (int r = 0; r < kMaxWideClusterParts; ++r) {
      if (r < int(parts)) q[r] = load_cluster<K>(&block_sums[k], uint32_t(r));
    }
    Packed<float, K> t{};
#pragma unroll
    for (int r = 0; r < kMaxWideClusterParts; ++r) {
      if (r < int(parts)) add_to(t, q[r]);
    }
    if (m == 1) {
      finish(k, t);
    } else if (rank == 0) {
      sums[(n * m + sub) * groups + k] = t;
    }
  }
  after_reads();
  if (m > 1) {
    arrive_and_wait(ex.arrived + n, unsigned(m), rank == 0);
    // A thread a group, its clusters' sums loaded 16 at a time (one trip to
    // L2 for the 15-16 clusters of a spread sample; 8 at a time took two,
    // 0.2-0.4 us more, notes v88), added in
    // cluster order (a warp a group, a lane a cluster, took a trip more to
    // L2 for its second group: +0.6-1.3 us, notes v86).
    const Packed<float, K>* sample_sums = sums + n * m * groups;
    for (int k = tid; k < groups; k += kClusterGnThreads) {
      Packed<float, K> t{};
      for (int j0 = 0; j0 < int(m); j0 += kMeetLoads) {
        Packed<float, K> q[kMeetLoads];
#pragma unroll
        for (int u = 0; u < kMeetLoads; ++u) {
          q[u] = j0 + u < int(m) ? load_cg<K>(sample_sums + (j0 + u) * groups + k)
                                 : Packed<float, K>{};
        }
#pragma unroll
        for (int u = 0; u < kMeetLoads; ++u) add_to(t, q[u]);
      }
      finish(k, t);
    }
  }
  __syncthreads();
  JAXNORM_GN_CLUSTER_STAMP(5);
}

// f(r, load(r)) for rows r = first, first + step, ... below end, the loads
// of kStreamLoads rows in flight: a block's streamed rows, read again.
constexpr int kStreamLoads = 8;
template <int kLoads = kStreamLoads, typename Load, typename F>
__device__ __forceinline__ void for_rows_loaded(int first, int end, int step, Load&& load,
                                                F&& f) {
  for (int a = first; a < end; a += kLoads * step) {
    decltype(load(0)) v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      if (a + u * step < end) v[u] = load(a + u * step);
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      if (a + u * step < end) f(a + u * step, v[u]);
    }
  }
}

// y = act(xhat scale + bias) and the statistics (mean_out, var_out: (N, G))
// of x (N, A, C): a cluster of blocks a sample (grid N * parts). A thread
// takes a vector of V channels (lane) in every `sets`-th row of its block's
// rows: the same channels, hence the same terms, throughout.
//
// kStream: the plan streams part of the rows (held_rows < rows_per_block);
// compiled apart, since the ring's code cost the kernel 3-9% where it holds
// every row (notes v87).
template <typename X, typename Y, typename W, int V, bool kStream>
__global__ void __launch_bounds__(kClusterGnThreads, 1)
    group_norm_cluster_fwd(const X* x, ChannelParams<W> p, ClusterGnArgs g,
                           ClusterGnExchange ex, float* mean_out, float* var_out, Y* y) {
  static_assert(sizeof(acc_t<X>) == 4 && V * sizeof(X) == 16);
  using A = float;
  extern __shared__ __align__(kDynSmemAlign) unsigned char dyn[];
  // The stages' mbarriers: full alone where every row is held, a ring of
  // them (BulkFill) where rows stream.
  __shared__ typename BulkFill<kClusterGnStages>::Shared bars;
  uint64_t* full = bars.full;
  BulkFill<kClusterGnStages> ring{bars};
  const int groups = g.c / g.group_size, lanes = g.c / V, sets = kClusterGnThreads / lanes;
  const ClusterGnSmem at =
      ClusterGnSmem::of(kClusterGnThreads, g.held_rows, g.c, V, g.group_size, sizeof(X));
  const X* slice = reinterpret_cast<const X*>(dyn);
  auto* partial = reinterpret_cast<float2*>(dyn + at.partial);
  auto* block_sums = reinterpret_cast<float2*>(dyn + at.block_sums);
  auto* stats = reinterpret_cast<float2*>(dyn + at.stats);
  auto* shift = reinterpret_cast<float*>(dyn + at.shift);

  const ClusterBlock me(g);
  const uint32_t rank = me.rank, m = me.m;
  const int64_t n = me.n, first_row = me.first_row;
  const int sub = me.sub, rows = me.rows, held = me.held;
  const X* sample = x + n * g.rows * g.c;
  const X* block = sample + first_row * g.c;
  const int tid = int(threadIdx.x), lane = tid % lanes, set = tid / lanes;
  const bool active = set < sets;
  const RowChunks chunks(held, rows, g.stage_rows);
  // Thread 0: chunk j into its stage (an empty one completes the phase).
  auto fill = [&](int j) {
    const int s = j % kClusterGnStages;
    int r0;
    const uint32_t bytes = chunks.bytes(j, uint32_t(g.c) * sizeof(X), r0);
    ring.fill(s, dyn + size_t(s) * g.stage_rows * g.c * sizeof(X), block + size_t(r0) * g.c,
              bytes, chunks.policy(j));
  };
  JAXNORM_GN_CLUSTER_STAMP(0);
  // The shifts' loads go out ahead of the bulk copies: behind them they came
  // back after a block's whole slice (4.3 us in, notes v88), and the sums
  // wait for them.
  const float first_shift = tid < groups ? to_acc(sample[int64_t(tid) * g.group_size]) : 0.0f;
  if constexpr (kStream) ring.init();
  if (tid == 0) {
    if constexpr (kStream) {
      for (int j = 0; j < kClusterGnStages; ++j) fill(j);
    } else {
      for (int s = 0; s < kClusterGnStages; ++s) mbar_init(&full[s], 1);
      fence_mbar_init();
      for (int s = 0, r = 0; r < held; ++s, r += g.stage_rows) {
        const int got = held - r < g.stage_rows ? held - r : g.stage_rows;
        const uint32_t bytes = uint32_t(got) * uint32_t(g.c) * sizeof(X);
        mbar_expect(&full[s], bytes);
        bulk_load(dyn + size_t(r) * g.c * sizeof(X), block + size_t(r) * g.c, bytes, &full[s]);
      }
    }
  }
  if (tid < groups) shift[tid] = first_shift;
  for (int k = tid + kClusterGnThreads; k < groups; k += kClusterGnThreads) {
    shift[k] = to_acc(sample[int64_t(k) * g.group_size]);
  }
  // The parameters travel while the rows land.
  A w[V], b[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    w[e] = active ? p.template w<A>(lane * V + e) : A(0);
    b[e] = active ? p.template b<A>(lane * V + e) : A(0);
  }
  __syncthreads();  // the mbarriers' initialization and the shifts
  JAXNORM_GN_CLUSTER_STAMP(1);

  A sh[V], s1[V], s2[V];
#pragma unroll
  for (int e = 0; e < V; ++e) s1[e] = s2[e] = 0;
  if (active) {
#pragma unroll
    for (int e = 0; e < V; ++e) sh[e] = shift[(lane * V + e) / g.group_size];
  }
  auto add = [&](const X* at) {
    RegVec<X, V> v;
    v.load_shared(reinterpret_cast<const uint4*>(at));
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A d = v.get(e) - sh[e];
      s1[e] += d;
      s2[e] = fmaf(d, d, s2[e]);
    }
  };
  // The streamed laps; each stage refilled with the chunk a lap on once
  // every thread has read it (the stage of the chunk before the thread's:
  // thread 0 then seldom waits).
  const int streamed_chunks = kStream ? chunks.laps * kClusterGnStages : 0;
  for (int j = 0; j < streamed_chunks; ++j) {
    const int s = j % kClusterGnStages;
    int r0, r1;
    chunks.range(j, r0, r1);
    // Every thread waits, rows to read or not, so that none releases the
    // stage for a lap on before the lap's phase completes.
    ring.wait(s);
    if (active) {
      const X* stage = slice + size_t(s) * g.stage_rows * g.c + lane * V;
      for (int r = r0 + set; r < r1; r += sets) add(stage + size_t(r - r0) * g.c);
    }
    ring.release(s);
    if (tid == 0 && j > 0) fill(j - 1 + kClusterGnStages);
  }
  if (tid == 0 && streamed_chunks > 0) fill(streamed_chunks - 1 + kClusterGnStages);
  // The held rows, which stay: a thread takes rows set, then every `sets`-th,
  // as it takes them again for y.
  if (active) {
    const uint32_t parity = kStream ? uint32_t(chunks.laps) & 1 : 0;
    int r = set;
    for (int s = 0, end = 0; end < held; ++s) {
      end = end + g.stage_rows < held ? end + g.stage_rows : held;
      if (r >= end) continue;
      mbar_wait(&full[s], parity);
      for (; r < end; r += sets) add(slice + size_t(r) * g.c + lane * V);
    }
  }
  block_group_sums<V>(partial, s1, s2, active, set, lane, sets, g.c, g.group_size, block_sums);
  JAXNORM_GN_CLUSTER_STAMP(3);
  // Every block adds the cluster's sums in rank order, then the sample's
  // clusters' in cluster order: the same bits in each.
  const A count = A(g.rows) * A(g.group_size);
  meet_groups<2>(reinterpret_cast<const Packed<float, 2>*>(block_sums), groups, ex, n, m, sub,
                 cluster_arrive_relaxed, [&](int k, const Packed<float, 2>& t) {
    const A d = t.v[0] / count, var = fmaxf(t.v[1] / count - d * d, A(0));
    stats[k] = make_float2(shift[k] + d, rsqrtf(var + A(g.epsilon)));
    if (rank == 0 && sub == 0) {
      mean_out[n * groups + k] = shift[k] + d, var_out[n * groups + k] = var;
    }
  });
  const bool leaves = m > 1 && tid == 0;
  const unsigned before = leaves ? atomicAdd(ex.departed + n, 1u) : 0u;
  if (active) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float2 st = stats[(lane * V + e) / g.group_size];
      w[e] *= st.y;
      b[e] -= st.x * w[e];
    }
    Y* out = y + (n * g.rows + first_row) * g.c + lane * V;
    auto y_of = [&](const RegVec<X, V>& v, A (&o)[V]) {
#pragma unroll
      for (int e = 0; e < V; ++e) o[e] = activate(g.act, fmaf(v.get(e), w[e], b[e]));
    };
    // Streamed rows first, while L2 may still hold them; their y evict-first,
    // so as not to push them out.
    if constexpr (kStream) {
      const X* row0 = block + lane * V;
      for_rows_loaded(held + set, rows, sets, [&](int r) {
        RegVec<X, V> v;
        v.template load<true>(row0 + size_t(r) * g.c);
        return v;
      }, [&](int r, const RegVec<X, V>& v) {
        A o[V];
        y_of(v, o);
        store_vec<V, true>(out + size_t(r) * g.c, o);
      });
    }
    for (int r = set; r < held; r += sets) {
      RegVec<X, V> v;
      v.load_shared(reinterpret_cast<const uint4*>(slice + size_t(r) * g.c + lane * V));
      A o[V];
      y_of(v, o);
      store_vec<V>(out + size_t(r) * g.c, o);
    }
  }
  JAXNORM_GN_CLUSTER_STAMP(6);
  if (leaves) reset_if_last(before, m * me.parts, ex.arrived + n, ex.departed + n);
  cluster_wait();  // no block leaves while another may read its sums
  JAXNORM_GN_CLUSTER_STAMP(7);
}

// How a cluster kernel (group_norm_cluster_fwd, or the backward's) runs x
// (n, a, c): `parts` blocks a cluster and args.clusters_per_sample clusters
// a sample, parts 0 where it does not serve it.
struct ClusterGnPlan {
  int parts = 0;
  int sums = 2;  // floats a group its meeting adds
  ClusterGnArgs args;
  size_t smem = 0;
  int64_t blocks(int64_t n) const { return n * args.clusters_per_sample * parts; }
  bool streams() const { return args.held_rows < args.rows_per_block; }
  // The clusters' sums of ClusterGnExchange.
  size_t exchange_bytes(int64_t n) const {
    if (args.clusters_per_sample == 1) return 0;
    const int groups = args.c / args.group_size;
    return size_t(n) * args.clusters_per_sample * groups * sums * sizeof(float);
  }
};

// What the plans below ask of a cluster kernel (Op): its dynamic shared
// memory holding `held` rows a block (Op::smem), the bytes a held row takes
// (Op::row_bytes), the clusters that run at once (Op::resident) and the
// floats a group of its meeting (Op::kSums).
template <typename X, typename Y, typename W, int V>
struct ClusterGnFwd {
  static constexpr int kSums = 2;
  static size_t smem(int64_t held, int64_t c, int64_t group_size) {
    return ClusterGnSmem::of(kClusterGnThreads, int(held), int(c), V, int(group_size), sizeof(X))
        .total;
  }
  static size_t row_bytes(int64_t c) { return size_t(c) * sizeof(X); }
  static int resident(size_t smem, int parts, bool streams, const DeviceInfo& dev) {
    auto kernel = streams ? group_norm_cluster_fwd<X, Y, W, V, true>
                          : group_norm_cluster_fwd<X, Y, W, V, false>;
    return resident_clusters(kernel, kClusterGnThreads, smem, parts, dev);
  }
};

// The plan of `parts` blocks a cluster and `clusters` clusters a sample, if
// all its clusters run at once and its rows fit the blocks' shared memory;
// or, where `stream`, with as many of each block's rows held there as fit
// and the rest streamed.
template <typename Op, int V>
ClusterGnPlan cluster_shape(int64_t n, int64_t a, int64_t c, int64_t group_size, int parts,
                            int clusters, const DeviceInfo& dev, bool stream = false) {
  ClusterGnPlan plan;
  const int64_t blocks = int64_t(parts) * clusters;
  const int64_t rows = (a + blocks - 1) / blocks;
  if (!dev.clusters || n < 1 || c / V > kClusterGnThreads ||
      rows > std::numeric_limits<int>::max()) {
    return plan;
  }
  const size_t fixed = Op::smem(0, c, group_size), row_bytes = Op::row_bytes(c);
  if (fixed + row_bytes > dev.max_dynamic_smem) return plan;
  const int64_t fit = int64_t((dev.max_dynamic_smem - fixed) / row_bytes);
  if (rows > fit && !stream) return plan;
  // Streaming, the ring's stages take held_rows / kClusterGnStages rows each.
  const int64_t held = rows <= fit ? rows : fit - fit % kClusterGnStages;
  if (held < 1) return plan;
  const size_t smem = Op::smem(held, c, group_size);
  if (n * clusters > Op::resident(smem, parts, held < rows, dev)) return plan;
  plan.parts = parts;
  plan.sums = Op::kSums;
  plan.smem = smem;
  plan.args.rows = a;
  plan.args.c = int(c);
  plan.args.group_size = int(group_size);
  plan.args.clusters_per_sample = clusters;
  plan.args.rows_per_block = int(rows);
  plan.args.held_rows = int(held);
  plan.args.stage_rows = int((held + kClusterGnStages - 1) / kClusterGnStages);
  return plan;
}

template <typename X, typename Y, typename W, int V>
ClusterGnPlan cluster_gn_shape(int64_t n, int64_t a, int64_t c, int64_t group_size, int parts,
                               int clusters, const DeviceInfo& dev, bool stream = false) {
  return cluster_shape<ClusterGnFwd<X, Y, W, V>, V>(n, a, c, group_size, parts, clusters, dev,
                                                    stream);
}

// The share of the SMs below which the passes stay faster.
constexpr double kClusterGnMinBusy = 0.45;

// A block takes 5-6 us to read and write 160 KB however many SMs run (30-45
// GB/s an SM, by bulk copies or cp.async alike, and its stores), so a launch
// wins only where one round of clusters, all of them at once, holds every
// sample and keeps most SMs busy: on an H200, 1.15-1.46x the passes with 48-73%
// of the SMs, 0.94-1.00x with 12-24%, and 0.72-0.94x with two or three rounds
// of 16 blocks (benchmarks/NOTES.md, v80). Of the cluster sizes that do,
// the largest, whose blocks take the fewest rows.
template <typename Op, int V>
ClusterGnPlan one_cluster_a_sample(int64_t n, int64_t a, int64_t c, int64_t group_size,
                                   const DeviceInfo& dev) {
  for (int parts = kMaxWideClusterParts; parts >= 1; --parts) {
    if (double(n * parts) < kClusterGnMinBusy * dev.sms) break;
    const ClusterGnPlan plan = cluster_shape<Op, V>(n, a, c, group_size, parts, 1, dev);
    if (plan.parts > 0) return plan;
  }
  return {};
}

// Clusters a sample beyond which their meeting costs more than smaller
// blocks save (an H200: one sample in 64 clusters of 2 took 12.4 us, in 4
// of 16 10.8, notes v86).
constexpr int kMaxClustersASample = 16;

// Of clusters of 16, 8, 4 or 2 blocks, each with the most clusters a sample
// (at least `min_clusters`, up to kMaxClustersASample) that run at once, the
// one with the most blocks: with `stream`, as many of their rows held as fit.
template <typename Op, int V>
ClusterGnPlan most_cluster_blocks(int64_t n, int64_t a, int64_t c, int64_t group_size,
                                  int min_clusters, bool stream, const DeviceInfo& dev) {
  ClusterGnPlan best;
  for (int parts : {16, 8, 4, 2}) {
    for (int m = kMaxClustersASample; m >= min_clusters; --m) {
      if (n * m * parts > dev.sms) continue;
      const ClusterGnPlan plan = cluster_shape<Op, V>(n, a, c, group_size, parts, m, dev, stream);
      if (plan.parts == 0) continue;
      if (plan.blocks(n) > best.blocks(n)) best = plan;
      break;
    }
  }
  return best;
}

template <typename X, typename Y, typename W, int V>
ClusterGnPlan most_blocks(int64_t n, int64_t a, int64_t c, int64_t group_size, int min_clusters,
                          bool stream, const DeviceInfo& dev) {
  return most_cluster_blocks<ClusterGnFwd<X, Y, W, V>, V>(n, a, c, group_size, min_clusters,
                                                          stream, dev);
}

// A single sample spreads over the SMs, and a plan streams, where the sample
// has at most this many groups: on an H200 (bf16, benchmarks/NOTES.md v87) a
// sample of 32 groups of 32x32x1280 ran 1.42x the passes in 15 clusters of 8,
// 256x256x128 1.17x, 256 groups (channels) of 32x28x28x256 1.23x; 1024 and
// 2048 channels 0.97x and 0.80x (streaming 76% of the rows, 0.89x).
constexpr int64_t kMaxGroupsSpread = 256;

// A plan that streams holds at least this share of each block's rows: on an
// H200 (v87) 1.29-1.35x the passes holding 28-58% of the rows with 1-4
// clusters a sample (16x64x64x320, 32 and 64 samples of 32x32x640), 1.03-1.10x
// holding 43-86% with 15 (1x512x512x64, 2x256x256x128, samples of 64 and 256
// channels), 0.93x holding 22% (256x56x56x64, 64 channels).
constexpr double kMinHeldShare = 0.25;

// Where one cluster a sample does not serve a batch, several clusters a
// sample ran 1.16-1.55x as fast as the passes on an H200 (1.25-1.36x with
// 8-16 samples of 1.3-2.6 MB), the more blocks the faster, up to
// kMaxClustersASample (most_blocks, v86), and a single sample of few groups
// as well (v87). Where x is more than the SMs' shared memory holds, the plan
// of the most blocks holds what fits and streams the rest, which it reads
// again for y (v87).
template <typename Op, int V>
ClusterGnPlan plan_clusters(int64_t n, int64_t a, int64_t c, int64_t group_size,
                            const DeviceInfo& dev) {
  ClusterGnPlan best = one_cluster_a_sample<Op, V>(n, a, c, group_size, dev);
  if (best.parts > 0) return best;
  const bool few_groups = c / group_size <= kMaxGroupsSpread;
  if (n >= 2 || few_groups) {
    best = most_cluster_blocks<Op, V>(n, a, c, group_size, 2, false, dev);
    if (double(best.blocks(n)) >= kClusterGnMinBusy * dev.sms) return best;
  }
  best = most_cluster_blocks<Op, V>(n, a, c, group_size, 1, true, dev);
  const ClusterGnArgs& g = best.args;
  if (!few_groups || best.parts == 0 || !best.streams() ||
      g.held_rows < kMinHeldShare * g.rows_per_block) {
    return {};
  }
  return best;
}

template <typename X, typename Y, typename W, int V>
ClusterGnPlan plan_cluster_gn(int64_t n, int64_t a, int64_t c, int64_t group_size,
                              const DeviceInfo& dev) {
  return plan_clusters<ClusterGnFwd<X, Y, W, V>, V>(n, a, c, group_size, dev);
}

// ClusterGnExchange's counters for launches on `stream`, arrived then
// departed, dev.sms of each (a sample spread takes 4 SMs or more), then the
// grid's two, zero, or null where they cannot be allocated. Each launch
// leaves them at zero, and a stream runs one launch at a time, so they are
// allocated once per device and stream; their zeroing is ordered on the
// stream.
inline unsigned* meeting_counters(const DeviceInfo& dev, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, unsigned*> known;
  std::lock_guard<std::mutex> lock(mu);
  unsigned*& counters = known[{dev.device, stream}];
  if (counters != nullptr) return counters;
  int current = 0;
  void* p = nullptr;
  const size_t bytes = (2 * size_t(dev.sms) + 2) * sizeof(unsigned);
  if (cudaGetDevice(&current) == cudaSuccess && cudaSetDevice(dev.device) == cudaSuccess &&
      cudaMalloc(&p, bytes) == cudaSuccess &&
      cudaMemsetAsync(p, 0, bytes, stream) == cudaSuccess) {
    counters = static_cast<unsigned*>(p);
  } else if (p != nullptr) {
    cudaFree(p);
  }
  cudaGetLastError();
  cudaSetDevice(current);
  return counters;
}

// The launch of `plan` (x: n samples), in its clusters (attrs: two). Several
// clusters a sample wait for each other, and where `grid_meets` every block
// for every other, so their launch is cooperative: the runtime refuses it
// rather than run them in turns.
inline cudaLaunchConfig_t cluster_gn_config(const ClusterGnPlan& plan, int64_t n,
                                            cudaStream_t stream, cudaLaunchAttribute (&attrs)[2],
                                            bool grid_meets = false) {
  cudaLaunchConfig_t config = cluster_config(unsigned(plan.blocks(n)), kClusterGnThreads,
                                             plan.smem, plan.parts, stream, attrs[0]);
  if (plan.args.clusters_per_sample > 1 || grid_meets) {
    attrs[1].id = cudaLaunchAttributeCooperative;
    attrs[1].val.cooperative = 1;
    config.numAttrs = 2;
  }
  return config;
}

// The meetings of a launch: where a plan spreads a sample, `sums` of
// plan.exchange_bytes(n); meeting_counters' `counters`, where given (a plan
// that spreads a sample, or a grid that meets).
inline ClusterGnExchange cluster_gn_exchange(const ClusterGnPlan& plan, void* sums,
                                             unsigned* counters, const DeviceInfo& dev) {
  if (counters == nullptr) return {};
  return {plan.args.clusters_per_sample > 1 ? sums : nullptr, counters, counters + dev.sms,
          counters + 2 * dev.sms, counters + 2 * dev.sms + 1};
}

// Runs `plan` (x: n samples); `sums` and `counters` as cluster_gn_exchange.
template <typename X, typename Y, typename W, int V>
cudaError_t launch_cluster_gn(cudaStream_t stream, const ClusterGnPlan& plan, int64_t n,
                              const X* x, ChannelParams<W> p, void* sums, unsigned* counters,
                              const DeviceInfo& dev, float* mean, float* var, Y* y) {
  auto kernel = plan.streams() ? group_norm_cluster_fwd<X, Y, W, V, true>
                               : group_norm_cluster_fwd<X, Y, W, V, false>;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t config = cluster_gn_config(plan, n, stream, attrs);
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, x, p, plan.args,
                                             cluster_gn_exchange(plan, sums, counters, dev),
                                             mean, var, y);
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

}  // namespace jaxnorm::cuda
