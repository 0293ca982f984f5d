#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (results under $OUT, default ./gpu-check):
# CUDA tests, the update frame rate of the learner's loop per batch size on the GPU with and without the replay
# mirror, the autotuner's probe and a short real training run with the learner on the GPU, and the throughput row
# with and without the mirror.
# Pendulum-v1 only where pybullet is not installed (its wheel is too large to carry to such a machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
RES=$(mktemp -d)  # full results here; $OUT gets the logs and CSVs
export PYTHONUNBUFFERED=1 SPREEZE_CACHE_DIR="$RES/cache"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count(), 'GPU(s)', flush=True)" | tee -a "$OUT/gpu.txt"
nproc | tee -a "$OUT/gpu.txt"

timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_algos.py tests/test_replay_mirror.py \
    tests/test_graphs.py 2>&1 \
    | tail -5 | tee "$OUT/gpu-tests.log"
# the GPU replay mirror (docs/benchmarks.md): the update loop alone, batches gathered on the CPU (prefetch thread)
# vs drawn from the mirror, same call; targets: fetch share <= 0.05 up to 65,536
timeout 200 python3 -m benchmarks.updates --env Pendulum-v1 --actor-device cuda:0 --seconds 3 --precisions fp32 \
    --prefetch auto --mirror off on --batch-sizes 1024 16384 65536 --out "$RES" 2>&1 | tail -12 | tee "$OUT/updates.log"
timeout 150 python3 run.py --env Pendulum-v1 --minutes 1 --total-steps 0 --no-window --run-dir "$RES/run" \
    2>&1 | grep -v "^\[spreeze\] *[0-9.]*s " | tail -40 | tee "$OUT/run.log"
tail -4 "$RES/run/evaluations.csv" | tee -a "$OUT/run.log"
cat "$RES/run/summary.json" >> "$OUT/run.log"
# in the system, autotuned: the mirror (auto on a GPU) and the CPU gather; targets: learner efficiency >= 0.95,
# update frame rate >= 1.3 x that of the CPU gather (4.24M/s on the H200 before the mirror)
for mirror in auto off; do
    mkdir -p "$RES/throughput-$mirror"
    timeout 200 python3 -m benchmarks.throughput --env Pendulum-v1 --seconds 30 --replay-mirror $mirror \
        --out "$RES/throughput-$mirror" 2>&1 | tail -14 | tee "$OUT/throughput-$mirror.log"
    cp "$RES/throughput-$mirror/throughput-Pendulum-v1.csv" "$OUT/throughput-$mirror.csv"
done
cp "$RES"/*.csv "$OUT"/
