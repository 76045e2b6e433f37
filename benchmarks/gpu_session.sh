#!/usr/bin/env bash
# Device-machine runs (results under $OUT), in parts that each fit a 10-minute call:
#   bash benchmarks/gpu_session.sh tests   # GPU tests, opcheck on CUDA, training example
#   bash benchmarks/gpu_session.sh bench   # compute-sanitizer memcheck, benchmark table, report
#   bash benchmarks/gpu_session.sh sweep   # backward side by side (with cuDNN if CUDNN_DIR
#                                          # holds cudnn_peer.py; default .peers/cudnn_dsa), report
#   bash benchmarks/gpu_session.sh properties  # tests/test_properties_gpu.py with 2x the examples
#                                          # (hypothesis from .peers/wheels when not installed)
#   bash benchmarks/gpu_session.sh sanitize-properties  # the property tests (1x), then the same
#                                          # examples (sharded over processes) and sanitize_case.py
#                                          # under compute-sanitizer initcheck and memcheck
#   bash benchmarks/gpu_session.sh features  # topk_length and the 576/512 layout (features_bench.py)
#   bash benchmarks/gpu_session.sh experiments  # A/B: evict_last_bench.py, proto_ab.py
#   bash benchmarks/gpu_session.sh triton-next  # GPU kernel tests and a quick bench under the
#                                          # Triton unpacked from .t39/triton*.tar.xz (a stripped
#                                          # cp312 wheel: docs/performance/method.md#another-triton)
# bench and sweep write benchmarks/results/*.json; report.py then rewrites README.md's
# performance section and docs/performance/bench.png. All three come back under $OUT
# (results/, README.md, bench.png): copy them into the checkout and commit them.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# Compiled kernels kept in the checkout (git-ignored): a later call on the same machine reuses them.
export TRITON_CACHE_DIR=$PWD/.cache/triton
# The image's default g++ (/opt/gcc) builds AOTInductor packages that segfault when loaded.
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++
# A copied working tree may carry an older .git: results name the commit written to
# .peers/bench_commit before the run (git rev-parse --short HEAD > .peers/bench_commit).
if [ -z "${BENCH_COMMIT:-}" ] && [ -f .peers/bench_commit ]; then export BENCH_COMMIT=$(cat .peers/bench_commit); fi
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"

