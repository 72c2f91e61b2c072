#!/usr/bin/env bash
# One GPU session: build jaxnorm with its CUDA kernels (no network needed: the
# build uses the machine's jax, nanobind and scikit-build-core), run the whole
# test suite on the GPU, then the benchmarks. Everything lands in $OUT.
#   OUT=/some/dir bash benchmarks/gpu_run.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
if [ -d .whl ]; then  # test-only wheels the machine may lack (pytest)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
  | tee "$OUT/device.txt"
echo "== build"
start=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -v \
    -C cmake.define.JAXNORM_CUDA=ON \
    -C cmake.define.JAXNORM_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
(cd /tmp && python3 -c "import jax, jaxnorm; print('jax', jax.__version__, jax.devices(), 'kernels:', jaxnorm.kernel_platforms())")

echo "== tests on the GPU"
(cd /tmp && python3 -m pytest -q -p no:cacheprovider "$repo/tests" 2>&1) | tee "$OUT/tests.log" | tail -15
tests_rc=${PIPESTATUS[0]}

echo "== kernel plans (C++, every register-path plan)"
jaxinc=$(python3 -c "import jax; print(jax.ffi.include_dir())")
if nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp -isystem "$jaxinc" \
    benchmarks/kernels/row_norm_plans.cu -o /tmp/row_norm_plans > "$OUT/plans_build.log" 2>&1; then
  /tmp/row_norm_plans > "$OUT/row_norm_plans.txt" 2>&1 || tail -5 "$OUT/row_norm_plans.txt"
  head -2 "$OUT/row_norm_plans.txt"
else
  tail -5 "$OUT/plans_build.log"
fi

echo "== benchmarks"
(cd benchmarks && python3 bench_row_norm.py --out "$OUT") 2>&1 | tee "$OUT/bench.log" | tail -40
exit "$tests_rc"
