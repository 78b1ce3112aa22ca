#!/usr/bin/env bash
# pagedattn on a GPU machine, one phase per `device` call (each under 10 minutes).
#   usage: bash scripts/gpu_check.sh PHASE          (repo root; no install needed)
# Phases:
#   correctness  the gate every kernel or launch change passes before it is called done
#             (7 minutes on a cold machine with its passes one after the other, 4.5 on a warm
#             one; now the plain driver runs beside the oracle and initcheck beside memcheck:
#             give it a call of its own): scripts/gpu_correctness.py --all (every kernel family x cache
#             dtype x layout x page size x head dim against the float64 oracle, a process a
#             family), then compute-sanitizer memcheck and initcheck over
#             scripts/sanitize_driver.py (every family once, and metadata past the tables)
#             -> $OUT/gpu-correctness.log, sanitize-*.log, correctness-summary.md
#             (docs/results/gpu-correctness-<gpu>.md records the commit it passed on)
#   tests     every gpu/gpu2-marked test (xdist when present), then
#             tests/serving/test_engine.py on the GPU -> $OUT/pytest-gpu.log, pytest-engine.log
#             (docs/results/gpu-tests-h200.log holds them one after the other); with $PEERS
#             carried, the compat layer's comparisons with FlashInfer and FA3 run too
#             (FlashInfer's JIT: TESTS_S=420)
#   bench     `pagedattn bench` of auto beside every peer found (the floor and FA3 peer files,
#             FlashInfer 0.7.4 TC and XQA), eager and graph after the clean L2 flush, eager
#             after the dirty (zeroing) one, each row's size-matched limit and the 32-layer
#             step (one CUDA graph), roofline in the run; host time and the variant rows;
#             appends the run to bench-runs.csv and regenerates the GPU's page
#             -> $OUT/results/ (copy over docs/results/; then `scripts/results.py readme-table`).
#             The limit and the step add minutes to the harness step: BENCH_ARGS="--layers 0"
#             leaves the step out, SHAPES=... splits the rows over calls
#   serving   `pagedattn bench-model` on a GGUF -> $OUT/results/serving-$GPU.{md,json}
#   sanitize  compute-sanitizer memcheck, racecheck, initcheck over scripts/sanitize_driver.py,
#             and memcheck over its CUDA-graph replays (memcheck beside initcheck, then
#             racecheck beside the replays) -> $OUT/sanitize-*.log, sanitizer-summary.md
#             (SAN_TOOLS="racecheck graphs": the passes `correctness` does not run)
#             (docs/results/gpu-correctness-<gpu>.md records each pass and the commit)
#   profile   ncu, auto beside the floor and FA3 on $NCU_SHAPES (scripts/ncu_side_by_side.py);
#             NCU_SECTIONS replaces the sections (e.g. "--section InstructionStats
#             --section SourceCounters --section WarpStateStats": instructions and stalls)
#   compute   paged prefill and MLA decode beside their peers (scripts/bench_prefill.py every
#             row beside FA3 and FlashInfer, with $PREFILL_VARIANTS; scripts/bench_mla.py every
#             row beside FlashInfer's MLA, ours $MLA_OURS), then ncu of ours beside the peers
#             (scripts/ncu_prefill_mla.py: prefill on $NCU_ROW, MLA at TP1 and TP8 b64-c4k)
#             -> $OUT/prefill.{json,log}, mla.{json,log}, ncu-prefill.csv, ncu-mla.csv
#             (about 8 minutes cold; PREFILL_S, MLA_S, NCU_S, WARM_S: per-step limits).
#             ORACLE=1: the gate's oracle (every family) beside the warm step first, into
#             $OUT/gpu-correctness.{log,json}; if a family fails or hangs, the benches run the
#             default kernels only (no opt-in variant in a timed row; ORACLE_S its limit).
#             NCU_WHAT="prefill mla" (default) or fewer; "" leaves ncu out
#   dropin    the FA drop-in per call, eager, beside FA3 in three calling patterns (the same
#             tensors, fresh views, fresh tensors; scripts/fa_dropin_per_call.py)
#             -> $OUT/results/fa-dropin-per-call-$GPU.{json,log}
#   ab        old against new src/: $AB_OLD/src (an untracked copy of the old tree) and ./src,
#             alternated $AB_ROUNDS times on $AB_SHAPES beside the floor, in one call
# Environment:
#   OUT=./out  PEERS=.peers  GPU=h200 (the results files' slug)
#   PEERS: `bash scripts/peers/fetch_peers.sh .peers` builds it (plain_floor.py, fa3_peer.py,
#     fa3.tar, flashinfer-0.7.4.tar.xz, apache_tvm_ffi-*.whl); name it in `carry`. A peer
#     whose files are absent is left out.
#   PAGEDATTN_GIT_SHA: the commit sent (the device's copy has no history; the pages name it).
#   BENCH_S, HOST_S, VARIANTS_S, TESTS_S, SERVING_S, SANITIZE_S, DROPIN_S: per-step limits
#     (s); BENCH_ARGS and SHAPES: more harness options (a CPU smoke: BENCH_ARGS=--dry-run TRITON_INTERPRET=1).
#   BENCH_STEPS="warm harness host variants": `warm` builds FlashInfer's JIT modules first,
#     side by side (WARM_S per row, default 170; cached in .fi_ws/ on a warm machine); the
#     harness on every row then takes about 5 minutes on an H100. If the phase does not fit a
#     call, split it over two and run `scripts/results.py page` here once every file is in
#     docs/results/.
#   MODEL=.model/smollm2.gguf, GGUF_PARTS="a b" (parts concatenated into MODEL), WHEELS=.whl
#   NCU_SHAPES, AB_OLD, AB_SHAPES, AB_ROUNDS: see profile and ab. The GPU fuzz test (tests)
#     takes PAGEDATTN_FUZZ_EXAMPLES, and PYTEST_ADDOPTS=--hypothesis-seed=N to replay a seed.
set -u -o pipefail
OUT=${OUT:-$PWD/out}
PEERS=${PEERS:-$PWD/.peers}
GPU=${GPU:-h200}
RES=$OUT/results
mkdir -p "$OUT" "$RES"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }
env_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    | tee "$OUT/env.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', \
triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/env.txt"
  echo "commit sent: ${PAGEDATTN_GIT_SHA:-unknown (PAGEDATTN_GIT_SHA unset)}" | tee -a "$OUT/env.txt"
}

