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

// One launch: x (N, A, C) channels-last, a cluster of `parts` blocks a sample.
struct ClusterGnArgs {
  int64_t rows = 0;        // A, a sample's rows
  int c = 0, group_size = 1;
  int clusters_per_sample = 1;
  int rows_per_block = 0;  // ceil(A / (parts * clusters_per_sample))
  int stage_rows = 0;      // rows a bulk copy
  double epsilon = 0;
  Activation act = Activation::kNone;
};

// Where a group holds whole vectors a thread sums its V channels itself, so
// that the block's sums take a float2 a lane and row set, not a channel.
__host__ __device__ inline int sums_a_lane(int group_size, int vec) {
  return group_size % vec == 0 ? vec : 1;
}

// The dynamic shared memory of a launch: the block's rows of x, then the
// threads' sums (a float2 a row set and lane or channel), the block's sums and
// the statistics (a float2 a group each), and the shifts (a float a group).
struct ClusterGnSmem {
  size_t slice = 0, partial = 0, block_sums = 0, stats = 0, shift = 0, total = 0;
  __host__ __device__ static ClusterGnSmem of(int threads, int rows_per_block, int c, int vec,
                                              int group_size, size_t x_bytes) {
    ClusterGnSmem s;
    const int sets = threads / (c / vec), groups = c / group_size;
    s.slice = size_t(rows_per_block) * c * x_bytes;  // a multiple of 16: c % vec == 0
    s.partial = s.slice;
    s.block_sums = s.partial + size_t(sets) * (c / sums_a_lane(group_size, vec)) * sizeof(float2);
    s.stats = s.block_sums + size_t(groups) * sizeof(float2);
    s.shift = s.stats + size_t(groups) * sizeof(float2);
    s.total = s.shift + size_t(groups) * sizeof(float);
    return s;
  }
};

// A float2 of the shared memory of the cluster's block of rank r.
__device__ __forceinline__ float2 load_cluster_float2(const float2* local, uint32_t r) {
  float2 v = make_float2(0.0f, 0.0f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];"
               : "=f"(v.x), "=f"(v.y)
               : "r"(cluster_addr(shared_addr(local), r))
               : "memory");
#endif
  return v;
}

// Where the clusters of a sample meet (clusters_per_sample > 1): each
// cluster's group sums (N, clusters_per_sample, G), and per sample the
// clusters that have published theirs and the blocks done waiting for them
// (N each; zero at the launch, left at zero by it: meeting_counters).
struct ClusterGnExchange {
  float2* sums = nullptr;
  unsigned* arrived = nullptr;
  unsigned* departed = nullptr;
};

// Waits until `expected` clusters have counted themselves in at `arrived`,
// counting this block's cluster in first where `arrive`: the block's earlier
// writes, ordered by the barrier, go out with thread 0's release, and what
// the others published is visible to the block after its acquire and the
// barrier (a grid barrier's pattern, without its fences: notes v86).
__device__ __forceinline__ void arrive_and_wait(unsigned* arrived, unsigned expected,
                                                bool arrive) {
  __syncthreads();  // the block's writes of its cluster's sums
  if (threadIdx.x == 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    if (arrive) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrived) : "memory");
    unsigned seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrived) : "memory");
    } while (seen < expected);
#endif
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

// Sums of the block's float2s over group k's `per` entries in each of the
// `sets` rows of `width` entries, in a fixed order: a warp a group where a
// group has many of them, else a thread a group.
__device__ __forceinline__ void sum_groups(const float2* partial, int sets, int width, int per,
                                           int groups, float2* block_sums) {
  const int items = sets * per;
  const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32;
  if (items >= 64) {
    for (int k = warp; k < groups; k += kClusterGnThreads / 32) {
      float v[2] = {0.0f, 0.0f};
      for (int i = lane; i < items; i += 32) {
        const int set = i / per;
        const float2 q = partial[set * width + k * per + (i - set * per)];
        v[0] += q.x, v[1] += q.y;
      }
      warp_sum(v);
      if (lane == 0) block_sums[k] = make_float2(v[0], v[1]);
    }
    return;
  }
  for (int k = tid; k < groups; k += kClusterGnThreads) {
    float2 t = make_float2(0.0f, 0.0f);
    for (int set = 0; set < sets; ++set) {
      for (int j = 0; j < per; ++j) {
        const float2 q = partial[set * width + k * per + j];
        t.x += q.x, t.y += q.y;
      }
    }
    block_sums[k] = t;
  }
}

