#!/usr/bin/env bash
# Device-machine runs (results under $OUT), in parts that each fit a 10-minute call:
#   bash benchmarks/gpu_session.sh tests   # GPU tests, opcheck on CUDA, training example
#                                          # (TEST_SHARD=1/3, 2/3, 3/3: one call each)
#   bash benchmarks/gpu_session.sh bench   # compute-sanitizer memcheck, benchmark table, report
#   bash benchmarks/gpu_session.sh sweep   # backward side by side (with cuDNN if CUDNN_DIR
#                                          # holds cudnn_peer.py; default .peers/cudnn_dsa), report
#   bash benchmarks/gpu_session.sh properties  # tests/test_properties_gpu.py with 2x the examples
#                                          # (hypothesis from .peers/wheels when not installed)
#   bash benchmarks/gpu_session.sh sanitize-properties  # the property tests (1x), then the same
#                                          # examples (sharded over processes) and sanitize_case.py
#                                          # under compute-sanitizer initcheck and memcheck
#   bash benchmarks/gpu_session.sh features  # topk_length and the 576/512 layout (features_bench.py)
#   bash benchmarks/gpu_session.sh experiments  # A/B: evict_last_bench.py, proto_ab.py, ...
#   bash benchmarks/gpu_session.sh next   # the GPU tests of an option (NEXT_TESTS, a -k expression), then
#                                          # its A/B next to cuDNN (NEXT_BENCH, a script in experiments/)
#   bash benchmarks/gpu_session.sh l2     # the L2 window's GPU tests and l2_persist_bench.py
#   bash benchmarks/gpu_session.sh partial16  # 16-bit partial rows (prototype): GPU tests, A/B
#   bash benchmarks/gpu_session.sh ablate  # a tile's work taken apart (tile_ablation_bench.py)
#   bash benchmarks/gpu_session.sh timeline  # a tile's timeline in the fast backward (tile_timeline.py)
#   bash benchmarks/gpu_session.sh ncu-peer  # ncu stall profiles of the fast main kernel and
#                                          # cuDNN's (benchmarks/experiments/ncu_peer.sh)
#   bash benchmarks/gpu_session.sh triton-next  # GPU kernel tests and a quick bench under the
#                                          # Triton unpacked from .t39/triton*.tar.xz (a stripped
#                                          # cp312 wheel: benchmarks/pack_triton.sh; another
#                                          # folder: TRITON_NEXT_TAR=.t38; an experiment
#                                          # instead: TRITON_NEXT_BENCH=script.py, after
#                                          # the GPU tests TRITON_NEXT_TESTS=-k expression)
# Any part: TCACHE_OUT=1 returns the compiled kernels ($OUT/triton_cache.tar.xz), which a
# fresh machine unpacks from .tcache/ (carry ".tcache") instead of compiling them again.
# bench and sweep write benchmarks/results/*.json; report.py then rewrites README.md's
# performance section and docs/performance/bench.png (from the H200's newest runs first:
# on another GPU the README keeps them; report.py --gpu). All three come back under $OUT
# (results/, README.md, bench.png): copy them into the checkout and commit them. The device tool
# returns at most eight files a call: run bench and sweep in separate calls (together they write
# nine, and the results JSON is what gets left out).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# Compiled kernels kept in the checkout (git-ignored): a later call on the same machine reuses them.
export TRITON_CACHE_DIR=$PWD/.cache/triton
# A fresh machine takes the kernels an earlier one compiled (benchmarks/triton_cache.py; the
# call carries ".tcache"), and then compiles only those whose source changed since.
# TCACHE_OUT=1: the cache back as $OUT/triton_cache.tar.xz when the call ends (if within the
# 16 MiB a returned file may hold); copy it to .tcache/ for the next calls.
if [ -f .tcache/triton_cache.tar.xz ] && [ ! -d "$TRITON_CACHE_DIR" ]; then
  timeout 120 python3 benchmarks/triton_cache.py unpack .tcache/triton_cache.tar.xz "$TRITON_CACHE_DIR" || true
