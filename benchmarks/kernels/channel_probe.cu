// GroupNorm's kernels (cpp/cuda/channel_norm_kernels.cuh) launched as the
// CUDA handlers launch them (channel_norm.cu: the forward computing its
// statistics, the backward computing them, mode "full" with dscale/dbias),
// bf16 NHWC x and dy, float32 scale and bias, 32 groups, on the benchmark's
// GroupNorm shapes: each kernel timed alone and each direction's launches
// together (CUDA graphs and events), against a device-to-device copy and a
// read-only pass of x (and of 1/16 of it, and an empty kernel: what a
// launch costs), with trial forms of tile_stats beside it (notes v76, v78).
// With PROBE=1 each timed sequence runs three times
// instead, for a profiler:
//
//   PROBE=1 PROBE_SHAPE=8x32x32x1280 ncu --set full ./channel_probe
//
// Build as channel_plans.cu (benchmarks/prebuild.sh).
#include <cstdio>
#include <vector>

#include "cuda/channel_norm_kernels.cuh"
#include "graph_timing.h"

using namespace jaxnorm::cuda;
using jaxnorm::Activation;
using bf16 = __nv_bfloat16;

// Trial: tile_stats with its row sets merged in one step instead of a tree
// (log2 R levels, two barriers each): every thread's (count, mean, M2) into
// shared memory, one barrier, then a thread per (lane, channel) of the block
// merges the R sets in order (kSplit false). With kSplit the block's spare
// threads share that: each (lane, channel) takes 256 / (its lanes' channels)
// threads (at most R), each merging a run of consecutive sets in order, and
// the first of them merges the runs' results in order after one more
// barrier: a chain of R / splits + splits merges in place of R (notes v78).
template <int V, bool kSplit, int kR = 8>
__global__ void __launch_bounds__(kChannelThreads, 2)
    tile_stats_one_merge(const bf16* x, Tiles t, float* partial) {
  using A = float;
  using Vec = RegVec<bf16, V>;
  __shared__ A shared[kChannelThreads * V * 3];
  const TileThread me(t, Sweep::kDown);
  A m[V][2];
#pragma unroll
  for (int e = 0; e < V; ++e) m[e][0] = m[e][1] = A(0);
  A count = 0;
  me.for_batches<V, kR>(t, [] {}, [&](int64_t, int got, const auto& a, const auto&) {
    if (got == kR) {
      add_batch<true, kR>(m, count, a, got);
    } else {
      add_batch<false, kR>(m, count, a, got);
    }
    count += A(got);
  }, x);
  const int tid = int(threadIdx.x);
#pragma unroll
  for (int e = 0; e < V; ++e) {
    shared[(e * 3) * kChannelThreads + tid] = count;
    shared[(e * 3 + 1) * kChannelThreads + tid] = m[e][0];
    shared[(e * 3 + 2) * kChannelThreads + tid] = m[e][1];
  }
  __syncthreads();
  const int items = t.lanes_per_block * V;
  const int64_t slab = (int64_t(blockIdx.x) / t.tiles) % t.slabs;
  const int room = kChannelThreads / items;  // threads a (lane, channel), at least 1
  const int splits = !kSplit ? 1 : room < t.row_sets ? room : t.row_sets;
  const int run = (t.row_sets + splits - 1) / splits;  // sets a split
  const int item = tid % items, split = tid / items;
  const int local = item % t.lanes_per_block, e = item / t.lanes_per_block;
  const int64_t lane = slab * t.lanes_per_block + local;
  A out[3] = {0, 0, 0};
  if (split < splits) {
    const int end = (split + 1) * run < t.row_sets ? (split + 1) * run : t.row_sets;
    for (int set = split * run; set < end; ++set) {
      const int from = set * t.lanes_per_block + local;
      const A in[3] = {shared[(e * 3) * kChannelThreads + from],
                       shared[(e * 3 + 1) * kChannelThreads + from],
                       shared[(e * 3 + 2) * kChannelThreads + from]};
      combine<3>(out, in);
    }
  }
  if (splits > 1) {
    __syncthreads();  // every run read before the slots are reused
    if (split < splits) {
#pragma unroll
      for (int k = 0; k < 3; ++k) shared[k * kChannelThreads + tid] = out[k];
    }
    __syncthreads();
    if (split == 0) {
      for (int r = 1; r < splits; ++r) {
        const int from = r * items + item;
        const A in[3] = {shared[from], shared[kChannelThreads + from],
                         shared[2 * kChannelThreads + from]};
        combine<3>(out, in);
      }
    }
  }
  if (split != 0 || lane >= t.lanes) return;
  A* dst = partial + ((me.n * t.tiles + me.tile) * t.c + lane * V + e) * 3;
  dst[0] = out[0], dst[1] = out[1], dst[2] = out[2];
}

__global__ void empty_kernel() {}

struct Shape {
  const char* name;
  int64_t n, rows, c, groups;
};

