#!/bin/bash
# session 13 helper fp8: A/B of main's src (old, 718df37) against .ab/new/src (FP8_V_PAIRS)
set -o pipefail
cd "$(dirname "$0")/.."
stamp() { echo "== $(date +%T) $*" | tee -a $OUT/log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv 2>&1 | tee -a $OUT/log
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" 2>&1 | tee -a $OUT/log
S=fp8-llama8b-b64-c8k,fp8-llama8b-b1-c32k,llama8b-b64-c8k
B="python3 -m pagedattn.cli bench --shapes $S --impls auto --peers none --graph --reps 30"
stamp "new (with the floor)"
PYTHONPATH=.ab/new/src timeout 170 $B --peer-file floor=.ab/plain_floor.py:best_floor_runner --out-dir $OUT/new 2>&1 | grep -v -i warn | tail -12 | tee -a $OUT/log
stamp "old"
PYTHONPATH=src timeout 80 $B --out-dir $OUT/old 2>&1 | grep -v -i warn | tail -8 | tee -a $OUT/log
stamp "new again"
PYTHONPATH=.ab/new/src timeout 80 $B --out-dir $OUT/new2 2>&1 | grep -v -i warn | tail -8 | tee -a $OUT/log
stamp "configs (new src, eager medians)"
PYTHONPATH=.ab/new/src timeout 150 python3 .ab/new/scripts/bench_variants.py --rows plain-fp8-llama8b-b64-c8k,plain-fp8-llama8b-b1-c32k --reps 30 --json $OUT/configs.json --configs "default;block_n=128,ctas_per_sm=2;block_n=64,ctas_per_sm=2;block_n=64,ctas_per_sm=4;block_n=64,num_stages=4;block_n=128,num_warps=8,ctas_per_sm=2;block_n=32,num_stages=4,ctas_per_sm=4" 2>&1 | grep -v -i warn | cut -c1-700 | tee -a $OUT/log
stamp "GPU tests of fp8 (new src)"
(cd .ab/new && timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_plan.py tests/test_cuda_graph.py tests/test_cases_shapes.py tests/test_cases_second_series.py tests/test_variants.py tests/test_ops.py -k "fp8 or B17 or N07 or recorded or dtypes" > $OUT/pytest.log 2>&1; tail -5 $OUT/pytest.log | tee -a $OUT/log)
stamp end
