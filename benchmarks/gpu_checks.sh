#!/bin/bash
# Issue 5's GPU checks on a lent device machine (one CUDA GPU, no network), as one call.
#
#   benchmarks/gpu_checks.sh prepare [BASE_DIR]   # here: wheels, Debian debs and the base model into
#                                                 # .whl/ .debs/ .device/ (git-ignored via .git/info/exclude)
#   device run, carry [".whl", ".debs", ".device"]:
#     bash benchmarks/gpu_checks.sh run           # env, pytest -m gpu, mismatch, engine, trainer on CUDA, bench async
#
# run's knobs (environment): CHECKS=0 skips the tests, mismatch and trainer; ASYNC=0 skips the async bench;
# GPU_TESTS (default tests/gpu); MISMATCH and TRAINER (dtypes, default "bfloat16 float32"; " " for none);
# ENGINE (dtypes for `rtrl bench engine` on CUDA, ours eager and compiled against transformers' generate; default
# none); TRAINER_SET (bench trainer's --set arguments: each dtype runs again with them, trainer_cuda_<dtype>_set.json;
# e.g. "--set rl.micro_batch_tokens=8192 --set rl.shared_run_min_tokens=16", the CPU's sizes); PROFILE=0 skips
# the profiled step bench trainer adds to its first run of each dtype (ours_profile, trl_profile in its JSON);
# BUDGET_S (seconds the whole run may take, default 540: the async bench gets what is left, and runs only when
# that is at least ASYNC_MIN_S, default 300); STEPS, EVAL (the async bench's steps and eval tasks); ASYNC_SET
# (its --set overrides; default: the trainer on the GPU in bf16, engines on 12 CPU workers).
# What lands in $OUT comes back (8 files at most): env.txt, checks.log (the tests' and the benches' output),
# mismatch_cuda_*.json, engine_cuda_*.json, trainer_cuda_*.json, async_cuda.json, async.log: pick the dtypes so
# that they stay 8 (two MISMATCH and two TRAINER dtypes with TRAINER_SET and the async bench make 10).
# SANDBOX=1 runs `rtrl bench sandbox` on the machine first (sandbox.json): how fast its sandboxes are, which
# bounds rollouts once the engines are fast.
# Seen on an H200 (2026-11-27): machine start ~30 s, setup ~20 s, tests/gpu/test_cuda_model.py + one CUDA
# trainer test ~20 s, bench trainer ~35 s a run; the async bench 20 steps with 24 eval tasks ~360 s, 10 steps
# with 8 ~190 s. 2026-11-28: tests/gpu (15 tests) 12 s, bench engine on CUDA ~115 s (its compile 40 s); the
# async bench with the workers' engines on the GPU (rollout.device=cuda, CUDA graphs) 10 steps with 8 eval
# tasks ~260 s on 1 worker, 8 steps with 4 ~160 s on 8.
set -u
PY=${PY:-.venv/bin/python}

prepare() {
  local base=${1:-runs/pretrain/checkpoints/step-0001250}
  for d in .whl .debs .device; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
  mkdir -p .whl .debs .device/base
  # What the device image lacks of our imports (its torch, numpy, safetensors, tokenizers, ... serve as they are).
  local pkgs="pydantic pydantic_core annotated-types typing-inspection typing_extensions fastapi starlette openai
              jiter sniffio zstandard opentelemetry-api httpx2 httpcore2 truststore idna anyio h11
              trl datasets dill multiprocess"
  for p in $pkgs; do
    v=$($PY -m pip show "$p" 2>/dev/null | awk '/^Version:/ {print $2}')
    [ -n "$v" ] || { echo "not installed here: $p"; continue; }
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$p==$v" 2>&1 | grep -v '^WARNING' || true
  done
  # The sandbox: bubblewrap, and pytest for the system interpreter the sandbox runs.
  (cd .debs && apt-get download bubblewrap python3-pytest python3-pluggy python3-py python3-iniconfig \
     python3-attr python3-more-itertools python3-packaging)
  cp "$base"/{config.json,generation_config.json,model.safetensors,tokenizer.json,tokenizer_config.json} .device/base/
  du -sh .whl .debs .device
}

