// The channel softmax's CUDA kernel (cpp/cuda/channel_softmax.cu: each_line
// of its lines) on bf16 lines under several teams: L lanes a line, M vectors a
// lane (the handler's is plan_line's, with SoftmaxLines::max_vecs). Fewer
// lanes a line hold more of it each and
// spend fewer shuffles on its max and sums; every load stays the vector width
// the line allows. Times the forward and the backward, each with its loads
// conditional and with every load made (load_line's kEvery), against a
// device-to-device copy, and checks each against a float64 host reference on
// sampled lines; "(handler)" marks what the handler runs.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp \
//        -isystem $(python -c "import jax; print(jax.ffi.include_dir())") \
//        benchmarks/kernels/softmax_lines.cu -o softmax_lines && ./softmax_lines
#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda/channel_softmax.cu"  // the handlers' kernel (each_line of SoftmaxFwdLine)
#include "graph_timing.h"

namespace softmax_lines {

using bf16 = __nv_bfloat16;
using namespace jaxnorm::cuda;

// The handler's lines (softmax_fwd_line, softmax_bwd_line) with their loads
// as kEvery says, whatever the handler's op would choose.
template <bool kBwd, bool kEvery>
struct LineAs : SoftmaxLines {
  template <typename X, int M, int V>
  __device__ __forceinline__ void apply(const LineLane& t, const X* x, const X* dy, X* out,
                                        bool valid) const {
    if constexpr (kBwd) {
      softmax_bwd_line<X, M, V, kEvery>(t, x, dy, out, valid);
    } else {
      softmax_fwd_line<X, M, V, kEvery>(t, x, out, valid);
    }
  }
};

// Largest |got - want| over every 97th line relative to the largest |want|:
// the softmax (bwd: its backward) in float64.
double check(const std::vector<float>& hx, const std::vector<float>& hdy,
             const std::vector<float>& got, int64_t lines, int c, bool bwd) {
  RelativeError rel;
  std::vector<double> y(c);
  for (int64_t line = 0; line < lines; line += 97) {
    const float* x = &hx[line * c];
    const float* g = &hdy[line * c];
    double top = -INFINITY, sum = 0, dot = 0;
    for (int ch = 0; ch < c; ++ch) top = std::fmax(top, x[ch]);
    for (int ch = 0; ch < c; ++ch) sum += y[ch] = std::exp(double(x[ch]) - top);
    for (int ch = 0; ch < c; ++ch) dot += (y[ch] /= sum) * g[ch];
    for (int ch = 0; ch < c; ++ch) {
      const double want = bwd ? y[ch] * (g[ch] - dot) : y[ch];
      rel.add(got[line * c + ch], want);
    }
  }
  return rel.value();
}

// Times each_line<bf16, M, V> at L lanes a line, forward and backward;
// nothing where M vectors of L lanes are not this case's fewest.
template <int V, int L, int M>
void run(cudaStream_t s, const LineCase& k, int sms, float copy, const bf16* x, const bf16* dy,
         bf16* out, const std::vector<float>& hx, const std::vector<float>& hdy) {
  const int vecs = k.c / V;
  if (k.c % V != 0 || M * L < vecs || (M - 1) * L >= vecs) return;
  LinePlan plan;
  plan.lanes = L, plan.m = M;
  while ((1 << plan.log_lanes) < L) ++plan.log_lanes;
  const int teams = kLineThreads / L;
  const int grid = int(std::min<int64_t>((k.lines + teams - 1) / teams, int64_t(sms) * 8));
  const int64_t n = k.lines * k.c;
  LinePlan planned;
  const bool is_planned =
      plan_line(vecs, &planned, SoftmaxLines::max_vecs(V * 2)) && planned.lanes == L;
  // The forward and the backward, each with conditional loads and with kEvery.
  for (int form = 0; form < 4; ++form) {
    const bool bwd = form >= 2, every = form % 2 == 1;
    const float us = time_us(s, [&] {
      auto go = [&](auto op) {
        each_line<bf16, M, V><<<grid, kLineThreads, 0, s>>>(k.lines, k.c, plan, x,
                                                            bwd ? dy : nullptr, out, op);
      };
      switch (form) {
        case 0: go(LineAs<false, false>{}); break;
        case 1: go(LineAs<false, true>{}); break;
        case 2: go(LineAs<true, false>{}); break;
        default: go(LineAs<true, true>{}); break;
      }
    });
    CHECK(cudaGetLastError());
    const double err = check(hx, hdy, to_host(out, n, true), k.lines, k.c, bwd);
    const double bytes = (bwd ? 3.0 : 2.0) * n * sizeof(bf16);
    const bool handler = is_planned && every == (bwd ? SoftmaxLines::every<M, true>()
                                                     : SoftmaxLines::every<M, false>());
    std::printf("softmax %-5s %-14s V=%d L=%-2d M=%-2d %7.1f us %6.0f GB/s %4.0f%%  err %.1e%s\n",
                bwd ? (every ? "bwd-e" : "bwd") : (every ? "fwd-e" : "fwd"), k.name, V, L, M,
                us, bytes / us / 1e3, 100 * bytes / us / 1e3 / copy, err,
                handler ? "  (handler)" : "");
  }
}

// The teams of 32 down to 1 lane that suit the cases' lines (run skips the
// others).
template <int V>
void run_all(cudaStream_t s, const LineCase& k, int sms, float copy, const bf16* x, const bf16* dy,
             bf16* out, const std::vector<float>& hx, const std::vector<float>& hdy) {
  run<V, 32, 3>(s, k, sms, copy, x, dy, out, hx, hdy);
  run<V, 32, 4>(s, k, sms, copy, x, dy, out, hx, hdy);
  run<V, 16, 5>(s, k, sms, copy, x, dy, out, hx, hdy);
  run<V, 16, 8>(s, k, sms, copy, x, dy, out, hx, hdy);
  run<V, 8, 10>(s, k, sms, copy, x, dy, out, hx, hdy);
  run<V, 8, 16>(s, k, sms, copy, x, dy, out, hx, hdy);
  run<V, 8, 2>(s, k, sms, copy, x, dy, out, hx, hdy);
  run<V, 4, 19>(s, k, sms, copy, x, dy, out, hx, hdy);
  run<V, 4, 3>(s, k, sms, copy, x, dy, out, hx, hdy);
  run<V, 2, 5>(s, k, sms, copy, x, dy, out, hx, hdy);
  run<V, 1, 10>(s, k, sms, copy, x, dy, out, hx, hdy);
}

}  // namespace softmax_lines

int main() {
  using namespace softmax_lines;
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  // The benchmark's 150 classes (4-byte vectors), 80 classes (16-byte vectors
  // of 10 a line), and 1000 (16-byte, 125 a line: beyond the handler's 96).
  const LineCase cases[] = {{16 * 64 * 64, 150, "16x64x64x150"},
                            {16 * 64 * 64, 80, "16x64x64x80"},
                            {16384, 1000, "16384x1000"}};
  const int sms = prop.multiProcessorCount;
  for (const LineCase& k : cases) {
    const LineData d(s, prop, k);
    if (k.c * sizeof(bf16) % 16 == 0) {
      run_all<8>(s, k, sms, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    } else {
      run_all<2>(s, k, sms, d.copy, d.x, d.dy, d.out, d.hx, d.hdy);
    }
  }
  std::printf("%s\n", utc_date().c_str());
  return 0;
}
