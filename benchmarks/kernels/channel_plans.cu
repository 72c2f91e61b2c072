// Times the channel norms' statistics pass (tile_stats in
// cpp/cuda/channel_norm_kernels.cuh) in several forms, bf16 NHWC on the
// benchmark's GroupNorm and BatchNorm shapes, straight from C++ with CUDA
// graphs and events, against two ceilings: a device-to-device copy and a
// read-only pass (each thread 8 vectors in flight). Forms: kR rows a batch
// and the blocks an SM the launch bounds ask for (r6-3: 6 rows, 3 blocks;
// r8-2 is the handlers' choice). Each form's
// statistics are checked against a float64 host reference (every (n,
// channel)). Then the forward's elementwise pass after it, apply_affine, with
// x's last read and y's stores evict-first (ef) or not (wb). Last, the pair
// (statistics, then apply_affine) as a forward runs it, after 256 MB of
// writes elsewhere (as after other kernels: L2 full of dirty lines; the
// writes' own time subtracted): over all of x at once, and a chunk of
// samples at a time (x's bytes of a chunk at most 8, 16 or 24 MB), so that
// the second read of a chunk may come from L2.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp \
//        -isystem $(python -c "import jax; print(jax.ffi.include_dir())") \
//        benchmarks/kernels/channel_plans.cu -o channel_plans && ./channel_plans
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/channel_norm_kernels.cuh"
#include "graph_timing.h"

using namespace jaxnorm::cuda;
using jaxnorm::Activation;
using bf16 = __nv_bfloat16;

struct Case {
  const char* name;
  int64_t n, rows, c;  // x as (N, A, C): GroupNorm per sample, BatchNorm over all rows
};

// One form of tile_stats: its name and kernel.
struct Form {
  const char* name;
  void (*kernel)(const bf16*, Tiles, float*);
};

// The largest relative error of the forms' statistics against float64, per
// (n, channel): |mean - ref| / ref std and |var - ref| / ref var.
double check_stats(const Case& k, const Tiles& t, const std::vector<float>& partial,
                   const std::vector<double>& ref) {
  double worst = 0;
  for (int64_t n = 0; n < k.n; ++n) {
    for (int64_t c = 0; c < k.c; ++c) {
      double count = 0, mean = 0, m2 = 0;
      for (int64_t tile = 0; tile < t.tiles; ++tile) {
        const float* p = &partial[((n * t.tiles + tile) * k.c + c) * 3];
        const double cb = p[0], mb = p[1], m2b = p[2];
        if (cb == 0) continue;
        const double total = count + cb, delta = mb - mean;
        mean += delta * cb / total;
        m2 += m2b + delta * delta * count * cb / total;
        count = total;
      }
      const double rm = ref[(n * k.c + c) * 2], rv = ref[(n * k.c + c) * 2 + 1];
      worst = std::max(worst, std::abs(mean - rm) / std::sqrt(rv));
      worst = std::max(worst, std::abs(m2 / count - rv) / rv);
      if (count != double(k.rows)) return INFINITY;
    }
  }
  return worst;
}

