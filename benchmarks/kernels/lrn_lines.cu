// Local response normalization across the channels of channels-last bf16 x,
// a line (one position's C channels, C a multiple of 8) in registers: the
// row kernels' structure, which notes v50 left to try for the along-channel
// ops. A team of L lanes takes a line; lane i holds the line's vectors
// j * L + i (j < M), so each load instruction of a team is contiguous, and a
// channel's window reaches into the neighbouring vectors through shuffles
// within the team. The window size is a template parameter (PyTorch's
// default 5), the power den^-beta one log2 and one exp2. Times the forward and
// the backward of the benchmark's LRN shapes at several team sizes against a
// device-to-device copy, and checks each against a float64 host reference on
// sampled lines. The handlers' kernels (cpp/cuda/channel_lines.cuh) took
// this design and its team sizes from these timings (notes v61). The
// handlers' kernel for channels-first x (lrn_positions) is timed on the same
// bytes read as NCHW, at several chunks of channels in flight, launch bounds
// (blocks an SM) and grids (one wave of blocks, or a block for every 256
// positions, the handler's since notes v65).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 benchmarks/kernels/lrn_lines.cu -o lrn_lines && ./lrn_lines
#include <cmath>
#include <cstdio>
#include <vector>

#include <cuda_bf16.h>

#include "cuda/local_response_norm.cu"  // the handlers' kernel (each_line of LrnLine)
#include "graph_timing.h"

namespace {

using bf16 = __nv_bfloat16;
constexpr int kVec = 8;  // bf16 channels a 16-byte vector
constexpr int kThreads = 256;

struct LrnParams {
  float alpha, beta, k;
};

__device__ void load_vec(const bf16* p, float (&out)[kVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int e = 0; e < kVec / 2; ++e) {
    const float2 f = __bfloat1622float2(h[e]);
    out[2 * e] = f.x, out[2 * e + 1] = f.y;
  }
}

__device__ void store_vec(bf16* p, const float (&in)[kVec]) {
  uint4 raw;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int e = 0; e < kVec / 2; ++e) h[e] = __floats2bfloat162_rn(in[2 * e], in[2 * e + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// out[j][e] = sum of s over channels [c - kLo, c + kHi] of the line, c the
// channel of the lane's vector j, element e; s must be zero in vectors past
// the line's end. The kHalf channels before a vector come from the lane before
// it in the team (or, for lane 0, from the last lane's previous vector), those
// after from the next lane (the last lane: lane 0's next vector).
template <int L, int M, int kLo, int kHi>
__device__ void window_sums(const float (&s)[M][kVec], int lane, float (&out)[M][kVec]) {
  constexpr int kHalf = kLo > kHi ? kLo : kHi;
  static_assert(kHalf <= kVec, "a window reaches one vector each way");
  float left[M][kHalf], right[M][kHalf];  // the tail of lane-1's and the head of lane+1's
#pragma unroll
  for (int j = 0; j < M; ++j) {
#pragma unroll
    for (int q = 0; q < kHalf; ++q) {
      left[j][q] = __shfl_sync(0xffffffffu, s[j][kVec - kHalf + q], (lane + L - 1) % L, L);
      right[j][q] = __shfl_sync(0xffffffffu, s[j][q], (lane + 1) % L, L);
    }
  }
#pragma unroll
  for (int j = 0; j < M; ++j) {
    float ext[kHalf + kVec + kHalf];
#pragma unroll
    for (int q = 0; q < kHalf; ++q) {
      ext[q] = lane > 0 ? left[j][q] : j > 0 ? left[j - 1][q] : 0.0f;
      ext[kHalf + kVec + q] = lane < L - 1 ? right[j][q] : j + 1 < M ? right[j + 1][q] : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) ext[kHalf + e] = s[j][e];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      float sum = 0.0f;
#pragma unroll
      for (int d = -kLo; d <= kHi; ++d) sum += ext[kHalf + e + d];
      out[j][e] = sum;
    }
  }
}

// The forward (kBwd false: out = y) or the backward (out = dx) of a block's
// lines at a time, all of the block's threads in every round (the shuffles
// need whole warps; lanes past the last line load zeros and store nothing).
template <int L, int M, int kSize, bool kBwd>
__global__ void __launch_bounds__(kThreads) lrn_lines(const bf16* x, const bf16* dy, bf16* out,
                                                      int64_t lines, int c, LrnParams p) {
  constexpr int kLo = kSize / 2, kHi = (kSize - 1) / 2;
  const int nvl = c / kVec, lane = threadIdx.x % L;
  const float scale = p.alpha / kSize;
  for (int64_t first = blockIdx.x * int64_t(kThreads / L); first < lines;
       first += int64_t(gridDim.x) * (kThreads / L)) {
    const int64_t line = first + threadIdx.x / L;
    const bool valid = line < lines;
    float v[M][kVec], g[M][kVec], s[M][kVec], w[M][kVec];
#pragma unroll
    for (int j = 0; j < M; ++j) {
      const bool here = valid && j * L + lane < nvl;
      const int64_t at = line * c + int64_t(j * L + lane) * kVec;
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[j][e] = g[j][e] = 0.0f;
      if (here) load_vec(x + at, v[j]);
      if (kBwd && here) load_vec(dy + at, g[j]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) s[j][e] = v[j][e] * v[j][e];
    }
    window_sums<L, M, kLo, kHi>(s, lane, w);
    // w: the window sums of x^2; then den^-beta in s.
#pragma unroll
    for (int j = 0; j < M; ++j) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float den = p.k + scale * w[j][e];
        const float pw = exp2f(-p.beta * __log2f(den));
        s[j][e] = pw;
        w[j][e] = kBwd ? g[j][e] * v[j][e] * pw / den : 0.0f;  // t_c of the backward
      }
    }
    if constexpr (kBwd) {
      float around[M][kVec];  // the c whose window holds j: [j - kHi, j + kLo]
      window_sums<L, M, kHi, kLo>(w, lane, around);
      const float coef = 2.0f * p.alpha * p.beta / kSize;
#pragma unroll
      for (int j = 0; j < M; ++j) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[j][e] = g[j][e] * s[j][e] - coef * v[j][e] * around[j][e];
      }
    } else {
#pragma unroll
      for (int j = 0; j < M; ++j) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[j][e] *= s[j][e];
      }
    }
