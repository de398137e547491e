#!/usr/bin/env bash
# Every GPU measurement issue 34 asks for, in one prepared run on a lent GPU machine (see
# ../shared/gpu/README.md for what that machine lacks and the wheels to bring in .whl/), each step
# under its own timeout, everything written to $OUT. About 9 minutes on one H200:
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
export SHARDWISE_CACHE=$OUT/cache  # the calibration below, for this session only
step() {  # name, seconds, command…
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)" | tee -a "$OUT/steps.txt"
  local began=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "   exit $? after $((SECONDS - began)) s" | tee -a "$OUT/steps.txt"
}
if [ -n "${GPU_SESSION_QUICK:-}" ]; then
  step throughput 600 $PY bench/gpu_throughput.py --sizes tiny --repeats 1 --steps 90 --warmup 40
  step checkpoint 300 $PY bench/checkpoint_save.py --layers 2 --hidden 256 --repeats 1
  step calibrate 300 "$BIN/shardwise" plan --calibrate
  exit 0
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# the profile (with the host's cost per dispatch) the planner and the runs' MFU read
step calibrate 150 "$BIN/shardwise" plan --calibrate
cp "$SHARDWISE_CACHE/this-machine.json" "$OUT/h200-calibrated-profile.json" 2>/dev/null
# tokens/s against the hand loop, eager and compiled, 3 repeats interleaved; with shardwise
# without its profile window (what CUPTI left attached cost); the planner beside each size
step throughput_86m 240 $PY bench/gpu_throughput.py --sizes 86M --repeats 3 --unprofiled \
  --steps 50 --warmup 20
step throughput_1.2b 200 $PY bench/gpu_throughput.py --sizes 1.2B --repeats 3 --no-compile \
  --steps 45 --warmup 15
# a 304M state (3.6 GB with AdamW's moments) saved from the GPU: sync, async, torch.save
step checkpoint 90 $PY bench/checkpoint_save.py --device cuda --layers 24 --hidden 1024 \
  --repeats 2
ls -la "$OUT"