fi
# The image's default g++ (/opt/gcc) builds AOTInductor packages that segfault when loaded.
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++
# A copied working tree may carry an older .git: results name the commit written to
# .peers/bench_commit on the machine that sends the run, before it (git rev-parse --short
# HEAD > .peers/bench_commit; run here, it would read the older .git).
if [ -z "${BENCH_COMMIT:-}" ] && [ -f .peers/bench_commit ]; then export BENCH_COMMIT=$(cat .peers/bench_commit); fi
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"

touch /tmp/gpu_session.start
report() {  # README section and figure from the newest results; everything back to $OUT
  timeout 60 python3 benchmarks/report.py 2>&1 | tail -3
  mkdir -p "$OUT/results"
  # only this call's results: the device tool returns a limited number of files
  find benchmarks/results -name '*.json' -newer /tmp/gpu_session.start -exec cp {} "$OUT/results/" \;
  cp README.md "$OUT/README.md"
  cp docs/performance/bench.png "$OUT/bench.png" 2>/dev/null
}

tcache_out() {  # (on EXIT) the compiled kernels back, with TCACHE_OUT=1
  [ "${TCACHE_OUT:-0}" = 1 ] && [ -d "$TRITON_CACHE_DIR" ] || return 0
  timeout 180 python3 benchmarks/triton_cache.py pack "$TRITON_CACHE_DIR" /tmp/triton_cache.tar.xz || return 0
  if [ "$(stat -c %s /tmp/triton_cache.tar.xz)" -le $((16 * 1024 * 1024)) ]; then
    cp /tmp/triton_cache.tar.xz "$OUT/"
  else
    echo "triton cache: over the 16 MiB a returned file may hold, not sent"
  fi
}
trap tcache_out EXIT

tests_passed() {  # whether the pytest tail in file $1 reports passes and no failure or error
  grep -q " passed" "$1" && ! grep -q -E "failed|error" "$1"
}

peer_experiment() {  # benchmarks/experiments/$1 next to cuDNN's backward (its kit installed
  # first), under a limit of $2 seconds; its rows to $OUT/$3
  timeout 120 bash .peers/cudnn_dsa/install.sh > "$OUT/cudnn_install.log" 2>&1
  PYTHONPATH=$PYTHONPATH:/tmp/cudnn_site timeout "$2" python3 benchmarks/experiments/$1 .peers/cudnn_dsa 2>&1 \
    | tee "$OUT/$3"
}

case "${1:-tests}" in
tests)
  # The CPU-only files (expecttest is not installed there) are covered by CI.
  # (-n: the kernels compile in parallel worker processes; the GPU runs them one after another)
  # On a fresh machine the whole list takes more than one call (2026-12-03: 70% of it in
  # 400 s with -n 12): TEST_SHARD=i/n runs every n-th test from the i-th (1-based) of the
  # collected list, opcheck and the example in shard 1 only. Halves no longer fit a call
  # (2026-12-06, H100: the first half cut at 397 of 399 by the 480 s limit, twice): thirds.
  files=(tests/test_kernels_gpu.py tests/test_compile.py tests/test_cuda_graphs.py tests/test_fsdp.py
         tests/test_checkpointing.py tests/test_modules.py tests/test_export.py)
  shard=${TEST_SHARD:-1/1}; i=${shard%/*}; n=${shard#*/}
  # A collection error stops the call: the shards would silently leave the file out.
  python3 -m pytest --collect-only -q -p no:cacheprovider "${files[@]}" > /tmp/gpu_test_list 2>&1 \
    || { tail -15 /tmp/gpu_test_list | tee "$OUT/gpu_tests_collect.log"; exit 1; }
  grep '::' /tmp/gpu_test_list | awk -v i="$i" -v n="$n" '(NR - i) % n == 0' > /tmp/gpu_test_ids
  mapfile -t ids < /tmp/gpu_test_ids; echo "shard $shard: ${#ids[@]} tests"
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -rs -n ${TEST_WORKERS:-12} -p no:cacheprovider \
    "${ids[@]}" 2>&1 | grep -v -i "benchmark" | tail -30 | tee "$OUT/gpu_tests_${i}of${n}.log"
  if [ "$i" = 1 ]; then
    timeout 90 python3 opcheck/run_opcheck.py --device cuda 2>&1 | tail -5 | tee "$OUT/opcheck_cuda.log"
    timeout 60 python3 examples/train_block.py --steps 300 --out "$OUT/loss.png" 2>&1 | tail -5
  fi
  ;;