// y = act(xhat scale + bias) and the statistics (mean_out, var_out: (N, G))
// of x (N, A, C): a cluster of blocks a sample (grid N * parts). A thread
// takes a vector of V channels (lane) in every `sets`-th row of its block's
// rows: the same channels, hence the same terms, throughout.
template <typename X, typename Y, typename W, int V>
__global__ void __launch_bounds__(kClusterGnThreads, 1)
    group_norm_cluster_fwd(const X* x, ChannelParams<W> p, ClusterGnArgs g,
                           ClusterGnExchange ex, float* mean_out, float* var_out, Y* y) {
  static_assert(sizeof(acc_t<X>) == 4 && V * sizeof(X) == 16);
  using A = float;
  extern __shared__ __align__(kDynSmemAlign) unsigned char dyn[];
  __shared__ uint64_t bars[kClusterGnStages];
  const int groups = g.c / g.group_size, lanes = g.c / V, sets = kClusterGnThreads / lanes;
  const ClusterGnSmem at =
      ClusterGnSmem::of(kClusterGnThreads, g.rows_per_block, g.c, V, g.group_size, sizeof(X));
  const X* slice = reinterpret_cast<const X*>(dyn);
  auto* partial = reinterpret_cast<float2*>(dyn + at.partial);
  auto* block_sums = reinterpret_cast<float2*>(dyn + at.block_sums);
  auto* stats = reinterpret_cast<float2*>(dyn + at.stats);
  auto* shift = reinterpret_cast<float*>(dyn + at.shift);

  const uint32_t parts = cluster_blocks(), rank = cluster_rank();
  const uint32_t cluster = blockIdx.x / parts, m = uint32_t(g.clusters_per_sample);
  const int64_t n = cluster / m;
  const int sub = int(cluster % m);  // the sample's cluster
  const int64_t first_row = (int64_t(sub) * parts + rank) * g.rows_per_block;
  const int64_t left = g.rows - first_row;
  const int rows = left <= 0 ? 0 : left < g.rows_per_block ? int(left) : g.rows_per_block;
  const X* sample = x + n * g.rows * g.c;
  const int tid = int(threadIdx.x), lane = tid % lanes, set = tid / lanes;
  const bool active = set < sets;
  JAXNORM_GN_CLUSTER_STAMP(0);
  if (tid == 0) {
    for (int s = 0; s < kClusterGnStages; ++s) mbar_init(&bars[s], 1);
    fence_mbar_init();
    for (int s = 0, r = 0; r < rows; ++s, r += g.stage_rows) {
      const int got = rows - r < g.stage_rows ? rows - r : g.stage_rows;
      const uint32_t bytes = uint32_t(got) * uint32_t(g.c) * sizeof(X);
      mbar_expect(&bars[s], bytes);
      bulk_load(dyn + size_t(r) * g.c * sizeof(X), sample + (first_row + r) * g.c, bytes,
                &bars[s]);
    }
  }
  for (int k = tid; k < groups; k += kClusterGnThreads) {
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
  if (active) {
#pragma unroll
    for (int e = 0; e < V; ++e) sh[e] = shift[(lane * V + e) / g.group_size], s1[e] = s2[e] = 0;
    int r = set;
    for (int s = 0, end = 0; end < rows; ++s) {
      end = end + g.stage_rows < rows ? end + g.stage_rows : rows;
      if (r >= end) continue;
      mbar_wait(&bars[s], 0);
      for (; r < end; r += sets) {
        RegVec<X, V> v;
        v.load_shared(reinterpret_cast<const uint4*>(slice + size_t(r) * g.c + lane * V));
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const A d = v.get(e) - sh[e];
          s1[e] += d;
          s2[e] = fmaf(d, d, s2[e]);
        }
      }
    }
    if (sums_a_lane(g.group_size, V) == V) {  // one group: its channels' sums added
#pragma unroll
      for (int e = 1; e < V; ++e) s1[0] += s1[e], s2[0] += s2[e];
      partial[set * lanes + lane] = make_float2(s1[0], s2[0]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) partial[set * g.c + lane * V + e] = make_float2(s1[e], s2[e]);
    }
  }
  __syncthreads();
  JAXNORM_GN_CLUSTER_STAMP(2);
  const int per_lane = sums_a_lane(g.group_size, V);
  sum_groups(partial, sets, g.c / per_lane, g.group_size / per_lane, groups, block_sums);
  cluster_arrive_release();
  cluster_wait();
  JAXNORM_GN_CLUSTER_STAMP(3);
  // Every block adds the cluster's sums in rank order, then the sample's
  // clusters' in cluster order: the same bits in each.
  const A count = A(g.rows) * A(g.group_size);
  auto finish = [&](int k, float2 t) {
    const A d = t.x / count, var = fmaxf(t.y / count - d * d, A(0));
    stats[k] = make_float2(shift[k] + d, rsqrtf(var + A(g.epsilon)));
    if (rank == 0 && sub == 0) {
      mean_out[n * groups + k] = shift[k] + d, var_out[n * groups + k] = var;
    }
  };
  for (int k = tid; k < groups; k += kClusterGnThreads) {
    float2 q[kMaxWideClusterParts];
#pragma unroll
    for (int r = 0; r < kMaxWideClusterParts; ++r) {
      if (r < int(parts)) q[r] = load_cluster_float2(&block_sums[k], uint32_t(r));
    }
    float2 t = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int r = 0; r < kMaxWideClusterParts; ++r) {
      if (r < int(parts)) t.x += q[r].x, t.y += q[r].y;
    }
    if (m == 1) {
      finish(k, t);
    } else if (rank == 0) {
      ex.sums[(n * m + sub) * groups + k] = t;
    }
  }
  cluster_arrive_relaxed();  // this block's reads of the others' sums are done
  if (m > 1) {
    arrive_and_wait(ex.arrived + n, unsigned(m), rank == 0);
    // A thread a group, its clusters' sums loaded 8 at a time, added in
    // cluster order (a warp a group, a lane a cluster, took a trip more to
    // L2 for its second group: +0.6-1.3 us, notes v86).
    const float2* sample_sums = ex.sums + n * m * groups;
    for (int k = tid; k < groups; k += kClusterGnThreads) {
      float2 t = make_float2(0.0f, 0.0f);
      for (int j0 = 0; j0 < int(m); j0 += 8) {
        float2 q[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          q[u] = j0 + u < int(m) ? __ldcg(sample_sums + (j0 + u) * groups + k) : make_float2(0, 0);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) t.x += q[u].x, t.y += q[u].y;
      }
      finish(k, t);
    }
  }
  __syncthreads();
  JAXNORM_GN_CLUSTER_STAMP(4);
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
    for (int r = set; r < rows; r += sets) {
      RegVec<X, V> v;
      v.load_shared(reinterpret_cast<const uint4*>(slice + size_t(r) * g.c + lane * V));
      A o[V];
#pragma unroll
      for (int e = 0; e < V; ++e) o[e] = activate(g.act, fmaf(v.get(e), w[e], b[e]));
      store_vec<V>(out + size_t(r) * g.c, o);
    }
  }
  JAXNORM_GN_CLUSTER_STAMP(5);
  if (leaves) reset_if_last(before, m * parts, ex.arrived + n, ex.departed + n);
  cluster_wait();  // no block leaves while another may read its sums
  JAXNORM_GN_CLUSTER_STAMP(6);
}

