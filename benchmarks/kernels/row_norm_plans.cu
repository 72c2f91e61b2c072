// Times the row-norm CUDA kernels under every register-path plan (vectors per
// thread), bf16, straight from C++ with CUDA graphs and events: the data the
// planner in row_norm_kernels.cuh is chosen from. It also checks each plan's
// output against a float64 host reference on sampled rows. Two copy kernels
// give the ceilings: a grid-stride copy, and one that loads 8 vectors a thread
// before storing them (the forward's pattern without the arithmetic).
// The one-block-a-row kernels (row_norm_block.cuh) are marked f.
// SHAPES=16384x4096,64x4096 runs those shapes (any) instead of the list in
// main(); PROBE=1 launches each plan three times
// instead of timing it (for Nsight Compute); FWD_ONLY=1 leaves out the
// backward; NO_CHECK=1 the checks against the host reference; TPR=352x1,192x2
// adds the planned backward at those threads a row x rows a block (a split:
// threads a block for its slice, one row a block), PARTS=3,6
// split over clusters of those many blocks a row, up to 16 (PARTS=8x2: at 2
// vectors a thread, not 4; ACC_SMEM=1 adds each split's accumulators in
// shared memory), COUNTS=26,27 the planned split on that many clusters,
// YOFF_KB=1,64 the planned forward with y that far past x (1: none),
// DRAM_SLOW=1 every plan as where DRAM is slow (dram_is_slow);
// FWD_1024=1 the 4-vector forward in blocks of up to 1024 threads (4w, 4we:
// scale loaded with x) where the plan takes more vectors a thread;
// FWD_CLUSTERS=1 the forward over clusters of 2, 4 and 8 (8c*) at any width
// that fwd_block takes at 4 or more vectors a thread, not only at 16. A split
// planned to hold its first pass's values (bwd_regs' kHold) is timed again
// without (sn, s8n). A split's sum_partials launch is timed alone (sp). g*:
// the planned backward given the statistics, where no plan of 4 or 8 vectors
// a thread above is it. SP=1 times the
// planned backward's sum_partials alone (sp) and the launch without it (o-,
// ro-). DXOFF=1x1,3x9 times the planned backward with dx and dy (a - 1) and
// (b - 1) half-KB into allocations of their own. CTX=1 times each backward
// again after a kernel that writes its dy (c: as a model's matmul writes the
// gradient that the norm's backward reads next) and after one that reads
// another tensor (r: L2 clean of the backward's data) or writes another
// (w: L2 dirty with lines the backward never reads), each pair's time less
// that kernel's alone; without CTX, launches follow each other. HOLD=1 times PARTS' splits
// of at most 256 threads held (o16H). The warp-role backward
// (row_norm_bwd_roles.cuh) is timed where it serves, as ro* (the plan there;
// ro2 or ro3 the other count of stages); o is then bwd_regs' plan, unplanned.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp \
//        -isystem $(python -c "import jax; print(jax.ffi.include_dir())") \
//        benchmarks/kernels/row_norm_plans.cu -o row_norm_plans && ./row_norm_plans
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include "cuda/row_norm_block.cuh"
#include "cuda/row_norm_bwd_roles.cuh"
#include "graph_timing.h"

using namespace jaxnorm::cuda;
using bf16 = __nv_bfloat16;

__global__ void empty_kernel() {}

// fwd_block's 4-vector forward in blocks of up to 1024 threads (the library's
// stop at 512): rows of 2049-4096 vectors in one block of 4 vectors a
// thread, as Liger-Kernel's Triton kernel takes rows of 32768 (FWD_1024=1).
template <bool kC, bool kEarly>
__global__ void __launch_bounds__(1024) fwd4_1024(FwdArgs a) {
  fwd_block_row<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 8, 4, kC, true, kEarly>(a);
}

__global__ void copy_kernel(const uint4* in, uint4* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = in[i];
  }
}

// Each thread loads 8 vectors, then stores them: the forward's access pattern
// without the arithmetic.
__global__ void copy8_kernel(const uint4* in, uint4* out, int64_t n) {
  const int64_t base = blockIdx.x * int64_t(blockDim.x) * 8 + threadIdx.x;
  uint4 v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = in[base + i * blockDim.x];
#pragma unroll
  for (int i = 0; i < 8; ++i) out[base + i * blockDim.x] = v[i];
}

// Each thread loads 2 vectors of in0 (and of in1, unless null), then stores
// them to out0 (out1): the decode forward's pattern without its reduction.
__global__ void copy2_kernel(const uint4* in0, uint4* out0, const uint4* in1, uint4* out1,
                             int64_t n) {
  const int64_t base = blockIdx.x * int64_t(blockDim.x) * 2 + threadIdx.x;
  uint4 a[2], b[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t at = base + i * blockDim.x;
    if (at < n) a[i] = in0[at];
    if (at < n && in1) b[i] = in1[at];
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t at = base + i * blockDim.x;
    if (at < n) out0[at] = a[i];
    if (at < n && in1) out1[at] = b[i];
  }
}

// Copies x to y, adding to each vector the same column's vector of kParams
// row-long tensors (scale and bias, read from L2 for every row): what the
// forward's parameter loads cost the memory system, without its arithmetic.
template <int kParams>
__global__ void copy_params_kernel(const uint4* in, uint4* out, const uint4* w, const uint4* b,
                                   int64_t n, int row_vecs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint4 v = in[i];
    const int c = int(uint32_t(i) % uint32_t(row_vecs));  // n < 2^32 here
    if (kParams > 0) v.x ^= w[c].x, v.y ^= w[c].y, v.z ^= w[c].z, v.w ^= w[c].w;
    if (kParams > 1) v.x ^= b[c].x, v.y ^= b[c].y, v.z ^= b[c].z, v.w ^= b[c].w;
    out[i] = v;
  }
}

// An empty kernel launched in clusters of `size` blocks.
__global__ void empty_cluster_kernel() {}

// fwd_block_row over a cluster of kParts blocks a row at NV vectors a thread
// (each block adds, normalizes and writes its own slice): the decode forward
// with the residual add, where two plain blocks sharing a row would race on h
// written in place.
template <int VEC, int NV, bool kC, bool kEarly, int kParts>
__global__ void __launch_bounds__(512) fwd_cluster_rows(FwdArgs a) {
  fwd_block_row<bf16, bf16, bf16, VEC, NV, kC, true, kEarly, 1, 0, kParts>(a);
}

float empty_cluster_us(cudaStream_t s, int blocks, int size) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t config = cluster_config(unsigned(blocks), 256, 0, size, s, attr);
  return time_us(s, [&] { CHECK(cudaLaunchKernelEx(&config, empty_cluster_kernel)); });
}

