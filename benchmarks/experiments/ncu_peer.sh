#!/usr/bin/env bash
# The fast backward next to cuDNN's sm90 DSA backward, same inputs (ncu_peer.py): every
# kernel's time over a K sweep ($OUT/peer_kernels.jsonl), then ncu stall profiles of the two
# main kernels, one warm launch each ($OUT/ncu_peer.csv, each run under a ### line). Needs the peer kit
# installed (gpu_session.sh does it: .peers/cudnn_dsa/install.sh) and ncu on the PATH.
#   bash benchmarks/experiments/ncu_peer.sh [T H K]...   (default: 4096 64 640 and 4096 128 1152)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PEER=${PEER:-.peers/cudnn_dsa}
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/benchmarks:$PWD/benchmarks/experiments:/tmp/cudnn_site:${PYTHONPATH:-}
# stall reasons (cycles a warp waits per issued instruction), the L2's reductions and the
# load/store path; the clocks left alone (METHOD.md). Metrics whose names this ncu may not
# know (the wgmma pipe, L2 reduction requests) go in a second pass, so that an unknown
# name cannot cost the first.
METRICS=regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio
METRICS=$METRICS,gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active
METRICS=$METRICS,lts__t_sectors_op_red.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct
METRICS=$METRICS,l1tex__t_requests_pipe_lsu_mem_global_op_red.sum,dram__bytes_read.sum,dram__bytes_write.sum
EXTRA=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_requests_op_red.sum
EXTRA=$EXTRA,lts__t_sector_op_red_hit_rate.pct,lts__t_sector_op_read_hit_rate.pct
IDS=${IDS:-distinct}  # or causal: the sweep's causal ids (its T = 131072 rows)
# first every kernel's time over a K sweep, both backwards (no ncu; KERNELS=0 leaves it out)
[ "${KERNELS:-1}" = 0 ] || timeout 200 python3 benchmarks/experiments/ncu_peer.py "$PEER" --kernels > "$OUT/peer_kernels.jsonl" 2> "$OUT/peer_kernels.err"
echo "kernels rc=$?"; tail -2 "$OUT/peer_kernels.err"
[ $# -ge 3 ] || set -- 4096 64 640 4096 128 1152
while [ $# -ge 3 ]; do
  T=$1 H=$2 K=$3; shift 3
  for k in ours:_bwd_main_gluon_kernel cudnn:FlashAttentionDSABackwardSm90_object; do
    name=${k%%:*} pat=${k#*:}
    for pass in main extra; do
      m=$METRICS; [ $pass = extra ] && m=$EXTRA
      # (one file for every run: only a few files come back from the device machine)
      echo "### $name $pass T=$T H=$H K=$K ids=$IDS" | tee -a "$OUT/ncu_peer.err" >> "$OUT/ncu_peer.csv"
      timeout 240 ncu --clock-control none --kernel-name "regex:$pat" --launch-skip 2 --launch-count 1 \
        --metrics "$m" --csv python3 benchmarks/experiments/ncu_peer.py "$PEER" --T $T --H $H --K $K \
        --ids "$IDS" --only $name >> "$OUT/ncu_peer.csv" 2>> "$OUT/ncu_peer.err"
      echo "$name $pass T=$T H=$H K=$K rc=$?"; tail -2 "$OUT/ncu_peer.err"
    done
  done
done