int main() {
  const std::vector<Case> cases = {
      {"gn 16x64x64x320", 16, 64 * 64, 320},  {"gn 8x32x32x1280", 8, 32 * 32, 1280},
      {"gn 4x128x128x128", 4, 128 * 128, 128}, {"gn 1x512x512x64", 1, 512 * 512, 64},
      {"bn 256x56x56x64", 1, 256 * 56 * 56, 64}, {"bn 128x28x28x256", 1, 128 * 28 * 28, 256},
      {"bn 64x14x14x1024", 1, 64 * 14 * 14, 1024},
  };
  const std::vector<Form> forms = {
      {"r6-3", tile_stats<bf16, 8, 6, 3>}, {"r4-3", tile_stats<bf16, 8, 4, 3>},
      {"r8-3", tile_stats<bf16, 8, 8, 3>}, {"r8-2", tile_stats<bf16, 8, 8, 2>},
      {"r4-4", tile_stats<bf16, 8, 4, 4>}, {"r6-2", tile_stats<bf16, 8, 6, 2>},
      {"r8-2up", tile_stats<bf16, 8, 8, 2, Sweep::kUp>},
  };
  int dev = 0;
  CHECK(cudaSetDevice(dev));
  const DeviceInfo& info = device_info(dev);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("%s, %d SMs; µs a call (GB/s of x's bytes read; apply: read + write)\n",
              prop.name, info.sms);
  for (const Form& f : forms) {
    cudaFuncAttributes attr;
    CHECK(cudaFuncGetAttributes(&attr, f.kernel));
    int blocks = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, f.kernel, kChannelThreads, 0));
    std::printf("form %-6s %3d registers, %3zu bytes local, %d blocks an SM\n", f.name,
                attr.numRegs, size_t(attr.localSizeBytes), blocks);
  }
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  for (const Case& k : cases) {
    const int64_t elems = k.n * k.rows * k.c;
    const size_t bytes = size_t(elems) * sizeof(bf16);
    bf16 *x, *y;
    float *partial, *moments;  // a mean and a variance for each (n, channel)
    uint4* sink;
    CHECK(cudaMalloc(&x, bytes));
    CHECK(cudaMalloc(&y, bytes));
    CHECK(cudaMalloc(&sink, 16));
    CHECK(cudaMalloc(&partial, size_t(info.sms) * 8 * k.c * 3 * sizeof(float) * 4));
    CHECK(cudaMalloc(&moments, size_t(k.n) * k.c * 2 * sizeof(float)));
    fill<<<info.sms * 8, 256, 0, s>>>(x, elems, 7u, 0.5f);
    std::vector<float> halves(size_t(k.n) * k.c * 2, 0.5f);
    CHECK(cudaMemcpy(moments, halves.data(), halves.size() * sizeof(float),
                     cudaMemcpyHostToDevice));
    float* const mean = moments;
    float* const var = moments + k.n * k.c;
    // An apply_affine launch from sample n0 on: one group a channel, no
    // scale or bias.
    auto launch_apply = [&](auto kernel, const Tiles& tt, int64_t n0, const bf16* xs, bf16* ys) {
      kernel<<<tt.blocks(), kChannelThreads, 0, s>>>(xs, mean + n0 * k.c, var + n0 * k.c,
                                                     ChannelParams<float>{nullptr, nullptr},
                                                     FastDiv(1), 1e-5, Activation::kNone, tt, ys);
    };
    CHECK(cudaStreamSynchronize(s));

    // float64 reference: per (n, channel) mean and variance.
    std::vector<bf16> hx(elems);
    CHECK(cudaMemcpy(hx.data(), x, bytes, cudaMemcpyDeviceToHost));
    std::vector<double> ref(size_t(k.n) * k.c * 2, 0.0);
    for (int64_t n = 0; n < k.n; ++n) {
      std::vector<double> sum(k.c, 0.0), sq(k.c, 0.0);
      for (int64_t r = 0; r < k.rows; ++r) {
        const bf16* row = &hx[(n * k.rows + r) * k.c];
        for (int64_t c = 0; c < k.c; ++c) sum[c] += double(__bfloat162float(row[c]));
      }
      for (int64_t c = 0; c < k.c; ++c) sum[c] /= double(k.rows);
      for (int64_t r = 0; r < k.rows; ++r) {
        const bf16* row = &hx[(n * k.rows + r) * k.c];
        for (int64_t c = 0; c < k.c; ++c) {
          const double d = double(__bfloat162float(row[c])) - sum[c];
          sq[c] += d * d;
        }
      }
      for (int64_t c = 0; c < k.c; ++c) {
        ref[(n * k.c + c) * 2] = sum[c], ref[(n * k.c + c) * 2 + 1] = sq[c] / double(k.rows);
      }
    }

    const float copy = time_us(s, [&] {
      CHECK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice, s));
    });
    const float read = time_us(s, [&] {
      read_only<<<info.sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(x),
                                                 int64_t(bytes / 16), sink);
    });
    std::printf("\n%s (%.1f MB): copy %.1f µs (%.0f GB/s), read %.1f µs (%.0f GB/s)\n", k.name,
                bytes / 1e6, copy, 2 * bytes / copy / 1e3, read, bytes / read / 1e3);
    for (const Form& f : forms) {
      const Tiles t = plan_tiles(k.n, k.rows, k.c, 8, sizeof(bf16), 3 * sizeof(float), info,
                                 f.kernel);
      const float us = time_us(s, [&] {
        f.kernel<<<t.blocks(), kChannelThreads, 0, s>>>(x, t, partial);
      });
      CHECK(cudaGetLastError());
      std::vector<float> hp(size_t(t.blocks() / t.slabs) * k.c * 3);
      CHECK(cudaMemcpy(hp.data(), partial, hp.size() * sizeof(float), cudaMemcpyDeviceToHost));
      const double err = check_stats(k, t, hp, ref);
      std::printf("  stats %-6s %6.1f µs %5.0f GB/s  (%lld blocks, %lld chunks a tile) err %.1e%s\n",
                  f.name, us, bytes / us / 1e3, (long long)t.blocks(),
                  (long long)((t.chunks() + t.tiles - 1) / t.tiles), err,
                  err < 1e-4 ? "" : "  WRONG");
    }
    auto stats = tile_stats<bf16, 8>;
    const Tiles ts = plan_tiles(k.n, k.rows, k.c, 8, sizeof(bf16), 3 * sizeof(float), info, stats);
    const Tiles ta = plan_tiles(k.n, k.rows, k.c, 8, sizeof(bf16), 0, info,
                                apply_affine<bf16, bf16, float, 8, true>);
    for (bool ef : {true, false}) {
      auto apply = ef ? apply_affine<bf16, bf16, float, 8, true> : apply_affine<bf16, bf16, float, 8, false>;
      const float alone = time_us(s, [&] {
        launch_apply(apply, ta, 0, x, y);
      });
      const float pair = time_us(s, [&] {
        stats<<<ts.blocks(), kChannelThreads, 0, s>>>(x, ts, partial);
        launch_apply(apply, ta, 0, x, y);
      });
      std::printf("  apply %s alone %6.1f µs %5.0f GB/s; stats + apply %6.1f µs\n",
                  ef ? "ef" : "wb", alone, 2 * bytes / alone / 1e3, pair);
    }
    {
      // After x itself is written, as by the op that produced it (a copy into
      // x, its time subtracted): the statistics sweeping x down (the
      // handlers') or up, alone and followed by an elementwise pass with
      // plain loads and stores, as XLA's BatchNorm y.
      bf16* x0;
      CHECK(cudaMalloc(&x0, bytes));
      CHECK(cudaMemcpy(x0, x, bytes, cudaMemcpyDeviceToDevice));
      auto produce = [&] { CHECK(cudaMemcpyAsync(x, x0, bytes, cudaMemcpyDeviceToDevice, s)); };
      const float made = time_us(s, produce, 5);
      std::printf("  after x is written (%.1f µs, subtracted):", made);
      auto wb = apply_affine<bf16, bf16, float, 8, false>;
      for (const Form& f : {forms[3], forms.back()}) {
        const float st = time_us(s, [&] {
          produce();
          f.kernel<<<ts.blocks(), kChannelThreads, 0, s>>>(x, ts, partial);
        }, 5) - made;
        const float pair = time_us(s, [&] {
          produce();
          f.kernel<<<ts.blocks(), kChannelThreads, 0, s>>>(x, ts, partial);
          launch_apply(wb, ta, 0, x, y);
        }, 5) - made;
        std::printf(" %s stats %.1f, + apply wb %.1f µs;", f.name, st, pair);
      }
      std::printf("\n");
      CHECK(cudaFree(x0));
    }
    {
      auto chunked = [&](int64_t per) {  // samples a chunk
        for (int64_t n0 = 0; n0 < k.n; n0 += per) {
          const int64_t cn = std::min(per, k.n - n0), off = n0 * k.rows * k.c;
          const Tiles cs = plan_tiles(cn, k.rows, k.c, 8, sizeof(bf16), 3 * sizeof(float), info,
                                      stats);
          const Tiles ca = plan_tiles(cn, k.rows, k.c, 8, sizeof(bf16), 0, info,
                                      apply_affine<bf16, bf16, float, 8, true>);
          stats<<<cs.blocks(), kChannelThreads, 0, s>>>(x + off, cs, partial);
          launch_apply(apply_affine<bf16, bf16, float, 8, true>, ca, n0, x + off, y + off);
        }
      };
      const size_t flush_bytes = size_t(256) << 20;
      void* flush;
      CHECK(cudaMalloc(&flush, flush_bytes));
      auto dirty = [&] { CHECK(cudaMemsetAsync(flush, 1, flush_bytes, s)); };
      const float alone = time_us(s, dirty, 5);
      const float st = time_us(s, [&] {
        dirty();
        stats<<<ts.blocks(), kChannelThreads, 0, s>>>(x, ts, partial);
      }, 5) - alone;
      std::printf("  after 256 MB of writes (%.1f µs, subtracted): stats %.1f µs; stats + apply",
                  alone, st);
      const float all = time_us(s, [&] { dirty(); chunked(k.n); }, 5) - alone;
      std::printf(" all %.1f µs (%.0f%% of copy)", all, 100 * copy / all);
      const int64_t sample = k.rows * k.c * int64_t(sizeof(bf16));
      for (int64_t mb : {8, 16, 24}) {
        const int64_t per = std::max<int64_t>(1, (mb << 20) / sample);
        if (per >= k.n) continue;
        const float t = time_us(s, [&] { dirty(); chunked(per); }, 5) - alone;
        std::printf("; %lld a chunk %.1f µs (%.0f%%)", (long long)per, t, 100 * copy / t);
      }
      std::printf("\n");
      CHECK(cudaFree(flush));
    }
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    CHECK(cudaFree(sink));
    CHECK(cudaFree(partial));
    CHECK(cudaFree(moments));
  }
  return 0;
}
