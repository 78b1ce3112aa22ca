#!/usr/bin/env bash
# Everything pagedattn runs on the H200, in phases sized for one `device` call each (< 10 min).
#   bash scripts/gpu_check.sh tune    # GPU tests of the kernels, main job, tile/launch sweep
#   bash scripts/gpu_check.sh bench   # harness vs peers (FlashInfer carried in .ext_fi), ladder
#   bash scripts/gpu_check.sh serve   # model, CUDA graphs, torch.compile, hardening, sanitizer
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

case "$phase" in
  tune)
    env_info
    stamp "GPU tests of the kernels"
    timeout 240 python3 -m pytest -q -x tests/test_decode.py -p no:cacheprovider 2>&1 \
      | tee "$OUT/pytest-decode.log" | tail -5
    stamp "main job: llama-3-8b, azure trace, batches 8 and 64"
    for b in 8 64; do
      timeout 120 python3 -m pagedattn.cli run --model llama-3-8b --batch "$b" \
        --csv "$OUT/mainjob-llama8b-b$b.csv" 2>&1 | tee "$OUT/mainjob-b$b.log"
    done
    stamp "tile/launch sweep"
    timeout 330 python3 scripts/tune_decode.py --shapes peers --reps 20 \
      --out "$OUT/tune.csv" > "$OUT/tune.log" 2>&1
    tail -3 "$OUT/tune.log"
    python3 - "$OUT/tune.csv" <<'PY' | tee "$OUT/tune-best.txt"
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1])))
best = {}
for r in rows:
    if r["shape"] not in best or float(r["median_us"]) < float(best[r["shape"]]["median_us"]):
        best[r["shape"]] = r
for s, r in best.items():
    print(s, {k: r[k] for k in ("block_n", "num_warps", "num_stages", "ctas_per_sm",
          "units_per_program", "min_chunk", "median_us", "gbps")})
PY
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
stamp "done"
