#!/usr/bin/env bash
# Every GPU measurement and check, in one prepared run on a lent GPU machine (see
# ../shared/gpu/README.md for what that machine lacks and the wheels to bring in .whl/), each step
# under its own timeout, everything written to $OUT. About 9 minutes on one H200 for all steps;
# GPU_SESSION_STEPS names the ones to run (default: all, in this order):
#   forked_ranks     ranks forked from the launcher's server train on the GPU, twice and resumed
#   stream_step      the GPT example's step streamed from a local S3 server against in memory
#                    (needs moto, s3fs and their dependencies among the wheels)
#   calibrate        `shardwise plan --calibrate`: the profile the planner and the runs' MFU read
#   throughput_86m   tokens/s against the hand loop, eager and compiled, 3 repeats interleaved
#   throughput_1.2b  the same at 1.2B, eager
#   checkpoint       a 304M state saved from the GPU: sync, async, torch.save
#   float8_1.2b      bf16 against float8 (tensorwise), compiled, shardwise and the hand loop, at
#                    1.2B with sequences of 2048 (needs torchao's wheel among the wheels)
#   float8_3b        the same at 3B
#
# The GPU time a session is lent is short (15 minutes, the machine's start included): run one
# plan of under 7 minutes, GPU_SESSION_PLAN=truth (what shardwise says about a GPU run: forked
# ranks, the calibration, 86M against the hand loop, the checkpoint; 390 s of limits) or
# lean (compile and float8: 86M compiled, float8 at 1.2B; 400 s of limits).
#
#   OUT=/tmp/out bash bench/gpu_session.sh            # on the device machine
#   GPU_SESSION_QUICK=1 OUT=/tmp/out bash bench/gpu_session.sh   # its plumbing, on a CPU (~3 min)
set -u
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
PY=${PY:-python3}
if [ -d .whl ]; then  # pydantic and tomli-w, brought as wheels (the GPU machine reaches no index)
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
BIN=$(dirname "$($PY -c 'import sys; print(sys.executable)')")
[ -x "$BIN/shardwise" ] || {
  printf '#!/bin/sh\nexec %s -m shardwise "$@"\n' "$($PY -c 'import sys; print(sys.executable)')" \
    > "$BIN/shardwise"
  chmod +x "$BIN/shardwise"
}
WORK=${WORK:-/tmp/gpu-session}  # run folders and the cache: what comes back is in $OUT alone
export SHARDWISE_CACHE=$WORK/cache  # the calibration below, for this session only
step() {  # name, seconds, command…
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)" | tee -a "$OUT/steps.txt"
  local began=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "   exit $? after $((SECONDS - began)) s" | tee -a "$OUT/steps.txt"
}
if [ -n "${GPU_SESSION_QUICK:-}" ]; then
  step throughput 600 $PY bench/gpu_throughput.py --sizes tiny --repeats 1 --steps 90 --warmup 40
  step float8 300 $PY bench/gpu_throughput.py --float8 tensorwise --sizes tiny --repeats 1 \
    --steps 60 --warmup 30
  step checkpoint 300 $PY bench/checkpoint_save.py --layers 2 --hidden 256 --repeats 1
  step calibrate 300 "$BIN/shardwise" plan --calibrate
  exit 0
fi
case "${GPU_SESSION_PLAN:-}" in
  truth) PLAN="forked_ranks calibrate throughput_86m checkpoint" ;;
  lean) PLAN="throughput_86m float8_1.2b" ;;
  *) PLAN="forked_ranks stream_step calibrate throughput_86m throughput_1.2b checkpoint" ;;
esac
STEPS=${GPU_SESSION_STEPS:-$PLAN}
short() { [ -n "${GPU_SESSION_PLAN:-}" ] && echo "$1" || echo "$2"; }  # a plan's value: it fits 7 min
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
DEVICE=${GPU_SESSION_DEVICE:-cuda}  # cpu: the first two steps' plumbing, on a CPU
command -v nvidia-smi > /dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if wanted forked_ranks || wanted stream_step; then
  $PY examples/make_tables.py --tables tokens > "$OUT/make_tables.txt" 2>&1  # runs/data/tokens{,-eval}
fi
wanted forked_ranks && step forked_ranks $(short 60 120) $PY bench/gpu_forked_ranks.py "$WORK/forked" \
  --device "$DEVICE"
wanted stream_step && step stream_step 200 $PY bench/stream_step.py --nproc 1 --repeats 3 \
  --warmup 20 --steps 120 --set job.device="$DEVICE"
if wanted calibrate; then  # the profile (with the host's cost per dispatch) for the planner, MFU
  step calibrate $(short 90 150) "$BIN/shardwise" plan --calibrate
  cp "$SHARDWISE_CACHE/this-machine.json" "$OUT/calibrated-profile.json" 2>/dev/null
fi
# tokens/s against the hand loop, eager and compiled, 3 repeats interleaved; with shardwise
# without its profile window (what CUPTI left attached cost); the planner beside each size
wanted throughput_86m && step throughput_86m $(short 150 240) $PY bench/gpu_throughput.py \
  --sizes 86M --repeats $(short 1 3) --unprofiled --steps 50 --warmup 20
wanted throughput_1.2b && step throughput_1.2b 200 $PY bench/gpu_throughput.py --sizes 1.2B \
  --repeats 3 --no-compile --steps 45 --warmup 15
# a 304M state (3.6 GB with AdamW's moments) saved from the GPU: sync, async, torch.save
wanted checkpoint && step checkpoint 90 $PY bench/checkpoint_save.py --device cuda --layers 24 \
  --hidden 1024 --repeats 2
# float8 (torchao) against bf16, both compiled: 4 runs that each compile, one repeat
wanted float8_1.2b && step float8_1.2b 250 $PY bench/gpu_throughput.py --float8 tensorwise \
  --sizes 1.2B-2k --repeats 1 --steps 40 --warmup 15
wanted float8_3b && step float8_3b 300 $PY bench/gpu_throughput.py --float8 tensorwise \
  --sizes 3B --repeats 1 --steps 40 --warmup 15
ls -la "$OUT"
