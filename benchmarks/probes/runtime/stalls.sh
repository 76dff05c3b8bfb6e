#!/usr/bin/env bash
# Where a kernel's time goes under ncu: bandwidth shares, issue and tensor-pipe activity, warp stall reasons.
#   bash benchmarks/probes/runtime/stalls.sh OUT.csv [kernels.py arguments...]
# (GPU machine; e.g. --build benchmarks/build --impl convdsl --cases a,b --calls 1)
set -euo pipefail
out=$1; shift
stalls=""
for r in long_scoreboard barrier wait math_pipe_throttle lg_throttle mio_throttle short_scoreboard \
         dispatch_stall not_selected selected sleeping membar imc_miss drain branch_resolving no_instruction \
         tex_throttle; do
  stalls+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
metrics="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
metrics+=",lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active"
metrics+=",sm__inst_issued.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active"
metrics+=",sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum"
metrics+=",lts__t_sectors_srcunit_tex.sum,launch__registers_per_thread,launch__grid_size${stalls}"
ncu --clock-control none --kernel-name regex:'grad_|_dispatch_' --metrics "$metrics" --csv --log-file "$out" \
    python3 "$(dirname "$0")/kernels.py" "$@" > /dev/null
