#!/usr/bin/env bash
# Everything pagedattn runs on the H200, in phases sized for one `device` call each (< 10 min).
#   bash scripts/gpu_check.sh tune      # GPU tests of the kernels, main job, tile/launch sweep
#   bash scripts/gpu_check.sh tuneprof  # kernel tests, tuned table, ncu profile, ladder
#   bash scripts/gpu_check.sh bench     # harness: auto vs peers (FlashInfer sdist in .ext_fi)
#   bash scripts/gpu_check.sh final_a   # retune, published benchmark, main job, hardening (session 1)
#   bash scripts/gpu_check.sh final_b   # model, serving tests, sanitizers (session 1)
#   bash scripts/gpu_check.sh step6     # GPU tests, host overhead, retune, bench the gap shapes
#   bash scripts/gpu_check.sh final2_a  # retune, then the published benchmark (session 2)
#   bash scripts/gpu_check.sh final2_b  # GPU tests, main job, sanitizers, ncu (session 2)
#   bash scripts/gpu_check.sh final4    # the published benchmark (carry .ext_fi)
# Each phase packs its results into $OUT/results-<phase>.tgz (the device returns <= 8 files).
# Full logs and tables go to $OUT (default ./out). Run from the repo root; no install needed.
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
  git rev-parse HEAD 2>/dev/null | tee -a "$OUT/env.txt"
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

assemble_gguf() {  # the 98 MB GGUF travels in two halves over two consecutive (warm) calls
  if [ -f .ext2/part.aa ] && [ -f .ext3/part.ab ]; then
    mkdir -p .model && cat .ext2/part.aa .ext3/part.ab > .model/smollm2.gguf
    sha256sum .model/smollm2.gguf | tee "$OUT/gguf.sha256"
  else
    ls -la .ext2 .ext3 .model 2>&1 | tee "$OUT/gguf.sha256"
  fi
}

run_tune() {  # run_tune LIMIT_S REPS: sweep -> .tuned/tuned_h200.json (copy it to
  # src/pagedattn/launch/ to publish), used by the rest of the phase
  stamp "tile/launch sweep -> tuned table"
  mkdir -p .tuned
  timeout "$1" python3 scripts/tune_decode.py --shapes peers --reps "$2" \
    --out "$RES/tune.csv" --table .tuned/tuned_h200.json > "$RES/tune.log" 2>&1
  grep -E "chosen|oracle|Error" "$RES/tune.log" | head -40; cp .tuned/tuned_h200.json "$RES/"
  export PAGEDATTN_TUNED_TABLE=$PWD/.tuned/tuned_h200.json
}

bench_peers() {  # bench_peers LIMIT_S: the published benchmark (auto vs peers, eager + graph)
  stamp "benchmark harness, peers shapes (auto vs FlashInfer and naive; eager and graph)"
  timeout "$1" python3 -m pagedattn.cli bench --shapes peers --impls auto \
    --peers naive,flashinfer-tc --graph --reps 50 --out-dir "$RES/bench" > "$RES/bench.log" 2>&1
  grep -E "^[a-z0-9-]+ +(auto|flashinfer-tc) " "$RES/bench.log"; tail -2 "$RES/bench.log"
}

pack() {  # the device returns at most 8 files: ship the run as one archive plus its logs
  tar czf "$OUT/results-$phase.tgz" -C "$RES" . && ls -la "$OUT"
}
RES=/tmp/res-$phase
mkdir -p "$RES"

case "$phase" in
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
    stamp "benchmark: auto beside the floor, eager and graph, roofline in the run"
    timeout 200 python3 -m pagedattn.cli bench --shapes peers --impls auto --peers none \
      --peer-file floor=.peers/plain_floor.py:best_floor_runner --graph --reps 40 \
      --out-dir "$RES/bench" > "$RES/bench.log" 2>&1; grep -E "auto|roofline" "$RES/bench.log"
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
      python3 - "$RES/ncu-$s.csv" <<'PY'
import csv, sys
keep = ("Duration", "DRAM Throughput", "Registers Per Thread", "Grid Size",
        "Achieved Occupancy", "Waves Per SM", "Theoretical Occupancy")