#pragma unroll
    for (int j = 0; j < M; ++j) {
      if (valid && j * L + lane < nvl) store_vec(out + line * c + int64_t(j * L + lane) * kVec, v[j]);
    }
  }
}

// Largest |got - want| over every 97th line, relative to the largest |want|
// there: PyTorch's LRN in float64 (window clipped at the line's ends, still
// divided by size).
double check(const std::vector<float>& hx, const std::vector<float>& hdy,
             const std::vector<float>& got, int64_t lines, int c, int size, LrnParams p,
             bool bwd) {
  const int lo = size / 2, hi = (size - 1) / 2;
  RelativeError rel;
  std::vector<double> den(c), t(c);
  for (int64_t line = 0; line < lines; line += 97) {
    const float* x = &hx[line * c];
    const float* g = &hdy[line * c];
    for (int ch = 0; ch < c; ++ch) {
      double sum = 0;
      for (int d = ch - lo; d <= ch + hi; ++d) sum += d >= 0 && d < c ? double(x[d]) * x[d] : 0;
      den[ch] = p.k + p.alpha / size * sum;
      t[ch] = double(g[ch]) * x[ch] * std::pow(den[ch], -p.beta - 1.0);
    }
    for (int ch = 0; ch < c; ++ch) {
      double want = x[ch] * std::pow(den[ch], -p.beta);
      if (bwd) {
        double around = 0;
        for (int d = ch - hi; d <= ch + lo; ++d) around += d >= 0 && d < c ? t[d] : 0;
        want = g[ch] * std::pow(den[ch], -p.beta) - 2.0 * p.alpha * p.beta / size * x[ch] * around;
      }
      rel.add(got[line * c + ch], want);
    }
  }
  return rel.value();
}

