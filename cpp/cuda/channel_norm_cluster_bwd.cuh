// GroupNorm's backward with x and dy read once, in the clusters of
// group_norm_cluster_fwd (channel_norm_cluster.cuh): a cluster (or several)
// a sample, each block a run of its rows, held in shared memory or streamed
// through a ring of bulk copies and read again from L2.
//
// The passes read x and dy twice (the tiles' sums, then dx: 5 tensor
// passes where dx needs 3) and launch three kernels. Here one meeting a
// sample brings each group what dx needs, K floats a group:
// - given the forward's statistics (K = 2), the sums of g dy and of
//   g dy (x - mean), g the scale;
// - computing them (K = 4: y dead under jax.grad), those sums about a shift
//   (the group's first value, as the forward's) and the shifted moments of
//   x, from which the mean and the sums about it follow.
// A channel's dscale and dbias are its rows' sums of dy (x - mean) rstd and
// dy; each cluster adds its blocks' (through distributed shared memory, in
// rank order) and writes them per cluster, and once every block has, the
// grid adds the clusters' (GridGrads): the same bits from run to run.
// A launch of param_grads for that took 3.2 us at 8x32x32x1280; the grid's
// blocks, all resident, meet while they write dx (benchmarks/NOTES.md v93).
// No activation: with SiLU's derivative, twice an element, the kernel lost
// to the passes (v92).
#pragma once

#include "cuda/channel_norm_cluster.cuh"

namespace jaxnorm::cuda {

// The float2s a row set takes in the threads' sums: x's moments
// (block_group_sums' layout), then dy's and dy d's a channel, lane-major
// (lane_sums_at: the reads a channel a thread touch a bank at most twice).
__host__ __device__ inline int bwd_set_stride(int c, int vec, int group_size) {
  const int moments = set_sums_stride(c, vec, group_size), lane_major = lane_sums_set(c, vec);
  return moments > lane_major ? moments : lane_major;
}

// The dynamic shared memory of a backward launch: the block's held rows of
// x, then of dy (stage s of the ring at s * stage_rows in each); the
// threads' sums (bwd_set_stride); the block's per-channel
// sums and those times the channel's scale (a float2 a channel each); the
// block's group sums of x's moments and of the scaled channel sums (a float2
// a group each), the meeting's K floats a group, and per group dx's terms
// (float4), the statistics (mean, rstd: float2) and the shift (float); the
// scale (a float a channel), loaded with the shifts: read from global memory
// where the sums and dx's terms need it, a channel a thread, it took a trip
// to L2 or three in the meeting's critical path.
struct ClusterGnBwdSmem {
  size_t dy = 0, partial = 0, chan = 0, wchan = 0, moments = 0, scaled = 0, meet = 0, terms = 0,
         stats = 0, shift = 0, scale = 0, total = 0;
  __host__ __device__ static ClusterGnBwdSmem of(int threads, int held_rows, int c, int vec,
                                                 int group_size, size_t x_bytes) {
    ClusterGnBwdSmem s;
    const int sets = threads / (c / vec), groups = c / group_size;
    s.dy = size_t(held_rows) * c * x_bytes;  // a multiple of 16: c % vec == 0
    s.partial = 2 * s.dy;
    const size_t sums = size_t(sets) * bwd_set_stride(c, vec, group_size) * sizeof(float2);
    s.chan = s.partial + round16(sums);
    s.wchan = s.chan + size_t(c) * sizeof(float2);
    s.moments = s.wchan + size_t(c) * sizeof(float2);
    s.scaled = s.moments + size_t(groups) * sizeof(float2);
    s.meet = s.scaled + size_t(groups) * sizeof(float2);  // 16-byte aligned: chan is, c even
    s.terms = s.meet + size_t(groups) * sizeof(float4);
    s.stats = s.terms + size_t(groups) * sizeof(float4);
    s.shift = s.stats + size_t(groups) * sizeof(float2);
    s.scale = s.shift + size_t(groups) * sizeof(float);
    s.total = s.scale + size_t(c) * sizeof(float);
    return s;
  }
};

// A thread's rows of x and dy, loaded for dx.
template <typename X, int V>
struct RowPair {
  RegVec<X, V> x, dy;
};

// A channel's dx = a dy + k_x x + k_0 (a = rstd scale), as apply_dx's terms.
struct DxTerms {
  float a, k_x, k_0;
  __device__ float dx(float x, float dy) const { return a * dy + k_x * x + k_0; }
};

// The rows the dx pass loads at once from L2 (x and dy: 8 registers a row
// of 16-bit channels); at 8 the kernel spilled (128 registers).
constexpr int kStreamPairLoads = 4;

// A warp's share of dscale and dbias: channels ch, ch + step, ... (ch: the
// warp's index in the grid, step: the grid's warps), each the sum of
// `clusters` float2s of chan (every cluster's sums of its channels, dbias's
// then dscale's), once every block has written its part (`arrived` at
// `expected`). Its lanes take every 32nd cluster and add their sums as a
// butterfly, so a channel's bits do not change from run to run. start()
// issues the loads of the first channel (all of them, up to 32 kGridSumLoads
// clusters) where the warp still has dx to write, so that their trip to L2
// passes meanwhile; finish() adds and writes. Every lane of the warp calls
// both.
constexpr int kGridSumLoads = 4;
template <typename W>
struct GridGrads {
  const Packed<float, 2>* sums;
  int clusters, c, ch, step;
  const unsigned* arrived;
  unsigned expected;
  bool ready = false;
  Packed<float, 2> q[kGridSumLoads];