report() {  # README section and figure from the newest results; everything back to $OUT
  timeout 60 python3 benchmarks/report.py 2>&1 | tail -3
  mkdir -p "$OUT/results"
  cp benchmarks/results/*.json "$OUT/results/" 2>/dev/null
  cp README.md "$OUT/README.md"
  cp docs/performance/bench.png "$OUT/bench.png" 2>/dev/null
}

case "${1:-tests}" in
tests)
  # The CPU-only files (expecttest is not installed there) are covered by CI.
  # (-n: the kernels compile in parallel worker processes; the GPU runs them one after another)
  timeout 420 python3 -m pytest -q -rs -n 6 -p no:cacheprovider tests/test_kernels_gpu.py tests/test_compile.py \
    tests/test_cuda_graphs.py tests/test_fsdp.py tests/test_checkpointing.py tests/test_modules.py \
    tests/test_export.py 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
  timeout 90 python3 opcheck/run_opcheck.py --device cuda 2>&1 | tail -5 | tee "$OUT/opcheck_cuda.log"
  timeout 60 python3 examples/train_block.py --steps 300 --out "$OUT/loss.png" 2>&1 | tail -5
  ;;
bench)
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_case.py \
    > "$OUT/sanitizer.log" 2>&1; echo "compute-sanitizer exit $?" | tee -a "$OUT/sanitizer.log"
  tail -5 "$OUT/sanitizer.log"
  timeout 380 python3 benchmarks/bench.py --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" | grep -v '^{'
  report
  ;;
sweep)
  CUDNN_DIR=${CUDNN_DIR:-.peers/cudnn_dsa}
  CUDNN=()
  if [ -f "$CUDNN_DIR/cudnn_peer.py" ]; then
    if [ -f "$CUDNN_DIR/install.sh" ]; then
      timeout 120 bash "$CUDNN_DIR/install.sh" > "$OUT/cudnn_install.log" 2>&1; tail -2 "$OUT/cudnn_install.log"
    fi
    CUDNN=(--cudnn "$CUDNN_DIR")
    export PYTHONPATH=/tmp/cudnn_site:$PYTHONPATH  # apache-tvm-ffi, installed there by install.sh
  fi
  timeout 480 python3 benchmarks/bench.py --backward-sweep ${CUDNN[@]+"${CUDNN[@]}"} --out "$OUT/bench_sweep.md" 2>&1 \
    | tee "$OUT/bench_sweep.log" | grep -v '^{'
  report
  ;;
properties)
  python3 -c "import hypothesis" 2>/dev/null || \
    python3 -m pip install -q --no-index --find-links .peers/wheels hypothesis 2>&1 | tail -2
  export DSV4_PROPERTY_LOG=$OUT/property_examples.log
  DSV4_PROPERTY_SCALE=${PROPERTY_SCALE:-2} timeout 240 python3 -m pytest -q -rs -n 8 -p no:cacheprovider \
    tests/test_properties_gpu.py --hypothesis-show-statistics -W ignore::UserWarning 2>&1 \
    | grep -v -i "benchmark" | tee "$OUT/properties_gpu.log" | grep -E "passing|passed|failed|Error" | tail -12
  ;;
sanitize-properties)
  python3 -c "import hypothesis" 2>/dev/null || \
    python3 -m pip install -q --no-index --find-links .peers/wheels hypothesis 2>&1 | tail -2
  # tests/test_properties_gpu.py at DSV4_PROPERTY_SCALE (SANITIZER_SCALE, default 1: 25
  # examples a test, 200 in all) against the oracle, then the same examples (a fixed seed)
  # under compute-sanitizer (SANITIZER_TOOLS, default initcheck and memcheck), and
  # sanitize_case.py under each tool. The plain run fills the kernel cache (the sanitizer
  # compiles and loads kernels at a fraction of the usual speed: 2026-12-01, H200, about
  # 30 s an example with a warm cache). Each (tool, test, shard) is a process of its own
  # (DSV4_PROPERTY_SHARD: SANITIZER_SHARDS processes share a test's examples), at most
  # SANITIZER_JOBS at once. No caching allocator: the sanitizer then sees each tensor's
  # own allocation. SANITIZER_ARGS go to compute-sanitizer (e.g. a kernel-name filter that
  # leaves PyTorch's own kernels out).
  export DSV4_PROPERTY_SCALE=${SANITIZER_SCALE:-1}
  DSV4_PROPERTY_LOG=$OUT/property_examples.log timeout ${PROPERTY_TIMEOUT:-200} python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_properties_gpu.py --hypothesis-show-statistics -W ignore::UserWarning 2>&1 \
    | grep -v -i "benchmark" > "$OUT/properties_gpu.log"
  grep -E "passing|passed|failed|Error" "$OUT/properties_gpu.log" | sort | uniq -c | tail -8
  echo "plain run: $(grep -c 'ok in' "$OUT/property_examples.log") examples passed"
  logs=/tmp/sanitizer_logs; rm -rf $logs; mkdir -p $logs
  shards=${SANITIZER_SHARDS:-2}
  jobs=()
  for tool in ${SANITIZER_TOOLS:-initcheck memcheck}; do
    for id in $(python3 -m pytest --collect-only -q -p no:cacheprovider tests/test_properties_gpu.py 2>/dev/null \
                | grep '::'); do
      for ((k = 0; k < shards; k++)); do jobs+=("$tool $k/$shards $id"); done
    done
    jobs+=("$tool 0/1 sanitize_case")
  done
  sanitize_one() {  # TOOL SHARD TEST: one process under compute-sanitizer, its log in $logs
    local tool=$1 shard=$2 id=$3 n cmd
    n=$(echo "$tool $shard $id" | md5sum | cut -c1-8)
    if [ "$id" = sanitize_case ]; then cmd=(python3 benchmarks/sanitize_case.py)
    else cmd=(python3 -m pytest -q -p no:cacheprovider "$id" -W ignore::UserWarning); fi
    { echo "== $tool $shard $id"
      DSV4_PROPERTY_SHARD=$shard DSV4_PROPERTY_LOG=$logs/$n.examples PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        timeout ${SANITIZER_TIMEOUT:-330} compute-sanitizer --tool $tool --error-exitcode 9 ${SANITIZER_ARGS:-} "${cmd[@]}" 2>&1 \
        | grep -v -i benchmark | tail -40
      echo "== $tool $shard $id: exit ${PIPESTATUS[0]}, examples passed: $(cat $logs/$n.examples 2>/dev/null | grep -c 'ok in')"
    } > $logs/$n.log 2>&1
  }
  export -f sanitize_one; export logs
  printf '%s\n' "${jobs[@]}" | xargs -P ${SANITIZER_JOBS:-16} -L 1 bash -c 'sanitize_one $0 $1 $2'
  cat $logs/*.log > "$OUT/sanitizer_properties.log"
  grep -E "^== .*: exit|Invalid|Uninitialized|failed" "$OUT/sanitizer_properties.log" | sort | tail -80
  echo "ERROR SUMMARY lines: $(grep 'ERROR SUMMARY' "$OUT/sanitizer_properties.log" | sort | uniq -c | tr '\n' ' ')"
  echo "examples passed under the sanitizer: $(cat $logs/*.examples 2>/dev/null | grep -c 'ok in')"
  # seconds an example took under the sanitizer (first examples of a process compile and load)
  cat $logs/*.examples 2>/dev/null | awk '/ok in/ {t = $(NF - 1); n++; s += t; if (t > m) m = t}
    END {if (n) printf "seconds an example: mean %.1f, max %.1f over %d\n", s / n, m, n}' 
  # the compiled kernels, for a later machine (a cold cache bounds this part): in pieces
  # under the 16 MB a returned file may have; `cat triton_cache.tar.xz.* | tar -xJ -C .cache`
  tar -cJf - -C .cache triton | split -b 15M - "$OUT/triton_cache.tar.xz." && ls -la "$OUT"/triton_cache.*
  ;;
features)
  timeout 400 python3 benchmarks/features_bench.py 2>&1 | tee "$OUT/features.log" | grep -v '^{'
  mkdir -p "$OUT/results" && cp benchmarks/results/*_features*.json "$OUT/results/" 2>/dev/null
  ;;
experiments)
  # A/B runs of options that are off by default until measured (docs/performance/backward.md):
  # the L2 evict-last reductions, then the deterministic and 576/512 backward timings again
  timeout 300 python3 benchmarks/experiments/evict_last_bench.py 2>&1 | tee "$OUT/evict_last.jsonl"
  PROTO_AB_SHORT=1 timeout 240 python3 benchmarks/experiments/proto_ab.py 2>&1 | tee "$OUT/proto_ab.jsonl"
  ;;
triton-next)
  tarball=$(ls .t39/triton*.tar.xz 2>/dev/null | head -1)
  [ -n "$tarball" ] || { echo "no .t39/triton*.tar.xz"; exit 2; }
  mkdir -p /tmp/triton-next && tar -xJf "$tarball" -C /tmp/triton-next
  export PYTHONPATH=/tmp/triton-next:$PYTHONPATH TRITON_CACHE_DIR=$PWD/.cache/triton-next
  python3 -c "import triton; print('triton', triton.__version__, triton.__file__)" | tee "$OUT/triton_next.log"
  # TRITON_NEXT_FULL=1: the `tests` part's GPU files and opcheck, and the whole default
  # table (about 9 minutes); else the kernel tests and three rows of the table
  if [ "${TRITON_NEXT_FULL:-0}" = 1 ]; then
    timeout 360 python3 -m pytest -q -rs -n 6 -p no:cacheprovider tests/test_kernels_gpu.py tests/test_compile.py \
      tests/test_cuda_graphs.py tests/test_checkpointing.py tests/test_modules.py tests/test_export.py 2>&1 \
      | tail -15 | tee -a "$OUT/triton_next.log"
    timeout 90 python3 opcheck/run_opcheck.py --device cuda 2>&1 | tail -3 | tee -a "$OUT/triton_next.log"
    timeout 300 python3 benchmarks/bench.py --no-torch --json "$OUT/bench_triton_next.json" 2>&1 \
      | grep -v '^{' | tail -16 | tee -a "$OUT/triton_next.log"
  else
    timeout 300 python3 -m pytest -q -rs -n 6 -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tail -15 \
      | tee -a "$OUT/triton_next.log"
    timeout 200 python3 benchmarks/bench.py --shapes 0,1,5 --no-torch --json "$OUT/bench_triton_next.json" 2>&1 \
      | grep -v '^{' | tail -12 | tee -a "$OUT/triton_next.log"
  fi
  ;;
*)
  echo "usage: bash benchmarks/gpu_session.sh tests|bench|sweep|properties|sanitize-properties|features|triton-next" >&2; exit 2
  ;;
esac
