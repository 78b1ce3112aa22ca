#!/bin/bash
# session 13 helper fp8, call 2: the final rule (four units per SM for fp8 with few pairs) and the GPU tests of the fp8 path
set -o pipefail
cd "$(dirname "$0")/.."
stamp() { echo "== $(date +%T) $*" | tee -a $OUT/log; }
stamp "final new src: fp8 rows"
PYTHONPATH=.ab/new/src timeout 50 python3 -m pagedattn.cli bench --shapes fp8-llama8b-b1-c32k,fp8-llama8b-b64-c8k --impls auto --peers none --graph --reps 30 --out-dir $OUT/final 2>&1 | grep -v -i warn | tail -5 | tee -a $OUT/log
stamp "GPU tests (new src)"
(cd .ab/new && timeout 50 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py tests/test_cases_second_series.py tests/test_variants.py tests/test_ops.py tests/test_plan.py -k "value_pairs or split_target or N07 or fp8 or recorded" > $OUT/pytest.log 2>&1; tail -6 $OUT/pytest.log | tee -a $OUT/log)
stamp end