// Read + write bandwidth of a 1 GiB device-to-device copy kernel.
float copy_gbps(cudaStream_t s, int sms) {
  const size_t n = size_t(1) << 30;
  void *a, *b;
  CHECK(cudaMalloc(&a, n));
  CHECK(cudaMalloc(&b, n));
  CHECK(cudaMemsetAsync(a, 1, n, s));
  float us = time_us(s, [&] {
    copy_kernel<<<sms * 8, 256, 0, s>>>(static_cast<const uint4*>(a), static_cast<uint4*>(b),
                                        int64_t(n / 16));
  }, 5, 5);
  for (int threads : {64, 256}) {
    float us8 = time_us(s, [&] {
      copy8_kernel<<<unsigned(n / 16 / 8 / threads), threads, 0, s>>>(
          static_cast<const uint4*>(a), static_cast<uint4*>(b), int64_t(n / 16));
    }, 5, 5);
    std::printf("copy8 (%d threads a block): %.0f GB/s\n", threads, 2.0f * n / us8 / 1e3f);
  }
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  return 2.0f * n / us / 1e3f;
}

struct Case {
  int64_t rows, hidden;
  bool centered;
};

// Largest |got - want| / (1 + |want|) over sampled rows of y and dx, and over
// all of dscale (float64 host reference).
double check(const Case& c, const std::vector<float>& x, const std::vector<float>& w,
             const std::vector<float>& b, const std::vector<float>& dy,
             const std::vector<float>& y, const std::vector<float>& dx,
             const std::vector<float>& dw, const std::vector<float>& db) {
  const int64_t H = c.hidden;
  double err = 0;
  std::vector<double> dw_ref(H, 0.0), db_ref(H, 0.0);
  for (int64_t r = 0; r < c.rows; ++r) {
    const float* xr = &x[r * H];
    const float* gr = &dy[r * H];
    double mean = 0, var = 0;
    if (c.centered) {
      for (int64_t j = 0; j < H; ++j) mean += xr[j];
      mean /= H;
    }
    for (int64_t j = 0; j < H; ++j) var += (xr[j] - mean) * (xr[j] - mean);
    const double rstd = 1.0 / std::sqrt(var / H + 1e-5);
    double sgx = 0, sg = 0;
    for (int64_t j = 0; j < H; ++j) {
      const double xh = (xr[j] - mean) * rstd, g = double(gr[j]) * w[j];
      dw_ref[j] += gr[j] * xh;
      db_ref[j] += gr[j];
      sgx += g * xh;
      sg += g;
    }
    if (r % 97 != 0 && r != c.rows - 1) continue;
    for (int64_t j = 0; j < H; ++j) {
      const double xh = (xr[j] - mean) * rstd, g = double(gr[j]) * w[j];
      const double yr = xh * w[j] + (c.centered ? b[j] : 0.0);
      const double dxr = rstd * (g - (c.centered ? sg / H : 0.0) - xh * sgx / H);
      err = std::max(err, std::abs(y[r * H + j] - yr) / (1 + std::abs(yr)));
      err = std::max(err, std::abs(dx[r * H + j] - dxr) / (1 + std::abs(dxr)));
    }
  }
  for (int64_t j = 0; j < H; ++j) {
    err = std::max(err, std::abs(dw[j] - dw_ref[j]) / (1 + std::abs(dw_ref[j])));
    if (c.centered) err = std::max(err, std::abs(db[j] - db_ref[j]) / (1 + std::abs(db_ref[j])));
  }
  return err;
}

// The items "AxB" (or "A", B then `b`) of the comma-separated list in the
// environment variable `name`, up to the first that is not one.
std::vector<std::pair<int64_t, int64_t>> env_pairs(const char* name, int64_t b) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const char* t = std::getenv(name); t && *t; ++t) {
    char* end = nullptr;
    const int64_t a = std::strtoll(t, &end, 10);
    const int64_t second = *end == 'x' ? std::strtoll(end + 1, &end, 10) : b;
    if (end == t || a <= 0 || second <= 0) break;
    out.push_back({a, second});
    t = end;
    if (*t != ',') break;
  }
  return out;
}