int main() {
  const std::vector<Shape> shapes = {{"16x64x64x320", 16, 64 * 64, 320, 32},
                                     {"8x32x32x1280", 8, 32 * 32, 1280, 32},
                                     {"4x128x128x128", 4, 128 * 128, 128, 32},
                                     {"1x512x512x64", 1, 512 * 512, 64, 32}};
  constexpr int V = 8;
  const DeviceInfo& dev = device_info(0);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %d SMs, %s. µs a call (median of 7 graphs of 20 calls); GB/s: the "
              "bytes a kernel must move (x read; x read and y written; ...)\n",
              prop.name, dev.sms, utc_date().c_str());
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  const char* only = std::getenv("PROBE_SHAPE");  // one shape's name, for a profiler
  for (const Shape& k : shapes) {
    if (only && std::string(only) != k.name) continue;
    const int64_t elems = k.n * k.rows * k.c, gs = k.c / k.groups;
    const size_t bytes = size_t(elems) * sizeof(bf16);
    bf16 *x, *dy, *y, *dx;
    float *partial, *chan, *own, *coef, *mean, *var, *scale, *bias;
    uint4* sink;
    for (bf16** p : {&x, &dy, &y, &dx}) CHECK(cudaMalloc(p, bytes));
    const size_t wave = size_t(dev.sms) * 8 * k.c * 5;  // per-tile results, ample
    for (float** p : {&partial}) CHECK(cudaMalloc(p, wave * sizeof(float)));
    for (float** p : {&chan, &own, &coef}) CHECK(cudaMalloc(p, k.n * k.c * 5 * sizeof(float)));
    for (float** p : {&mean, &var}) CHECK(cudaMalloc(p, k.n * k.groups * sizeof(float)));
    for (float** p : {&scale, &bias}) CHECK(cudaMalloc(p, k.c * sizeof(float)));
    float *dscale, *dbias;
    CHECK(cudaMalloc(&dscale, k.c * sizeof(float)));
    CHECK(cudaMalloc(&dbias, k.c * sizeof(float)));
    CHECK(cudaMalloc(&sink, 16));
    fill<<<dev.sms * 8, 256, 0, s>>>(x, elems, 7u, 0.5f);
    fill<<<dev.sms * 8, 256, 0, s>>>(dy, elems, 9u, 0.0f);
    std::vector<float> ones(k.c, 1.0f);
    CHECK(cudaMemcpy(scale, ones.data(), k.c * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemset(bias, 0, k.c * sizeof(float)));
    const ChannelParams<float> p{scale, bias};

    const Tiles ts = plan_tiles(k.n, k.rows, k.c, V, sizeof(bf16), 3 * sizeof(float), dev,
                                tile_stats<bf16, V>);
    const Tiles ta = plan_tiles(k.n, k.rows, k.c, V, sizeof(bf16), 0, dev,
                                apply_affine<bf16, bf16, float, V>);
    const Tiles tm = plan_tiles(k.n, k.rows, k.c, V, 2 * sizeof(bf16), 5 * sizeof(float), dev,
                                tile_moments_sums<bf16, bf16, V>);
    const Tiles tx = plan_tiles(k.n, k.rows, k.c, V, 2 * sizeof(bf16), 0, dev,
                                apply_dx<bf16, bf16, float, V>);
    const GroupChunks chunks = plan_group_chunks(k.n, k.c, gs, dev);
    const int64_t gblocks = chunks.blocks(k.n);
    // The merges' buffers in shared memory where they fit (null chan, own).
    const size_t smem3 = merge_smem_bytes<float>(chunks, 3);
    const size_t smem5 = merge_smem_bytes<float>(chunks, 5);
    const GroupSumsMode full{true, false, true, false, true};
    ParamGrads<float, float> grads;
    if (k.n > 1) grads = {chan, k.n, k.c, dscale, dbias};
    float* ds = k.n > 1 ? nullptr : dscale;
    float* db = k.n > 1 ? nullptr : dbias;

    auto stats = [&] {
      tile_stats<bf16, V><<<ts.blocks(), kChannelThreads, 0, s>>>(x, ts, partial);
    };
    auto merge = [&] {
      group_stats<bf16><<<gblocks, kChannelThreads, smem3, s>>>(partial, smem3 ? nullptr : chan,
                                                               ts, chunks, mean, var);
    };
    auto apply = [&] {
      apply_affine<bf16, bf16, float, V><<<ta.blocks(), kChannelThreads, 0, s>>>(
          x, mean, var, p, FastDiv(uint32_t(gs)), 1e-5, Activation::kNone, ta, y);
    };
    auto moments = [&] {
      tile_moments_sums<bf16, bf16, V><<<tm.blocks(), kChannelThreads, 0, s>>>(x, dy, tm, partial);
    };
    auto sums = [&] {
      group_sums<bf16, float><<<gblocks, kChannelThreads, smem5, s>>>(
          partial, chan, p, mean, var, nullptr, tm, chunks, 1e-5, full, nullptr, coef, ds, db,
          smem5 ? nullptr : own);
    };
    auto dx_pass = [&] {
      apply_dx<bf16, bf16, float, V><<<tx.blocks(), kChannelThreads, 0, s>>>(
          x, dy, coef, Activation::kNone, tx, dx, grads);
    };
    // Valid inputs for each kernel timed alone.
    stats(), merge(), moments(), sums();
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaGetLastError());

    const float copy = time_us(s, [&] {
      CHECK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice, s));
    });
    const float read = time_us(s, [&] {
      read_only<<<dev.sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(x),
                                              int64_t(bytes / 16), sink);
    });
    auto rate = [&](double moved, float us) { return moved / us / 1e3; };
    std::printf("\n%s (x %.1f MB; %lld groups a merge block, %lld blocks): copy %.1f µs "
                "(%.0f GB/s), read %.1f µs (%.0f GB/s)\n",
                k.name, bytes / 1e6, (long long)chunks.per, (long long)gblocks, copy,
                rate(2.0 * bytes, copy), read, rate(bytes, read));
    auto row = [&](const char* name, const Tiles* t, double moved, auto&& launch) {
      const float us = time_us(s, launch);
      CHECK(cudaGetLastError());
      std::printf("  %-22s %6.1f µs", name, us);
      if (moved > 0) std::printf(" %5.0f GB/s", rate(moved, us));
      if (t) std::printf("  (%lld blocks, %lld chunks of %d rows a tile)", (long long)t->blocks(),
                         (long long)((t->chunks() + t->tiles - 1) / t->tiles), t->row_sets);
      std::printf("\n");
    };
    row("tile_stats", &ts, bytes, stats);
    // the trials, their results against tile_stats' (a different merge order)
    const size_t np = size_t(ts.blocks() / ts.slabs) * k.c * 3;
    stats();
    const std::vector<float> want = to_host(partial, np, false);
    auto trial = [&](const char* name, auto launch) {
      row(name, &ts, bytes, launch);
      CHECK(cudaStreamSynchronize(s));
      const std::vector<float> got = to_host(partial, np, false);
      RelativeError mean_err, m2_err;
      for (size_t i = 0; i < np; i += 3) {
        if (got[i] != want[i]) mean_err.add(INFINITY, 1);  // counts must agree
        mean_err.add(got[i + 1], want[i + 1]);
        m2_err.add(got[i + 2], want[i + 2]);
      }
      std::printf("  (against the tree: mean %.1e, M2 %.1e relative)\n", mean_err.value(),
                  m2_err.value());
    };
    trial("tile_stats one merge", [&] {
      tile_stats_one_merge<V, false><<<ts.blocks(), kChannelThreads, 0, s>>>(x, ts, partial);
    });
    trial("tile_stats split merge", [&] {
      tile_stats_one_merge<V, true><<<ts.blocks(), kChannelThreads, 0, s>>>(x, ts, partial);
    });
    stats(), merge();  // the tree's, for the kernels after
    row("empty kernel", nullptr, 0, [&] { empty_kernel<<<1, 32, 0, s>>>(); });
    row("read_only rows/16", nullptr, bytes / 16.0, [&] {
      read_only<<<dev.sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(x),
                                              int64_t(bytes / 256), sink);
    });
    row("group_stats", nullptr, 0, merge);
    row("apply_affine", &ta, 2.0 * bytes, apply);
    row("forward", nullptr, 2.0 * bytes, [&] { stats(), merge(), apply(); });
    row("tile_moments_sums", &tm, 2.0 * bytes, moments);
    row("group_sums", nullptr, 0, sums);
    row("apply_dx", &tx, 3.0 * bytes, dx_pass);
    row("backward", nullptr, 3.0 * bytes, [&] { moments(), sums(), dx_pass(); });
    // The passes over fewer rows of each sample (their own plans): what a
    // launch costs beyond its bytes is the intercept of time against rows.
    for (int64_t part : {16, 4, 2}) {
      const int64_t rows = k.rows / part;
      const double moved = double(bytes) / part;
      const Tiles ps = plan_tiles(k.n, rows, k.c, V, sizeof(bf16), 3 * sizeof(float), dev,
                                  tile_stats<bf16, V>);
      const Tiles pa = plan_tiles(k.n, rows, k.c, V, sizeof(bf16), 0, dev,
                                  apply_affine<bf16, bf16, float, V>);
      char name[64];
      std::snprintf(name, sizeof name, "tile_stats rows/%lld", (long long)part);
      row(name, &ps, moved, [&] {
        tile_stats<bf16, V><<<ps.blocks(), kChannelThreads, 0, s>>>(x, ps, partial);
      });
      std::snprintf(name, sizeof name, "apply_affine rows/%lld", (long long)part);
      row(name, &pa, 2 * moved, [&] {
        apply_affine<bf16, bf16, float, V><<<pa.blocks(), kChannelThreads, 0, s>>>(
            x, mean, var, p, FastDiv(uint32_t(gs)), 1e-5, Activation::kNone, pa, y);
      });
    }
    for (bf16* q : {x, dy, y, dx}) CHECK(cudaFree(q));
    for (float* q : {partial, chan, own, coef, mean, var, scale, bias, dscale, dbias}) {
      CHECK(cudaFree(q));
    }
    CHECK(cudaFree(sink));
  }
  return 0;
}
