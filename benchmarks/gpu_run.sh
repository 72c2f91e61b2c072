#!/usr/bin/env bash
# One run on a GPU machine: build jaxnorm with its CUDA kernels (no network needed: the
# build uses the machine's jax, nanobind and scikit-build-core), run the whole
# test suite on the GPU, then the benchmarks. Everything lands in $OUT.
#   OUT=/some/dir bash benchmarks/gpu_run.sh
# STEPS picks what runs after the build (unset: tests plans bench; also
# "examples", which runs examples/ on the machine's GPUs, "model", the
# Llama-style model benchmark (MODEL_ARGS go to bench_llama.py), "context",
# norm_context.py's backward after a matmul and back to back (RMSNorm and
# LayerNorm, 65536x1024 and 16384x4096), "unet", the convolutional models' benchmark
# (GroupNorm, BatchNorm), "command_buffers", command_buffers.py (CB_ARGS
# go to it), and "sanitize", the row-norm tests under
# compute-sanitizer's SANITIZE_TOOLS, or SANITIZE_TESTS selected by pytest's
# -k SANITIZE_K or named in the file SANITIZE_IDS, in SANITIZE_N shards,
# SANITIZE_P at a time, from shard SANITIZE_FROM; "mbarrier", racecheck on
# kernels/mbarrier_racecheck.cu's orderings alone; "channel_plans",
# kernels/channel_plans.cu; "channel_probe", kernels/channel_probe.cu (and
# its profile by Nsight Compute); "gn_cluster", kernels/gn_cluster.cu (BWD=1:
# its backward);
# "lrn_lines", kernels/lrn_lines.cu; "softmax_lines",
# kernels/softmax_lines.cu: these six and "plans" alone skip
# the jaxnorm build); SKIP_BUILD=1 keeps an earlier
# build; PREBUILT=1 takes the module built elsewhere for this machine's Python
# and GPU (jaxnorm/_jaxnorm.cpython-3XX-*.so, and build-bench/'s harnesses
# for their steps: benchmarks/prebuild.sh), from the source
# tree, in place of the build;
# BENCH_ARGS
# go to bench_row_norm.py, UNET_ARGS to bench_unet.py; TESTS picks test files (default: all),
# TESTS_K the tests in them by pytest's -k, TESTS_N
# runs them in that many processes (each takes a share of the GPU's memory;
# default 12: the whole suite in about five minutes on an H200, where one
# process took nine for a tenth of it; TESTS_N= runs one); the step
# "ncu" profiles the cases in NCU_CASES (see ncu_probe.py) with Nsight
# Compute where the machine lets it read the counters.
set -uo pipefail
export PATH=/usr/local/cuda/bin:$PATH
OUT=${OUT:-$PWD/gpu-out}
STEPS=${STEPS-tests plans bench}  # STEPS="" (set, empty): the build alone
step() { [[ " $STEPS " == *" $1 "* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
if [ -d .whl ]; then  # wheels the machine may lack (pytest; Liger-Kernel, a benchmark peer)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; uname -r; } \
  | tee "$OUT/device.txt"
needs_build=$([ -z "$STEPS" ] && echo 1)  # the build alone
for s in $STEPS; do  # the mbarrier check and the C++ harnesses need no jaxnorm build
  case $s in mbarrier|channel_plans|channel_probe|gn_cluster|lrn_lines|softmax_lines|plans) ;;
    *) needs_build=1 ;;
  esac
done
if [ -n "$needs_build" ]; then
  echo "== build"
  start=$(date +%s)
  if [ "${PREBUILT:-0}" = 1 ]; then
    # The source tree on the path, with its module: no pip install.
    export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
    module=$(cd /tmp && python3 -c "import jaxnorm._jaxnorm as m; print(m.__file__)") || exit 1
    echo "prebuilt module: $module"
  elif [ "${SKIP_BUILD:-0}" = 1 ] && (cd /tmp && python3 -c "import jaxnorm" 2>/dev/null); then
    echo "kept the earlier build"
  elif ! python3 -m pip install --no-build-isolation --no-deps -v \
      -C cmake.define.JAXNORM_CUDA=ON \
      -C cmake.define.JAXNORM_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" \
      -C cmake.define.JAXNORM_CUDA_LINEINFO=ON \
      . > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; exit 1
  fi
  echo "built in $(( $(date +%s) - start )) s"
  rm -f "$OUT/build.log"  # kept only when the build fails
  (cd /tmp && python3 -c "import jax, jaxnorm; print('jax', jax.__version__, jax.devices(), 'kernels:', jaxnorm.kernel_platforms())")
fi

tests_rc=0
TESTS_N=${TESTS_N-12}
if step tests; then
  echo "== tests on the GPU"
  # Compiling dominates the suite: processes side by side share the GPU.
  (cd /tmp && env ${TESTS_N:+XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.8 / $TESTS_N, 3))")} \
      python3 -m pytest -q -p no:cacheprovider ${TESTS_N:+-n $TESTS_N} ${TESTS_K:+-k "$TESTS_K"} \
      ${TESTS:-$repo/tests} 2>&1) \
    | tee "$OUT/tests.log" | tail -15
  tests_rc=${PIPESTATUS[0]}
fi

if step examples; then
  echo "== examples"
  for ex in quickstart sharded_training llama_train unet_train; do
    (cd /tmp && python3 "$repo/examples/$ex.py" 2>&1) | tee "$OUT/example_$ex.log" | tail -12
  done
fi

if step ncu; then
  echo "== Nsight Compute: ${NCU_CASES}"
  # Without preallocation, ncu saves and restores only the buffers in use
  # between its replays, not most of the GPU's memory.
  (cd benchmarks && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_TIMEOUT:-240}" \
      ncu --profile-from-start off --clock-control none --set full \
      --import-source no -f -o /tmp/probe python3 ncu_probe.py ${NCU_CASES}) \
      > "$OUT/ncu.log" 2>&1 || tail -5 "$OUT/ncu.log"
  if [ -f /tmp/probe.ncu-rep ]; then
    ncu -i /tmp/probe.ncu-rep --page details > "$OUT/ncu_details.txt" 2>&1
    ncu -i /tmp/probe.ncu-rep --page source --print-source sass --csv \
        --kernel-name "${NCU_SOURCE_KERNELS:-regex:fwd_regs|bwd_regs}" > "$OUT/ncu_sass.csv" 2>&1
    grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Memory Throughput" "$OUT/ncu_details.txt" | head -200
  fi
fi

if step sanitize; then
  # An allocator that gives each buffer an allocation of its own, so that
  # memcheck sees the bounds of each: from jax 0.11 that is "address" (its
  # "platform" shares XLA's backend allocator, which may suballocate: jax's
  # docs/gpu_memory_allocation.rst), before it "platform". Only jaxnorm's
  # kernels are instrumented.
  # SANITIZE_ALLOCATOR overrides the choice.
  allocator=${SANITIZE_ALLOCATOR:-$(python3 -c "import jax; \
v = tuple(map(int, jax.__version__.split('.')[:2])); print('address' if v >= (0, 11) else 'platform')")}
  export allocator
  # The tests are split into SANITIZE_N shards (every N-th test), each run by a
  # process of its own under compute-sanitizer, SANITIZE_P at a time: under
  # memcheck a process's GPU memory grows with the tests it has run (v59), so
  # none runs many. Their logs are joined into one.
  sanitize_shard() {  # tool, shard
    (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=$allocator \
        XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" \
        timeout "${SANITIZE_TIMEOUT:-280}" \
        compute-sanitizer --tool "$1" --kernel-name kns=jaxnorm --error-exitcode 3 \
        env PYTHONPATH="$repo/benchmarks${PYTHONPATH:+:$PYTHONPATH}" \
        python3 -m pytest -q -p no:cacheprovider -p sanitize_plugin --shard "$2/${SANITIZE_N:-1}" \
        ${SANITIZE_K:+-k "$SANITIZE_K"} ${SANITIZE_IDS:+--ids-from "$repo/$SANITIZE_IDS"} \
        ${SANITIZE_CLEAR:+--clear-caches} \
        ${SANITIZE_TESTS:-$repo/tests/test_row_norm.py $repo/tests/test_add_norm.py} \
        > "/tmp/sanitizer_$1_$2.log" 2>&1
    echo "exit status $?" >> "/tmp/sanitizer_$1_$2.log")
  }
  export -f sanitize_shard
  export repo SANITIZE_N SANITIZE_TIMEOUT SANITIZE_K SANITIZE_IDS SANITIZE_CLEAR SANITIZE_TESTS
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    echo "== compute-sanitizer $tool, ${SANITIZE_N:-1} shards, ${SANITIZE_P:-1} at a time, allocator $allocator"
    # SANITIZE_BUDGET: seconds for all shards; the logs are joined then, whole or not.
    rm -f /tmp/sanitizer_"$tool"_*.log
    seq "${SANITIZE_FROM:-0}" $((${SANITIZE_N:-1} - 1)) \
      | timeout "${SANITIZE_BUDGET:-3600}" xargs -P "${SANITIZE_P:-1}" -I{} bash -c "sanitize_shard $tool {}"
    # The budget stops xargs, not the shards it started: they would hold the
    # GPU through the steps after this one.
    pkill -f "compute-sanitizer --tool $tool" && sleep 5
    for ((i = ${SANITIZE_FROM:-0}; i < ${SANITIZE_N:-1}; i++)); do
      printf '\n==== shard %s/%s\n' "$i" "${SANITIZE_N:-1}"  # (a cut log may end mid-line)
      cat "/tmp/sanitizer_${tool}_$i.log" 2>/dev/null || echo "(not started)"
    done > "$OUT/sanitizer_$tool.log"
    grep -hE "SUMMARY|exit status" "$OUT/sanitizer_$tool.log" | sort | uniq -c
    grep -hE " in [0-9.]+s" "$OUT/sanitizer_$tool.log" | grep -oE "[0-9]+ (passed|failed|skipped|errors?)" \
      | awk '{n[$2] += $1} END {for (k in n) printf "%s %d, ", k, n[k]; print "in all"}'
  done
fi

# Builds benchmarks/kernels/$1.cu into /tmp/$1 (PREBUILT=1: copies
# build-bench/$1, from prebuild.sh); the build log lands in $OUT on failure.
harness() {
  { [ "${PREBUILT:-0}" = 1 ] && cp "build-bench/$1" "/tmp/$1"; } && return 0
  nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp \
      -isystem "$(python3 -c "import jax; print(jax.ffi.include_dir())")" \
      "benchmarks/kernels/$1.cu" -o "/tmp/$1" > "$OUT/$1_build.log" 2>&1 \
    && rm -f "$OUT/$1_build.log" || { tail -20 "$OUT/$1_build.log"; return 1; }
}

if step mbarrier && harness mbarrier_racecheck; then
  # Which mbarrier orderings racecheck understands (kernels/mbarrier_racecheck.cu).
  echo "== racecheck on the mbarrier orderings alone"
  for v in bulk ring slots ring_all slots_all; do
    compute-sanitizer --tool racecheck /tmp/mbarrier_racecheck "$v" 2>&1 \
      | tee -a "$OUT/mbarrier_racecheck.log" | grep -E "sums|SUMMARY|Race" | head -5
  done
fi

if step channel_plans && harness channel_plans; then
  echo "== channel norm statistics pass (C++, kernels/channel_plans.cu)"
  /tmp/channel_plans > "$OUT/channel_plans.txt" 2>&1 || tail -5 "$OUT/channel_plans.txt"
  cat "$OUT/channel_plans.txt"
fi

if step channel_probe && harness channel_probe; then
  echo "== GroupNorm's kernels one by one (C++, kernels/channel_probe.cu)"
  /tmp/channel_probe > "$OUT/channel_probe.txt" 2>&1 || tail -5 "$OUT/channel_probe.txt"
  cat "$OUT/channel_probe.txt"
  if command -v ncu > /dev/null; then  # its kernels' profile at one shape
    PROBE=1 PROBE_SHAPE=8x32x32x1280 timeout 240 ncu --set full --import-source no -f \
      -o /tmp/channel_probe /tmp/channel_probe > "$OUT/channel_probe_ncu.log" 2>&1
    [ -f /tmp/channel_probe.ncu-rep ] && ncu -i /tmp/channel_probe.ncu-rep --page raw --csv \
      > "$OUT/channel_probe_ncu.csv" 2>&1
  fi
fi

if step gn_cluster && harness gn_cluster; then
  echo "== GroupNorm's forward in clusters against the passes (C++, kernels/gn_cluster.cu)"
  /tmp/gn_cluster > "$OUT/gn_cluster.txt" 2>&1 || tail -5 "$OUT/gn_cluster.txt"
  cat "$OUT/gn_cluster.txt"
fi

if step lrn_lines && harness lrn_lines; then
  echo "== LRN with a line in registers (C++, kernels/lrn_lines.cu)"
  /tmp/lrn_lines 2>&1 | tee "$OUT/lrn_lines.txt"
fi

if step softmax_lines && harness softmax_lines; then
  echo "== the channel softmax's teams of lanes (C++, kernels/softmax_lines.cu)"
  /tmp/softmax_lines 2>&1 | tee "$OUT/softmax_lines.txt"
fi

if step plans && harness row_norm_plans; then
  echo "== kernel plans (C++, every register-path plan)"
  /tmp/row_norm_plans > "$OUT/row_norm_plans.txt" 2>&1 || tail -5 "$OUT/row_norm_plans.txt"
  head -3 "$OUT/row_norm_plans.txt"
fi

if step bench; then
  echo "== benchmarks"
  # --update keeps the committed records of the cases not measured now.
  [[ " ${BENCH_ARGS:-} " == *" --update "* ]] && cp benchmarks/results/row_norm_*.json "$OUT/"
  (cd benchmarks && python3 bench_row_norm.py --out "$OUT" ${BENCH_ARGS:-}) 2>&1 \
    | tee "$OUT/bench.log" | tail -40
fi
if step model; then
  echo "== model benchmark"
  (cd benchmarks && python3 bench_llama.py --out "$OUT" ${MODEL_ARGS:-}) 2>&1 \
    | tee "$OUT/bench_llama.log" | tail -12
fi
if step context; then
  echo "== a norm's backward after a matmul and back to back"
  for op in rms_norm layer_norm; do
    (cd benchmarks && python3 norm_context.py --op $op --shape 65536x1024 --k 2816 &&
      python3 norm_context.py --op $op --shape 16384x4096 --k 11008) 2>&1
  done | tee "$OUT/norm_context.txt" | grep -v "^    "
fi
if step unet; then
  echo "== convolutional models benchmark"
  (cd benchmarks && python3 bench_unet.py --out "$OUT" ${UNET_ARGS:-}) 2>&1 \
    | tee "$OUT/bench_unet.log" | tail -8
fi
if step command_buffers; then
  echo "== steps with custom calls in XLA's command buffers or not"
  (cd benchmarks && python3 command_buffers.py --out "$OUT" ${CB_ARGS:-}) 2>&1 \
    | tee "$OUT/command_buffers.log" | tail -14
fi
exit "$tests_rc"