lines = open(sys.argv[1]).read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
for r in csv.DictReader(lines[start:] if start is not None else []):
    if r["Metric Name"] in keep:
        print(r["ID"], r["Kernel Name"][:22], r["Metric Name"], r["Metric Value"], r["Metric Unit"])
PY
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
  tune)  # first exploration run (kept for the record: docs/perf-notes.md, step 1)
    env_info
    stamp "GPU tests of the kernels"
    timeout 240 python3 -m pytest -q -x tests/test_decode.py -p no:cacheprovider 2>&1 \
      | tee "$OUT/pytest-decode.log" | tail -5
    stamp "main job: llama-3-8b, azure trace, batches 8 and 64"
    for b in 8 64; do
      timeout 120 python3 -m pagedattn.cli run --model llama-3-8b --batch "$b" \
        --csv "$RES/mainjob-llama8b-b$b.csv" 2>&1 | tee "$RES/mainjob-b$b.log"
    done
    stamp "tile/launch sweep"
    timeout 330 python3 scripts/tune_decode.py --shapes peers --reps 20 \
      --out "$RES/tune.csv" --table "$RES/tuned_h200.json" > "$RES/tune.log" 2>&1
    grep chosen "$RES/tune.log"
    pack
    ;;
  tuneprof)  # second run: tuned table (oracle-checked), then the ladder under ncu
    env_info; ncu --version | tee -a "$OUT/env.txt"
    run_tune 230 12
    stamp "ladder: 5 stages + auto on the study's shape and a trace batch, under ncu"
    timeout 210 python3 -m pagedattn.cli ladder --out "$RES/docs/ladder-h200.md" \
      --out-dir "$RES/ladder" > "$RES/ladder.log" 2>&1; tail -40 "$RES/ladder.log"
    pack
    ;;
  bench)  # final numbers: auto vs peers, eager and graph, roofline in the same run
    env_info
    assemble_gguf
    setup_flashinfer
    [ -f .tuned/tuned_h200.json ] && export PAGEDATTN_TUNED_TABLE=$PWD/.tuned/tuned_h200.json
    stamp "benchmark harness, peers shapes"
    timeout 420 python3 -m pagedattn.cli bench --shapes peers --impls auto \
      --peers naive,flashinfer-tc --graph --reps 50 --out-dir "$RES/bench" 2>&1 \
      | tee "$RES/bench.log" | tail -45
    pack
    ;;

  final_a)  # last tuning of the table, then the published benchmark and the main job
    env_info
    setup_flashinfer
    run_tune 130 10
    bench_peers 220
    stamp "main job: llama-3-8b, azure trace, batches 8 and 64"
    for b in 8 64; do
      timeout 60 python3 -m pagedattn.cli run --model llama-3-8b --batch "$b" \
        --csv "$RES/mainjob-llama8b-b$b.csv" > "$RES/mainjob-b$b.log" 2>&1
      grep -E "auto|baseline|gqa|split|fused|vector" "$RES/mainjob-b$b.log" | tail -6
    done
    stamp "hardening: gpu-marked tests at natural sizes"
    OUT=$RES timeout 170 bash scripts/gpu_hardening.sh tests | tail -25
    pack
    ;;
  final_b)  # warm after final_a: the model (GGUF second half), serving tests, sanitizers
    env_info
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site
    assemble_gguf
    export PAGEDATTN_GGUF=$PWD/.model/smollm2.gguf
    [ -f .tuned/tuned_h200.json ] && export PAGEDATTN_TUNED_TABLE=$PWD/.tuned/tuned_h200.json
    stamp "generate: continuous batching of three prompts through paged_decode"
    timeout 70 python3 -m pagedattn.cli generate --chat --max-new-tokens 48 \
      "What is the capital of France?" "Write a haiku about GPUs." \
      "Explain paged attention in one sentence." 2>&1 | tee "$RES/generate.log" | tail -15
    stamp "model benchmark: tokens/s paged vs dense SDPA, agreement with transformers"
    timeout 120 python3 -m pagedattn.serving.bench_model --batch 32 --new-tokens 128 \
      > "$RES/bench_model.json" 2> "$RES/bench_model.err"; cat "$RES/bench_model.json"
    tail -3 "$RES/bench_model.err"
    stamp "serving tests on the GPU: CUDA graphs, torch.compile, ops, engine, model"
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_cuda_graph.py \
      tests/test_ops.py tests/test_engine.py tests/test_cache.py tests/test_append_kv.py \
      tests/test_model.py 2>&1 | tee "$RES/pytest-serving.log" | tail -8
    stamp "compute-sanitizer memcheck and racecheck"
    OUT=$RES timeout 270 bash scripts/gpu_hardening.sh sanitize | tail -12
    pack
    ;;
  step6)  # session 2: balanced splits + recorded launch plans: tests, host time, retune
    env_info
    stamp "GPU tests: decode (plans), CUDA graphs, determinism, cases"
    timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
      tests/test_cuda_graph.py tests/test_determinism.py tests/test_cases_masking.py \
      tests/test_cases_shapes.py 2>&1 | tee "$RES/pytest.log" | tail -4
    stamp "host overhead"
    timeout 60 python3 scripts/host_overhead.py --shapes llama8b-b64-c2k,llama8b-b1-c32k \
      > "$RES/host.log" 2>&1; grep '^{' "$RES/host.log"
    run_tune 230 10
    gap=llama8b-b1-c32k,llama8b-b8-c8k,llama8b-b64-c2k,qwen7b-b64-c4k,hd64-smollm-b64-c2k
    gap=$gap,fp8-llama8b-b1-c32k,azure-conv-b64-llama8b,mooncake-b16-llama8b,tp8-70b-b128-c8k
    stamp "bench on the gap shapes with the new table"
    timeout 100 python3 -m pagedattn.cli bench --shapes "$gap" --impls auto --peers none \
      --graph --reps 40 --out-dir "$RES/bench" > "$RES/bench.log" 2>&1
    grep -E "^[a-z0-9-]+ +auto " "$RES/bench.log"; grep -i "roofline" "$RES/bench.log" | tail -1
    pack
    ;;
  final2_a)  # session 2: retune with the clock-ramp warm-up, then the published benchmark
    env_info
    setup_flashinfer
    run_tune 170 10
    bench_peers 330
    pack
    ;;
  final2_b)  # GPU tests, main job, sanitizers on the new launch path, ncu on the gap shapes
    env_info
    stamp "GPU tests: kernels, cases, CUDA graphs, serving"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_decode.py \
      tests/test_cuda_graph.py tests/test_determinism.py tests/test_cases_masking.py \
      tests/test_cases_shapes.py tests/test_cases_runtime.py tests/test_ops.py \
      tests/test_engine.py tests/test_append_kv.py 2>&1 | tee "$RES/pytest-gpu.log" | tail -6
    stamp "main job: llama-3-8b, azure trace, batch 64"
    timeout 60 python3 -m pagedattn.cli run --model llama-3-8b --batch 64 \
      --csv "$RES/mainjob-llama8b-b64.csv" > "$RES/mainjob-b64.log" 2>&1
    grep -E "auto|baseline|gqa|split|fused|vector" "$RES/mainjob-b64.log" | tail -6
    stamp "compute-sanitizer memcheck and racecheck"
    OUT=$RES timeout 170 bash scripts/gpu_hardening.sh sanitize | tail -12
    for s in llama8b-b64-c2k hd64-smollm-b64-c2k; do
      stamp "ncu: auto on $s"
      timeout 45 python3 -m pagedattn.cli profile --impl auto --shape "$s" \
        --out-dir "$RES/ncu-$s" > "$RES/ncu-$s.log" 2>&1; tail -22 "$RES/ncu-$s.log"
    done
    pack
    ;;
  final4)  # the published benchmark of the final tree (both merge grids; carry .ext_fi)
    env_info
    setup_flashinfer
    bench_peers 170
    pack
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
stamp "done"
