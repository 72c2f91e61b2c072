// The orderings the warp-role backward (cpp/cuda/row_norm_bwd_roles.cuh)
// relies on, each alone in a small kernel, to learn which of them
// compute-sanitizer's racecheck understands (sm_90):
//
//   bulk     one bulk copy (cp.async.bulk) into shared memory, awaited on its
//            mbarrier's transaction count, then read by every warp;
//   ring     two stages reused row after row: a stage is copied again only
//            after every warp arrived on its `empty` mbarrier and the copying
//            thread waited there (and fenced the async proxy);
//   slots    each warp writes its slot and arrives on an mbarrier that one
//            warp waits on before it reads every slot (no block barrier).
//
// In ring and slots a warp's lanes read, meet at __syncwarp, and its first
// lane alone arrives on the barrier that releases the memory to its next
// writer. ring_all and slots_all have every lane that read arrive itself
// (counts of threads, not warps): the release then covers each reader's own
// accesses, with no transitive step through __syncwarp.
//
// Every variant checks its sums exactly (small integers) and prints them; a
// hazard report on a variant whose sums are right, run after run, is then the
// tool's, not the kernel's.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp \
//        -isystem $(python -c "import jax; print(jax.ffi.include_dir())") \
//        benchmarks/kernels/mbarrier_racecheck.cu -o mbarrier_racecheck
//   for v in bulk ring slots ring_all slots_all; do
//     compute-sanitizer --tool racecheck ./mbarrier_racecheck $v
//   done
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda/common.cuh"
#include "cuda_check.h"
using namespace jaxnorm::cuda;

constexpr int kThreads = 128, kWarps = kThreads / 32, kRowFloats = 256, kRows = 64;

// Variant bulk: one row copied once, summed by every warp (each the whole row).
__global__ void one_bulk_copy(const float* in, float* out) {
  __shared__ __align__(128) float row[kRowFloats];
  __shared__ __align__(8) uint64_t full;
  if (threadIdx.x == 0) {
    mbar_init(&full, 1);
    fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_expect(&full, sizeof(row));
    bulk_load(row, in + blockIdx.x * kRowFloats, sizeof(row), &full);
  }
  mbar_wait(&full, 0);
  float s = 0;
  for (int c = threadIdx.x % 32; c < kRowFloats; c += 32) s += row[c];
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (threadIdx.x % 32 == 0) out[blockIdx.x * kWarps + threadIdx.x / 32] = s;
}

// Variant ring: kRows rows through two stages; thread 0 copies, every warp
// sums every row and arrives on the stage's `empty` when done reading it
// (its first lane, or with kAllLanes every lane).
template <bool kAllLanes>
__global__ void two_stage_ring(const float* in, float* out) {
  __shared__ __align__(128) float stage[2][kRowFloats];
  __shared__ __align__(8) uint64_t full[2], empty[2];
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(&full[s], 1), mbar_init(&empty[s], kAllLanes ? kThreads : kWarps);
    }
    fence_mbar_init();
  }
  __syncthreads();
  auto copy = [&](int r) {
    const int s = r % 2;
    if (r >= 2) {  // the warps are done with the stage's previous row
      mbar_wait(&empty[s], uint32_t(r / 2 - 1) & 1);
      fence_proxy_async();
    }
    mbar_expect(&full[s], sizeof(stage[s]));
    bulk_load(stage[s], in + (blockIdx.x * kRows + r) * kRowFloats, sizeof(stage[s]), &full[s]);
  };
  if (threadIdx.x == 0) copy(0), copy(1);
  for (int r = 0; r < kRows; ++r) {
    const int s = r % 2;
    mbar_wait(&full[s], uint32_t(r / 2) & 1);
    float v = 0;
    for (int c = threadIdx.x % 32; c < kRowFloats; c += 32) v += stage[s][c];
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (kAllLanes) {
      mbar_arrive(&empty[s]);
    } else {
      __syncwarp();
      if (threadIdx.x % 32 == 0) mbar_arrive(&empty[s]);
    }
    if (threadIdx.x % 32 == 0) out[(blockIdx.x * kRows + r) * kWarps + threadIdx.x / 32] = v;
    if (threadIdx.x == 0 && r + 2 < kRows) copy(r + 2);
  }
}

