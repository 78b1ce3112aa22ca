#!/usr/bin/env bash
# Hardening on the H200, from the repo root. Phases:
#   tests     the gpu-marked tests of the hardening and second-series files (natural sizes of
#             B01..B22 and N06..N16, N11 at batch 70,000, CUDA graphs, validate= checks,
#             determinism); gpu2 tests run too when two GPUs are visible (N19);
#   fuzz      the longer hypothesis fuzz against the float64 oracle (random seed, printed);
#   sanitize  compute-sanitizer memcheck, racecheck and initcheck over
#             scripts/sanitize_driver.py: every kernel (every impl through the public API,
#             split_kv_v4's and auto's merges incl. the per-group merge, LSE, fp8, HND,
#             append_kv, CUDA-graph replay), after one plain run that warms Triton's cache
#             (the JIT would otherwise compile under the sanitizer). Under 8 minutes.
#   bash scripts/gpu_hardening.sh [sanitize|tests|fuzz|all]      (default: sanitize)
# One device call runs at most 10 minutes: run `tests` (+ `fuzz`) and `sanitize` as separate
# calls; `all` runs every phase back to back (about 12 minutes).
# Logs go to $OUT (default ./out), at most 8 files:
#   hardening-tests.log, hardening-fuzz.log, sanitize-warm.log, sanitize-memcheck.log,
#   sanitize-racecheck.log, sanitize-initcheck.log, sanitizer-summary.md (a page to paste
#   into docs/results/sanitizer-h200.md: commit, GPU, errors per tool, timings, kernels).
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
what=${1:-sanitize}
t0=$(date +%s)
stamp() { echo "[gpu_hardening +$(( $(date +%s) - t0 ))s] $*"; }
SUMMARY=$OUT/sanitizer-summary.md
FILES="tests/test_cases_masking.py tests/test_cases_shapes.py tests/test_cases_runtime.py
       tests/test_cases_second_series.py tests/test_validation.py tests/test_determinism.py
       tests/test_fuzz.py tests/test_cuda_graph.py"
declare -A SECS STATUS

phase() {  # phase NAME TIMEOUT LOG CMD...: run, time, keep the exit status
  local name=$1 limit=$2 log=$3; shift 3
  local s=$(date +%s)
  stamp "$name (limit ${limit}s)"
  timeout "$limit" "$@" > "$log" 2>&1
  STATUS[$name]=$?
  SECS[$name]=$(( $(date +%s) - s ))
  tail -n 25 "$log"
  stamp "$name: exit ${STATUS[$name]} after ${SECS[$name]}s"
}

if [[ $what == all || $what == tests ]]; then
  # pytest-xdist (in the H200 image): Triton compiles in 4 processes at once; one file per
  # process (B01 holds 2 x 4.9 GB caches in one process only)
  XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4 --dist loadfile")
  # shellcheck disable=SC2086
  phase tests 420 "$OUT/hardening-tests.log" python3 -m pytest -q -m "gpu or gpu2" -p no:cacheprovider \
    $XDIST -rfE --durations=15 -k "not fuzz_against_oracle_gpu" $FILES
fi

if [[ $what == all || $what == fuzz ]]; then
  SEED=${FUZZ_SEED:-$RANDOM$RANDOM}
  stamp "fuzz seed $SEED (rerun: FUZZ_SEED=$SEED bash scripts/gpu_hardening.sh fuzz)"
  PAGEDATTN_FUZZ_EXAMPLES=${PAGEDATTN_FUZZ_EXAMPLES:-40} phase fuzz 100 \
    "$OUT/hardening-fuzz.log" python3 -m pytest -q -p no:cacheprovider -rfE \
    --hypothesis-seed="$SEED" --hypothesis-show-statistics \
    "tests/test_fuzz.py::test_fuzz_against_oracle_gpu"
  echo "seed $SEED" >> "$OUT/hardening-fuzz.log"
fi