run() {
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  local t0; t0=$(date +%s)
  log() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; /usr/bin/python3 --version;
    python3 --version; } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  for f in .debs/*.deb; do dpkg -x "$f" / || log "dpkg -x $f failed"; done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
  local rtrl="python3 -m realtime_rl.cli"
  timeout 60 python3 -c "from realtime_rl.environments.sandbox.probe import probe_isolation as p; print(p().label)"
  if [ "${SANDBOX:-0}" = 1 ]; then
    log "bench sandbox"
    timeout 120 $rtrl bench sandbox --json "$OUT/sandbox.json" 2>&1 | tee -a "$OUT/checks.log" | grep -A14 '"metrics"'
  fi
  if [ "${CHECKS:-1}" = 1 ]; then
    log "pytest -m gpu"
    timeout 200 python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/gpu} -s -p no:cacheprovider -o addopts="" 2>&1 \
      | tee -a "$OUT/checks.log" | tail -25
    for dt in ${MISMATCH:-bfloat16 float32}; do
      log "mismatch cuda $dt"
      RTRL_BENCH_DEVICE=cuda RTRL_BENCH_DTYPE=$dt timeout 120 $rtrl bench mismatch --json "$OUT/mismatch_cuda_$dt.json" \
        2>&1 | tee -a "$OUT/checks.log" | grep -A12 '"metrics"'
    done
    for dt in ${ENGINE:-}; do
      log "engine cuda $dt"
      RTRL_BENCH_DEVICE=cuda RTRL_BENCH_DTYPE=$dt timeout 240 $rtrl bench engine --json "$OUT/engine_cuda_$dt.json" \
        2>&1 | tee -a "$OUT/checks.log" | grep -E '"(tokens_per_s|hf_tokens_per_s|speedup_vs_hf|eager_speedup_vs_hf|compile_s|compile_error)"'
    done
    local trainer=${TRAINER:-bfloat16 float32}
    local probe
    if [ -n "${trainer// /}" ] && ! probe=$(python3 -c "import trl, datasets, accelerate, pyarrow" 2>&1); then
      echo "$probe" >> "$OUT/checks.log"; log "bench trainer skipped: TRL's imports fail here (checks.log)"; trainer=""
    fi
    for dt in $trainer; do
      log "trainer cuda $dt"
      RTRL_BENCH_BASE=.device/base RTRL_BENCH_DEVICE=cuda RTRL_BENCH_DTYPE=$dt RTRL_BENCH_PROFILE=${PROFILE:-1} \
        timeout 150 $rtrl bench trainer --json "$OUT/trainer_cuda_$dt.json" 2>&1 | tee -a "$OUT/checks.log" | grep -A6 '"metrics"'
      [ -n "${TRAINER_SET:-}" ] || continue
      log "trainer cuda $dt $TRAINER_SET"
      RTRL_BENCH_BASE=.device/base RTRL_BENCH_DEVICE=cuda RTRL_BENCH_DTYPE=$dt timeout 150 \
        $rtrl bench trainer --json "$OUT/trainer_cuda_${dt}_set.json" $TRAINER_SET 2>&1 | tee -a "$OUT/checks.log" \
        | grep -A6 '"metrics"'
    done
  fi
  [ "${ASYNC:-1}" = 1 ] || { log end; return; }
  local left=$(( ${BUDGET_S:-540} - ($(date +%s) - t0) - 15 ))
  if [ "$left" -lt "${ASYNC_MIN_S:-300}" ]; then  # 20 steps took ~360-420 s on an H100/H200 (2026-11-27)
    log "async bench skipped: $left s left of BUDGET_S (run it with CHECKS=0 or fewer checks)"; return
  fi
  log "async bench, $left s left"
  local sets=${ASYNC_SET:-"--set rl.device=cuda --set rl.dtype=bfloat16 --set rollout.workers=12"}
  RTRL_BENCH_BASE=.device/base RTRL_BENCH_STEPS=${STEPS:-20} RTRL_BENCH_EVAL_TASKS=${EVAL:-24} timeout "$left" \
    $rtrl bench async --json "$OUT/async_cuda.json" $sets 2>&1 | tr '\r' '\n' | grep -v '^\s*$' \
    | tee "$OUT/async.log" | tail -30
  log end
}

case ${1:-} in
  prepare) shift; prepare "$@" ;;
  run) run ;;
  *) echo "usage: $0 prepare [BASE_DIR] | run" >&2; exit 2 ;;
esac