// Times lrn_lines<L, C / 8 / L> forward and backward on one case.
template <int L, int M>
void run(cudaStream_t s, const LineCase& k, int grid, float copy, const bf16* x, const bf16* dy,
         bf16* out, const std::vector<float>& hx, const std::vector<float>& hdy) {
  if (M * L * kVec < k.c || (M - 1) * L * kVec >= k.c) return;  // not this case's split
  // alpha well above PyTorch's default 1e-4, so that the window's sums show
  // in bf16 and the check sees them; the time does not depend on it.
  const LrnParams p{0.5f, 0.75f, 1.0f};
  const int64_t n = k.lines * k.c;
  for (bool bwd : {false, true}) {
    auto kernel = bwd ? lrn_lines<L, M, 5, true> : lrn_lines<L, M, 5, false>;
    const float us =
        time_us(s, [&] { kernel<<<grid, kThreads, 0, s>>>(x, dy, out, k.lines, k.c, p); });
    CHECK(cudaGetLastError());
    const double err = check(hx, hdy, to_host(out, n, true), k.lines, k.c, 5, p, bwd);
    const double bytes = (bwd ? 3.0 : 2.0) * n * sizeof(bf16);
    std::printf("lrn %-4s %-14s L=%-2d M=%d %9.1f us %6.0f GB/s %4.0f%%  err %.1e\n",
                bwd ? "bwd" : "fwd", k.name, L, M, us, bytes / us / 1e3,
                100 * bytes / us / 1e3 / copy, err);
  }
}

// The handlers' kernel on the same case and grid rule (hd), for the gap
// between the bench's 62.8 µs and this file's 52.9 at 128x55x55x96 (v61).
template <int M>
void run_handler(cudaStream_t s, const LineCase& k, int sms, float copy, const bf16* x,
                 const bf16* dy, bf16* out, const std::vector<float>& hx,
                 const std::vector<float>& hdy) {
  using namespace jaxnorm::cuda;
  LinePlan plan;
  if (!plan_line(k.c / kVec, &plan) || plan.m != M) return;
  const LrnParams p{0.5f, 0.75f, 1.0f};
  const LrnConsts pc{p.alpha / 5, p.beta, p.k};
  const int teams = kLineThreads >> plan.log_lanes;
  const int grid = int(std::min<int64_t>((k.lines + teams - 1) / teams, int64_t(sms) * 8));
  const int64_t n = k.lines * k.c;
  for (bool bwd : {false, true}) {
    const float us = time_us(s, [&] {
      if (bwd) {
        each_line<bf16, M, kVec><<<grid, kLineThreads, 0, s>>>(k.lines, k.c, plan, x, dy, out,
                                                               LrnLine<5, true>{pc});
      } else {
        each_line<bf16, M, kVec><<<grid, kLineThreads, 0, s>>>(k.lines, k.c, plan, x, nullptr,
                                                               out, LrnLine<5, false>{pc});
      }
    });
    CHECK(cudaGetLastError());
    const double err = check(hx, hdy, to_host(out, n, true), k.lines, k.c, 5, p, bwd);
    const double bytes = (bwd ? 3.0 : 2.0) * n * sizeof(bf16);
    std::printf("lrn %-4s %-14s hd L=%-2d M=%d %6.1f us %6.0f GB/s %4.0f%%  err %.1e\n",
                bwd ? "bwd" : "fwd", k.name, plan.lanes, M, us, bytes / us / 1e3,
                100 * bytes / us / 1e3 / copy, err);
  }
}

