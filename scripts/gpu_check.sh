#!/usr/bin/env bash
# Everything pagedattn runs on the H200, in phases sized for one `device` call each (< 10 min).
# Session 4: explore5 (tests of the launch path, host time, config A/B on variant rows);
#   final5a / final5b / final5c (x2, consecutive warm calls): benchmark + host + variants,
#   the serving benchmark, every GPU test + sanitizers, on the shipped tree; fi074 (prepared,
#   not yet run): FlashInfer 0.7.4 beside auto in the same run.
# Session 5 ran final5c (carry .ext2), final5b (carry .ext3 .whl), final5a (carry .peers) on one
#   H200 as consecutive warm calls: 222 + 166 + 186 s, about 10 device-minutes with the start.
#   serveprof (prepared, not yet run): the serving step profile, after final5b on a warm machine.
# Session 8 ran explore8 / explore8b (the serving step's host gap, then the overlapped engine),
#   then final5c (carry .ext2), final5b (carry .ext3 .whl), fi074 (carry .ext4 .peers: FlashInfer
#   0.7.4 beside auto and the floor, host time, variant rows) on the shipped tree.
# Session 9 ran explore9 / explore9b (the window kernel's registers, the per-head merge; A/B
#   against an untracked copy of the previous src/ in ab9/head), then final5c, final5b
#   (SERVEPROF=0) and fi074 on the shipped tree; fi074 needed more than the 490 s left, so it
#   is now two calls: fi074 (the benchmark, carry .ext4 .peers) and fi074v (host time and the
#   variant rows, carry .ext4), about 15 device-minutes for the three final phases together.
# Session 10 ran fi074 then fi074v on de57610 (src/ = fce3882; 391 + 134 s, all 16 shapes),
#   then explore10 / explore10b / explore10c (config A/B on the rows auto trails, ncu of the
#   window on Azure beside FlashInfer, the window rows with one unit per sequence).
# Session 11 ran host11 (cProfile of the one-shot host path; 8 warps on the variant rows), then
#   final5c (carry .ext2), final5b (carry .ext3 .whl, SERVEPROF=0), fi074 (carry .ext4 .peers)
#   and fi074v (carry .ext4) on the shipped tree as consecutive warm calls (301 + 206 + 345 +
#   125 s), then host11b / host11c (host time A/B and medians) and explore11b (q_len=4 tiles).
# Session 12 ran nothing here (the device time of this work was spent). The tree on main needs,
#   as consecutive warm calls with PAGEDATTN_GIT_SHA set: final5c (carry .ext2), final5b (carry
#   .ext3 .whl, SERVEPROF=0), fi074 (carry .ext4 .peers, BENCH_S=560), fi074v (carry .ext4) and
#   host11c: about 1,150 device-seconds with the start.
# Session 13: compat13 (prepared, not yet run): the compat layer's GPU tests, beside the real
#   FA3 (carry .peers with fa3.tar) and FlashInfer 0.7.4 (carry .ext4).
# Session 3's phases (earlier sessions' phases are in git history):
#   lean1 / lean2 / lean3 / lean4   exploration: sweeps beside the plain floor (carry .peers),
#                                   host time and its profile, fp8 bisection
#   ncu3                            ncu: auto's main kernel beside the floor's split kernel
#   final3 / final4                 the shipped tree: every gpu/gpu2 test, the benchmark beside
#                                   the floor (eager + graph, roofline in the run), host time,
#                                   the variant rows (set PAGEDATTN_GIT_SHA to the commit sent)
#   final3b                         sanitizers over every kernel (scripts/gpu_hardening.sh)
# Results go to $OUT (default ./out). Run from the repo root; no install needed.
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
phase=${1:-tune}
t0=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }

env_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    | tee "$OUT/env.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" \
    | tee -a "$OUT/env.txt"
  # the device's copy of the tree has a stale git HEAD: the commit sent is PAGEDATTN_GIT_SHA
  echo "commit sent: ${PAGEDATTN_GIT_SHA:-unknown (PAGEDATTN_GIT_SHA unset)}" | tee -a "$OUT/env.txt"
}

setup_flashinfer() {  # the peers/README.md recipe: sdist, data links, CUDA 13 flag
  local tgz
  tgz=$(ls .ext_fi/flashinfer_python-*.tar.gz 2>/dev/null | head -1) || return 0
  [ -n "$tgz" ] || return 0
  mkdir -p /tmp/fi && tar xzf "$tgz" -C /tmp/fi
  local fi_dir
  fi_dir=$(ls -d /tmp/fi/flashinfer_python-* | head -1)
  mkdir -p "$fi_dir/flashinfer/data"
  ln -sfn "$fi_dir/include" "$fi_dir/flashinfer/data/include"
  ln -sfn "$fi_dir/csrc" "$fi_dir/flashinfer/data/csrc"
  ln -sfn "$fi_dir/3rdparty/cutlass" "$fi_dir/flashinfer/data/cutlass"
  sed -i 's/"-use_fast_math",/"-use_fast_math", "-static-global-template-stub=false",/' \
    "$fi_dir/flashinfer/jit/core.py"
  export PYTHONPATH=$fi_dir:$PYTHONPATH
  export MAX_JOBS=16
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || true
}

