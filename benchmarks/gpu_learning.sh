#!/usr/bin/env bash
# Learning speed on a lent GPU machine (docs/benchmarks.md, "Learning speed on a GPU machine"), one seed, MuJoCo
# standing in for PyBullet (whose wheel cannot be carried there). Stages, one or two per call of the device
# tool; each run is one `benchmarks.compare` (fresh profile cache, --keep-runs):
#   bash benchmarks/gpu_learning.sh default               the default command for 300 s (start-up counted)
#   bash benchmarks/gpu_learning.sh batches 256 1024 ...  --batch-size B for 120 s each
#   bash benchmarks/gpu_learning.sh probe                 the GPU tests (-m gpu), then the learner's update rate
#                                                         eager against graphed (benchmarks.updates, the env's
#                                                         preset, 3 s a point; about 2-3 min in all)
#   bash benchmarks/gpu_learning.sh eager                 the default command with --no-cuda-graphs for 300 s (the
#                                                         default replays CUDA graphs on one GPU)
# Everything lands in $OUT/gpu-learning-<stage>.tar.gz (the tool brings back 8 files at most), rewritten after
# every run and every 20 s meanwhile, so a call cut off at its time limit still brings back the runs it finished
# and the metrics and tests of the one it was in.
# Size the call's timeout: each run lasts its seconds plus its start-up (run.py's --minutes starts after the
# profile: about 35-40 s on an H200 machine) plus a few seconds to stop; the wheels install in about 15 s.
# SECONDS_DEFAULT / SECONDS_BATCH / ENV_ID override the budget and the env. A machine's start takes a minute or
# two of the ~15 lent: on 2026-11-28 `probe` then a 300-s run in one call took 421 s, and another 300-s run on
# the warm machine right after it 352 s (each call's files came back; about 13.6 minutes held in all).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-learning}
STAGE=${1:?default, batches, probe or eager}; shift
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
pack() {  # each pack in a temporary file of its own, renamed into place: the last whole archive always stands
    local tmp; tmp=$(mktemp "$OUT/.pack.XXXXXX") || return
    if tar czf "$tmp" -C "$RES" . 2>/dev/null; then mv -f "$tmp" "$OUT/gpu-learning-$STAGE.tar.gz"; else rm -f "$tmp"; fi
}
STOP=$(mktemp -u)  # the packer's stop sign: it ends within 2 s of it, never in the middle of a pack
( n=0; while [ ! -e "$STOP" ]; do sleep 2; n=$((n + 1)); [ $((n % 10)) -eq 0 ] && pack; done ) >/dev/null 2>&1 &
PACKER=$!
trap 'touch "$STOP"; wait $PACKER 2>/dev/null; rm -f "$STOP"; pack' EXIT
compare() {  # one benchmarks.compare invocation; its console (less the per-second status lines) in compare-NAME.log
    local name=$1; shift
    python3 -m benchmarks.compare --env "$ENV_ID" --seeds 1 --levels 1000 2000 2500 --out "$RES" --keep-runs \
        --name "$name" "$@" 2>&1 | grep --line-buffered -v "^\[spreeze\] *[0-9.]*s " | tee "$RES/compare-$name.log"
    pack
}
probe() {  # the GPU-only tests, then the learner's loop eager against graphed
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py tests/test_algos.py \
        tests/test_replay_mirror.py 2>&1 | tail -25 | tee "$RES/gpu-tests.log"
    timeout 240 python3 -m benchmarks.updates --env "$ENV_ID" --actor-device cuda:0 --project-args "" \
        --precisions fp32 --cuda-graphs off on --batch-sizes 256 1024 4096 16384 --seconds 3 --out "$RES" 2>&1 \
        | tee "$RES/updates.log"
    pack
}
case $STAGE in
    default) compare gpu-default --seconds "${SECONDS_DEFAULT:-300}" --setting "default=" ;;
    batches) for b in "$@"; do compare "gpu-batch$b" --seconds "${SECONDS_BATCH:-120}" --setting "batch$b=--batch-size $b"; done ;;
    probe) probe ;;
    eager) compare gpu-eager --seconds "${SECONDS_DEFAULT:-300}" --setting "eager=--no-cuda-graphs" ;;
    *) echo "stage: default, batches, probe or eager" >&2; exit 2 ;;
esac
for f in "$RES"/*/spreeze.log; do echo "== $f"; grep -E "samplers|batch size|precision|learner:|stopped by|test return" "$f"; done
