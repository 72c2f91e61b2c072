// GroupNorm's forward in clusters (cpp/cuda/channel_norm_cluster.cuh) against
// the passes (tile_stats, group_stats, apply_affine) as the CUDA handler
// launches them: bf16 NHWC x with an offset (a large mean), float32 scale and
// bias, 32 groups; for each sample shape and batch size the cluster plan
// (blocks a cluster, clusters that run at once), both forwards' time
// (CUDA graphs and events, as channel_probe.cu), and the cluster forward's y
// and statistics against the passes' (parts 0: the handler keeps the passes).
// The plan's rule (plan_cluster_gn) was drawn from this table with every
// batch planned (notes v80).
//
// Build as channel_probe.cu (benchmarks/prebuild.sh).
#include <cstdio>
#include <vector>

#include "cuda/channel_norm_cluster.cuh"
#include "graph_timing.h"

using namespace jaxnorm::cuda;
using jaxnorm::Activation;
using bf16 = __nv_bfloat16;

struct Case {
  const char* sample;
  int64_t rows, c;
  std::vector<int64_t> batches;
};

int main() {
  const std::vector<Case> cases = {{"32x32x1280", 32 * 32, 1280, {1, 2, 4, 6, 8}},
                                   {"64x64x320", 64 * 64, 320, {4, 16}},
                                   {"32x32x640", 32 * 32, 640, {4, 8, 16}},
                                   {"16x16x1280", 16 * 16, 1280, {8, 16, 64}}};
  constexpr int V = 8, kGroups = 32;
  const DeviceInfo& dev = device_info(0);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %d SMs, %s. µs a call (median of 7 graphs of 20 calls); %% of copy: "
              "x read and y written at the copy's rate\n",
              prop.name, dev.sms, utc_date().c_str());
  std::printf("%-12s %4s %5s %6s %6s %8s %8s %8s %6s %6s %9s %9s %9s\n", "sample", "n",
              "parts", "active", "copy", "passes", "cluster", "ratio", "p%", "c%",
              "y-diff", "mean-diff", "var-diff");
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  std::printf("# clusters of the kernel the GPU runs at once, by blocks a cluster, at 190 KB "
              "of shared memory a block:");
  for (int parts = 1; parts <= kMaxWideClusterParts; ++parts) {
    std::printf(" %d: %d", parts,
                resident_clusters(group_norm_cluster_fwd<bf16, bf16, float, V>,
                                  kClusterGnThreads, 190 << 10, parts, dev));
  }
  std::printf("\n");
  for (const Case& k : cases) {
    for (int64_t n : k.batches) {
      const int64_t elems = n * k.rows * k.c, gs = k.c / kGroups;
      const size_t bytes = size_t(elems) * sizeof(bf16);
      bf16 *x, *y, *y2;
      float *partial, *chan, *mean, *var, *mean2, *var2, *scale, *bias;
      for (bf16** q : {&x, &y, &y2}) CHECK(cudaMalloc(q, bytes));
      CHECK(cudaMalloc(&partial, size_t(dev.sms) * 8 * k.c * 3 * sizeof(float)));
      CHECK(cudaMalloc(&chan, n * k.c * 3 * sizeof(float)));
      for (float** q : {&mean, &var, &mean2, &var2}) {
        CHECK(cudaMalloc(q, n * kGroups * sizeof(float)));
      }
      for (float** q : {&scale, &bias}) CHECK(cudaMalloc(q, k.c * sizeof(float)));
      fill<<<dev.sms * 8, 256, 0, s>>>(x, elems, 7u, 3.0f);
      std::vector<float> hs(k.c), hb(k.c);
      for (int64_t i = 0; i < k.c; ++i) hs[i] = 0.5f + 0.001f * i, hb[i] = 0.01f * (i % 17);
      CHECK(cudaMemcpy(scale, hs.data(), k.c * 4, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(bias, hb.data(), k.c * 4, cudaMemcpyHostToDevice));
      const ChannelParams<float> p{scale, bias};

      const Tiles ts = plan_tiles(n, k.rows, k.c, V, sizeof(bf16), 3 * sizeof(float), dev,
                                  tile_stats<bf16, V>);
      const Tiles ta = plan_tiles(n, k.rows, k.c, V, sizeof(bf16), 0, dev,
                                  apply_affine<bf16, bf16, float, V>);
      const GroupChunks chunks = plan_group_chunks(n, k.c, gs, dev);
      const size_t smem3 = merge_smem_bytes<float>(chunks, 3);
      auto passes = [&] {
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
      const auto ya = to_host(y, elems, true);
      const auto ma = to_host(mean, n * kGroups, false), va = to_host(var, n * kGroups, false);
      auto pct = [&](float us) { return us > 0 ? 100.0 * copy / us : 0.0; };
      ClusterGnPlan plan = plan_cluster_gn<bf16, bf16, float, V>(n, k.rows, k.c, gs, dev);
      plan.args.epsilon = 1e-5;
      auto cluster = [&] {
        CHECK((launch_cluster_gn<bf16, bf16, float, V>(s, plan, n, x, p, mean2, var2, y2)));
      };
      float t_cluster = 0;
      RelativeError ey, em, ev;
      const int active =
          plan.parts > 0 ? resident_clusters(group_norm_cluster_fwd<bf16, bf16, float, V>,
                                             kClusterGnThreads, plan.smem, plan.parts, dev)
                         : 0;
      if (plan.parts > 0) {
        CHECK(cudaMemset(y2, 0, bytes));
        cluster();
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaGetLastError());
        const auto yb = to_host(y2, elems, true);
        for (int64_t i = 0; i < elems; ++i) ey.add(yb[i], ya[i]);
        const auto mb = to_host(mean2, n * kGroups, false);
        const auto vb = to_host(var2, n * kGroups, false);
        for (int64_t i = 0; i < n * kGroups; ++i) em.add(mb[i], ma[i]), ev.add(vb[i], va[i]);
        t_cluster = time_us(s, cluster);
      }
      std::printf("%-12s %4lld %5d %6d %6.1f %8.1f %8.1f %8.2f %5.0f%% %5.0f%% %9.1e %9.1e "
                  "%9.1e\n",
                  k.sample, (long long)n, plan.parts, active, copy, t_passes, t_cluster,
                  t_cluster > 0 ? t_passes / t_cluster : 0.0, pct(t_passes), pct(t_cluster),
                  ey.value(), em.value(), ev.value());
      for (bf16* q : {x, y, y2}) CHECK(cudaFree(q));
      for (float* q : {partial, chan, mean, var, mean2, var2, scale, bias}) CHECK(cudaFree(q));
    }
  }
  return 0;
}