setup_flashinfer074() {  # peers/README recipe for 0.7.4: the wheel's flashinfer/ repacked as
  # .ext4/flashinfer-0.7.4.tar.xz (25 MB) + the apache-tvm-ffi wheel; JIT builds go to the
  # ignored .fi_ws/, which stays on a warm machine between calls (10-35 s per config cold)
  [ -f .ext4/flashinfer-0.7.4.tar.xz ] || { echo "no .ext4/flashinfer-0.7.4.tar.xz"; return 0; }
  mkdir -p /tmp/fi074 .fi_ws
  [ -d /tmp/fi074/flashinfer ] || tar xJf .ext4/flashinfer-0.7.4.tar.xz -C /tmp/fi074
  python3 -m pip install --quiet --no-index --no-deps --target /tmp/fi074 \
    .ext4/apache_tvm_ffi-*.whl 2>&1 | tail -2
  export PYTHONPATH=$PYTHONPATH:/tmp/fi074
  export FLASHINFER_WORKSPACE_BASE=$PWD/.fi_ws
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || true
}

bench_beside_floor() {  # bench_beside_floor SECONDS PEERS: auto beside the plain floor (carry
  # .peers) and PEERS ("none" or a comma list), eager and graph, roofline in the run
  stamp "benchmark: auto beside the floor and peers=$2, eager and graph, roofline in the run"
  timeout "$1" python3 -m pagedattn.cli bench --shapes peers --impls auto --peers "$2" \
    --peer-file floor=.peers/plain_floor.py:best_floor_runner --graph --reps 40 \
    --out-dir "$RES/bench" > "$RES/bench.log" 2>&1; grep -E "auto|roofline" "$RES/bench.log"
}

assemble_gguf() {  # the 98 MB GGUF travels in two halves over two consecutive (warm) calls
  if [ -f .ext2/part.aa ] && [ -f .ext3/part.ab ]; then
    mkdir -p .model && cat .ext2/part.aa .ext3/part.ab > .model/smollm2.gguf
    sha256sum .model/smollm2.gguf | tee "$OUT/gguf.sha256"
  else
    ls -la .ext2 .ext3 .model 2>&1 | tee "$OUT/gguf.sha256"
  fi
}

serveprof_random() {  # serveprof_random SECONDS TOP LINES: the serving step profile at batch
  # 1 and 64 (SmolLM2-135M's shapes, random weights), JSON per batch under $RES
  for a in "--batch 1" "--batch 64"; do
    stamp "serving step profile (random weights): $a"
    # shellcheck disable=SC2086
    timeout "$1" python3 scripts/profile_serving_step.py --random $a --top "$2" \
      --json "$RES/serveprof-$(echo $a | tr -d ' -').json" 2>&1 | grep -v -i warn | head -"$3"
  done
}

ncu_summary() {  # ncu_summary CSV: the headline metrics per kernel
  python3 - "$1" <<'PY'
import csv, sys
keep = ("Duration", "DRAM Throughput", "Registers Per Thread", "Grid Size",
    "Achieved Occupancy", "Waves Per SM", "Theoretical Occupancy", "Block Size")
lines = open(sys.argv[1]).read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
for r in csv.DictReader(lines[start:] if start is not None else []):
    if r["Metric Name"] in keep:
        print(r["ID"], r["Kernel Name"][:40], r["Metric Name"], r["Metric Value"], r["Metric Unit"])
PY
}

ab_plain_rows() {  # ab_plain_rows SECONDS: split target, stages and tiles A/B (eager
  # medians) on the plain rows where auto trails the fastest peer (session 10)
  stamp "config A/B, plain rows (eager medians)"
  timeout "$1" python3 scripts/bench_variants.py --reps 60 --json "$RES/ab-plain.json" \
    --rows plain-hd64-smollm-b64-c2k,plain-llama8b-b8-c8k,plain-b1-c32k,plain-llama8b-b256-c1k,plain-qwen7b-b64-c4k,plain-tp8-70b-b128-c8k,plain-hd256-b32-c4k,plain-mooncake-b16-llama8b \
    --configs "default;ctas_per_sm=2;ctas_per_sm=6;ctas_per_sm=8;num_stages=2;num_stages=3;block_n=32;block_n=128" \
    2>&1 | cut -c1-900
}

pack() {  # the device returns at most 8 files: ship the run as one archive plus its logs
  tar czf "$OUT/results-$phase.tgz" -C "$RES" . && ls -la "$OUT"
}
RES=/tmp/res-$phase
mkdir -p "$RES"