setup_flashinfer() {  # FlashInfer 0.7.4 from the peers folder; JIT builds go to .fi_ws/
  FI_PEERS=none
  [ -f "$PEERS/flashinfer-0.7.4.tar.xz" ] || { echo "no FlashInfer in $PEERS"; return 0; }
  mkdir -p /tmp/fi074 .fi_ws
  [ -d /tmp/fi074/flashinfer ] || tar xJf "$PEERS/flashinfer-0.7.4.tar.xz" -C /tmp/fi074
  python3 -m pip install --quiet --no-index --no-deps --target /tmp/fi074 \
    "$PEERS"/apache_tvm_ffi-*.whl 2>&1 | tail -2
  export PYTHONPATH=$PYTHONPATH:/tmp/fi074 FLASHINFER_WORKSPACE_BASE=$PWD/.fi_ws
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" \
    && FI_PEERS=flashinfer-tc,flashinfer-xqa
}

peer_files() {  # the --peer-file arguments of the peers present in $PEERS
  PEER_FILES=()
  [ -f "$PEERS/plain_floor.py" ] \
    && PEER_FILES+=(--peer-file "floor=$PEERS/plain_floor.py:best_floor_runner")
  [ -f "$PEERS/fa3_peer.py" ] && [ -f "$PEERS/fa3.tar" ] \
    && PEER_FILES+=(--peer-file "fa3=$PEERS/fa3_peer.py")
  echo "peer files: ${PEER_FILES[*]:-none}"
}
oracle() {  # oracle LIMIT ARGS...: every family against the float64 oracle, a process a
  # family (scripts/gpu_correctness.py --all ARGS) -> $OUT/gpu-correctness.{log,json}; prints
  # the failed, crashed and timed-out cases; its exit status
  local limit=$1 rc; shift
  timeout "$limit" python3 scripts/gpu_correctness.py --all "$@" \
    --json "$OUT/gpu-correctness.json" > "$OUT/gpu-correctness.log" 2>&1
  rc=$?
  grep -E "FAIL|CRASH|TIMED" "$OUT/gpu-correctness.log" | head -20
  return $rc
}

print_ncu() {  # print_ncu CSV: each profiled kernel's name, grid and section values
  python3 -c "import sys; from pagedattn.bench.ncu import read_ncu_csv
for k in read_ncu_csv(sys.argv[1]): print(k.name[:40], k.grid, k.values)" "$1"
}