count_errors() {  # memcheck/initcheck: "ERROR SUMMARY: N errors"; racecheck: "(N errors, M warnings)"
  local log=$1 n
  n=$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | grep -oE "[0-9]+" | tail -1)
  [ -z "$n" ] && n=$(grep -oE "\([0-9]+ errors?" "$log" | grep -oE "[0-9]+" | tail -1)
  echo "${n:-unknown}"
}

if [[ $what == all || $what == sanitize ]]; then
  # budget: 60 + 4 x SANITIZE_S (default 130) s at most, plus start-up
  phase warm 60 "$OUT/sanitize-warm.log" python3 scripts/sanitize_driver.py
  # one allocation per tensor: an out-of-bounds read is visible (memcheck) and memory reused
  # from PyTorch's pool does not count as initialized (initcheck)
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  phase memcheck "${SANITIZE_S:-130}" "$OUT/sanitize-memcheck.log" compute-sanitizer --tool memcheck \
    --leak-check no --print-limit 50 python3 scripts/sanitize_driver.py
  phase racecheck "${SANITIZE_S:-130}" "$OUT/sanitize-racecheck.log" compute-sanitizer --tool racecheck \
    --racecheck-report hazard --print-limit 50 python3 scripts/sanitize_driver.py
  # (compute-sanitizer 2025.3 takes --track-unused-memory as a flag: off by default)
  phase initcheck "${SANITIZE_S:-130}" "$OUT/sanitize-initcheck.log" compute-sanitizer --tool initcheck \
    --print-limit 50 python3 scripts/sanitize_driver.py
  unset PYTORCH_NO_CUDA_MEMORY_CACHING
  # CUDA-graph capture needs PyTorch's caching allocator: the graph replays in their own pass
  phase memcheck-graphs "${SANITIZE_S:-130}" "$OUT/sanitize-memcheck-graphs.log" \
    compute-sanitizer --tool memcheck --leak-check no --print-limit 50 \
    python3 scripts/sanitize_driver.py --graphs-only
fi

{
  echo "# Hardening on the GPU ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
  # a copied tree (the device machine) names its commit in PAGEDATTN_GIT_SHA
  sha=${PAGEDATTN_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
  dirty=$([ -n "${PAGEDATTN_GIT_SHA:-}" ] || git status --porcelain -- src 2>/dev/null | head -1)
  echo "Commit measured: \`$sha\`${dirty:+ (src/ modified: dirty)}"
  echo
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
  python3 -c "import torch, triton; print('torch', torch.__version__, '/ triton', triton.__version__)"
  echo
  echo "| phase | exit | seconds | errors | log |"
  echo "|---|---|---|---|---|"
  for p in tests fuzz warm memcheck racecheck initcheck memcheck-graphs; do
    [ -n "${STATUS[$p]+x}" ] || continue
    case $p in
      tests|fuzz) log=hardening-$p.log
        err=$(grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$OUT/$log" | tail -1) ;;
      warm) log=sanitize-warm.log; err=$(grep -E "failure" "$OUT/$log" | tail -1) ;;
      *) log=sanitize-$p.log; err="$(count_errors "$OUT/$log") sanitizer errors; driver: $(grep -E "failure" "$OUT/$log" | tail -1)" ;;
    esac
    echo "| $p | ${STATUS[$p]} | ${SECS[$p]} | ${err:-?} | $log |"
  done
  echo
  echo "Exit 124 = the phase hit its time limit. Total: $(( $(date +%s) - t0 )) s."
  if [ -f "$OUT/sanitize-warm.log" ]; then
    echo
    echo "Driver (\`scripts/sanitize_driver.py\`): $(grep -E "^kernels launched" "$OUT/sanitize-warm.log")."
    echo "Calls checked against the float64 oracle: $(grep -cE " (ok|FAIL)$" "$OUT/sanitize-warm.log")."
  fi
} > "$SUMMARY"
cat "$SUMMARY"
stamp "done"