  __device__ GridGrads(const float* chan, int clusters_, int c_, const unsigned* arrived_,
                       unsigned expected_)
      : sums(reinterpret_cast<const Packed<float, 2>*>(chan)),
        clusters(clusters_),
        c(c_),
        ch(int(blockIdx.x * blockDim.x + threadIdx.x) / 32),
        step(int(gridDim.x * blockDim.x) / 32),
        arrived(arrived_),
        expected(expected_) {}
  __device__ void wait() {
    if (ready) return;
    if (threadIdx.x % 32 == 0) wait_for_count(arrived, expected);
    __syncwarp();  // lane 0's acquire, before the other lanes' loads
    ready = true;
  }
  __device__ void load(int channel, int j0) {
    wait();
#pragma unroll
    for (int u = 0; u < kGridSumLoads; ++u) {
      const int j = j0 + int(threadIdx.x % 32) + 32 * u;
      q[u] = j < clusters ? load_cg<2>(sums + int64_t(j) * c + channel) : Packed<float, 2>{};
    }
  }
  __device__ void start() {
    if (ch < c) load(ch, 0);
  }
  __device__ void finish(W* dscale, W* dbias) {
    for (int channel = ch; channel < c; channel += step) {
      float t[2] = {0.0f, 0.0f};
      for (int j0 = 0; j0 < clusters; j0 += 32 * kGridSumLoads) {
        if (channel != ch || j0 > 0) load(channel, j0);
#pragma unroll
        for (int u = 0; u < kGridSumLoads; ++u) t[0] += q[u].v[0], t[1] += q[u].v[1];
      }
      warp_sum(t);
      if (threadIdx.x % 32 == 0) {
        if (dbias) dbias[channel] = from_acc<W>(t[0]);
        if (dscale) dscale[channel] = from_acc<W>(t[1]);
      }
    }
  }
};

// dx (n, a, c) and, where dscale or dbias (c each) is asked for, those, by
// way of each cluster's sums of its channels (dbias, dscale) at
// chan_out[((n * m + sub) * c + channel) * 2] and the grid's meeting
// (ex.grid_arrived, a cooperative launch); from x and dy (n, a, c)
// channels-last and the statistics (mean, var: (n, G); kOwn: computed). A
// thread takes a vector of V channels (lane) in every `sets`-th row of its
// block's rows, as group_norm_cluster_fwd.
template <typename X, typename W, int V, bool kOwn>
__global__ void __launch_bounds__(kClusterGnThreads, 1)
    group_norm_cluster_bwd(const X* x, const X* dy, ChannelParams<W> p, const float* mean,
                           const float* var, ClusterGnArgs g, ClusterGnExchange ex,
                           float* chan_out, W* dscale, W* dbias, X* dx) {
  static_assert(sizeof(acc_t<X>) == 4 && V * sizeof(X) == 16);
  using A = float;
  constexpr int K = kOwn ? 4 : 2;
  extern __shared__ __align__(kDynSmemAlign) unsigned char dyn[];
  __shared__ typename BulkFill<kClusterGnStages>::Shared bars;
  BulkFill<kClusterGnStages> ring{bars};
  const int groups = g.c / g.group_size, lanes = g.c / V, sets = kClusterGnThreads / lanes;
  const ClusterGnBwdSmem at =
      ClusterGnBwdSmem::of(kClusterGnThreads, g.held_rows, g.c, V, g.group_size, sizeof(X));
  const X* slice_x = reinterpret_cast<const X*>(dyn);
  const X* slice_dy = reinterpret_cast<const X*>(dyn + at.dy);
  auto* partial = reinterpret_cast<float2*>(dyn + at.partial);
  auto* chan = reinterpret_cast<float2*>(dyn + at.chan);
  auto* wchan = reinterpret_cast<float2*>(dyn + at.wchan);
  auto* moments = reinterpret_cast<float2*>(dyn + at.moments);
  auto* scaled = reinterpret_cast<float2*>(dyn + at.scaled);
  auto* meet = reinterpret_cast<Packed<float, K>*>(dyn + at.meet);
  auto* stats = reinterpret_cast<float2*>(dyn + at.stats);
  auto* terms = reinterpret_cast<float4*>(dyn + at.terms);
  auto* shift = reinterpret_cast<float*>(dyn + at.shift);
  auto* scale = reinterpret_cast<float*>(dyn + at.scale);

  const ClusterBlock me(g);
  const int64_t sample = me.n * g.rows * g.c, first = sample + me.first_row * g.c;
  const int tid = int(threadIdx.x), lane = tid % lanes, set = tid / lanes;
  const bool active = set < sets;
  const RowChunks chunks(me.held, me.rows, g.stage_rows);
  const size_t stage_elems = size_t(g.stage_rows) * g.c;
  // Thread 0: chunk j of x and dy into its stage.
  auto fill = [&](int j) {
    const int s = j % kClusterGnStages;
    int r0;
    const uint32_t bytes = chunks.bytes(j, uint32_t(g.c) * sizeof(X), r0);
    ring.fill(s, dyn + s * stage_elems * sizeof(X), x + first + size_t(r0) * g.c,
              dyn + at.dy + s * stage_elems * sizeof(X), dy + first + size_t(r0) * g.c, bytes,
              chunks.policy(j));
  };
  // The shifts (kOwn: the group's first value in the sample, as the
  // forward's; else its mean) go out ahead of the bulk copies.
  auto shift_of = [&](int k) {
    return kOwn ? to_acc(x[sample + int64_t(k) * g.group_size]) : mean[me.n * groups + k];
  };
  JAXNORM_GN_CLUSTER_STAMP(0);
  const float first_shift = tid < groups ? shift_of(tid) : 0.0f;
  A w[V];  // channels tid, tid + kClusterGnThreads, ... (c <= V kClusterGnThreads)
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int c = tid + i * kClusterGnThreads;
    w[i] = c < g.c ? p.template w<A>(c) : A(0);
  }
  ring.init();
  if (tid == 0) {
    for (int j = 0; j < kClusterGnStages; ++j) fill(j);
  }
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int c = tid + i * kClusterGnThreads;
    if (c < g.c) scale[c] = w[i];
  }
  for (int k = tid; k < groups; k += kClusterGnThreads) {
    shift[k] = k == tid ? first_shift : shift_of(k);
    if constexpr (!kOwn) {
      stats[k] = make_float2(shift[k], rsqrt_acc(var[me.n * groups + k] + A(g.epsilon)));
    }
  }
  __syncthreads();  // the mbarriers' initialization, the shifts and statistics
  JAXNORM_GN_CLUSTER_STAMP(1);

  // Per channel: the sums of d, d^2 (kOwn), dy and dy d, d = x - shift.
  A sh[V], s1[V], s2[V], sg[V], sgd[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    s1[e] = s2[e] = sg[e] = sgd[e] = A(0);
    const int k = active ? (lane * V + e) / g.group_size : 0;
    sh[e] = shift[k];
  }
  auto add = [&](const X* xa, const X* dya) {
    RegVec<X, V> xv, gv;
    xv.load_shared(reinterpret_cast<const uint4*>(xa));
    gv.load_shared(reinterpret_cast<const uint4*>(dya));
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const A d = xv.get(e) - sh[e], gd = gv.get(e);
      if constexpr (kOwn) {
        s1[e] += d;
        s2[e] = fmaf(d, d, s2[e]);
      }
      sg[e] += gd;
      sgd[e] = fmaf(gd, d, sgd[e]);
    }
  };
  const int streamed_chunks = chunks.laps * kClusterGnStages;
  for (int j = 0; j < streamed_chunks; ++j) {
    const int s = j % kClusterGnStages;
    int r0, r1;
    chunks.range(j, r0, r1);
    ring.wait(s);  // every thread, as group_norm_cluster_fwd's
    if (active) {
      for (int r = r0 + set; r < r1; r += sets) {
        const size_t off = s * stage_elems + size_t(r - r0) * g.c + lane * V;
        add(slice_x + off, slice_dy + off);
      }
    }
    ring.release(s);
    if (tid == 0 && j > 0) fill(j - 1 + kClusterGnStages);
  }
  if (tid == 0 && streamed_chunks > 0) fill(streamed_chunks - 1 + kClusterGnStages);
  // The held rows, in the ring's last lap.
  for (int s = 0, end = 0, r = set; end < me.held; ++s) {
    end = end + g.stage_rows < me.held ? end + g.stage_rows : me.held;
    ring.wait(s);
    if (!active) continue;
    for (; r < end; r += sets) add(slice_x + size_t(r) * g.c + lane * V,
                                   slice_dy + size_t(r) * g.c + lane * V);
  }

  // The block's sums: x's moments a group; dy and dy d a channel (chan),
  // and a group of those times the scale.
  if constexpr (kOwn) {
    block_group_sums<V>(partial, s1, s2, active, set, lane, sets, g.c, g.group_size, moments);
    __syncthreads();  // sum_groups' reads of partial, rewritten below
  }
  const int set_sums = lane_sums_set(g.c, V);
  if (active) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      partial[set * set_sums + e * lane_sums_stride(lanes) + lane] = make_float2(sg[e], sgd[e]);
    }
  }
  __syncthreads();
  for (int c = tid; c < g.c; c += kClusterGnThreads) {
    const float2* at_c = partial + lane_sums_at<V>(c, lanes);
    const float2 t = sum_items([&](int s, int) { return at_c[s * set_sums]; }, 1, sets, 0, 1);
    const A wc = scale[c];
    chan[c] = t;
    wchan[c] = make_float2(wc * t.x, wc * t.y);
  }
  __syncthreads();
  sum_groups([&](int k, int, int j) { return wchan[k * g.group_size + j]; }, 1, g.group_size,
             groups, scaled);
  __syncthreads();
  JAXNORM_GN_CLUSTER_STAMP(3);
  for (int k = tid; k < groups; k += kClusterGnThreads) {
    if constexpr (kOwn) {
      meet[k] = Packed<float, 4>{{moments[k].x, moments[k].y, scaled[k].x, scaled[k].y}};
    } else {
      meet[k] = Packed<float, 2>{{scaled[k].x, scaled[k].y}};
    }
  }
  // meet_groups' cluster barrier orders these writes before the other
  // blocks' reads; the block's own threads read them after it too.

  // Per group: the statistics and dx's means of g dy and g dy xhat.
  const A count = A(g.rows) * A(g.group_size);
  meet_groups<K>(meet, groups, ex, me.n, me.m, me.sub, [] {},
                 [&](int k, const Packed<float, K>& t) {
    A moved = 0, mu = shift[k], r = kOwn ? A(0) : stats[k].y;  // moved: mu less the shift
    const A sum_g = t.v[K - 2];
    A sum_gd = t.v[K - 1];
    if constexpr (kOwn) {
      moved = t.v[0] / count;
      const A v = fmaxf(t.v[1] / count - moved * moved, A(0));
      mu += moved, r = rsqrt_acc(v + A(g.epsilon));
      stats[k] = make_float2(mu, r);
      sum_gd -= moved * sum_g;  // about the mean
    }
    terms[k] = make_float4(sum_g / count, r * sum_gd / count, moved, 0.0f);
  });
  // dscale and dbias: the cluster's sums of a channel's, every parts-th
  // channel a block, in rank order.
  const bool grads = dscale || dbias;
  if (grads) {
    for (int c = int(me.rank) + tid * int(me.parts); c < g.c;
         c += kClusterGnThreads * int(me.parts)) {
      // Every block's loads in flight at once (one at a time, a round trip
      // each), added in rank order.
      const auto* mine = reinterpret_cast<const Packed<float, 2>*>(&chan[c]);
      Packed<float, 2> q[kMaxWideClusterParts], t{};
#pragma unroll
      for (int r = 0; r < kMaxWideClusterParts; ++r) {
        if (r < int(me.parts)) q[r] = load_cluster<2>(mine, uint32_t(r));
      }
#pragma unroll
      for (int r = 0; r < kMaxWideClusterParts; ++r) {
        if (r < int(me.parts)) add_to(t, q[r]);
      }
      const int k = c / g.group_size;
      const A moved = terms[k].z;  // sums about the shift, moved to the mean
      float* out = chan_out + ((me.n * me.m + me.sub) * g.c + c) * 2;
      out[0] = t.v[0], out[1] = stats[k].y * (t.v[1] - moved * t.v[0]);
    }
    __syncthreads();  // the block's part of chan_out, released to the grid
    if (tid == 0) count_in(ex.grid_arrived);
  }
  cluster_arrive_relaxed();  // this block's reads of the others' shared memory are done
  const bool leaves = me.m > 1 && tid == 0;
  const unsigned before = leaves ? atomicAdd(ex.departed + me.n, 1u) : 0u;

  GridGrads<W> grid(chan_out, int(gridDim.x / me.parts), g.c, ex.grid_arrived, gridDim.x);
  DxTerms k[V];
  X* out = dx + first + lane * V;
  auto dx_of = [&](const RegVec<X, V>& xv, const RegVec<X, V>& gv, A (&o)[V]) {
#pragma unroll
    for (int e = 0; e < V; ++e) o[e] = k[e].dx(xv.get(e), gv.get(e));
  };
  if (active) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int gk = (lane * V + e) / g.group_size;
      const float2 st = stats[gk];  // mean, rstd
      const float4 tm = terms[gk];  // mean_g, mean_gx
      const A k_x = -st.y * st.y * tm.y;
      k[e] = {st.y * scale[lane * V + e], k_x, -st.y * tm.x - k_x * st.x};
    }
    // Streamed rows first, while L2 holds them: their last reads and dx
    // evict-first.
    const X* x0 = x + first + lane * V;
    const X* dy0 = dy + first + lane * V;
    for_rows_loaded<kStreamPairLoads>(me.held + set, me.rows, sets, [&](int r) {
      RowPair<X, V> v;
      v.x.template load<true>(x0 + size_t(r) * g.c);
      v.dy.template load<true>(dy0 + size_t(r) * g.c);
      return v;
    }, [&](int r, const RowPair<X, V>& v) {
      A o[V];
      dx_of(v.x, v.dy, o);
      store_vec<V, true>(out + size_t(r) * g.c, o);
    });
  }
  if (grads) grid.start();
  if (active) {
    for (int r = set; r < me.held; r += sets) {
      RegVec<X, V> xv, gv;
      xv.load_shared(reinterpret_cast<const uint4*>(slice_x + size_t(r) * g.c + lane * V));
      gv.load_shared(reinterpret_cast<const uint4*>(slice_dy + size_t(r) * g.c + lane * V));
      A o[V];
      dx_of(xv, gv, o);
      store_vec<V>(out + size_t(r) * g.c, o);
    }
  }
  JAXNORM_GN_CLUSTER_STAMP(6);
  if (leaves) reset_if_last(before, me.m * me.parts, ex.arrived + me.n, ex.departed + me.n);
  if (grads) {
    grid.finish(dscale, dbias);
    __syncthreads();  // the block's warps are done waiting for the grid
    if (tid == 0) {
      reset_if_last(atomicAdd(ex.grid_departed, 1u), gridDim.x, ex.grid_arrived,
                    ex.grid_departed);
    }
  }
  cluster_wait();  // no block leaves while another may read its shared memory
  JAXNORM_GN_CLUSTER_STAMP(7);
}