case "$phase" in
  explore11c)  # session 11: branch next/qlen-tiles (multi_token_config): its gpu-marked tests of
    # the kernel and plan, then q_len=4 beside plain b64-c2k under the new default
    RES=$OUT
    env_info
    XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadfile")
    stamp "GPU tests: variants, plan, decode"
    # shellcheck disable=SC2086
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider $XDIST -rfE tests/test_variants.py \
      tests/test_plan.py tests/test_decode.py > "$RES/pytest-gpu-kernel.log" 2>&1
    tail -4 "$RES/pytest-gpu-kernel.log"
    stamp "q_len=4 and plain b64-c2k, default configs (eager medians)"
    timeout 90 python3 scripts/bench_variants.py --reps 60 --json "$RES/qlen4-branch.json" \
      --rows qlen4-b64-c2k,plain-b64-c2k --configs "default;block_n=64,num_stages=2,ctas_per_sm=4" \
      2>&1 | cut -c1-600
    ;;
  explore11b)  # session 11: q_len=4 without spills. Capped at 128 registers, its 64-token
    # tiles 2 deep spill 92 bytes; ptxas fits 32-token tiles 3 deep in 128 with none and
    # 16-token tiles 4 deep in 98 (the bundled ptxas, sm_90a); twice, plain b64-c2k beside
    RES=$OUT
    env_info
    for i in 1 2; do
      stamp "q_len=4 tile A/B, pass $i (eager medians)"
      timeout 150 python3 scripts/bench_variants.py --reps 60 --json "$RES/ab-qlen4-$i.json" \
        --rows qlen4-b64-c2k,plain-b64-c2k \
        --configs "default;block_n=32,num_stages=3;block_n=16,num_stages=4;block_n=32,num_stages=4;block_n=32,num_stages=3,ctas_per_sm=3" \
        2>&1 | cut -c1-900
    done
    ;;
  host11c)  # session 11: host time of the shipped tree, each figure the median of seven
    # timings of 2,000 calls (the host clock drifts between runs: host11b)
    RES=$OUT
    env_info
    stamp "host time"
    timeout 120 python3 scripts/host_time.py --repeats 7 --json "$RES/host.json" 2>&1 \
      | tee "$RES/host.log"
    ;;
  host11b)  # session 11: host time of the one-shot without its launch record, A/B in one call:
    # 6405c4f's src/ (copied untracked to ab11/old) and the tree's, alternated three times
    RES=$OUT
    for i in 1 2 3; do
      for t in old new; do
        if [ $t = old ]; then P=$PWD/ab11/old/src; else P=$PWD/src; fi
        stamp "host time, $t tree, round $i"
        PYTHONPATH=$P timeout 40 python3 scripts/host_time.py --json "$RES/host-$t-$i.json" \
          2>&1 | tee -a "$RES/host-ab.log"
      done
    done
    ;;
  host11)  # session 11: where the one-shot paged_decode's host time goes (cProfile of
    # scripts/host_time.py, by own and cumulative time), then explore11's second half: eight
    # warps on the variant rows that trail FlashInfer (q_len=4, soft-cap)
    RES=$OUT
    env_info
    stamp "host time with cProfile"
    timeout 90 python3 scripts/host_time.py --profile 2>&1 | tee "$RES/host-profile.log" \
      | grep -E "^batch=|^---"
    stamp "num_warps A/B on the variant rows that trail FlashInfer (eager medians)"
    timeout 200 python3 scripts/bench_variants.py --reps 60 --json "$RES/ab-warps-variants.json" \
      --rows qlen4-b64-c2k,softcap50-b64-c2k,plain-b64-c2k \
      --configs "default;num_warps=8,ctas_per_sm=2;num_warps=8,ctas_per_sm=2,block_n=32,num_stages=3" \
      2>&1 | cut -c1-900
    ;;
  explore11)  # prepared in session 10, not yet run: eight warps per program, which the
    # sweeps never varied; compiled for sm_90 (bundled ptxas), the fp8 kernel takes 255
    # registers at 4 warps x 128-token tiles (8 warps per SM), 184 at 8 warps (still 8 per
    # SM) and 128 at 8 warps x 64-token tiles (16 per SM, 8 bytes spilled); perf-notes step 25
    RES=$OUT
    env_info
    stamp "num_warps A/B (eager medians)"
    timeout 300 python3 scripts/bench_variants.py --reps 60 --json "$RES/ab-warps.json" \
      --rows plain-fp8-llama8b-b64-c8k,plain-fp8-llama8b-b1-c32k,plain-hd256-b32-c4k,plain-hd64-smollm-b64-c2k,plain-llama8b-b8-c8k \
      --configs "default;num_warps=8;num_warps=8,block_n=64;num_warps=8,block_n=64,ctas_per_sm=4;num_warps=8,num_stages=2" \
      2>&1 | cut -c1-900
    # q_len=4 is capped at 128 registers and spills 92 bytes at 4 warps; at 8 warps and two
    # programs per SM it fits 128 with no spill (106 with 32-token tiles 3 deep)
    stamp "num_warps A/B on the variant rows that trail FlashInfer (eager medians)"
    timeout 200 python3 scripts/bench_variants.py --reps 60 --json "$RES/ab-warps-variants.json" \
      --rows qlen4-b64-c2k,softcap50-b64-c2k,plain-b64-c2k \
      --configs "default;num_warps=8,ctas_per_sm=2;num_warps=8,ctas_per_sm=2,block_n=32,num_stages=3" \
      2>&1 | cut -c1-900
    ;;
  racecheck10)  # session 10: racecheck alone with the time session 9's lacked (it stopped
    # after 76 of 80 calls at 70 s), on the shipped src/
    RES=$OUT
    env_info
    stamp "warm-up (compiles every kernel the driver calls)"
    timeout 60 python3 scripts/sanitize_driver.py > "$RES/sanitize-warm.log" 2>&1
    tail -2 "$RES/sanitize-warm.log"
    stamp "racecheck"
    timeout 170 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 50 \
      python3 scripts/sanitize_driver.py > "$RES/sanitize-racecheck.log" 2>&1
    echo "exit $?" >> "$RES/sanitize-racecheck.log"; tail -4 "$RES/sanitize-racecheck.log"
    ;;
  explore10d)  # session 10: branch next/window-one-unit (copied untracked to ab10/new): its
    # GPU tests of the kernel and plan, then the window rows beside FlashInfer (carry .ext4)
    RES=$OUT
    setup_flashinfer074
    stamp "GPU tests of the kernel (ab10/new)"
    (cd ab10/new && PYTHONPATH=$PWD/src:/tmp/fi074 timeout 200 python3 -m pytest -q -m gpu \
      -p no:cacheprovider -rfE tests/test_variants.py tests/test_plan.py tests/test_decode.py) \
      > "$RES/pytest.log" 2>&1; tail -4 "$RES/pytest.log"
    stamp "window rows beside FlashInfer (ab10/new)"
    PYTHONPATH=$PWD/ab10/new/src:/tmp/fi074 timeout 200 python3 ab10/new/scripts/bench_variants.py \
      --json "$RES/window-rows-branch.json" \
      --rows window1024-azure,window1024-b64-c2k,window1024-b32-c2k,window1024-b16-c2k,window4096-b1-c32k,plain-azure,plain-b64-c2k \
      2>&1 | cut -c1-400
    ;;
  explore10c)  # session 10: the window rows with one unit per sequence and kv head
    # (num_splits=1: no split, no merge, as FlashInfer runs them) beside FlashInfer (carry .ext4)
    RES=$OUT
    setup_flashinfer074
    if [ "${NOSPLIT_ROWS:-1}" = 1 ]; then  # NOSPLIT_ROWS=0: the A/B below only
      stamp "window rows, split and unsplit, beside FlashInfer"
      timeout 200 python3 scripts/bench_variants.py --json "$RES/window-nosplit.json" \
        --rows window1024-azure,window1024-azure-nosplit,window1024-b64-c2k,window1024-b64-c2k-nosplit \
        2>&1 | cut -c1-500
    fi
    stamp "unsplit window rows: stages A/B (eager medians)"
    timeout 120 python3 scripts/bench_variants.py --reps 60 --json "$RES/window-nosplit-ab.json" \
      --rows ${AB_ROWS:-window1024-azure-nosplit,window1024-b64-c2k-nosplit} \
      --configs "${AB_CONFIGS:-default;num_stages=2;num_stages=3;block_n=128,num_stages=2;block_n=32,num_stages=3}" \
      2>&1 | cut -c1-700
    ;;
  explore10b)  # session 10: explore10's plain-row A/B again (hd256 at 128-token tiles ran
    # out of shared memory and ended the script; a config that does not fit is now recorded)
    RES=$OUT
    env_info
    ab_plain_rows 400
    ;;
  explore10)  # session 10: config A/B of the split target, stages and tiles on the rows
    # where auto trails (issue 10) and on the window rows (issue 11), then ncu of the
    # 1,024-token window on Azure, ours beside FlashInfer 0.7.4 (carry .ext4)
    RES=$OUT
    env_info
    setup_flashinfer074
    ab_plain_rows 260
    stamp "config A/B, window rows (eager medians)"
    timeout 120 python3 scripts/bench_variants.py --reps 60 --json "$RES/ab-window.json" \
      --rows window1024-azure,window1024-b64-c2k \
      --configs "default;num_stages=2,ctas_per_sm=4;num_stages=3,ctas_per_sm=4;num_stages=3,ctas_per_sm=6;num_stages=4;num_stages=2;block_n=32,num_stages=4;block_n=128,num_stages=2" \
      2>&1 | cut -c1-700
    stamp "ncu: window1024-azure (ours, FlashInfer)"
    timeout 100 ncu --clock-control none --section SpeedOfLight --section LaunchStats \
      --section Occupancy -k regex:'paged_decode|merge|Merge|Prefill|Decode' --csv \
      --page details python3 scripts/ncu_side_by_side.py --row window1024-azure \
      > "$RES/ncu-window1024-azure.csv" 2> "$RES/ncu-window1024-azure.err"
    ncu_summary "$RES/ncu-window1024-azure.csv"
    ;;
  explore9b)  # session 9: the window kernel in 128 registers (tile-aligned window start,
    # clamped addresses) and the per-head merge in one round, A/B against the last shipped
    # tree (ab9/head, untracked copy) in the same call; then the GPU tests of the new kernel
    RES=$OUT
    env_info
    setup_flashinfer074
    rows=window1024-b64-c2k,window1024-azure,window4096-b1-c32k,plain-b1-c32k,plain-llama8b-b8-c8k,plain-b64-c1025,plain-b64-c2k,qlen4-b64-c2k
    for t in head new head new; do
      stamp "A/B tree $t (eager medians)"
      p=$PWD/src; [ $t = head ] && p=$PWD/ab9/head/src
      PYTHONPATH=$p timeout 100 python3 scripts/bench_variants.py --rows $rows --reps 60 \
        --configs "default;num_stages=3" --json "$RES/ab-$t.json" 2>&1 | cut -c1-300 | tail -8
    done
    stamp "new tree beside FlashInfer (eager, graph)"
    timeout 120 python3 scripts/bench_variants.py --rows $rows --json "$RES/rows-new.json" 2>&1 \
      | cut -c1-400
    stamp "GPU tests of the kernel"
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -x -rfE tests/test_variants.py \
      tests/test_decode.py tests/test_plan.py > "$RES/pytest.log" 2>&1; tail -4 "$RES/pytest.log"
    ;;
  explore9)  # session 9: the 1,024-token window behind FlashInfer (issue 11): the window rows
    # beside a plain batch of the same work (64 x 1,025 keys), split/tile A/B, and ncu of
    # ours beside FlashInfer's window kernel; ncu of b1-c32k ours beside the floor with the
    # merges (carry .ext4 .peers)
    RES=$OUT
    env_info
    setup_flashinfer074
    rows=window1024-b64-c2k,window1024-azure,plain-b64-c1025,plain-b64-c2k
    stamp "rows beside FlashInfer"
    timeout 120 python3 scripts/bench_variants.py --rows $rows --json "$RES/rows.json" 2>&1 \
      | cut -c1-400
    stamp "config A/B (eager)"
    timeout 150 python3 scripts/bench_variants.py --rows $rows --reps 60 --json "$RES/ab.json" \
      --configs "default;ctas_per_sm=2;ctas_per_sm=8;num_stages=3;block_n=32,num_stages=3;block_n=128;min_chunk=512" \
      2>&1 | cut -c1-600
    for row in window1024-b64-c2k plain-b64-c1025; do
      stamp "ncu: $row (ours, FlashInfer)"
      timeout 90 ncu --clock-control none --section SpeedOfLight --section LaunchStats \
        --section Occupancy -k regex:'paged_decode|merge|Merge|Prefill|Decode' --csv \
        --page details python3 scripts/ncu_side_by_side.py --row $row > "$RES/ncu-$row.csv" \
        2> "$RES/ncu-$row.err"; ncu_summary "$RES/ncu-$row.csv"
    done
    stamp "ncu: llama8b-b1-c32k (ours, floor, with merges)"
    timeout 60 ncu --clock-control none --section SpeedOfLight --section LaunchStats \
      --section Occupancy -k regex:'_paged_decode_kernel|_merge|_floor_' --csv \
      --page details python3 scripts/ncu_side_by_side.py --shape llama8b-b1-c32k \
      --peer-file .peers/plain_floor.py > "$RES/ncu-b1-c32k.csv" 2> "$RES/ncu-b1-c32k.err"
    ncu_summary "$RES/ncu-b1-c32k.csv"
    ;;
  explore7)  # session 7: the one-tile split remainder (perf-notes step 20) on the variant rows,
    # and where a batch-1 serving step's time goes (SmolLM2-135M's shapes, random weights)
    RES=$OUT
    env_info
    stamp "variant rows (auto only)"
    timeout 150 python3 scripts/bench_variants.py --json "$RES/variants.json" 2>&1 | cut -c1-300
    for a in "--batch 1" "--batch 1 --no-graphs" "--batch 64"; do
      stamp "serving step profile: $a"
      # shellcheck disable=SC2086
      timeout 120 python3 scripts/profile_serving_step.py --random $a --top 25 \
        --json "$RES/serveprof-$(echo $a | tr -d ' -').json" 2>&1 | tail -55
    done
    ;;
  explore8)  # session 8: a batch-1 serving step's wall time beside its graph replayed back to
    # back (GPU only): how much of a step is the host's
    RES=$OUT
    env_info
    serveprof_random 120 20 30
    ;;
  explore8b)  # session 8: the engine overlapping host and GPU (step k + 1 launched before step
    # k is read): the GPU tests of the serving path, then the step profile again
    RES=$OUT
    env_info
    XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadfile")
    stamp "GPU tests: engine, graphs, model, cache, serving CLI"
    # shellcheck disable=SC2086
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_engine.py \
      > "$RES/pytest-engine.log" 2>&1; tail -4 "$RES/pytest-engine.log"
    # shellcheck disable=SC2086
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider $XDIST -rfE \
      tests/test_cuda_graph.py tests/test_model.py tests/test_cache.py tests/test_layers.py \
      tests/test_serving_cli.py > "$RES/pytest.log" 2>&1; tail -6 "$RES/pytest.log"
    serveprof_random 100 8 18
    ;;
  explore8c)  # session 8: the trace run alone, A/B: session 6's tree (f7f6d72, copied untracked
    # into .abold/src) against the shipped one, with and without the overlapped decode
    RES=$OUT
    for t in old new new-no-overlap; do
      case $t in
        old) P=$PWD/.abold/src; A="" ;;
        new) P=$PWD/src; A="" ;;
        new-no-overlap) P=$PWD/src; A="--no-overlap" ;;
      esac
      stamp "trace $t"
      # shellcheck disable=SC2086
      PYTHONPATH=$P timeout 100 python3 scripts/trace_ab.py --label "$t" $A 2>&1 \
        | grep -v -i warn | tail -2 | tee -a "$RES/trace_ab.log"
    done
    ;;
  explore7b)  # session 7: one unit per sequence (ONE_UNIT) and the reused staging buffers:
    # the GPU tests they touch, then the batch-1 serving step again (random weights)
    RES=$OUT
    env_info
    XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadfile")
    stamp "GPU tests: plan, decode, variants, graphs, engine, cache"
    # shellcheck disable=SC2086
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider $XDIST -rfE tests/test_plan.py \
      tests/test_decode.py tests/test_variants.py tests/test_cuda_graph.py tests/test_engine.py \
      tests/test_cache.py > "$RES/pytest.log" 2>&1; tail -6 "$RES/pytest.log"
    serveprof_random 120 12 22
    ;;
  fi074)  # FlashInfer 0.7.4 (TC and XQA) beside auto and the floor in one run (carry .ext4
    # and .peers). On a cold machine most of the time is FlashInfer's JIT (session 9: the 16
    # shapes needed more than 380 s there), so this call is the benchmark alone; fi074v (the
    # next, warm call: the JIT cache in .fi_ws stays) takes host time and the variant rows
    RES=$OUT
    env_info
    setup_flashinfer074
    bench_beside_floor "${BENCH_S:-540}" flashinfer-tc,flashinfer-xqa
    ;;
  fi074v)  # right after fi074 (warm; carry .ext4): host time, then the variant rows beside
    # FlashInfer 0.7.4's same variants
    RES=$OUT
    setup_flashinfer074
    stamp "host time"
    timeout 45 python3 scripts/host_time.py 2>&1 | tee "$RES/host.log"
    stamp "variant rows beside FlashInfer"
    timeout 400 python3 scripts/bench_variants.py --json "$RES/variants.json" 2>&1 | cut -c1-300
    ;;
  final5a)  # session 4, the shipped tree (PAGEDATTN_GIT_SHA names it): the benchmark beside
    # the floor (carry .peers), host time, the variant rows; carry .ext2 (GGUF, first half)
    RES=$OUT
    env_info
    bench_beside_floor 230 none
    stamp "host time"
    timeout 45 python3 scripts/host_time.py 2>&1 | tee "$RES/host.log"
    stamp "variant rows"
    timeout 120 python3 scripts/bench_variants.py --json "$RES/variants.json" 2>&1 | cut -c1-300
    ls -la .ext2 > "$RES/ext2.txt" 2>&1
    ;;
  final5b)  # right after final5a (warm): carry .ext3 (GGUF, second half) and .whl (gguf
    # wheel); the serving benchmark on SmolLM2-135M
    RES=$OUT
    assemble_gguf
    python3 -m pip install --quiet --no-index --no-deps --target /tmp/gguf_pkg .whl/gguf-*.whl \
      2>&1 | tail -2
    export PYTHONPATH=$PYTHONPATH:/tmp/gguf_pkg
    stamp "the engine's tests on the GPU (unmarked: they take the GPU when there is one)"
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_engine.py \
      > "$RES/pytest-engine.log" 2>&1; tail -3 "$RES/pytest-engine.log"
    stamp "serving benchmark"
    timeout 400 python3 -m pagedattn.cli bench-model --gguf .model/smollm2.gguf \
      --out "$RES/serving-h200" 2>&1 | tee "$RES/serving.log" | tail -40
    [ "${SERVEPROF:-1}" = 1 ] && serveprof_random 60 12 22  # SERVEPROF=0: skip (device time)
    ;;
  serveprof)  # prepared in session 5, not yet run: where a SmolLM2 decode step's time goes
    # (scripts/profile_serving_step.py), batch 1 and 64, graphs and eager; run right after
    # final5b on the warm machine (it assembled .model/smollm2.gguf), carry .whl (gguf wheel)
    RES=$OUT
    python3 -m pip install --quiet --no-index --no-deps --target /tmp/gguf_pkg .whl/gguf-*.whl \
      2>&1 | tail -2
    export PYTHONPATH=$PYTHONPATH:/tmp/gguf_pkg
    for b in 1 64; do
      for g in "" "--no-graphs"; do
        stamp "serving step profile: batch $b ${g:-graphs}"
        # shellcheck disable=SC2086
        timeout 120 python3 scripts/profile_serving_step.py --gguf .model/smollm2.gguf \
          --batch "$b" $g --json "$RES/serveprof-b$b${g:+-eager}.json" 2>&1 | tail -18
      done
    done
    ;;
  final5c)  # the shipped tree on two GPUs: every GPU-marked test (N19 included), then the
    # sanitizers over every kernel
    RES=$OUT
    env_info
    XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadfile")
    stamp "every gpu / gpu2 test"
    # shellcheck disable=SC2086
    timeout 200 python3 -m pytest -q -m "gpu or gpu2" -p no:cacheprovider $XDIST -rfE \
      --durations=10 tests > "$RES/pytest-gpu.log" 2>&1; tail -15 "$RES/pytest-gpu.log"
    stamp "the engine's tests on the GPU (unmarked: they take the GPU when there is one)"
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_engine.py \
      > "$RES/pytest-engine.log" 2>&1; tail -3 "$RES/pytest-engine.log"
    stamp "sanitizers"
    # racecheck needed 67 s in session 8 and more than 70 on session 9's slower host
    OUT=$RES SANITIZE_S=${SANITIZE_S:-100} timeout 380 bash scripts/gpu_hardening.sh sanitize \
      | tail -14
    ;;
  explore5)  # session 4: GPU tests of the launch path, host time, variant/plain config A/B
    RES=$OUT
    env_info
    stamp "GPU tests: plan, decode, variants"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_plan.py \
      tests/test_decode.py tests/test_variants.py > "$RES/pytest.log" 2>&1; tail -4 "$RES/pytest.log"
    stamp "host time"
    timeout 60 python3 scripts/host_time.py 2>&1 | tee "$RES/host.log"
    stamp "config A/B on the variant rows and the trailing plain rows"
    timeout 330 python3 scripts/bench_variants.py --reps 50 \
      --rows "${ROWS:-qlen4-b64-c2k,alibi-b64-c2k,window1024-b64-c2k,softcap50-b64-c2k,sinks-b64-c2k,invariant-b64-c2k,plain-b64-c2k,plain-b1-c32k,plain-llama8b-b8-c8k,plain-hd64-smollm-b64-c2k,plain-tp8-70b-b128-c8k,plain-qwen7b-b64-c4k}" \
      --configs "${CONFIGS:-default;maxnreg=128;ctas_per_sm=8;num_stages=3;block_n=32,num_stages=3}" \
      --json "$RES/ab.json" 2>&1 | tee "$RES/ab.log" | cut -c1-400
    ;;
  final3)  # session 3, the shipped tree (x2): every GPU-marked test, the benchmark beside the
    # floor (carry .peers), host time. PAGEDATTN_GIT_SHA names the commit of the copied tree.
    env_info
    XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4 --dist loadfile")
    stamp "every gpu / gpu2 test"
    # shellcheck disable=SC2086
    timeout 250 python3 -m pytest -q -m "gpu or gpu2" -p no:cacheprovider $XDIST -rfE \
      --durations=10 tests 2>&1 | tee "$RES/pytest-gpu.log" | tail -25
    stamp "benchmark: auto beside the floor, eager and graph, roofline in the run"
    timeout 270 python3 -m pagedattn.cli bench --shapes peers --impls auto --peers none \
      --peer-file floor=.peers/plain_floor.py:best_floor_runner --graph --reps 40 \
      --out-dir "$RES/bench" > "$RES/bench.log" 2>&1; tail -30 "$RES/bench.log"
    stamp "host time"
    timeout 45 python3 scripts/host_time.py --json "$RES/host_time.json" 2>&1 | tee "$RES/host.log"
    pack
    ;;
  final4)  # session 3, the final tree: benchmark beside the floor, host time, every GPU test,
    # the variant rows; written straight to $OUT (a call cut at its limit still returns them)
    RES=$OUT
    bench_beside_floor 200 none
    stamp "host time"
    timeout 40 python3 scripts/host_time.py 2>&1 | tee "$RES/host.log"
    XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadfile")
    stamp "every gpu / gpu2 test"
    # shellcheck disable=SC2086
    timeout 150 python3 -m pytest -q -m "gpu or gpu2" -p no:cacheprovider $XDIST -rfE \
      tests > "$RES/pytest-gpu.log" 2>&1; tail -4 "$RES/pytest-gpu.log"
    stamp "variant rows"
    timeout 100 python3 scripts/bench_variants.py --json "$RES/variants.json" 2>&1 | tail -14
    ;;
  final3b)  # right after final3, warm: sanitizers over every kernel, the variant rows
    env_info
    OUT=$RES SANITIZE_S=${SANITIZE_S:-75} timeout 330 bash scripts/gpu_hardening.sh sanitize \
      | tail -14
    stamp "variant rows"
    timeout 120 python3 scripts/bench_variants.py --json "$RES/variants.json" 2>&1 \
      | tee "$RES/variants.log" | tail -16
    pack
    ;;
  ncu3)  # session 3: ncu, auto's main kernel beside the floor's split kernel (carry .peers)
    env_info
    for s in ${SHAPES:-llama8b-b64-c2k mooncake-b16-llama8b hd64-smollm-b64-c2k fp8-llama8b-b64-c8k}; do
      stamp "ncu: $s"
      timeout 100 ncu --clock-control none --section SpeedOfLight --section LaunchStats \
        --section Occupancy -k regex:'_paged_decode_kernel|_floor_split_kernel' --csv \
        --page details python3 scripts/ncu_side_by_side.py --shape "$s" \
        --peer-file .peers/plain_floor.py > "$RES/ncu-$s.csv" 2> "$RES/ncu-$s.err"
      ncu_summary "$RES/ncu-$s.csv"
    done
    pack
    ;;
  lean4)  # session 3: fp8 bisection at N07's natural size (carry .peers), host time
    env_info
    stamp "fp8 paths at N07's natural size"
    timeout 240 python3 .peers/diag_fp8.py 2>&1 | tee "$RES/diag_fp8.log"
    stamp "host time"
    timeout 60 python3 scripts/host_time.py --json "$RES/host_time.json" 2>&1 | tee "$RES/host.log"
    pack
    ;;
  lean3)  # session 3: GPU tests incl. the second-series cases, host time, defaults vs floor
    env_info
    stamp "GPU tests: plan, decode, second-series cases, launchers"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_plan.py \
      tests/test_decode.py tests/test_cases_second_series.py tests/test_launchers.py 2>&1 \
      | tee "$RES/pytest.log" | tail -12
    stamp "host time"
    timeout 60 python3 scripts/host_time.py --json "$RES/host_time.json" 2>&1 | tee "$RES/host.log"
    stamp "defaults beside the floor, every peer row (carry .peers)"
    timeout 240 python3 scripts/sweep_decode.py --grid none --out "$RES" \
      --peer-file .peers/plain_floor.py 2>&1 | tee "$RES/sweep.log" | grep -v "^  best"
    pack
    ;;
  lean2)  # session 3: host-path profile, GPU tests, the fp32/fp8 focus sweep
    env_info
    stamp "GPU tests: plan, decode"
    timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_plan.py \
      tests/test_decode.py 2>&1 | tee "$RES/pytest.log" | tail -5
    stamp "host time, profiled"
    timeout 90 python3 scripts/host_time.py --profile --json "$RES/host_time.json" 2>&1 \
      | tee "$RES/host.log"
    stamp "focus sweep: fp32 and fp8"
    timeout 300 python3 scripts/sweep_decode.py --grid focus --budget-s 260 --out "$RES" \
      --shapes seed-fp32-b64-c2048,fp8-llama8b-b64-c8k,fp8-llama8b-b1-c32k 2>&1 \
      | tee "$RES/sweep.log"
    pack
    ;;
  lean1)  # session 3: GPU tests of the plan path, host time, sweep beside the plain floor
    env_info
    stamp "GPU tests: plan, decode"
    timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_plan.py \
      tests/test_decode.py 2>&1 | tee "$RES/pytest.log" | tail -5
    stamp "host time"
    timeout 60 python3 scripts/host_time.py --json "$RES/host_time.json" 2>&1 | tee "$RES/host.log"
    stamp "sweep beside the floor (carry .peers)"
    timeout 400 python3 scripts/sweep_decode.py --shapes "${SHAPES:-peers}" --out "$RES" \
      --peer-file .peers/plain_floor.py --budget-s 340 2>&1 | tee "$RES/sweep.log" \
      | grep -v "^  DecodeConfig"
    pack
    ;;
  compat13)  # session 13, prepared, not yet run: the compat layer (issue 26). Its own tests on
    # CUDA, compat beside the real FA3 (carry .peers with fa3.tar) and FlashInfer 0.7.4 (carry
    # .ext4), then FlashInfer's and FA3's own decode tests at full size (as far as time allows)
    RES=$OUT
    env_info
    setup_flashinfer074
    XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadfile")
    stamp "compat: own tests on CUDA, beside the real FA3 and FlashInfer 0.7.4"
    PAGEDATTN_FA3_TAR=$PWD/.peers/fa3.tar timeout 150 python3 -m pytest -q -p no:cacheprovider \
      -rfEs tests/test_compat.py tests/test_compat_vs_peers.py > "$RES/pytest-compat.log" 2>&1
    tail -8 "$RES/pytest-compat.log"
    stamp "FlashInfer's own batch-decode tests, full size"
    # shellcheck disable=SC2086
    timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider $XDIST -rfE \
      tests/test_compat_fi_batch_decode.py > "$RES/pytest-compat-fi.log" 2>&1
    tail -6 "$RES/pytest-compat-fi.log"
    stamp "FA3's own test_flash_attn_kvcache, full size"
    # shellcheck disable=SC2086
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider $XDIST -rfE --maxfail 20 \
      tests/test_compat_fa_kvcache.py > "$RES/pytest-compat-fa.log" 2>&1
    tail -6 "$RES/pytest-compat-fa.log"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
stamp "done"