// Channels-first x (NCHW, M = n, B = positions): the handlers' lrn_positions
// at kChunk channels' loads in flight and kMinFwd / kMinBwd blocks an SM in
// its launch bound (0: ptxas's own registers), checked against the same
// reference on the lines gathered channels-last.
template <int kChunk, int kMinFwd = 0, int kMinBwd = 0, bool kWholeGrid = false>
void run_positions(cudaStream_t s, const LineCase& k, int64_t positions, int sms, float copy,
                   const bf16* x, const bf16* dy, bf16* out, const std::vector<float>& hx,
                   const std::vector<float>& hdy) {
  using namespace jaxnorm::cuda;
  const LrnParams p{0.5f, 0.75f, 1.0f};
  const LrnConsts pc{p.alpha / 5, p.beta, p.k};
  const int64_t n = k.lines * k.c, m = k.lines / positions;
  const jaxnorm::ChannelShape shape{m, k.c, positions};
  // kWholeGrid: a block for every 256 positions, no thread taking a second.
  const int64_t blocks = (k.lines + kLineThreads - 1) / kLineThreads;
  const int grid = int(kWholeGrid ? blocks : std::min<int64_t>(blocks, int64_t(sms) * 8));
  auto lines_of = [&](const std::vector<float>& v) {  // (m, c, b) -> (m, b, c)
    std::vector<float> t(n);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t c = 0; c < k.c; ++c) {
        for (int64_t b = 0; b < positions; ++b) {
          t[(i * positions + b) * k.c + c] = v[(i * k.c + c) * positions + b];
        }
      }
    }
    return t;
  };
  const std::vector<float> lx = lines_of(hx), ldy = lines_of(hdy);
  for (bool bwd : {false, true}) {
    const float us = time_us(s, [&] {
      if (bwd) {
        lrn_positions<bf16, 5, true, kChunk, kMinBwd>
            <<<grid, kLineThreads, 0, s>>>(shape, x, dy, out, pc);
      } else {
        lrn_positions<bf16, 5, false, kChunk, kMinFwd>
            <<<grid, kLineThreads, 0, s>>>(shape, x, nullptr, out, pc);
      }
    });
    CHECK(cudaGetLastError());
    const double err = check(lx, ldy, lines_of(to_host(out, n, true)), k.lines, k.c, 5, p, bwd);
    const double bytes = (bwd ? 3.0 : 2.0) * n * sizeof(bf16);
    std::printf("lrn %-4s %-14s nchw chunk=%-2d min=%d %s %6.1f us %6.0f GB/s %4.0f%%  err %.1e\n",
                bwd ? "bwd" : "fwd", k.name, kChunk, bwd ? kMinBwd : kMinFwd,
                kWholeGrid ? "whole" : "wave ", us, bytes / us / 1e3,
                100 * bytes / us / 1e3 / copy, err);
  }
}

}  // namespace

int main() {
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const LineCase cases[] = {{128 * 55 * 55, 96, "128x55x55x96"},
                            {128 * 27 * 27, 256, "128x27x27x256"}};
  const int sms = prop.multiProcessorCount;
  for (const LineCase& k : cases) {
    const LineData d(s, prop, k);
    const int grid = sms * (2048 / kThreads);
    run<2, 6>(s, k, grid, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    run<4, 3>(s, k, grid, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    run<8, 4>(s, k, grid, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    run<16, 2>(s, k, grid, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    run<32, 1>(s, k, grid, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    run_handler<1>(s, k, sms, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    run_handler<2>(s, k, sms, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    run_handler<3>(s, k, sms, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    if (k.c == 96) {  // the same bytes as NCHW 128x96x55x55
      const LineCase nchw{k.lines, k.c, "128x96x55x55"};
      run_positions<8>(s, nchw, 55 * 55, sms, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
      run_positions<8, 0, 0, true>(s, nchw, 55 * 55, sms, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
      run_positions<8, 8, 6>(s, nchw, 55 * 55, sms, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
      run_positions<8, 8, 6, true>(s, nchw, 55 * 55, sms, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
      run_positions<16, 6, 4>(s, nchw, 55 * 55, sms, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    }
  }
  std::printf("%s\n", utc_date().c_str());
  return 0;
}
