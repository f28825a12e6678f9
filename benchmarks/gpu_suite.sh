#!/usr/bin/env bash
# The GPU checks in one run, for a machine lent for a few minutes: the CUDA tests, then the GPU benchmarks.
#
#   bash benchmarks/gpu_suite.sh          # from the repository root; installs nothing
#
# Each step has a time limit so that the whole run ends within 6 minutes on one H100; a step that fails
# or runs out of time is reported and the next one still runs. Full logs go to "$OUT" (default
# /tmp/gpu_out); a compact summary is printed at the end (and kept in "$OUT/summary.txt").
set -u
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LIMIT_S LINES_KEPT COMMAND...: runs COMMAND under a time limit, its output teed to $OUT/NAME.log;
# the summary keeps the last LINES_KEPT lines and the exit status
step() {
    local name=$1 limit=$2 keep=$3
    shift 3
    local t0=$(date +%s)
    echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local dt=$(( $(date +%s) - t0 ))
    note ""
    note "--- $name: exit $rc in ${dt}s$( [ "$rc" = 124 ] && echo ' (TIMED OUT)')"
    tail -n "$keep" "$OUT/$name.log" | tee -a "$SUMMARY" > /dev/null
}

note "gpu_suite on $(hostname) at $(date -u +%FT%TZ)"
python - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU'}")
EOF

# (a) every test that needs CUDA (they skip without one, so CI never runs them)
# (only the files that hold them: collecting the whole suite takes long and needs every test dependency)
CUDA_TESTS="tests/unit/test_content_hash.py tests/integration/test_cuda.py tests/integration/test_device_load.py
  tests/integration/test_dedup_repository.py tests/integration/test_capture_stats.py
  tests/integration/test_async_capture.py tests/integration/test_bad_input.py tests/integration/test_dcp_backend.py"
# shellcheck disable=SC2086
step tests 110 8 python -m pytest -q -p no:cacheprovider -k "cuda or gpu" $CUDA_TESTS

# (b) capture rate against the pinned-copy floor; 1 GB of 416 tensors idle and with a busy Python thread
step capture 75 12 python benchmarks/gpu_capture.py --gb 1 --repeat ${CAPTURE_REPEAT:-1} ${CAPTURE_MODES:+--modes "$CAPTURE_MODES"}

# (c) a GPT trained on the GPU, snapshotted every iteration, against no snapshot
step training 85 7 python benchmarks/gpu_training.py --step-ms 100 --steps 10 --rounds 3
# (c') the same with a frozen model (only the LayerNorms train): what dedup leaves to write each step
step training-frozen 60 7 python benchmarks/gpu_training.py --step-ms 100 --steps 10 --rounds 3 --frozen

# (d) loads onto the GPU: ckptrepo against torch.load(map_location="cuda") and DCP
step load 60 9 python benchmarks/gpu_load.py --gb 2 --repeat 2

note ""
note "gpu_suite: $(( $(date +%s) - START ))s in all; logs in $OUT"
echo
echo "================ SUMMARY ================"
cat "$SUMMARY"
