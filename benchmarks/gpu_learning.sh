#!/usr/bin/env bash
# Learning speed on a lent GPU machine (docs/benchmarks.md, "Learning speed on a GPU machine"), one seed, MuJoCo
# standing in for PyBullet (whose wheel cannot be carried there). Two stages, each one `benchmarks.compare` with
# a fresh profile cache and --keep-runs, so that each fits one call of the device tool:
#   bash benchmarks/gpu_learning.sh default               the default command for 300 s (start-up counted)
#   bash benchmarks/gpu_learning.sh batches 256 1024 ...  --batch-size B for 120 s each
# Everything lands in $OUT/gpu-learning-<stage>.tar.gz (the tool brings back 8 files at most).
# SECONDS_DEFAULT / SECONDS_BATCH / ENV_ID override the budget and the env.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-learning}
STAGE=${1:?default or batches}; shift
ENV_ID=${ENV_ID:-Walker2d-v5}
mkdir -p "$OUT"
RES=$(mktemp -d)
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -d /tmp/site/mujoco ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; } > "$RES/gpu.txt" 2>&1
# fail in seconds, not minutes, when something is missing there
python3 -c "
import sys, torch, gymnasium as gym, spreeze
env = gym.make('$ENV_ID'); env.reset(seed=0)
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'gymnasium', gym.__version__, flush=True)
assert torch.cuda.is_available() or '${ALLOW_CPU:-0}' == '1', 'no CUDA'
" 2>&1 | tee -a "$RES/gpu.txt" || { cp "$RES/gpu.txt" "$OUT/"; exit 3; }
case $STAGE in
    default)
        python3 -m benchmarks.compare --env "$ENV_ID" --seconds "${SECONDS_DEFAULT:-300}" --seeds 1 \
            --setting "default=" --levels 1000 2000 2500 --name gpu-default --out "$RES" --keep-runs 2>&1 \
            | grep -v "^\[spreeze\] *[0-9.]*s " | tee "$RES/compare.log" ;;
    batches)
        settings=()
        for b in "$@"; do settings+=(--setting "batch$b=--batch-size $b"); done
        python3 -m benchmarks.compare --env "$ENV_ID" --seconds "${SECONDS_BATCH:-120}" --seeds 1 "${settings[@]}" \
            --levels 1000 2000 2500 --name gpu-batches --out "$RES" --keep-runs 2>&1 \
            | grep -v "^\[spreeze\] *[0-9.]*s " | tee "$RES/compare.log" ;;
    *) echo "stage: default or batches" >&2; exit 2 ;;
esac
tar czf "$OUT/gpu-learning-$STAGE.tar.gz" -C "$RES" .
for f in "$RES"/*/spreeze.log; do echo "== $f"; grep -E "samplers|batch size|precision|learner:|stopped by|test return" "$f"; done