// ClusterGnPlan's Op (cluster_shape) for the backward.
template <typename X, typename W, int V, bool kOwn>
struct ClusterGnBwd {
  static constexpr int kSums = kOwn ? 4 : 2;
  static size_t smem(int64_t held, int64_t c, int64_t group_size) {
    return ClusterGnBwdSmem::of(kClusterGnThreads, int(held), int(c), V, int(group_size),
                                sizeof(X))
        .total;
  }
  static size_t row_bytes(int64_t c) { return 2 * size_t(c) * sizeof(X); }  // x and dy
  static int resident(size_t smem, int parts, bool, const DeviceInfo& dev) {
    return resident_clusters(group_norm_cluster_bwd<X, W, V, kOwn>, kClusterGnThreads, smem,
                             parts, dev);
  }
};

// Runs `plan` (from plan_clusters<ClusterGnBwd<X, W, V, kOwn>>; x: n
// samples); `sums` and `counters` as cluster_gn_exchange (counters also
// where dscale or dbias is asked for: the grid meets); chan_out (n *
// clusters_per_sample * c * 2 floats) where dscale or dbias is.
template <typename X, typename W, int V, bool kOwn>
cudaError_t launch_cluster_gn_bwd(cudaStream_t stream, const ClusterGnPlan& plan, int64_t n,
                                  const X* x, const X* dy, ChannelParams<W> p,
                                  const float* mean, const float* var, void* sums,
                                  unsigned* counters, const DeviceInfo& dev, float* chan_out,
                                  W* dscale, W* dbias, X* dx) {
  const bool grads = dscale || dbias;
  if (grads && (chan_out == nullptr || counters == nullptr)) return cudaErrorInvalidValue;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t config = cluster_gn_config(plan, n, stream, attrs, grads);
  const cudaError_t err = cudaLaunchKernelEx(
      &config, group_norm_cluster_bwd<X, W, V, kOwn>, x, dy, p, mean, var, plan.args,
      cluster_gn_exchange(plan, sums, counters, dev), chan_out, dscale, dbias, dx);
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

}  // namespace jaxnorm::cuda