int main(int argc, char** argv) {
  // SHAPES=64x4096,1x4096 runs those shapes alone (any), else this list.
  std::vector<std::pair<int64_t, int64_t>> shapes = env_pairs("SHAPES", 0);
  if (shapes.empty()) {
    shapes = {{16384, 4096}, {4096, 8192}, {65536, 1024}, {8192, 12288},
              {2048, 32768}, {512, 65536}, {1024, 65536}, {256, 65536}, {128, 65536},
              {64, 65536}, {34, 65536}, {33, 65536}, {8, 65536}, {1, 65536},
              {16384, 8192}, {2048, 8192}, {32768, 2048}, {131072, 512}, {2048, 4096},
              {512, 4096}, {256, 4096},
              {128, 4096}, {64, 4096}, {32, 4096}, {16, 4096}, {8, 4096}, {2, 4096},
              {1, 4096}, {256, 8192}, {64, 8192}, {8, 8192}, {1, 8192}};
  }
  std::vector<Case> cases;
  for (bool centered : {false, true}) {
    for (auto [r, h] : shapes) cases.push_back({r, h, centered});
  }
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  int dev = 0;
  CHECK(cudaGetDevice(&dev));
  // DRAM_SLOW=1: plan as where DRAM is slow (dram_is_slow), to time those
  // rules on a GPU whose DRAM is fast; the kernels are the same.
  DeviceInfo info = device_info(dev);
  if (std::getenv("DRAM_SLOW")) info.dram_gbps = 1;
  const int sms = info.sms;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  const float copy = copy_gbps(s, sms);
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  std::printf("device %s, %d SMs, copy %.0f GB/s, %s%s\n", prop.name, sms, copy, date,
              std::getenv("DRAM_SLOW") ? ", planned as where DRAM is slow" : "");
  // What a launch costs in these graphs before any work: an empty kernel.
  for (int blocks : {1, 64}) {
    const float us = time_us(s, [&] { empty_kernel<<<blocks, 256, 0, s>>>(); });
    std::printf("empty kernel, %d blocks of 256: %.2f us a launch\n", blocks, us);
  }
  // ... and in clusters (sm_90): what a launch of a cluster kernel adds.
  int clusters = 0;
  CHECK(cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, dev));
  for (int size : {2, 4, 8}) {
    if (!clusters) break;
    for (int blocks : {8, 128}) {
      std::printf("empty kernel, %d blocks of 256 in clusters of %d: %.2f us a launch\n", blocks,
                  size, empty_cluster_us(s, blocks, size));
    }
  }
  std::printf("%-3s %-9s %12s %3s %4s %3s %6s %6s %9s %6s %5s  %s\n", "op", "pass", "shape",
              "nv", "tpr", "rpb", "grid", "smem", "us", "GB/s", "copy", "err");
  constexpr int VEC = 8;
  for (const Case& c : cases) {
    const int64_t n = c.rows * c.hidden, H = c.hidden, nvec = H / VEC;
    bf16 *x, *dy, *y, *dx, *w, *b, *dw, *dbias, *res, *h;
    float *mean, *rstd, *partial;
    for (bf16** p : {&x, &dy, &y, &dx, &res, &h}) CHECK(cudaMalloc(p, n * 2));
    for (bf16** p : {&w, &b, &dw, &dbias}) CHECK(cudaMalloc(p, H * 2));
    CHECK(cudaMalloc(&mean, c.rows * 4));
    CHECK(cudaMalloc(&rstd, c.rows * 4));
    CHECK(cudaMalloc(&partial, size_t(2) * 32 * sms * H * 4));
    fill<<<1024, 256, 0, s>>>(x, n, 1, 0.5f);
    fill<<<1024, 256, 0, s>>>(dy, n, 2, 0.0f);
    fill<<<1024, 256, 0, s>>>(res, n, 5, 0.0f);
    fill<<<64, 256, 0, s>>>(w, H, 3, 1.0f);
    fill<<<64, 256, 0, s>>>(b, H, 4, 0.0f);
    const char* op = c.centered ? "ln" : "rms";
    char shape[32];
    std::snprintf(shape, sizeof shape, "%ldx%ld", long(c.rows), long(H));
    FwdArgs fa{x, w, c.centered ? b : nullptr, y, mean, rstd, c.rows, H, 0, 0, 1e-5,
               c.centered, true, c.centered, true, false};
    BwdArgs ba{x, w, mean, rstd, dy, dx, partial, dw, c.centered ? dbias : nullptr,
               c.rows, H, 0, 0, c.centered, true, c.centered, false};
    const int regions = 1 + int(c.centered);
    std::vector<float> hx, hw, hb, hdy;
    const bool verify = n <= (int64_t(1) << 26) && !std::getenv("NO_CHECK");
    if (verify) {
      hx = to_host(x, n, true), hw = to_host(w, H, true), hb = to_host(b, H, true);
      hdy = to_host(dy, n, true);
    }
    // CTX=1: dy written again before a launch from a copy of its own (dy0),
    // or another tensor (h) read.
    const bool ctx = std::getenv("CTX") != nullptr;
    bf16* dy0 = nullptr;
    if (ctx) {
      CHECK(cudaMalloc(&dy0, n * 2));
      CHECK(cudaMemcpyAsync(dy0, dy, n * 2, cudaMemcpyDeviceToDevice, s));
    }
    auto write_dy = [&] {
      copy_kernel<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(dy0),
                                          reinterpret_cast<uint4*>(dy), n * 2 / 16);
    };
    auto read_other = [&] {
      read_only<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(h), n * 2 / 16,
                                        reinterpret_cast<uint4*>(partial));
    };
    auto write_other = [&] {
      copy_kernel<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(dy0),
                                          reinterpret_cast<uint4*>(h), n * 2 / 16);
    };
    const float write_us = ctx ? time_us(s, write_dy) : 0, read_us = ctx ? time_us(s, read_other) : 0;
    const float other_us = ctx ? time_us(s, write_other) : 0;
    // Times a backward launch, checks its output and prints a row (with CTX,
    // two more: c and r).
    auto time_bwd = [&](const char* name, int tpr, int rpb, int grid, size_t smem, auto launch) {
      if (std::getenv("FWD_ONLY")) return;
      const double bytes = 3.0 * n * 2;
      auto row = [&](const char* ctx_mark, float us) {
        double err = -1;
        if (verify) {
          CHECK(cudaStreamSynchronize(s));
          err = check(c, hx, hw, hb, hdy, to_host(y, n, true), to_host(dx, n, true),
                      to_host(dw, H, true), to_host(dbias, H, true));
        }
        std::printf("%-3s %-9s %12s %3s%s %4d %3d %6d %6zu %9.1f %6.0f %4.0f%%  %.1e\n", op,
                    "bwd", shape, name, ctx_mark, tpr, rpb, grid, smem, us, bytes / us / 1e3,
                    100 * bytes / us / 1e3 / copy, err);
      };
      row(ctx ? " " : "", time_us(s, launch));
      if (!ctx) return;
      row("c", time_us(s, [&] { write_dy(); launch(); }) - write_us);
      row("r", time_us(s, [&] { read_other(); launch(); }) - read_us);
      row("w", time_us(s, [&] { write_other(); launch(); }) - other_us);
    };
    // The grid of a split's launch of `kernel`: as many clusters as then fit.
    auto split_grid = [&](auto kernel, const RowPlan& q, size_t smem) {
      return grid_size(q.groups, resident_clusters(kernel, q.threads(), smem, q.parts, info)) *
             q.parts;
    };
    const auto held = bwd_regs_kernel<bf16, bf16, bf16, VEC>(true, true, true, false, true);
    // A split planned to hold its first pass's values (bwd_regs' kHold),
    // again without (sn: computing the statistics; s8n: given them), on as
    // many clusters as then fit.
    auto time_unheld = [&](const char* name, const auto& l, const BwdArgs& args) {
      if (l.plan.parts < 2 || l.kernel != held) return;
      auto lu = l;
      lu.kernel = bwd_regs_kernel<bf16, bf16, bf16, VEC>(true, true, true);
      lu.grid = split_grid(lu.kernel, l.plan, lu.smem);
      time_bwd(name, l.plan.tpr, 1, lu.grid, lu.smem,
               [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, lu, args)); });
    };
    // The plans the handlers take are marked *: few-rows kernels where they
    // serve, else the generic plan.
    const FewBwdPlan few = plan_bwd_few<bf16, VEC>(c.rows, H, info);
    const RowPlan fwd_plan = plan_fwd(c.rows, nvec, VEC, sms);
    const RowPlan bwd_plan =  // given the forward's statistics
        plan_bwd_rows<bf16, bf16, bf16, VEC>(c.rows, H, regions, true, false, info);
    const RowPlan own_plan =  // computing them
        plan_bwd_rows<bf16, bf16, bf16, VEC>(c.rows, H, regions, true, true, info);
    for (int nv : {4, 8}) {
      if (threads_per_row(nvec, nv) > kMaxRowThreads) continue;
     for (int one_row : {0, 1}) {
      RowPlan p = plan_with_nv(c.rows, nvec, nv, sms);
      if (one_row && p.rows_per_block == 1) continue;
      if (one_row) p.rows_per_block = 1, p.groups = c.rows;
      auto mark_of = [&](const RowPlan& q, bool few_serves) {
        return !few_serves && q.nv == p.nv && q.rows_per_block == p.rows_per_block ? "*" : "";
      };
      for (bool write_y : {true, false}) {
        const char* mark = mark_of(fwd_plan, block_fwd_nv(c.rows, nvec, write_y, false, c.centered, info) > 0);
        FwdArgs a = fa;
        a.write_y = write_y;
        float us = time_us(s, [&] { CHECK(launch_fwd<bf16, bf16, bf16, VEC>(s, info, p, a)); });
        const double bytes = write_y ? 2.0 * n * 2 : 1.0 * n * 2;
        std::printf("%-3s %-9s %12s %2d%s%s %4d %3d %6ld %6s %9.1f %6.0f %4.0f%%\n", op,
                    write_y ? "fwd" : "stats", shape, nv, "", mark, p.tpr, p.rows_per_block,
                    long(p.groups), "-", us, bytes / us / 1e3, 100 * bytes / us / 1e3 / copy);
      }
      CHECK(launch_fwd<bf16, bf16, bf16, VEC>(s, info, p, fa));
      if (bwd_smem_bytes<bf16, bf16, bf16, VEC>(p, H, true, regions) > info.max_dynamic_smem) continue;
      if (nv > kMaxBwdNv) continue;
      const char* mark = mark_of(bwd_plan, few.blocks > 0);
      auto l = plan_bwd<bf16, bf16, bf16, VEC>(p, H, true, regions, true, info);
      lean_for_layer_norm(l, c.centered, info);
      char name[16];
      std::snprintf(name, sizeof name, "%2d%s", nv, mark);
      time_bwd(name, p.tpr, p.rows_per_block, l.grid, l.smem,
               [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, l, ba)); });
     }
    }
    // The planned backward given the statistics (g*) where the loop above
    // did not time its plan.
    if (bwd_plan.nv > 0 && bwd_plan.parts == 1 && few.blocks == 0 &&
        bwd_plan.rows_per_block != plan_with_nv(c.rows, nvec, bwd_plan.nv, sms).rows_per_block) {
      CHECK(launch_fwd<bf16, bf16, bf16, VEC>(s, info, fwd_plan, fa));  // y and statistics
      auto l = plan_bwd<bf16, bf16, bf16, VEC>(bwd_plan, H, true, regions, true, info);
      lean_for_layer_norm(l, c.centered, info);
      time_bwd("g*", bwd_plan.tpr, bwd_plan.rows_per_block, l.grid, l.smem,
               [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, l, ba)); });
    }
    // The planned backward computing its rows' statistics from x (o*), as
    // under jax.grad, where the forward's mean and rstd go unused and the
    // forward itself is left out.
    if (own_plan.nv > 0 && few.blocks == 0) {
      CHECK(launch_fwd<bf16, bf16, bf16, VEC>(s, info, fwd_plan, fa));  // y, for the check
      BwdArgs own = ba;
      own.mean = own.rstd = nullptr;
      own.epsilon = 1e-5;
      auto l = plan_bwd<bf16, bf16, bf16, VEC>(own_plan, H, true, regions, true, info);
      lean_for_layer_norm(l, c.centered, info);
      const bool roles = roles_serve(own, info);  // then the handlers' plan
      time_bwd(own_plan.parts > 1 ? "so*" : roles ? " o" : " o*", own_plan.tpr,
               own_plan.rows_per_block,
               l.grid, l.smem, [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, l, own)); });
      // DXOFF=1x1,3x1,...: the same launch with dx and dy in allocations of
      // their own, (a - 1) and (b - 1) half-KB past their starts: whether
      // where dx and dy lie against x changes what it takes (no check).
      for (auto [dxo, dyo] : env_pairs("DXOFF", 1)) {
        const size_t ox = size_t(dxo - 1) * 512, oy = size_t(dyo - 1) * 512;
        char *pdx, *pdy;
        CHECK(cudaMalloc(&pdx, n * 2 + ox));
        CHECK(cudaMalloc(&pdy, n * 2 + oy));
        CHECK(cudaMemcpyAsync(pdy + oy, dy, n * 2, cudaMemcpyDeviceToDevice, s));
        BwdArgs ao = own;
        ao.dx = pdx + ox;
        ao.dy = pdy + oy;
        char name[16];
        std::snprintf(name, sizeof name, "d%d.%d", int(dxo), int(dyo));
        const float us = time_us(s, [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, l, ao)); });
        std::printf("%-3s %-9s %12s %5s %4d %3d %6d %6zu %9.1f\n", op, "bwd", shape, name,
                    own_plan.tpr, own_plan.rows_per_block, l.grid, l.smem, us);
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaFree(pdx));
        CHECK(cudaFree(pdy));
      }
      // A one-block launch with its accumulators in registers, again in the
      // other arithmetic (lean_for_layer_norm): the short (oL) or the full (oF).
      const auto full_kernel = bwd_regs_kernel<bf16, bf16, bf16, VEC>(true, false, true);
      const auto lean_kernel =
          bwd_regs_kernel<bf16, bf16, bf16, VEC>(true, false, true, false, false, true);
      if (l.kernel == full_kernel || l.kernel == lean_kernel) {
        auto la = l;
        la.kernel = l.kernel == full_kernel ? lean_kernel : full_kernel;
        CHECK(allow_dynamic_smem_once(la.kernel, la.smem, info));
        time_bwd(l.kernel == full_kernel ? " oL" : " oF", own_plan.tpr, own_plan.rows_per_block,
                 la.grid, la.smem, [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, la, own)); });
      }
      // A split that may load its slices by bulk copies (split_may_load_in_bulk),
      // again the other way: by each thread's cp.async (sc) where planned with
      // bulk copies, else with them (sb).
      const auto bulk_kernel = bwd_regs_kernel<bf16, bf16, bf16, VEC>(true, true, false, true);
      const auto copy_kernel = bwd_regs_kernel<bf16, bf16, bf16, VEC>(true, true, false);
      if (split_may_load_in_bulk(own_plan, nvec, regions) &&
          (l.kernel == bulk_kernel || l.kernel == copy_kernel)) {
        const bool bulk = l.kernel == bulk_kernel;
        auto lc = l;
        lc.kernel = bulk ? copy_kernel : bulk_kernel;
        CHECK(allow_dynamic_smem_once(lc.kernel, lc.smem, info));  // (planned for l.kernel)
        time_bwd(bulk ? " sc" : " sb", own_plan.tpr, 1, lc.grid, lc.smem,
                 [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, lc, own)); });
      }
      time_unheld(" sn", l, own);
      // A split's sum of its clusters' partial dscale/dbias rows alone (sp):
      // the part of its time that does not follow the rows a cluster takes.
      if (l.plan.parts > 1) {
        time_bwd(" sp", 256, 1, 0, 0, [&] {  // (its grid not shown)
          CHECK((launch_sum_partials<bf16, float>(s, own, l.partial_rows())));
        });
      }
      auto time_own = [&](const char* name, const RowPlan& q) {
        const auto lq = plan_bwd<bf16, bf16, bf16, VEC>(q, H, true, regions, true, info);
        if (lq.smem > info.max_dynamic_smem) return;
        time_bwd(name, q.tpr, q.rows_per_block, lq.grid, lq.smem,
                 [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, lq, own)); });
        // HOLD=1: a split of at most kMaxSliceThreads threads that plan_bwd
        // does not hold (two blocks an SM fit with its accumulators in shared
        // memory), held anyway (name+H): as many blocks an SM as its 255
        // registers a thread leave room for.
        if (std::getenv("HOLD") && q.parts > 1 && lq.kernel != held &&
            q.threads() <= kMaxSliceThreads) {
          auto lh = lq;
          lh.kernel = held;
          lh.smem = bwd_smem_bytes<bf16, bf16, bf16, VEC>(q, H, false, regions, true);
          CHECK(allow_dynamic_smem_once(lh.kernel, lh.smem, info));
          lh.grid = split_grid(lh.kernel, q, lh.smem);
          char held_name[16];
          std::snprintf(held_name, sizeof held_name, "%sH", name);
          time_bwd(held_name, q.tpr, 1, lh.grid, lh.smem,
                   [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, lh, own)); });
        }
        // ACC_SMEM=1: a split that holds dscale/dbias in registers, again
        // with them in shared memory (name+m), as many blocks as then fit.
        if (!std::getenv("ACC_SMEM") || q.parts == 1 ||
            lq.kernel == bwd_regs_kernel<bf16, bf16, bf16, VEC>(true, true, false)) {
          return;
        }
        auto lm = lq;
        lm.kernel = bwd_regs_kernel<bf16, bf16, bf16, VEC>(true, true, false);
        lm.smem = bwd_smem_bytes<bf16, bf16, bf16, VEC>(q, H, false, regions, false);
        if (lm.smem > info.max_dynamic_smem) return;
        lm.grid = split_grid(lm.kernel, q, lm.smem);
        char smem_name[16];
        std::snprintf(smem_name, sizeof smem_name, "%sm", name);
        time_bwd(smem_name, q.tpr, q.rows_per_block, lm.grid, lm.smem,
                 [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, lm, own)); });
      };
      // COUNTS=26,27: the planned split on that many clusters (so26, so27)
      // in place of the resident ones: which counts leave a short last round.
      for (const auto& item : env_pairs("COUNTS", 1)) {
        if (own_plan.parts == 1) break;
        auto lk = l;
        lk.grid = int(item.first) * own_plan.parts;
        char name[16];
        std::snprintf(name, sizeof name, "so%d", int(item.first));
        time_bwd(name, own_plan.tpr, 1, lk.grid, lk.smem,
                 [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, lk, own)); });
      }
      // TPR=352x1,192x2: the same launch with other threads a row and rows a
      // block (whole warps; a thread's vectors past the row's end masked). A
      // split keeps its part count and one row a block; tpr is then each
      // block's threads for its slice (s=).
      for (auto [tpr, rpb] : env_pairs("TPR", 1)) {
        RowPlan q = own_plan;
        q.held = false;  // (HOLD=1 times it held)
        q.tpr = int(tpr);
        q.rows_per_block = q.parts == 1 ? int(rpb) : 1;
        q.groups = (c.rows + q.rows_per_block - 1) / q.rows_per_block;
        const int64_t span = (nvec + q.parts - 1) / q.parts;
        if (q.tpr % 32 == 0 && int64_t(q.tpr) * kMaxBwdNv >= span && q.tpr <= kMaxRowThreads &&
            (q.parts == 1 || split_fits_slots(q.parts, q.tpr))) {
          time_own(q.parts == 1 ? " o=" : " s=", q);
        }
      }
      // The backward in warp roles (row_norm_bwd_roles.cuh), where it serves:
      // ro* with the planned stages, ro2 / ro3 with the other count.
      if (roles) {
        const int planned = roles_stages(H, info);
        for (int stages : {planned, 5 - planned}) {
          char name[16];
          std::snprintf(name, sizeof name, stages == planned ? "ro*" : "ro%d", stages);
          time_bwd(name, kRoleThreads, 1, roles_grid(own, info), size_t(stages) * 2 * H * 2,
                   [&] { CHECK(launch_bwd_roles<bf16, bf16>(s, info, own, stages)); });
        }
      }
      // SP=1: the planned launch's sum of its partial rows alone (sp, where
      // a split's is not timed above), reading what the last launch above
      // left (its check: the roles' partial rows where they serve, else
      // bwd_regs' plan's), and the launch without it (ro- / o-).
      const int64_t sp_rows = roles ? roles_grid(own, info) : l.partial_rows();
      if (std::getenv("SP") && sp_rows > 1) {
        if (l.plan.parts == 1 || roles) {
          time_bwd(" sp", 256, 1, 0, 0,
                   [&] { CHECK((launch_sum_partials<bf16, float>(s, own, sp_rows))); });
        }
        if (roles) {
          const int stages = roles_stages(H, info);
          auto kernel = c.centered ? (stages == 2 ? &bwd_roles<bf16, bf16, true, 2>
                                                  : &bwd_roles<bf16, bf16, true, kRoleStages>)
                                   : (stages == 2 ? &bwd_roles<bf16, bf16, false, 2>
                                                  : &bwd_roles<bf16, bf16, false, kRoleStages>);
          time_bwd("ro-", kRoleThreads, 1, int(sp_rows), size_t(stages) * 2 * H * 2, [&] {
            kernel<<<unsigned(sp_rows), kRoleThreads, size_t(stages) * 2 * H * 2, s>>>(own);
            CHECK(cudaGetLastError());
          });
        } else {
          BwdArgs a = own;
          a.tpr = l.plan.tpr, a.rows_per_block = l.plan.rows_per_block, a.parts = l.plan.parts;
          a.stage_params = l.stage_scale;
          time_bwd(" o-", l.plan.tpr, l.plan.rows_per_block, l.grid, l.smem, [&] {
            CHECK(launch_clusters(l.kernel, unsigned(l.grid), l.plan.threads(), l.smem,
                                  l.plan.parts, s, a));
          });
        }
      }
      // PARTS=3,6: the same, split over clusters of that many blocks, a
      // slice of the row each at 4 vectors a thread (o3, o6); PARTS=8x2 at
      // 2 vectors a thread (o8/2: twice the threads, the rest masked).
      for (const auto& item : env_pairs("PARTS", 1)) {
        RowPlan q = own_plan;
        q.held = false;  // (HOLD=1 times it held)
        q.parts = int(item.first);
        q.rows_per_block = 1;
        q.groups = c.rows;
        const int nv = kMaxBwdNv / int(item.second);
        q.tpr = nv > 0 ? threads_per_row((nvec + q.parts - 1) / q.parts, nv) : 0;
        if (info.clusters && q.parts >= 2 && q.parts <= kMaxWideClusterParts && q.tpr >= 32 &&
            q.tpr <= kMaxRowThreads && split_fits_slots(q.parts, q.tpr)) {
          char name[16];
          std::snprintf(name, sizeof name, item.second > 1 ? " o%d/%d" : " o%d", q.parts,
                        int(item.second));
          time_own(name, q);
        }
      }
    }
    // Rows over 2048 vectors: the backward's cluster split as planned (s*,
    // its grid the resident clusters cudaOccupancyMaxActiveClusters reports,
    // up to one a row), then on fewer clusters (s): a grid the GPU cannot
    // hold at once runs its last clusters as a second wave.
    if (bwd_plan.parts > 1 && few.blocks == 0) {
      CHECK(launch_fwd<bf16, bf16, bf16, VEC>(s, info, fwd_plan, fa));  // y and statistics
      const auto l = plan_bwd<bf16, bf16, bf16, VEC>(bwd_plan, H, true, regions, true, info);
      const int planned = l.grid / bwd_plan.parts;
      std::vector<int> counts = {planned};
      for (int k : {planned - 1, planned - 2, planned - 4, planned - 8, planned * 7 / 8,
                    planned * 3 / 4, planned / 2}) {
        if (k >= 1 && std::find(counts.begin(), counts.end(), k) == counts.end()) {
          counts.push_back(k);
        }
      }
      for (int k : counts) {
        auto lk = l;
        lk.grid = k * bwd_plan.parts;
        char name[16];
        std::snprintf(name, sizeof name, "s%d%s", bwd_plan.parts, k == planned ? "*" : "");
        time_bwd(name, bwd_plan.tpr, 1, lk.grid, lk.smem,
                 [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, lk, ba)); });
      }
      time_unheld("s8n", l, ba);
    }
    // Rows that fit a block, split over a cluster of 2 or 4 anyway (c2, c4):
    // smaller blocks, more of them an SM, where the shared memory a thread
    // needs binds (LayerNorm's two accumulators: one 256-thread block an SM
    // at 8192 wide).
    if (bwd_plan.parts == 1 && bwd_plan.nv > 0 && few.blocks == 0 && info.clusters) {
      CHECK(launch_fwd<bf16, bf16, bf16, VEC>(s, info, fwd_plan, fa));  // y and statistics
      for (int parts : {2, 4}) {
        RowPlan q = plan_bwd_split(c.rows, nvec, info);
        q.parts = parts;
        q.tpr = threads_per_row((nvec + parts - 1) / parts, kMaxBwdNv);
        if (q.tpr < 32 || q.nv == 0) continue;
        const auto l = plan_bwd<bf16, bf16, bf16, VEC>(q, H, true, regions, true, info);
        char name[16];
        std::snprintf(name, sizeof name, "c%d", parts);
        time_bwd(name, q.tpr, 1, l.grid, l.smem,
                 [&] { CHECK(launch_bwd<bf16, bf16, bf16, VEC>(s, l, ba)); });
      }
    }
    // x to y with 0, 1 or 2 parameter tensors read along (copy+Np).
    for (int k = 0; !c.centered && k < 3; ++k) {
      auto kernel = k == 0 ? copy_params_kernel<0> : k == 1 ? copy_params_kernel<1>
                                                            : copy_params_kernel<2>;
      const float us = time_us(s, [&] {
        kernel<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(x),
                                       reinterpret_cast<uint4*>(y),
                                       reinterpret_cast<const uint4*>(w),
                                       reinterpret_cast<const uint4*>(b), n / VEC, int(nvec));
      });
      char name[16];
      std::snprintf(name, sizeof name, "+%dp", k);
      std::printf("%-3s %-9s %12s %5s %4d %3d %6d %6s %9.1f %6.0f %4.0f%%\n", op, "copy", shape,
                  name, 256, 1, sms * 8, "-", us, 4.0 * n / us / 1e3, 400.0 * n / us / 1e3 / copy);
    }
    // The handler's one-block-a-row forward as planned (h: with y; +r: the
    // residual add; stats +r: statistics and h only, as under jax.grad),
    // where it holds 4 or more vectors a thread.
    // YOFF_KB=1,64,...: the planned one-block-a-row forward writing y at
    // x + n + that many KB (1: right after x), in one allocation: whether
    // where y lies against x changes what the same kernel takes.
    for (const auto& item : env_pairs("YOFF_KB", 1)) {
      const int nv = block_fwd_nv(c.rows, nvec, true, false, c.centered, info);
      if (nv <= kFewNv) break;
      const int64_t off = item.first == 1 ? 0 : item.first * 1024;  // "1": no offset
      char* base;
      CHECK(cudaMalloc(&base, n * 4 + off));
      CHECK(cudaMemcpyAsync(base, x, n * 2, cudaMemcpyDeviceToDevice, s));
      FwdArgs a = fa;
      a.x = base;
      a.y = base + n * 2 + off;
      const float us =
          time_us(s, [&] { CHECK(launch_fwd_block<bf16, bf16, bf16, VEC>(s, info, nv, a)); });
      std::printf("%-3s %-9s %12s %5s %4d %3d %6ld %6ld %9.1f %6.0f %4.0f%%\n", op, "fwd@", shape,
                  "yoff", threads_per_row(nvec, nv), 1, long(c.rows), long(off / 1024), us,
                  4.0 * n / us / 1e3, 400.0 * n / us / 1e3 / copy);
      CHECK(cudaStreamSynchronize(s));
      CHECK(cudaFree(base));
    }
    for (int mode = 0; mode < 3; ++mode) {
      const bool write_y = mode < 2, residual = mode > 0;
      if (residual && c.centered) continue;
      const int nv = block_fwd_nv(c.rows, nvec, write_y, residual, c.centered, info);
      if (nv <= kFewNv) continue;
      FwdArgs a = fa;
      a.write_y = write_y;
      if (residual) a.residual = res, a.new_residual = h;
      const float us =
          time_us(s, [&] { CHECK(launch_fwd_block<bf16, bf16, bf16, VEC>(s, info, nv, a)); });
      const double bytes = (write_y ? 2.0 : 1.0) * n * 2 + (residual ? 2.0 * n * 2 : 0);
      const int threads = threads_per_row(nvec, nv);
      auto print_row = [&](const char* name, float t, int tpr = 0) {
        std::printf("%-3s %-9s %12s %5s %4d %3d %6ld %6s %9.1f %6.0f %4.0f%%\n", op,
                    write_y ? "fwd" : "stats", shape, name, tpr ? tpr : threads, 1,
                    long(c.rows), "-", t, bytes / t / 1e3, 100 * bytes / t / 1e3 / copy);
      };
      char name[16];
      std::snprintf(name, sizeof name, "%dh%s", nv, residual ? "+r" : "");
      print_row(name, us);
      std::vector<float> y_plan;  // to check the other kernels against
      if (verify && !residual && write_y) y_plan = to_host(y, n, true);
      // The largest difference of `launch`'s y from the plan's, relative.
      auto check_y = [&](auto launch, const char* label) {
        if (y_plan.empty()) return;
        CHECK(cudaMemset(y, 0, n * 2));
        launch();
        std::vector<float> got = to_host(y, n, true);
        double diff = 0;
        for (int64_t i = 0; i < n; ++i) {
          diff = std::max(diff, std::abs(double(got[i]) - y_plan[i]) / (1 + std::abs(y_plan[i])));
        }
        std::printf("    y-diff of %s against the plan: %.1e\n", label, diff);
      };
      // What the parameters' loads cost: the same launch without bias (-b)
      // and without scale and bias (-p); y is not checked.
      for (int drop = c.centered ? 0 : 1; mode == 0 && drop < 2; ++drop) {
        FwdArgs bare = a;
        bare.has_bias = false;
        if (drop == 1) bare.has_scale = false;
        std::snprintf(name, sizeof name, "%dh-%s", nv, drop ? "p" : "b");
        print_row(name, time_us(s, [&] {
          CHECK(launch_fwd_block<bf16, bf16, bf16, VEC>(s, info, nv, bare));
        }));
      }
      // A cluster of 2, 4 or 8 blocks a row (8c2, 8c4, 8c8); without the
      // residual, y-diff against the planned kernel's y.
      auto cluster_row = [&](auto parts) {
        constexpr int kParts = decltype(parts)::value;
        if (threads_per_row((nvec + kParts - 1) / kParts, 8) < 32) return;  // a warp at least
        with_centered(c.centered, [&](auto centered) {
          constexpr bool kC = decltype(centered)::value;
          auto launch = [&] { CHECK(launch_fwd_cluster<bf16, bf16, bf16, VEC, kC, kParts>(s, info, a)); };
          std::snprintf(name, sizeof name, "8c%d%s", kParts, residual ? "+r" : "");
          print_row(name, time_us(s, launch));
          check_y(launch, name);
          return 0;
        });
      };
      if ((nv == kLongNv || std::getenv("FWD_CLUSTERS")) && info.clusters && write_y) {
        cluster_row(std::integral_constant<int, 2>{});
        cluster_row(std::integral_constant<int, 4>{});
        cluster_row(std::integral_constant<int, 8>{});
      }
      const int threads4 = threads_per_row(nvec, 4);
      if (std::getenv("FWD_1024") && write_y && threads4 > 512 && threads4 <= 1024) {
        with_centered(c.centered, [&](auto centered) {
          constexpr bool kC = decltype(centered)::value;
          auto one = [&](auto early) {
            constexpr bool kE = decltype(early)::value;
            auto kernel = fwd4_1024<kC, kE>;
            const size_t smem = fwd_block_smem<bf16, bf16, VEC, 4, kC, true, kE>(threads4,
                                                                              residual);
            if (smem > 0) CHECK(allow_dynamic_smem_once(kernel, smem, info));
            auto launch = [&] { kernel<<<c.rows, threads4, smem, s>>>(a); };
            std::snprintf(name, sizeof name, "4w%s%s", kE ? "e" : "", residual ? "+r" : "");
            print_row(name, time_us(s, launch), threads4);
            check_y(launch, name);
          };
          one(std::false_type{});
          one(std::true_type{});
          return 0;
        });
      }
      if (nv == kLongNv && mode == 0) {  // the row in registers alone (16r)
        with_centered(c.centered, [&](auto centered) {
          constexpr bool kC = decltype(centered)::value;
          auto kernel = fwd_block<bf16, bf16, bf16, VEC, kLongNv, kC, true, false>;
          const size_t smem = fwd_block_smem<bf16, bf16, VEC, kLongNv, kC, true, false>(threads, false);
          CHECK(allow_dynamic_smem_once(kernel, smem, info));
          print_row("16r", time_us(s, [&] { kernel<<<c.rows, threads, smem, s>>>(a); }));
          return 0;
        });
      }
    }
    // The one-block-a-row forward (row_norm_block.cuh, marked f) wherever a
    // row fits its block, with scale and bias loaded with x (e) or at their
    // use, and for few rows also with two blocks a row (/2), with the row
    // length fixed at compile time (x, where a kernel has it) and with the
    // residual add (+r: reads x and residual, writes y and new_residual; its
    // values are checked by the test suite); * where the handler takes it.
    // y-diff (without the residual): against the first kernel's y, 0 where
    // the statistics keep their bits.
    std::vector<float> y_ref;  // y of the first one-block-a-row kernel timed
    bool has_fixed = false;  // a kernel compiled for this row length
    with_row_vecs(nvec, [&](auto v) {
      has_fixed = decltype(v)::value > 0;
      return cudaSuccess;
    });
    auto few_fwd = [&](auto nv, auto write_y, auto early, auto split, bool fixed,
                       bool residual = false) {
      constexpr int NV = decltype(nv)::value, S = decltype(split)::value;
      constexpr bool kWriteY = decltype(write_y)::value, kEarly = decltype(early)::value;
      const int threads = threads_per_row(nvec, NV);
      if (threads < 32 || threads > fwd_block_threads(NV, kWriteY)) return;
      if (fixed && (NV != kFewNv || !has_fixed)) return;
      with_centered(c.centered, [&](auto centered) {
        constexpr bool kC = decltype(centered)::value;
        with_row_vecs(fixed ? nvec : 0, [&](auto vecs) {
          constexpr int V = NV == kFewNv ? decltype(vecs)::value : 0;
          auto kernel = fwd_block<bf16, bf16, bf16, VEC, NV, kC, kWriteY, kEarly, S, V>;
          bool planned = block_fwd_nv(c.rows, nvec, kWriteY, residual, c.centered, info) == NV;
          if (planned && NV == kFewNv) planned = fixed == has_fixed;
          if (planned && kWriteY && NV == kFewNv) {  // launch_fwd_block's rules
            planned = kEarly && S == (split_rows(c.rows, sms, kC) && !residual ? 2 : 1);
          } else if (planned && kWriteY && NV == 4) {
            planned = kEarly == fwd_loads_early<bf16, bf16, bf16, VEC, kC>(threads, residual, info);
          }
          FwdArgs a = fa;
          a.write_y = kWriteY;
          if (residual) a.residual = res, a.new_residual = h;
          const unsigned grid = unsigned(c.rows * S);
          const size_t smem = fwd_block_smem<bf16, bf16, VEC, NV, kC, kWriteY, kEarly>(threads, residual);
          CHECK(allow_dynamic_smem_once(kernel, smem, info));
          const float us = time_us(s, [&] { kernel<<<grid, threads, smem, s>>>(a); });
          const double bytes = (kWriteY ? 2.0 : 1.0) * n * 2 * (residual ? 2 : 1);
          char name[16];
          std::snprintf(name, sizeof name, "%df%s%s%s%s%s", NV, kEarly && kWriteY ? "e" : "",
                        V > 0 ? "x" : "", S > 1 ? "/2" : "", residual ? "+r" : "",
                        planned ? "*" : "");
          std::printf("%-3s %-9s %12s %5s %4d %3d %6ld %6s %9.1f %6.0f %4.0f%%", op,
                      kWriteY ? "fwd" : "stats", shape, name, threads, 1, long(grid), "-", us,
                      bytes / us / 1e3, 100 * bytes / us / 1e3 / copy);
          if (kWriteY) {
            kernel<<<grid, threads, smem, s>>>(fa);  // checked with dx
            if (verify && !residual) {  // largest |y - y_ref| / (1 + |y_ref|)
              std::vector<float> got = to_host(y, n, true);
              if (y_ref.empty()) y_ref = got;
              double diff = 0;
              for (int64_t i = 0; i < n; ++i) {
                const double d = std::abs(double(got[i]) - y_ref[i]);
                diff = std::max(diff, d / (1 + std::abs(y_ref[i])));
              }
              std::printf("  y-diff %.1e", diff);
            }
          }
          std::printf("\n");
          return cudaSuccess;
        });
      });
    };
    using yes = std::true_type;
    using no = std::false_type;
    using one = std::integral_constant<int, 1>;
    using two = std::integral_constant<int, 2>;
    using four = std::integral_constant<int, 4>;
    few_fwd(one{}, no{}, no{}, one{}, false);
    few_fwd(two{}, no{}, no{}, one{}, false);
    few_fwd(two{}, no{}, no{}, one{}, true);
    few_fwd(four{}, no{}, no{}, one{}, false);
    few_fwd(std::integral_constant<int, 8>{}, no{}, no{}, one{}, false);
    few_fwd(two{}, yes{}, yes{}, one{}, false);  // the reference for y-diff
    few_fwd(one{}, yes{}, yes{}, one{}, false);
    few_fwd(four{}, yes{}, no{}, one{}, false);
    few_fwd(four{}, yes{}, yes{}, one{}, false);
    few_fwd(four{}, yes{}, no{}, one{}, false, true);
    few_fwd(four{}, yes{}, yes{}, one{}, false, true);
    few_fwd(two{}, yes{}, yes{}, one{}, false, true);
    if (c.rows <= 4 * sms) {  // two blocks a row; the row length fixed; the residual
      few_fwd(two{}, yes{}, yes{}, two{}, false);
      few_fwd(two{}, yes{}, yes{}, one{}, true);
      few_fwd(two{}, yes{}, yes{}, two{}, true);
      few_fwd(two{}, yes{}, yes{}, one{}, true, true);
      // The residual add over a cluster of P blocks a row at NV vectors a
      // thread (nvP+r), its y against the planned kernel's (y-diff).
      if (!c.centered && info.clusters) {
        FwdArgs ar = fa;
        ar.residual = res, ar.new_residual = h;
        CHECK(launch_fwd_block<bf16, bf16, bf16, VEC>(
            s, info, block_fwd_nv(c.rows, nvec, true, true, false, info), ar));
        const std::vector<float> y_planned = to_host(y, n, true);
        auto cluster_fwd = [&](auto nv, auto parts, auto early) {
          constexpr int NV = decltype(nv)::value, P = decltype(parts)::value;
          constexpr bool kEarly = decltype(early)::value;
          const int threads = threads_per_row((nvec + P - 1) / P, NV);
          if (threads < 32 || threads > 512) return;
          auto kernel = fwd_cluster_rows<VEC, NV, false, kEarly, P>;
          const size_t smem = fwd_block_smem<bf16, bf16, VEC, NV, false, true, kEarly>(threads, true);
          CHECK(allow_dynamic_smem_once(kernel, smem, info));
          const unsigned grid = unsigned(c.rows * P);
          const float us = time_us(s, [&] {
            CHECK(launch_clusters(kernel, grid, threads, smem, P, s, ar));
          });
          const std::vector<float> got = to_host(y, n, true);
          double diff = 0;
          for (int64_t i = 0; i < n; ++i) {
            const double d = std::abs(double(got[i]) - y_planned[i]);
            diff = std::max(diff, d / (1 + std::abs(double(y_planned[i]))));
          }
          char name[16];
          std::snprintf(name, sizeof name, "%d%sc%d+r", NV, kEarly ? "e" : "", P);
          const double bytes = 2.0 * n * 2 * 2;
          std::printf("%-3s %-9s %12s %5s %4d %3d %6u %6zu %9.1f %6.0f %4.0f%%  y-diff %.1e\n",
                      op, "fwd", shape, name, threads, 1, grid, smem, us, bytes / us / 1e3,
                      100 * bytes / us / 1e3 / copy, diff);
        };
        cluster_fwd(four{}, two{}, yes{});
        cluster_fwd(four{}, two{}, no{});
        cluster_fwd(four{}, four{}, yes{});
        cluster_fwd(std::integral_constant<int, 8>{}, two{}, no{});
      }
      // What the forward's bytes alone take here: one kernel that copies
      // x to y (and residual to new_residual), the decode kernels' pattern
      // without their reduction.
      const int64_t vecs = n * 2 / 16;
      const unsigned copy_grid = unsigned((vecs + 511) / 512);
      for (bool with_res : {false, true}) {
        const float us = time_us(s, [&] {
          copy2_kernel<<<copy_grid, 256, 0, s>>>(
              reinterpret_cast<const uint4*>(x), reinterpret_cast<uint4*>(y),
              with_res ? reinterpret_cast<const uint4*>(res) : nullptr,
              with_res ? reinterpret_cast<uint4*>(h) : nullptr, vecs);
        });
        const double bytes = 2.0 * n * 2 * (with_res ? 2 : 1);
        std::printf("%-3s %-9s %12s %5s %4d %3d %6u %6s %9.1f %6.0f %4.0f%%\n", op, "copy", shape,
                    with_res ? "x+r" : "x", 256, 1, copy_grid, "-", us, bytes / us / 1e3,
                    100 * bytes / us / 1e3 / copy);
      }
    }
    // The few-rows backward as planned (f*: one block for one row, fk* the
    // column plan); computing the statistics (fo*, fko*: as under jax.grad,
    // the forward's output dead), for one row also at a row length known at
    // run time only (f0o); the statistics-only forward, then the backward
    // given them (sf+f); and the column plan's two launches alone (fk-dots,
    // fk-cols: timed, not checked).
    if (few.blocks > 0) {
      CHECK(launch_fwd<bf16, bf16, bf16, VEC>(s, info, fwd_plan, fa));  // y, for the check
      auto few_bwd = [&](const char* name, auto launch) {
        time_bwd(name, few.threads, 1, few.blocks, 0, launch);
      };
      few_bwd(few.columns ? "2fk*" : " 2f*",
              [&] { CHECK(launch_bwd_few<bf16, bf16, bf16, VEC>(s, few, ba)); });
      BwdArgs own = ba;
      own.mean = own.rstd = nullptr;
      own.epsilon = 1e-5;
      few_bwd(few.columns ? "fko*" : " fo*",
              [&] { CHECK(launch_bwd_few<bf16, bf16, bf16, VEC>(s, few, own)); });
      if (!few.columns) {
        with_centered(c.centered, [&](auto centered) {
          auto kernel = bwd_few<bf16, bf16, bf16, VEC, decltype(centered)::value, false, true>;
          few_bwd(" f0o", [&] { kernel<<<1, few.threads, 0, s>>>(own, nullptr); });
          return 0;
        });
      }
      FwdArgs stats = fa;
      stats.write_y = false;
      stats.has_scale = stats.has_bias = false;
      few_bwd("sf+f", [&] {
        if (const int nv = block_fwd_nv(c.rows, nvec, false, false, c.centered, info)) {
          CHECK(launch_fwd_block<bf16, bf16, bf16, VEC>(s, info, nv, stats));
        } else {
          CHECK(launch_fwd<bf16, bf16, bf16, VEC>(s, info, plan_fwd(c.rows, nvec, VEC, sms),
                                                  stats));
        }
        CHECK(launch_bwd_few<bf16, bf16, bf16, VEC>(s, few, ba));
      });
    }
    if (few.columns) {
      with_centered(c.centered, [&](auto centered) {
        constexpr bool kC = decltype(centered)::value;
        const unsigned col_grid = unsigned((nvec + kColVecs - 1) / kColVecs);
        const float us_dots = time_us(s, [&] {  // as planned: the row length fixed if it can be
          CHECK(with_row_vecs(nvec, [&](auto vecs) {
            auto dots = bwd_few<bf16, bf16, bf16, VEC, kC, true, false, decltype(vecs)::value>;
            dots<<<few.blocks, few.threads, 0, s>>>(ba, nullptr);
            return cudaGetLastError();
          }));
        });
        const float us_cols = time_us(s, [&] {
          bwd_cols<bf16, bf16, bf16, VEC, kC><<<col_grid, kColThreads, 0, s>>>(ba, nullptr);
        });
        std::printf("%-3s %-9s %12s %3s %4d %3d %6d %6s %9.1f\n", op, "bwd", shape, "fk-dots",
                    few.threads, 1, few.blocks, "-", us_dots);
        std::printf("%-3s %-9s %12s %3s %4d %3d %6u %6s %9.1f\n", op, "bwd", shape, "fk-cols",
                    kColThreads, kColRows, col_grid, "-", us_cols);
      });
    }
    CHECK(cudaStreamSynchronize(s));
    for (void* p : {(void*)x, (void*)dy, (void*)y, (void*)dx, (void*)res, (void*)h, (void*)w, (void*)b,
                    (void*)dw, (void*)dbias, (void*)mean, (void*)rstd, (void*)partial,
                    (void*)dy0}) {
      CHECK(cudaFree(p));
    }
    std::fflush(stdout);
  }
  return 0;
}