phase_correctness() {
  env_info
  { echo "# GPU correctness gate, commit ${PAGEDATTN_GIT_SHA:-unknown} ($(date -u +%FT%H:%MZ))"
    echo; head -1 "$OUT/env.txt"; echo; } > "$OUT/correctness-summary.md"
  { echo; echo "| pass | exit | s | sanitizer errors | driver | log |"; echo "|---|---|---|---|---|---|"
  } > "$OUT/sanitizer-summary.md"
  # the plain driver beside the oracle: it compiles every kernel the sanitizers then run
  # (the JIT would otherwise run under them), while the oracle's families compile theirs
  stamp "every family against the oracle, the plain driver beside it"
  san warm "$OUT/sanitize-warm.log" python3 scripts/sanitize_driver.py &
  local warm=$!
  oracle "${CORRECTNESS_S:-260}" --jobs 10
  local rc=$?
  wait "$warm"
  sed -n '/^| family/,$p' "$OUT/gpu-correctness.log" | tee -a "$OUT/correctness-summary.md"
  echo "oracle pass: exit $rc" | tee -a "$OUT/correctness-summary.md"
  # memcheck and initcheck side by side, each over every part (eight processes: the
  # instrumented module loads are CPU-bound, the GPU is not the limit)
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  san_parts memcheck --tool memcheck --leak-check no &
  san_parts initcheck --tool initcheck &
  wait
  unset PYTORCH_NO_CUDA_MEMORY_CACHING
  echo "parts (scripts/sanitize_driver.py --only): $SAN_PARTS" >> "$OUT/sanitizer-summary.md"
  cat "$OUT/sanitizer-summary.md" | tee -a "$OUT/correctness-summary.md"
  return $rc
}

phase_tests() {
  env_info
  setup_flashinfer  # the compat layer's comparisons with FlashInfer (FA3: found in $PEERS)
  local xdist
  xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadfile")
  stamp "every gpu / gpu2 test"
  # shellcheck disable=SC2086
  timeout "${TESTS_S:-300}" python3 -m pytest -q -m "gpu or gpu2" -p no:cacheprovider $xdist \
    -rfE --durations=10 tests > "$OUT/pytest-gpu.log" 2>&1; tail -15 "$OUT/pytest-gpu.log"
  stamp "the engine's tests on the GPU (unmarked: they take the GPU when there is one)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/serving/test_engine.py \
    > "$OUT/pytest-engine.log" 2>&1; tail -3 "$OUT/pytest-engine.log"
}