bench)
  if [ "${SANITIZE:-1}" = 1 ]; then  # SANITIZE=0: the table alone
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_case.py \
      > "$OUT/sanitizer.log" 2>&1; echo "compute-sanitizer exit $?" | tee -a "$OUT/sanitizer.log"
    tail -5 "$OUT/sanitizer.log"
  fi
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
  # (SWEEP_ARGS: more of bench.py's options, e.g. "--T 4096" for the T = 4096 rows alone)
  timeout ${SWEEP_TIMEOUT:-480} python3 benchmarks/bench.py --backward-sweep ${CUDNN[@]+"${CUDNN[@]}"} ${SWEEP_ARGS:-} \
    --out "$OUT/bench_sweep.md" 2>&1 \
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
  # sanitize_case.py under each tool. The plain run fills the kernel cache (compiling bounds
  # it; the sanitizer then loads and patches each kernel, 2026-12-01, H200: about 30 s an
  # example). Each (tool, test, shard) is a process of its own (DSV4_PROPERTY_SHARD), at
  # most SANITIZER_JOBS at once, all cut at SANITIZER_BUDGET seconds from the start. The
  # run resumes: each example passed is recorded in .cache/sanitizer/<tool>.done (and
  # plain.done) and skipped by the next call (DSV4_PROPERTY_DONE); on a fresh machine,
  # copy the returned *.done files there first. No caching allocator: the sanitizer then
  # sees each tensor's own allocation. SANITIZER_ARGS (and SANITIZER_ARGS_<tool>) go to
  # compute-sanitizer, e.g. SANITIZER_ARGS_memcheck="--kernel-name-exclude kns=native": PyTorch's
  # own kernels (at::native) then run unchecked. (Under initcheck their writes would then go
  # unseen: false reports, never hidden ones.)
  export DSV4_PROPERTY_SCALE=${SANITIZER_SCALE:-1}
  deadline=$(($(date +%s) + ${SANITIZER_BUDGET:-560}))
  done_dir=$PWD/.cache/sanitizer; logs=/tmp/sanitizer_logs; rm -rf $logs; mkdir -p $logs $done_dir
  tests=$(python3 -m pytest --collect-only -q -p no:cacheprovider tests/test_properties_gpu.py 2>/dev/null | grep '::' \
          | grep -E -- "${SANITIZER_ONLY:-.}")  # SANITIZER_ONLY: a regex on the test ids
  shards=${SANITIZER_SHARDS:-2}
  tools=${SANITIZER_TOOLS:-initcheck memcheck}
  sanitize_one() {  # TOOL SHARD TEST: one process (under compute-sanitizer unless TOOL=plain)
    local tool=$1 shard=$2 id=$3 n cmd left
    n=$tool-$(echo "$tool $shard $id" | md5sum | cut -c1-8)
    left=$((deadline - $(date +%s) - 15)); [ $left -lt 20 ] && { echo "== $tool $shard $id: not started (budget)" > $logs/$n.log; return; }
    if [ "$id" = sanitize_case ]; then cmd=(python3 benchmarks/sanitize_case.py)
    else cmd=(python3 -m pytest -q -p no:cacheprovider "$id" -W ignore::UserWarning); fi
    local extra=SANITIZER_ARGS_$tool  # per tool, e.g. SANITIZER_ARGS_memcheck
    [ "$tool" = plain ] || cmd=(compute-sanitizer --tool $tool --error-exitcode 9 ${SANITIZER_ARGS:-} ${!extra:-} "${cmd[@]}")
    [ "$tool" = plain ] || export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    DSV4_PROPERTY_SHARD=$shard DSV4_PROPERTY_LOG=$logs/$n.examples DSV4_PROPERTY_DONE=$done_dir/$tool.done \
      timeout -k 10 $left "${cmd[@]}" > $logs/$n.full 2>&1
    local rc=$? errors
    # every sanitizer report (not only the tail), then the tail of the output
    errors=$(grep '^=========' $logs/$n.full | grep -v -E 'COMPUTE-SANITIZER|ERROR SUMMARY: 0 errors' | wc -l)
    { echo "== $tool $shard $id"
      grep '^=========' $logs/$n.full | grep -v 'COMPUTE-SANITIZER' | head -60
      grep -v -i -E '^=========|benchmark' $logs/$n.full | tail -25
      echo "== $tool $shard $id: exit $rc, sanitizer report lines $errors, examples passed: $(grep -c ' ok .* in ' $logs/$n.examples 2>/dev/null)"
    } > $logs/$n.log 2>&1
    # only a process without reports counts its examples as clean
    [ $errors = 0 ] || mv $logs/$n.examples $logs/$n.examples.reported 2>/dev/null
  }
  export -f sanitize_one; export logs deadline done_dir SANITIZER_ARGS SANITIZER_ARGS_memcheck SANITIZER_ARGS_initcheck
  for tool in $tools; do  # arguments the sanitizer rejects: say so, drop them
    a=SANITIZER_ARGS_$tool
    if ! timeout 120 compute-sanitizer --tool $tool ${SANITIZER_ARGS:-} ${!a:-} python3 -c \
        "import torch; torch.ones(4, device='cuda').sum().item()" > /tmp/sanitizer_args.log 2>&1; then
      echo "compute-sanitizer --tool $tool ${SANITIZER_ARGS:-} ${!a:-}: rejected, run without them"; tail -3 /tmp/sanitizer_args.log
      unset SANITIZER_ARGS $a
    fi
  done
  passed() { cat $done_dir/$1.done 2>/dev/null | grep -c "${2:- ok .* in }"; }
  # the plain run (fills the kernel cache), its processes sharded like the sanitizer's
  if [ "${SANITIZER_PLAIN:-1}" = 1 ]; then
    for id in $tests; do for ((k = 0; k < shards; k++)); do echo "plain $k/$shards $id"; done; done \
      | deadline=$(($(date +%s) + ${PROPERTY_TIMEOUT:-200})) xargs -P 16 -L 1 bash -c 'sanitize_one $0 $1 $2'
    cat $logs/*.examples >> $done_dir/plain.done 2>/dev/null
    grep -h -E "^== .*: exit|failed|Error" $logs/*.log | sort | uniq -c | sort -rn | head -12
    echo "plain run: $(passed plain) examples passed in all"
    cat $logs/*.log > "$OUT/properties_gpu.log"; rm -f $logs/*
  fi
  jobs=()
  for tool in $tools; do
    grep -q '^sanitize_case ok' $done_dir/$tool.done 2>/dev/null || jobs+=("$tool 0/1 sanitize_case")
  done
  for tool in $tools; do
    for id in $tests; do for ((k = 0; k < shards; k++)); do jobs+=("$tool $k/$shards $id"); done; done
  done
  printf '%s\n' "${jobs[@]}" | xargs -P ${SANITIZER_JOBS:-16} -L 1 bash -c 'sanitize_one $0 $1 $2'
  for f in $logs/*.log; do
    e=${f%.log}.examples; tool=$(basename $f | cut -d- -f1)
    [ -f $e ] && cat $e >> $done_dir/$tool.done
    if grep -q '== .* sanitize_case: exit 0, sanitizer report lines 0' $f; then echo "sanitize_case ok" >> $done_dir/$tool.done; fi
  done
  cat $logs/*.log > "$OUT/sanitizer_properties.log"; cp $done_dir/*.done "$OUT/"
  grep -h -E "^== .*: (exit|not)|Invalid|Uninitialized|failed" "$OUT/sanitizer_properties.log" | sort | tail -40
  echo "ERROR SUMMARY lines: $(grep 'ERROR SUMMARY' "$OUT/sanitizer_properties.log" | sort | uniq -c | tr '\n' ' ')"
  for tool in $tools; do
    echo "$tool: $(passed $tool) examples passed in all; $(passed $tool '^sanitize_case ok') sanitize_case"
    # seconds an example took (the first examples of a process load and patch the kernels)
    grep -h ' ok .* in ' $logs/$tool-*.examples 2>/dev/null | awk '{t = $(NF - 1); n++; s += t; if (t > m) m = t}
      END {if (n) printf "  this call: seconds an example: mean %.1f, max %.1f over %d\n", s / n, m, n}'
  done
  ;;
features)
  timeout 400 python3 benchmarks/features_bench.py 2>&1 | tee "$OUT/features.log" | grep -v '^{'
  mkdir -p "$OUT/results" && cp benchmarks/results/*_features*.json "$OUT/results/" 2>/dev/null
  ;;
experiments)
  # A/B runs of options that are off by default until measured (docs/performance/backward.md):
  # the L2 evict-last reductions, then the deterministic and 576/512 backward timings again
  # (EXPERIMENTS: a subset, e.g. "evict_last det_sort"), the deterministic backward with
  # one sort for several chunks against one a chunk, and the fast one with split roles
  ex=${EXPERIMENTS:-evict_last proto_ab det_sort split}
  [[ $ex == *evict_last* ]] && timeout 300 python3 benchmarks/experiments/evict_last_bench.py 2>&1 | tee "$OUT/evict_last.jsonl"
  [[ $ex == *proto_ab* ]] && PROTO_AB_SHORT=1 timeout 240 python3 benchmarks/experiments/proto_ab.py 2>&1 | tee "$OUT/proto_ab.jsonl"
  [[ $ex == *det_sort* ]] && PYTHONPATH=$PYTHONPATH:$PWD/benchmarks timeout 240 python3 \
    benchmarks/experiments/det_sort_groups_bench.py 2>&1 | tee "$OUT/det_sort.jsonl"
  if [[ $ex == *split* ]]; then  # next to cuDNN's backward when its kit is in .peers/cudnn_dsa
    peer=()
    if [ -f .peers/cudnn_dsa/install.sh ]; then
      timeout 120 bash .peers/cudnn_dsa/install.sh > "$OUT/cudnn_install.log" 2>&1 && peer=(.peers/cudnn_dsa)
    fi
    PYTHONPATH=$PYTHONPATH:/tmp/cudnn_site timeout 300 python3 benchmarks/experiments/split_roles_bench.py \
      ${peer[@]+"${peer[@]}"} 2>&1 | tee "$OUT/split_roles.jsonl"
  fi
  ;;
next)
  # The GPU tests of an option alone under a short limit (a hang costs this step only), then
  # its A/B next to cuDNN (only if they passed; its rows print as they finish). Default: dQ
  # by TMA (dq_tma_bench.py). About 9 minutes.
  timeout ${NEXT_TESTS_TIMEOUT:-200} python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/test_kernels_gpu.py \
    -k "${NEXT_TESTS:-dq_tma}" 2>&1 | tail -6 | tee "$OUT/next_tests.log"
  tests_passed "$OUT/next_tests.log" && peer_experiment "${NEXT_BENCH:-dq_tma_bench.py}" ${NEXT_BENCH_TIMEOUT:-330} next_bench.jsonl
  ;;
l2)
  # The fast backward's L2 window (backward.persist_rows, off by default): its GPU tests, then
  # l2_persist_bench.py's arms (L2P_ROWS, default 2,5,0: T = 131072 and 65536 causal, 4096).
  # About 5 minutes on a fresh machine. First whether the driver takes a window on the legacy
  # default stream (where most callers launch) and on a created one.
  timeout 60 python3 -c "
import torch
from dsv4_sparse_attn.kernels import l2_policy as p
t = torch.empty(1 << 20, device='cuda')
for name, s in (('default stream', torch.cuda.current_stream()), ('created stream', torch.cuda.Stream())):
    with torch.cuda.stream(s), p.window(t) as on:
        print(name, s.cuda_stream, 'window set:', on, p.unavailable())
" 2>&1 | tee "$OUT/l2_streams.log"
  timeout 200 python3 -m pytest -q -x -n 3 -p no:cacheprovider tests/test_kernels_gpu.py -k l2_window 2>&1 \
    | tail -6 | tee "$OUT/l2_tests.log"
  L2P_ROWS=${L2P_ROWS:-2,5,0} timeout 330 python3 benchmarks/experiments/l2_persist_bench.py 2>&1 \
    | tee "$OUT/l2_persist.jsonl"
  ;;
partial16)
  # The prototype of 16-bit partial rows: its GPU tests, then partial16_bench.py (the
  # deterministic backward's main kernel and fold with fp32 and 16-bit rows). About 5 minutes.
  # (P16_TESTS: another -k expression, e.g. "16_bit and 576")
  timeout 200 python3 -m pytest -q -x -n 3 -p no:cacheprovider tests/test_kernels_gpu.py -k "${P16_TESTS:-16_bit}" 2>&1 \
    | tail -6 | tee "$OUT/partial16_tests.log"
  tests_passed "$OUT/partial16_tests.log" && PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/experiments timeout 330 \
    python3 benchmarks/experiments/partial16_bench.py 2>&1 | tee "$OUT/partial16.jsonl"
  ;;
ablate)
  # Parts of a tile taken out of the fast backward over a K sweep (tile_ablation_bench.py);
  # the arms compile in parallel processes first.
  timeout 120 bash .peers/cudnn_dsa/install.sh > "$OUT/cudnn_install.log" 2>&1
  printf '%s\n' 0 1 2 4 8 7 | timeout 200 xargs -P 6 -I{} env ABLATE_WARM={} python3 \
    benchmarks/experiments/tile_ablation_bench.py 2>&1 | tail -3
  PYTHONPATH=$PYTHONPATH:/tmp/cudnn_site timeout 200 python3 benchmarks/experiments/tile_ablation_bench.py \
    .peers/cudnn_dsa 2>&1 | tee "$OUT/tile_ablation.jsonl"
  ;;
timeline)
  # A tile's timeline in the fast backward (tile_timeline.py) after its GPU test; the four
  # builds compile in parallel processes first. About 4 minutes.
  timeout 200 python3 -m pytest -q -x -n 2 -p no:cacheprovider tests/test_kernels_gpu.py -k timeline 2>&1 \
    | tail -4 | tee "$OUT/timeline_tests.log"
  printf '%s\n' fast,0 fast,1 fast_qd_tma,0 fast_qd_tma,1 | timeout 200 xargs -P 4 -I{} env TIMELINE_WARM={} \
    python3 benchmarks/experiments/tile_timeline.py 2>&1 | tail -3
  timeout 330 python3 benchmarks/experiments/tile_timeline.py 2>&1 | tee "$OUT/tile_timeline.jsonl"
  ;;
ncu-peer)
  # The fast backward next to cuDNN's: kernel times over a K sweep, then ncu stall profiles (about 5 minutes)
  timeout 120 bash .peers/cudnn_dsa/install.sh > "$OUT/cudnn_install.log" 2>&1 || { echo "no cuDNN peer kit"; exit 2; }
  bash benchmarks/experiments/ncu_peer.sh
  ;;
triton-next)
  # TRITON_NEXT_TAR: the folder of the packed Triton (benchmarks/pack_triton.sh), default .t39
  tarball=$(ls ${TRITON_NEXT_TAR:-.t39}/triton*.tar.xz 2>/dev/null | head -1)
  [ -n "$tarball" ] || { echo "no ${TRITON_NEXT_TAR:-.t39}/triton*.tar.xz"; exit 2; }
  # (a fresh folder: on a warm machine another Triton may be unpacked there already)
  rm -rf /tmp/triton-next && mkdir -p /tmp/triton-next && tar -xJf "$tarball" -C /tmp/triton-next
  export PYTHONPATH=/tmp/triton-next:$PYTHONPATH TRITON_CACHE_DIR=$PWD/.cache/triton-next
  python3 -c "import triton; print('triton', triton.__version__, triton.__file__)" | tee "$OUT/triton_next.log"
  # TRITON_NEXT_FULL=1: the `tests` part's GPU files and opcheck, and the whole default
  # table (about 9 minutes; TRITON_NEXT_PARTS="tests" or "bench" for one of the two, e.g.
  # in two calls); else the kernel tests and three rows of the table
  parts=${TRITON_NEXT_PARTS:-tests bench}
  if [ -n "${TRITON_NEXT_BENCH:-}" ]; then
    # an experiment under this Triton instead (a script in benchmarks/experiments/, next to
    # cuDNN's backward), e.g. TRITON_NEXT_BENCH=triton_defaults_bench.py; with
    # TRITON_NEXT_TESTS (a -k expression) the GPU kernel tests it selects first, and the
    # experiment only if they pass
    ok=1
    if [ -n "${TRITON_NEXT_TESTS:-}" ]; then
      timeout ${TRITON_NEXT_TESTS_TIMEOUT:-300} python3 -m pytest -q -x -n ${TRITON_NEXT_JOBS:-12} -p no:cacheprovider \
        tests/test_kernels_gpu.py -k "$TRITON_NEXT_TESTS" 2>&1 | tail -6 | tee -a "$OUT/triton_next.log"
      tests_passed "$OUT/triton_next.log" || ok=0
    fi
    [ "$ok" = 1 ] && peer_experiment "$TRITON_NEXT_BENCH" ${TRITON_NEXT_BENCH_TIMEOUT:-480} triton_next_bench.jsonl
  elif [ "${TRITON_NEXT_FULL:-0}" = 1 ]; then
    [[ $parts == *tests* ]] && timeout ${TRITON_NEXT_TESTS_TIMEOUT:-360} python3 -m pytest -q -rs -n ${TRITON_NEXT_JOBS:-12} -p no:cacheprovider tests/test_kernels_gpu.py tests/test_compile.py \
      tests/test_cuda_graphs.py tests/test_checkpointing.py tests/test_modules.py tests/test_export.py 2>&1 \
      | tail -15 | tee -a "$OUT/triton_next.log"
    [[ $parts == *tests* ]] && timeout 90 python3 opcheck/run_opcheck.py --device cuda 2>&1 | tail -3 | tee -a "$OUT/triton_next.log"
    [[ $parts == *bench* ]] && timeout ${TRITON_NEXT_BENCH_TIMEOUT:-300} python3 benchmarks/bench.py --no-torch --json "$OUT/bench_triton_next.json" 2>&1 \
      | grep -v '^{' | tail -16 | tee -a "$OUT/triton_next.log"
  else
    timeout 300 python3 -m pytest -q -rs -n ${TRITON_NEXT_JOBS:-12} -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tail -15 \
      | tee -a "$OUT/triton_next.log"
    timeout 200 python3 benchmarks/bench.py --shapes 0,1,5 --no-torch --json "$OUT/bench_triton_next.json" 2>&1 \
      | grep -v '^{' | tail -12 | tee -a "$OUT/triton_next.log"
  fi
  ;;
*)
  echo "usage: bash benchmarks/gpu_session.sh tests|bench|sweep|properties|sanitize-properties|features|experiments|next|ablate|ncu-peer|triton-next" >&2; exit 2
  ;;
esac
