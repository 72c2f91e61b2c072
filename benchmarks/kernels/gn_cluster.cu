// GroupNorm's forward in clusters (cpp/cuda/channel_norm_cluster.cuh) against
// the passes (tile_stats, group_stats, apply_affine) as the CUDA handler
// launches them: bf16 NHWC x with an offset (a large mean), float32 scale and
// bias, 32 groups (or, the "bn:" cases, BatchNorm's shapes as one sample of
// N*H*W rows, a group a channel); for each sample shape and batch size the
// cluster plan (blocks a cluster, clusters that run at once, the share of
// each block's rows held in shared memory), both forwards' time (CUDA graphs
// and events, as channel_probe.cu), and the cluster forward's y and
// statistics against the passes'. Each batch runs in every shape that fits
// with 16, 8, 4 or 2 blocks a cluster: one cluster a sample, and the fewest
// and the most clusters a sample that hold it and run at once; a batch that
// does not fit, in the plan of the most blocks that streams part of its rows.
// "plan" marks plan_cluster_gn's (none: the handler keeps the passes). Its
// rule was drawn from this table (notes v80, v86, v87).
// BWD=1: the backward instead, as under jax.grad with y dead (statistics
// computed, no activation): the cluster backward (channel_norm_cluster_bwd.cuh)
// against the passes (tile_moments_sums, group_sums, apply_dx), both with
// dscale and dbias; the differences are dx's, dscale's and dbias'.
//
// Build as channel_probe.cu (benchmarks/prebuild.sh).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

// STAMPS=1 (with ONLY): each block's thread 0 stamps the global timer at
// the kernel's phases (JAXNORM_GN_CLUSTER_STAMP in channel_norm_cluster.cuh
// and channel_norm_cluster_bwd.cuh) in one more launch, printed as quantiles
// over the blocks. The backward's "loaded+summed" is x's moments' (it takes
// the rows' sums on to the channels' after it), its "block sums" the
// block's scaled channel sums.
constexpr int kStamps = 8;
__device__ unsigned long long g_stamps[4096 * kStamps];
#define JAXNORM_GN_CLUSTER_STAMP(i)                                               \
  if (threadIdx.x == 0) {                                                         \
    unsigned long long t;                                                         \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));                        \
    if (blockIdx.x < 4096) g_stamps[blockIdx.x * kStamps + (i)] = t;              \
  }

#include "cuda/channel_norm_cluster_bwd.cuh"
#include "graph_timing.h"

using namespace jaxnorm::cuda;
using jaxnorm::Activation;
using bf16 = __nv_bfloat16;

struct Case {
  const char* sample;
  int64_t rows, c;
  std::vector<int64_t> batches;
  int64_t groups = 32;  // c: BatchNorm's, x (N*H*W, C) as one sample
};

// One more launch, its blocks' stamps as microseconds from the first block's
// start: min, median and max over the blocks for each phase.
template <typename F>
void print_stamps(cudaStream_t s, unsigned blocks, F launch) {
  launch();
  CHECK(cudaStreamSynchronize(s));
  std::vector<unsigned long long> t(size_t(blocks) * kStamps);
  CHECK(cudaMemcpyFromSymbol(t.data(), g_stamps, t.size() * sizeof(t[0])));
  unsigned long long t0 = ~0ull;
  for (unsigned b = 0; b < blocks; ++b) t0 = std::min(t0, t[b * kStamps]);
  const char* names[kStamps] = {"start",        "shifts",     "loaded+summed", "block sums",
                                "cluster sums", "statistics", "stores issued", "end"};
  for (int i = 0; i < kStamps; ++i) {
    std::vector<double> v(blocks);
    for (unsigned b = 0; b < blocks; ++b) v[b] = 1e-3 * double(t[b * kStamps + i] - t0);
    std::sort(v.begin(), v.end());
    std::printf("#   %-14s us: min %6.2f  median %6.2f  max %6.2f\n", names[i], v[0],
                v[blocks / 2], v[blocks - 1]);
  }
}

constexpr int V = 8;
using Fwd = ClusterGnFwd<bf16, bf16, float, V>;
using Bwd = ClusterGnBwd<bf16, float, V, true>;