phase_bench() {
  env_info
  setup_flashinfer
  peer_files
  local steps=${BENCH_STEPS:-warm harness host variants}
  if [[ " $steps " == *" warm "* ]] && [ "$FI_PEERS" != none ]; then
    # FlashInfer JIT-builds a module per (dtype, head_dim, group) on first use, 10-35 s each,
    # one after another inside the harness (about 4 of its minutes on a cold machine): one
    # small run per module set, side by side, builds them all first (about 100 s cold on an
    # H100 machine's 16 cores, 1ee97d9; a warm machine's .fi_ws/ has them)
    stamp "warm: FlashInfer's JIT modules, a row per module set, side by side"
    local rows
    rows=$(python3 - "${SHAPES:-peers}" <<'PY'
import sys
from pagedattn.bench.shapes import PEER_SHAPES, SHAPES, get_shape
arg = sys.argv[1]
names = {"peers": PEER_SHAPES, "all": SHAPES}.get(arg) or arg.split(",")
rows = {}
for name in names:
    s = get_shape(name)
    m = s.model
    key = (s.dtype, s.cache_dtype, m.head_dim, m.num_q_heads // m.num_kv_heads, s.page_size)
    if key not in rows or s.kv_bytes < get_shape(rows[key]).kv_bytes:
        rows[key] = name
print(" ".join(rows.values()))
PY
)
    mkdir -p /tmp/pagedattn-warm  # its logs stay there: a call brings back at most 8 files
    # shellcheck disable=SC2086
    printf "%s\n" $rows | xargs -P 8 -I{} sh -c "timeout ${WARM_S:-170} python3 -m pagedattn.cli \
      bench --shapes {} --impls auto --peers $FI_PEERS --reps 1 --warmup 1 --layers 0 \
      --no-check --host-calls 1 --allow-errors --out-dir /tmp/pagedattn-warm/{} \
      > /tmp/pagedattn-warm/{}.log 2>&1; echo \"warm {}: exit \$?\""
  fi
  if [[ " $steps " == *" harness "* ]]; then
    stamp "benchmark: auto beside $FI_PEERS and the peer files, eager and graph"
    rm -rf /tmp/pagedattn-bench  # a warm machine's last run
    timeout "${BENCH_S:-420}" python3 -m pagedattn.cli bench --shapes "${SHAPES:-peers}" \
      --impls auto --peers "$FI_PEERS" "${PEER_FILES[@]}" --graph --reps 40 ${BENCH_ARGS:-} \
      --out-dir /tmp/pagedattn-bench > "$OUT/bench.log" 2>&1; tail -n 70 "$OUT/bench.log" | cut -c1-200
    # the harness writes outside $OUT and only $RES's copies come back: a call returns at most
    # 8 files, and two copies of each left the page and the runs CSV behind
    for ext in csv json md; do cp /tmp/pagedattn-bench/bench.$ext "$RES/bench-$GPU.$ext"; done
    cp /tmp/pagedattn-bench/bench_roofline.png "$RES/bench-$GPU-roofline.png" 2>/dev/null  # none untimed
    cp docs/results/bench-runs.csv "$RES/"
    python3 scripts/results.py append "$RES/bench-$GPU.json" --runs "$RES/bench-runs.csv" \
      --commit "${PAGEDATTN_GIT_SHA:-}" --source "docs/results/bench-$GPU.{csv,json,md}"
  fi
  if [[ " $steps " == *" host "* ]]; then
    stamp "host time"
    timeout "${HOST_S:-60}" python3 scripts/host_time.py 2>&1 | tee "$RES/host-time-$GPU.log"
  fi
  if [[ " $steps " == *" variants "* ]]; then
    stamp "variant rows beside FlashInfer"
    timeout "${VARIANTS_S:-200}" python3 scripts/bench_variants.py \
      --json "$RES/variants-$GPU.json" 2>&1 | cut -c1-300
  fi
  # the page needs the harness's run; a call of the host or variant steps alone exits 0
  if [ -f "$RES/bench-$GPU.json" ]; then
    python3 scripts/results.py page --gpu "$GPU" --dir "$RES"
  fi
}

phase_serving() {
  env_info
  local model=${MODEL:-.model/smollm2.gguf} w
  if [ -n "${GGUF_PARTS:-}" ]; then  # a GGUF over the carry limit travels in parts
    mkdir -p "$(dirname "$model")"
    # shellcheck disable=SC2086
    cat $GGUF_PARTS > "$model"
  fi
  sha256sum "$model" | tee "$OUT/gguf.sha256"
  for w in "${WHEELS:-.whl}"/gguf-*.whl; do
    [ -f "$w" ] && python3 -m pip install --quiet --no-index --no-deps --target /tmp/gguf_pkg "$w"
  done
  export PYTHONPATH=$PYTHONPATH:/tmp/gguf_pkg
  stamp "serving benchmark"
  timeout "${SERVING_S:-450}" python3 -m pagedattn.cli bench-model --gguf "$model" \
    --out "$RES/serving-$GPU" 2>&1 | tee "$OUT/serving.log" | tail -40
}

san() {  # san NAME LOG CMD...: one sanitizer pass, its time and errors into the summary
  local name=$1 log=$2 s rc n; shift 2
  s=$(date +%s); stamp "$name"
  timeout "${SANITIZE_S:-130}" "$@" > "$log" 2>&1; rc=$?
  n=$(grep -oE "ERROR SUMMARY: [0-9]+ error|\([0-9]+ errors?" "$log" | grep -oE "[0-9]+" | tail -1)
  echo "| $name | $rc | $(( $(date +%s) - s )) | ${n:-?} | $(grep -E "failure" "$log" | tail -1) \
| $(basename "$log") |" | tee -a "$OUT/sanitizer-summary.md"
}

# the driver's parts that each sanitizer pass runs side by side, a process each (one pass
# over the whole driver outran 100 s under memcheck: the instrumented module loads are CPU-bound)
SAN_PARTS=${SAN_PARTS:-"decode append,variants,prefill gluon mla,bad,plans"}
san_parts() {  # san_parts NAME TOOL-ARGS...: one sanitizer over every part, in parallel
  local name=$1 part i=0; shift
  for part in $SAN_PARTS; do
    i=$((i + 1))
    san "$name-$i" "$OUT/sanitize-$name-$i.log" compute-sanitizer "$@" --print-limit 50 \
      python3 scripts/sanitize_driver.py --only "$part" &
  done
  wait
}

phase_sanitize() {
  env_info
  { echo "# compute-sanitizer, commit ${PAGEDATTN_GIT_SHA:-unknown} ($(date -u +%FT%H:%MZ))"
    echo; echo "| pass | exit | s | sanitizer errors | driver | log |"; echo "|---|---|---|---|---|---|"
  } > "$OUT/sanitizer-summary.md"
  # the plain run compiles every kernel (the JIT would otherwise run under the sanitizer)
  san warm "$OUT/sanitize-warm.log" python3 scripts/sanitize_driver.py
  # one allocation per tensor: an out-of-bounds read is visible (memcheck) and memory reused
  # from PyTorch's pool does not count as initialized (initcheck)
  # two rounds of passes side by side: memcheck beside initcheck, then racecheck (its parts
  # alone once outran their limit) beside the graph replays under memcheck
  local tools=" ${SAN_TOOLS:-memcheck racecheck initcheck graphs} "
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  [[ $tools == *" memcheck "* ]] && san_parts memcheck --tool memcheck --leak-check no &
  [[ $tools == *" initcheck "* ]] && san_parts initcheck --tool initcheck &
  wait
  [[ $tools == *" racecheck "* ]] \
    && san_parts racecheck --tool racecheck --racecheck-report hazard &
  # graph capture needs the caching allocator
  [[ $tools == *" graphs "* ]] && (unset PYTORCH_NO_CUDA_MEMORY_CACHING
    san memcheck-graphs "$OUT/sanitize-memcheck-graphs.log" \
      compute-sanitizer --tool memcheck --leak-check no --print-limit 50 \
      python3 scripts/sanitize_driver.py --graphs-only) &
  wait
  unset PYTORCH_NO_CUDA_MEMORY_CACHING
  echo "tools: $tools" >> "$OUT/sanitizer-summary.md"
  echo "parts (scripts/sanitize_driver.py --only): $SAN_PARTS" >> "$OUT/sanitizer-summary.md"
  echo "Driver: $(grep -E "^kernels launched" "$OUT/sanitize-warm.log")" >> "$OUT/sanitizer-summary.md"
  cat "$OUT/sanitizer-summary.md"
}

phase_profile() {
  env_info
  local shape peers=(--peer-file "$PEERS/plain_floor.py:floor_runner")
  [ -f "$PEERS/fa3_peer.py" ] && [ -f "$PEERS/fa3.tar" ] \
    && peers+=(--peer-file "fa3=$PEERS/fa3_peer.py")  # FA3's kernels: CUTLASS device_kernel
  for shape in ${NCU_SHAPES:-llama8b-b64-c2k llama8b-b1-c32k azure-conv-b64-llama8b}; do
    stamp "ncu: $shape, auto beside the floor (and FA3)"
    # shellcheck disable=SC2086
    timeout "${NCU_S:-120}" ncu --clock-control none ${NCU_SECTIONS:---section SpeedOfLight \
      --section LaunchStats --section Occupancy --section WarpStateStats} \
      -k regex:'_paged_decode|_merge|_floor_|device_kernel|prepare_varlen' --csv \
      --page details python3 scripts/ncu_side_by_side.py --shape "$shape" "${peers[@]}" \
      > "$OUT/ncu-$shape.csv" 2> "$OUT/ncu-$shape.err"
    print_ncu "$OUT/ncu-$shape.csv"
  done
}

phase_compute() {  # the compute-bound kernels: paged prefill and MLA beside their peers, ncu
  env_info
  setup_flashinfer
  export PYTHONPATH=$PYTHONPATH:$PWD/scripts  # bench_prefill's --variants: policy_patch
  local fa3=() log=/tmp/pagedattn-compute
  mkdir -p "$log"
  [ -f "$PEERS/fa3_peer.py" ] && [ -f "$PEERS/fa3.tar" ] && fa3=(--fa3 "$PEERS/fa3_peer.py")
  # FlashInfer's sm_90 prefill and MLA modules are JIT builds of a minute or two each: one
  # untimed run of each first, side by side, so neither lands inside a timed row
  local variants=${PREFILL_VARIANTS:-} ours=${MLA_OURS:-default}
  stamp "warm: FlashInfer's prefill and MLA modules, our kernels${ORACLE:+, the oracle beside}"
  timeout "${WARM_S:-170}" python3 scripts/bench_prefill.py "${fa3[@]}" --reps 1 \
    --rows chunks-b8-q512-c4k > "$log/warm-prefill.log" 2>&1 &
  timeout "${WARM_S:-170}" python3 scripts/bench_mla.py --reps 1 --rows ds-tp8-b64-c4k \
    > "$log/warm-mla.log" 2>&1 &
  if [ -n "${ORACLE:-}" ]; then  # the gate's oracle first: an opt-in kernel that fails or
    # hangs there (a wrong arrival count) never runs in a timed row
    oracle "${ORACLE_S:-215}" --jobs 11 --family-timeout 200
    local orc=$?
    sed -n '/^| family/,$p' "$OUT/gpu-correctness.log"
    if [ $orc -ne 0 ]; then
      echo "oracle: exit $orc: the benches run the default kernels only"
      variants="" ours=default
    fi
  fi
  wait
  stamp "prefill: every row beside FA3 and FlashInfer (variants: ${variants:-none})"
  timeout "${PREFILL_S:-260}" python3 scripts/bench_prefill.py "${fa3[@]}" --reps 10 \
    --variants "$variants" --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
  echo "exit $?"; grep -v Warning "$OUT/prefill.log" | tail -9 | cut -c1-700
  stamp "MLA: every row beside FlashInfer (ours: $ours)"
  timeout "${MLA_S:-150}" python3 scripts/bench_mla.py --reps 15 --ours "$ours" \
    --json "$OUT/mla.json" > "$OUT/mla.log" 2>&1
  echo "exit $?"; grep -v Warning "$OUT/mla.log" | tail -11 | cut -c1-600
  local what
  for what in ${NCU_WHAT-prefill mla}; do
    stamp "ncu: $what, ours beside the peers, one call each"
    local args=("$what")
    [ "$what" = prefill ] && args+=(--row "${NCU_ROW:-prompt-8k}" --variants "$variants" "${fa3[@]}")
    [ "$what" = mla ] && args+=(--ours "$ours")
    # shellcheck disable=SC2086
    timeout "${NCU_S:-120}" ncu --clock-control none ${NCU_SECTIONS:---section SpeedOfLight \
      --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section WarpStateStats} --profile-from-start off \
      --csv --page details python3 scripts/ncu_prefill_mla.py "${args[@]}" \
      > "$OUT/ncu-$what.csv" 2> "$log/ncu-$what.err"
    echo "exit $?"; tail -2 "$log/ncu-$what.err" | cut -c1-300
    grep -q '^"ID"' "$OUT/ncu-$what.csv" && print_ncu "$OUT/ncu-$what.csv" | cut -c1-900
  done
}

phase_dropin() {  # the FA drop-in per call beside FA3, three calling patterns (one process)
  env_info
  mkdir -p "$OUT/results"
  [ -f "$PEERS/fa3_peer.py" ] && [ -f "$PEERS/fa3.tar" ] || { echo "no FA3 in $PEERS"; return 2; }
  timeout "${DROPIN_S:-300}" python3 scripts/fa_dropin_per_call.py --fa3 "$PEERS/fa3_peer.py" \
    --json "$OUT/results/fa-dropin-per-call-$GPU.json" 2>&1 \
    | tee "$OUT/results/fa-dropin-per-call-$GPU.log"
}

phase_ab() {  # AB_OLD: a folder holding the old tree's src/ (git archive OLD | tar x -C ab/old)
  env_info
  [ -d "${AB_OLD:-}/src" ] || { echo "AB_OLD=${AB_OLD:-} has no src/"; return 2; }
  peer_files
  local i t p
  for i in $(seq "${AB_ROUNDS:-2}"); do
    for t in old new; do
      p=$PWD/src; [ $t = old ] && p=$(cd "$AB_OLD" && pwd)/src
      stamp "A/B: $t tree, round $i"
      PYTHONPATH=$p timeout 200 python3 -m pagedattn.cli bench --impls auto --peers none \
        --shapes "${AB_SHAPES:-llama8b-b64-c2k,llama8b-b1-c32k,ragged-b64-llama8b}" \
        "${PEER_FILES[@]}" --graph --reps 40 --out-dir "$OUT/ab-$t-$i" > "$OUT/ab-$t-$i.log" 2>&1
    done
  done
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("ab-*/bench.json")):
    for r in json.loads(f.read_text())["rows"]:
        print(f.parent.name, r["shape"], r["impl"], r.get("median_us"), r.get("graph_median_us"))
PY
}

phase=${1:-}
case "$phase" in
  correctness|tests|bench|serving|sanitize|profile|compute|dropin|ab) "phase_$phase"; rc=$?; stamp "$phase: exit $rc"; exit $rc ;;
  *) sed -n '2,30p' "$0"; exit 2 ;;
esac