// How group_norm_cluster_fwd runs x (n, a, c): `parts` blocks a cluster
// and args.clusters_per_sample clusters a sample, parts 0 where it does not
// serve it.
struct ClusterGnPlan {
  int parts = 0;
  ClusterGnArgs args;
  size_t smem = 0;
  int64_t blocks(int64_t n) const { return n * args.clusters_per_sample * parts; }
  // The clusters' sums of ClusterGnExchange.
  size_t exchange_bytes(int64_t n) const {
    if (args.clusters_per_sample == 1) return 0;
    const int groups = args.c / args.group_size;
    return size_t(n) * args.clusters_per_sample * groups * sizeof(float2);
  }
};

// The plan of `parts` blocks a cluster and `clusters` clusters a sample, if
// its rows fit the blocks' shared memory and all its clusters run at once.
template <typename X, typename Y, typename W, int V>
ClusterGnPlan cluster_gn_shape(int64_t n, int64_t a, int64_t c, int64_t group_size, int parts,
                               int clusters, const DeviceInfo& dev) {
  ClusterGnPlan plan;
  const int64_t blocks = int64_t(parts) * clusters;
  const int64_t rows = (a + blocks - 1) / blocks;
  if (!dev.clusters || n < 1 || c / V > kClusterGnThreads ||
      rows * c * int64_t(sizeof(X)) > int64_t(dev.max_dynamic_smem)) {
    return plan;
  }
  const ClusterGnSmem s =
      ClusterGnSmem::of(kClusterGnThreads, int(rows), int(c), V, int(group_size), sizeof(X));
  if (s.total > dev.max_dynamic_smem) return plan;
  auto kernel = group_norm_cluster_fwd<X, Y, W, V>;
  if (n * clusters > resident_clusters(kernel, kClusterGnThreads, s.total, parts, dev)) {
    return plan;
  }
  plan.parts = parts;
  plan.smem = s.total;
  plan.args.rows = a;
  plan.args.c = int(c);
  plan.args.group_size = int(group_size);
  plan.args.clusters_per_sample = clusters;
  plan.args.rows_per_block = int(rows);
  plan.args.stage_rows = int((rows + kClusterGnStages - 1) / kClusterGnStages);
  return plan;
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
template <typename X, typename Y, typename W, int V>
ClusterGnPlan plan_one_cluster_a_sample(int64_t n, int64_t a, int64_t c, int64_t group_size,
                                        const DeviceInfo& dev) {
  for (int parts = kMaxWideClusterParts; parts >= 1; --parts) {
    if (double(n * parts) < kClusterGnMinBusy * dev.sms) break;
    const ClusterGnPlan plan = cluster_gn_shape<X, Y, W, V>(n, a, c, group_size, parts, 1, dev);
    if (plan.parts > 0) return plan;
  }
  return {};
}

// Clusters a sample beyond which their meeting costs more than smaller
// blocks save (an H200: one sample in 64 clusters of 2 took 12.4 us, in 4
// of 16 10.8, notes v86).
constexpr int kMaxClustersASample = 16;

// Where one cluster a sample does not serve a batch of 2 or more, several
// clusters a sample ran 1.16-1.55x as fast as the passes on an H200
// (1.25-1.36x with 8-16 samples of 1.3-2.6 MB), the more blocks the faster,
// up to kMaxClustersASample: of clusters of 16, 8, 4 or 2 blocks, each with
// the most clusters a sample that run at once, the one with the most blocks
// (v86). One sample (0.88-1.10x) stays with the passes.
template <typename X, typename Y, typename W, int V>
ClusterGnPlan plan_cluster_gn(int64_t n, int64_t a, int64_t c, int64_t group_size,
                              const DeviceInfo& dev) {
  ClusterGnPlan best = plan_one_cluster_a_sample<X, Y, W, V>(n, a, c, group_size, dev);
  if (best.parts > 0 || n < 2) return best;
  for (int parts : {16, 8, 4, 2}) {
    for (int m = kMaxClustersASample; m >= 2; --m) {
      if (n * m * parts > dev.sms) continue;
      const ClusterGnPlan plan = cluster_gn_shape<X, Y, W, V>(n, a, c, group_size, parts, m, dev);
      if (plan.parts == 0) continue;
      if (plan.blocks(n) > best.blocks(n)) best = plan;
      break;
    }
  }
  if (double(best.blocks(n)) < kClusterGnMinBusy * dev.sms) return {};
  return best;
}

// ClusterGnExchange's counters for launches on `stream`, arrived then
// departed, dev.sms of each (a sample spread takes 4 SMs or more), zero, or
// null where they cannot be allocated. Each launch leaves them at zero, and a
// stream runs one launch at a time, so they are allocated once per device
// and stream; their zeroing is ordered on the stream.
inline unsigned* meeting_counters(const DeviceInfo& dev, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, unsigned*> known;
  std::lock_guard<std::mutex> lock(mu);
  unsigned*& counters = known[{dev.device, stream}];
  if (counters != nullptr) return counters;
  int current = 0;
  void* p = nullptr;
  const size_t bytes = 2 * size_t(dev.sms) * sizeof(unsigned);
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

// Runs `plan` (x: n samples); `sums` holds plan.exchange_bytes(n) and
// `counters` are meeting_counters' where the plan spreads a sample. Several
// clusters a sample wait for each other, so their launch is cooperative: the
// runtime refuses it rather than run them in turns.
template <typename X, typename Y, typename W, int V>
cudaError_t launch_cluster_gn(cudaStream_t stream, const ClusterGnPlan& plan, int64_t n,
                              const X* x, ChannelParams<W> p, void* sums, unsigned* counters,
                              const DeviceInfo& dev, float* mean, float* var, Y* y) {
  auto kernel = group_norm_cluster_fwd<X, Y, W, V>;
  const int m = plan.args.clusters_per_sample;
  ClusterGnExchange ex;
  if (m > 1) ex = {static_cast<float2*>(sums), counters, counters + dev.sms};
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t config = cluster_config(unsigned(plan.blocks(n)), kClusterGnThreads,
                                             plan.smem, plan.parts, stream, attrs[0]);
  if (m > 1) {
    attrs[1].id = cudaLaunchAttributeCooperative;
    attrs[1].val.cooperative = 1;
    config.numAttrs = 2;
  }
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, x, p, plan.args, ex, mean, var, y);
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

}  // namespace jaxnorm::cuda