// Variant slots: row after row, every warp writes its slot and arrives on
// `summed`; warp 0 waits there, adds the slots and writes the total. A slot
// is written again only after warp 0 arrived on `read` (its first lane, or
// with kAllLanes every lane; two sets of slots).
template <bool kAllLanes>
__global__ void slots_through_mbarrier(float* out) {
  __shared__ float slots[2][kWarps];
  __shared__ __align__(8) uint64_t summed[2], read[2];
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(&summed[s], kWarps), mbar_init(&read[s], kAllLanes ? 32 : 1);
    }
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = 0; r < kRows; ++r) {
    const int s = r % 2;
    if (r >= 2) mbar_wait(&read[s], uint32_t(r / 2 - 1) & 1);
    if (lane == 0) {
      slots[s][warp] = float((blockIdx.x + r + warp) % 7);
      mbar_arrive(&summed[s]);
    }
    if (warp == 0) {
      mbar_wait(&summed[s], uint32_t(r / 2) & 1);
      float total = 0;
      for (int w = 0; w < kWarps; ++w) total += slots[s][w];
      if (kAllLanes) {
        mbar_arrive(&read[s]);
      } else {
        __syncwarp();
        if (lane == 0) mbar_arrive(&read[s]);
      }
      if (lane == 0) out[blockIdx.x * kRows + r] = total;
    }
  }
}

int main(int argc, char** argv) {
  const char* variant = argc > 1 ? argv[1] : "bulk";
  const int blocks = 8;
  std::vector<float> in(size_t(blocks) * kRows * kRowFloats);
  for (size_t i = 0; i < in.size(); ++i) in[i] = float(i % 5);
  float *d_in, *d_out;
  CHECK(cudaMalloc(&d_in, in.size() * sizeof(float)));
  CHECK(cudaMalloc(&d_out, size_t(blocks) * kRows * kWarps * sizeof(float)));
  CHECK(cudaMemcpy(d_in, in.data(), in.size() * sizeof(float), cudaMemcpyHostToDevice));
  auto row_sum = [&](size_t row) {
    float s = 0;
    for (int c = 0; c < kRowFloats; ++c) s += in[row * kRowFloats + c];
    return s;
  };
  std::vector<float> got, want;
  if (!std::strcmp(variant, "bulk")) {
    one_bulk_copy<<<blocks, kThreads>>>(d_in, d_out);
    for (int b = 0; b < blocks; ++b) {
      for (int w = 0; w < kWarps; ++w) want.push_back(row_sum(size_t(b)));  // block b copies row b
    }
  } else if (!std::strcmp(variant, "ring") || !std::strcmp(variant, "ring_all")) {
    if (std::strcmp(variant, "ring")) {
      two_stage_ring<true><<<blocks, kThreads>>>(d_in, d_out);
    } else {
      two_stage_ring<false><<<blocks, kThreads>>>(d_in, d_out);
    }
    for (int b = 0; b < blocks; ++b) {
      for (int r = 0; r < kRows; ++r) {
        for (int w = 0; w < kWarps; ++w) want.push_back(row_sum(size_t(b) * kRows + r));
      }
    }
  } else if (!std::strcmp(variant, "slots") || !std::strcmp(variant, "slots_all")) {
    if (std::strcmp(variant, "slots")) {
      slots_through_mbarrier<true><<<blocks, kThreads>>>(d_out);
    } else {
      slots_through_mbarrier<false><<<blocks, kThreads>>>(d_out);
    }
    for (int b = 0; b < blocks; ++b) {
      for (int r = 0; r < kRows; ++r) {
        float total = 0;
        for (int w = 0; w < kWarps; ++w) total += float((b + r + w) % 7);
        want.push_back(total);
      }
    }
  } else {
    std::fprintf(stderr, "variant must be bulk, ring, slots, ring_all or slots_all, got %s\n",
                 variant);
    return 2;
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  got.resize(want.size());
  CHECK(cudaMemcpy(got.data(), d_out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) bad += got[i] != want[i];
  std::printf("%s: %zu sums, %d wrong\n", variant, want.size(), bad);
  return bad != 0;
}