// The plans of Op timed for a batch of n: with 16, 8, 4 or 2 blocks a
// cluster, one cluster a sample and the fewest and the most clusters a
// sample that hold it and run at once; where none holds it, the plan of the
// most blocks that streams part of its rows.
template <typename Op>
std::vector<ClusterGnPlan> plans_to_time(int64_t n, const Case& k, int64_t gs,
                                         const DeviceInfo& dev) {
  std::vector<ClusterGnPlan> shapes;
  for (int parts : {16, 8, 4, 2}) {
    ClusterGnPlan one, fewest, most;
    for (int m = 1; m * n <= dev.sms; ++m) {
      const ClusterGnPlan q = cluster_shape<Op, V>(n, k.rows, k.c, gs, parts, m, dev);
      if (q.parts == 0) continue;
      if (m == 1) one = q;
      if (m > 1 && fewest.parts == 0) fewest = q;
      most = q;
    }
    for (const ClusterGnPlan& q : {one, fewest, most}) {
      const bool seen = shapes.size() > 0 && shapes.back().parts == q.parts &&
                        shapes.back().args.clusters_per_sample == q.args.clusters_per_sample;
      if (q.parts > 0 && !seen) shapes.push_back(q);
    }
  }
  const ClusterGnPlan streamed = most_cluster_blocks<Op, V>(n, k.rows, k.c, gs, 1, true, dev);
  if (shapes.empty() && streamed.parts > 0) shapes.push_back(streamed);
  return shapes;
}

