// CHECK(call): a failed CUDA runtime call ends the program with its file,
// line and error (the benchmark and check programs in this directory).
#pragma once
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

inline void check_at(cudaError_t e, const char* file, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s:%d %s\n", file, line, cudaGetErrorString(e));
  std::exit(1);
}
#define CHECK(...) check_at((__VA_ARGS__), __FILE__, __LINE__)
