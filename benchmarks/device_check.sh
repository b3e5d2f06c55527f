#!/usr/bin/env bash
# The checks that need a CUDA device, in one run: the CUDA tests, then the stall benchmark with
# GB GiB of state (default 8) against the pinned device-to-host copy. Uses the python3 on the
# PATH (torch, safetensors, tokenizers, xxhash and pytest installed); nothing is installed.
# Logs and stall.json go to $OUT (default ./device-out).
#
#     bash benchmarks/device_check.sh            # or: GB=2 SAVES=4 bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/device-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

{
    python3 -c 'import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'
    echo "locked-memory limit (ulimit -l): $(ulimit -l)"
    echo "/dev/shm: $(df -h /dev/shm | tail -1)"
    echo "cpus: $(nproc)"
} 2>&1 | tee "$out/env.log"

echo "== CUDA tests"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py \
    2>&1 | tee "$out/cuda_tests.log" || status=1

echo "== stall benchmark"
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/async_stall.py --device cuda \
    --gb "${GB:-8}" --saves "${SAVES:-5}" --json "$out/stall.json" \
    2>&1 | tee "$out/stall.log" || status=1
exit $status