int main() {
  const std::vector<Case> cases = {{"32x32x1280", 32 * 32, 1280, {1, 2, 3, 4, 6, 8}},
                                   {"128x128x128", 128 * 128, 128, {2, 3, 4}},
                                   {"64x64x320", 64 * 64, 320, {2, 4, 8, 16}},
                                   {"32x32x640", 32 * 32, 640, {4, 8, 16, 32, 64}},
                                   {"16x16x1280", 16 * 16, 1280, {8, 16}},
                                   {"512x512x64", 512 * 512, 64, {1}},
                                   {"256x256x128", 256 * 256, 128, {1, 2}},
                                   // BatchNorm: N*H*W rows, a group a channel
                                   {"bn:256x56x56x64", 256 * 56 * 56, 64, {1}, 64},
                                   {"bn:128x56x56x64", 128 * 56 * 56, 64, {1}, 64},
                                   {"bn:128x28x28x256", 128 * 28 * 28, 256, {1}, 256},
                                   {"bn:64x28x28x256", 64 * 28 * 28, 256, {1}, 256},
                                   {"bn:32x28x28x256", 32 * 28 * 28, 256, {1}, 256},
                                   {"bn:64x14x14x1024", 64 * 14 * 14, 1024, {1}, 1024},
                                   {"bn:32x14x14x1024", 32 * 14 * 14, 1024, {1}, 1024},
                                   {"bn:64x7x7x2048", 64 * 7 * 7, 2048, {1}, 2048}};
  // ONLY=sample:n:parts:m[:held%] runs that shape alone (for STAMPS, or Nsight
  // Compute); held% where the plan streams.
  const char* only = std::getenv("ONLY");
  const bool bwd = std::getenv("BWD") != nullptr;
  const DeviceInfo& dev = device_info(0);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %d SMs, %s, %s. µs a call (median of 7 graphs of 20 calls); %% of copy: "
              "%s at the copy's rate\n",
              prop.name, dev.sms, utc_date().c_str(), bwd ? "backward" : "forward",
              bwd ? "x and dy read and dx written" : "x read and y written");
  std::printf("%-17s %4s %5s %5s %6s %6s %6s %8s %8s %8s %6s %6s %9s %9s %9s\n", "sample", "n",
              "parts", "m", "held%", "active", "copy", "passes", "cluster", "ratio", "p%", "c%",
              bwd ? "dx-diff" : "y-diff", bwd ? "ds-diff" : "mean-diff",
              bwd ? "db-diff" : "var-diff");
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  std::printf("# clusters of the kernel the GPU runs at once, by blocks a cluster, at 190 KB "
              "of shared memory a block:");
  for (int parts = 1; parts <= kMaxWideClusterParts; ++parts) {
    std::printf(" %d: %d", parts,
                resident_clusters(group_norm_cluster_fwd<bf16, bf16, float, V, false>,
                                  kClusterGnThreads, 190 << 10, parts, dev));
  }
  std::printf("\n");
  for (const Case& k : cases) {
    for (int64_t n : k.batches) {
      const std::string prefix = std::string(k.sample) + ":" + std::to_string(n) + ":";
      if (only && std::string(only).rfind(prefix, 0) != 0) continue;
      const int64_t elems = n * k.rows * k.c, groups = k.groups, gs = k.c / groups;
      const size_t bytes = size_t(elems) * sizeof(bf16);
      // BWD: y and y2 hold dx, mean and var dscale and dbias (the passes'
      // and the clusters').
      bf16 *x, *y, *y2, *dy;
      float *partial, *chan, *mean, *var, *mean2, *var2, *scale, *bias, *coef, *own;
      for (bf16** q : {&x, &y, &y2, &dy}) CHECK(cudaMalloc(q, bytes));
      // the passes' merges, or the backward's sums a sample and channel (2)
      // or a cluster and channel (2): the plans timed take up to dev.sms
      // clusters in all, more than kMaxClustersASample a sample
      const int64_t clusters = std::max<int64_t>(n * kMaxClustersASample, dev.sms);
      CHECK(cudaMalloc(&chan, clusters * k.c * 2 * sizeof(float)));
      for (float** q : {&coef, &own}) CHECK(cudaMalloc(q, n * k.c * 5 * sizeof(float)));
      for (float** q : {&mean, &var, &mean2, &var2}) {
        CHECK(cudaMalloc(q, std::max(n * groups, k.c) * sizeof(float)));
      }
      for (float** q : {&scale, &bias}) CHECK(cudaMalloc(q, k.c * sizeof(float)));
      fill<<<dev.sms * 8, 256, 0, s>>>(x, elems, 7u, 3.0f);
      fill<<<dev.sms * 8, 256, 0, s>>>(dy, elems, 11u, 0.0f);
      std::vector<float> hs(k.c), hb(k.c);
      for (int64_t i = 0; i < k.c; ++i) hs[i] = 0.5f + 0.001f * i, hb[i] = 0.01f * (i % 17);
      CHECK(cudaMemcpy(scale, hs.data(), k.c * 4, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(bias, hb.data(), k.c * 4, cudaMemcpyHostToDevice));
      const ChannelParams<float> p{scale, bias};

      const Tiles ts = plan_tiles(n, k.rows, k.c, V, sizeof(bf16), 3 * sizeof(float), dev,
                                  tile_stats<bf16, V>);
      const Tiles ta = plan_tiles(n, k.rows, k.c, V, sizeof(bf16), 0, dev,
                                  apply_affine<bf16, bf16, float, V>);
      // The backward's passes as channel_norm.cu's launch_bwd runs them (own
      // statistics, dx, dscale and dbias).
      const Tiles tm = plan_tiles(n, k.rows, k.c, V, 2 * sizeof(bf16), 5 * sizeof(float), dev,
                                  tile_moments_sums<bf16, bf16, V>);
      const Tiles tx = plan_tiles(n, k.rows, k.c, V, 2 * sizeof(bf16), 0, dev,
                                  apply_dx<bf16, bf16, float, V>);
      const int64_t tiles = std::max(ts.blocks() / ts.slabs * 3, tm.blocks() / tm.slabs * 5);
      CHECK(cudaMalloc(&partial, size_t(tiles) * k.c * sizeof(float)));
      const GroupChunks chunks = plan_group_chunks(n, k.c, gs, dev);
      const size_t smem3 = merge_smem_bytes<float>(chunks, 3);
      const size_t smem5 = merge_smem_bytes<float>(chunks, 5);
      auto passes = [&] {
        if (bwd) {
          const bool here = n == 1;  // group_sums writes dscale and dbias
          tile_moments_sums<bf16, bf16, V><<<tm.blocks(), kChannelThreads, 0, s>>>(x, dy, tm,
                                                                                 partial);
          group_sums<bf16, float><<<chunks.blocks(n), kChannelThreads, smem5, s>>>(
              partial, chan, p, nullptr, nullptr, nullptr, tm, chunks, 1e-5,
              GroupSumsMode{true, false, true, false, true}, nullptr, coef,
              here ? mean : nullptr, here ? var : nullptr, gs > 1 && smem5 == 0 ? own : nullptr);
          ParamGrads<float, float> grads;
          if (!here) grads = {chan, n, k.c, mean, var};
          apply_dx<bf16, bf16, float, V><<<tx.blocks(), kChannelThreads, 0, s>>>(
              x, dy, coef, Activation::kNone, tx, y, grads);
          return;
        }
        tile_stats<bf16, V><<<ts.blocks(), kChannelThreads, 0, s>>>(x, ts, partial);
        group_stats<bf16><<<chunks.blocks(n), kChannelThreads, smem3, s>>>(
            partial, smem3 ? nullptr : chan, ts, chunks, mean, var);
        apply_affine<bf16, bf16, float, V><<<ta.blocks(), kChannelThreads, 0, s>>>(
            x, mean, var, p, FastDiv(uint32_t(gs)), 1e-5, Activation::kNone, ta, y);
      };
      const float copy = time_us(s, [&] {
        CHECK(cudaMemcpyAsync(y2, x, bytes, cudaMemcpyDeviceToDevice, s));
      });
      passes();
      CHECK(cudaStreamSynchronize(s));
      CHECK(cudaGetLastError());
      const float t_passes = time_us(s, passes);
      const int64_t stats = bwd ? k.c : n * groups;  // values in mean and var
      const auto ya = to_host(y, elems, true);
      const auto ma = to_host(mean, stats, false), va = to_host(var, stats, false);
      // The backward moves 3 tensors (x, dy, dx) where the copy moves 2.
      auto pct = [&](float us) { return us > 0 ? (bwd ? 150.0 : 100.0) * copy / us : 0.0; };
      const ClusterGnPlan planned = bwd ? plan_clusters<Bwd, V>(n, k.rows, k.c, gs, dev)
                                        : plan_clusters<Fwd, V>(n, k.rows, k.c, gs, dev);
      const std::vector<ClusterGnPlan> shapes =
          bwd ? plans_to_time<Bwd>(n, k, gs, dev) : plans_to_time<Fwd>(n, k, gs, dev);
      std::printf("%-17s %4lld %5s %5s %6s %6s %6.1f %8.1f %8s %8s %5.0f%%  plan: parts %d m %d "
                  "held %d of %d\n",
                  k.sample, (long long)n, "-", "-", "-", "-", copy, t_passes, "-", "-",
                  pct(t_passes), planned.parts, planned.args.clusters_per_sample,
                  planned.args.held_rows, planned.args.rows_per_block);
      void* exchange = nullptr;
      CHECK(cudaMalloc(&exchange, size_t(n) * dev.sms * k.c * sizeof(float4)));
      unsigned* counters = meeting_counters(dev, s);
      for (ClusterGnPlan plan : shapes) {
        plan.args.epsilon = 1e-5;
        const int m = plan.args.clusters_per_sample;
        const int held = int(100.0 * plan.args.held_rows / plan.args.rows_per_block + 0.5);
        const std::string id = std::string(k.sample) + ":" + std::to_string(n) + ":" +
                               std::to_string(plan.parts) + ":" + std::to_string(m) +
                               (held < 100 ? ":" + std::to_string(held) : "");
        if (only && id != only) continue;
        // One call: the cluster kernel (BWD: with dscale in mean2, dbias in var2).
        auto launch = [&] {
          if (!bwd) {
            return launch_cluster_gn<bf16, bf16, float, V>(s, plan, n, x, p, exchange, counters,
                                                           dev, mean2, var2, y2);
          }
          return launch_cluster_gn_bwd<bf16, float, V, true>(
              s, plan, n, x, dy, p, nullptr, nullptr, exchange, counters, dev, chan, mean2, var2,
              y2);
        };
        auto cluster = [&] { CHECK(launch()); };
        RelativeError ey, em, ev;
        const int active = Bwd::resident(plan.smem, plan.parts, plan.streams(), dev) * bwd +
                           Fwd::resident(plan.smem, plan.parts, plan.streams(), dev) * !bwd;
        CHECK(cudaMemset(y2, 0, bytes));
        const cudaError_t err = launch();
        if (err != cudaSuccess) {
          std::printf("%-17s %4lld %5d %5d launch failed: %s\n", k.sample, (long long)n,
                      plan.parts, m, cudaGetErrorString(err));
          continue;
        }
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaGetLastError());
        const auto yb = to_host(y2, elems, true);
        for (int64_t i = 0; i < elems; ++i) ey.add(yb[i], ya[i]);
        const auto mb = to_host(mean2, stats, false), vb = to_host(var2, stats, false);
        for (int64_t i = 0; i < stats; ++i) em.add(mb[i], ma[i]), ev.add(vb[i], va[i]);
        const float t_cluster = time_us(s, cluster);
        const bool is_plan = plan.parts == planned.parts &&
                             m == planned.args.clusters_per_sample &&
                             plan.args.held_rows == planned.args.held_rows;
        if (only && std::getenv("STAMPS")) print_stamps(s, unsigned(plan.blocks(n)), cluster);
        std::printf("%-17s %4lld %5d %5d %6d %6d %6.1f %8.1f %8.1f %8.2f %5.0f%% %5.0f%% %9.1e "
                    "%9.1e %9.1e%s  %s\n",
                    k.sample, (long long)n, plan.parts, m, held, active, copy, t_passes, t_cluster,
                    t_passes / t_cluster, pct(t_passes), pct(t_cluster), ey.value(),
                    em.value(), ev.value(), is_plan ? "  plan" : "", id.c_str());
      }
      CHECK(cudaFree(exchange));
      for (bf16* q : {x, y, y2, dy}) CHECK(cudaFree(q));
      for (float* q : {partial, chan, mean, var, mean2, var2, scale, bias, coef, own}) {
        CHECK(cudaFree(q));
      }
    }
  }
  return 0;
}
