#!/usr/bin/env bash
# Builds, on a machine with nvcc but no GPU, what gpu_run.sh's PREBUILT=1
# takes on the GPU machine in place of its own build: the CUDA module for that
# machine's Python and jax (jaxnorm/_jaxnorm.cpython-3XX-*.so) and the C++
# benchmarks (build-bench/row_norm_plans, lrn_lines, softmax_lines,
# channel_plans, channel_probe and gn_cluster). The module's
# FFI headers come from the GPU machine's jax version (a handler loads in that
# jaxlib and newer ones).
#   PYTHON=python3.12 JAX_VERSION=0.11.2 CUDA_ARCHS=90 bash benchmarks/prebuild.sh
set -euo pipefail
export PATH=/usr/local/cuda/bin:$PATH
PYTHON=${PYTHON:-python3.12}
JAX_VERSION=${JAX_VERSION:-0.11.2}
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-/tmp/jaxnorm-prebuild-venv}
build=${BUILD_DIR:-/tmp/jaxnorm-prebuild}

if [ ! -x "$venv/bin/python" ]; then
  "$PYTHON" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q nanobind "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION"
cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$venv/bin/python" -DJAXNORM_CUDA=ON \
  -DJAXNORM_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" -DJAXNORM_CUDA_LINEINFO=ON \
  > "$build.configure.log"
ninja -C "$build"
cp "$build"/_jaxnorm.cpython-*.so "$repo/jaxnorm/"

mkdir -p "$repo/build-bench"
jaxinc=$("$venv/bin/python" -c "import jax; print(jax.ffi.include_dir())")
for name in row_norm_plans lrn_lines softmax_lines channel_plans channel_probe gn_cluster; do  # as gpu_run.sh's harness() builds them
  nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -I"$repo/cpp" -isystem "$jaxinc" \
    "$repo/benchmarks/kernels/$name.cu" -o "$repo/build-bench/$name"
done
ls -l "$repo"/jaxnorm/_jaxnorm.cpython-*.so "$repo"/build-bench/*
