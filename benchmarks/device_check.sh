#!/usr/bin/env bash
# The GPU check, for a task that is lent a device machine (one H200, its own torch 2.11 + CUDA 13
# on Python 3.12, no network): the CUDA-marked tests, then the sampling and SFT benchmarks on
# SmolLM2-135M's architecture on the GPU, receipts in $OUT. Finishes in under 8 minutes: each
# phase has its own time limit, all of them within DEVICE_CHECK_BUDGET_S (450 s) of the start,
# and a phase that fails or runs out of time is recorded and the next one still runs.
#
# How to run it:
#   1. Here, before the call (needs PyPI; about 10 s):  benchmarks/device_wheels.sh
#      It fills the ignored folder .device-carry/ (the project's wheels except torch, for
#      CPython 3.12, and SmolLM2's config and tokenizer: about 56 MB; the tracked tree adds
#      about 2 MB, under the tool's 64 MiB).
#   2. The tool call (this script must be committed or untracked-not-ignored in the checkout
#      the session runs from: the device gets that checkout, not a helper's worktree):
#        run(command="bash benchmarks/device_check.sh", carry=[".device-carry"], timeout_s=540)
#   3. What comes back, under the reply's files_at: device_check.log (everything printed),
#      summary.json (each phase's exit code and seconds), env.txt (nvidia-smi, pip check,
#      versions), pytest_cuda.log, sampling_smollm2_cuda_bf16.json,
#      sampling_smollm2_cuda_fp32.json, sft_step_smollm2_cuda.json (benchmarks/README.md says
#      what the receipts hold).
#
# SmolLM2's weights (538 MB float32, 269 MB bf16) cannot be carried within 64 MiB, so the model
# is SmolLM2-135M-Instruct's exact architecture and tokenizer with random weights, built there
# by benchmarks/model_shape.py: decoding a fixed number of tokens (stop=[] / min_new_tokens)
# and a training step cost the same whatever the weights' values; the receipts' logprob
# figures (sft precision) are of that random model. Real weights placed at
# .device-carry/smollm2/ (config, tokenizer, model.safetensors) are used instead when present.
#
# CUDA-marked tests: every tests/*.py that uses `pytest.mark.cuda`, run with `-m cuda`; none
# is marked today, which the log and summary.json say (the benchmarks still exercise the
# server on CUDA end to end: SDK sampling with exact token counts, forward_backward and
# optim_step, engine logprobs in bf16 and float32).
#
# On this CPU machine, to catch the script's own errors (minutes, tiny shapes):
#   flock /tmp/rlcli-heavy.lock env DEVICE_CHECK_CPU=1 OUT=$(mktemp -d) bash benchmarks/device_check.sh
# uses .venv instead of the device's python3 (and only checks the wheels would install on 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
: "${OUT:?set OUT to the folder the receipts go to (the device tool sets it)}"
CPU=${DEVICE_CHECK_CPU:-0}
BUDGET=${DEVICE_CHECK_BUDGET_S:-450}
CARRY=$ROOT/.device-carry
SITE=/tmp/rlcli-device-site
MODEL=/tmp/rlcli-smollm2-shape
export TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
if [ "$CPU" = 1 ]; then
  DEV=cpu; PY=$ROOT/.venv/bin/python
else
  # The image's python3 is itself a venv (/opt/torch/.venv): a venv made from it would not see
  # its torch. So the carried wheels go to a folder put first on PYTHONPATH (ahead of the
  # image's transformers 5.17), with this tree's src/ (rlcli, no build). Servers inherit it.
  DEV=cuda; PY=python3
  export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
fi

phase_setup() {
  [ -d "$CARRY/wheels" ] || { echo "no $CARRY/wheels: run benchmarks/device_wheels.sh here and carry .device-carry"; return 1; }
  if [ "$CPU" = 1 ]; then
    # The wheels are for 3.12 on manylinux: check they would install there.
    "$PY" -m pip install -q --dry-run --no-index --no-deps --ignore-installed \
      --target /tmp/rlcli-device-dry --python-version 3.12 --implementation cp \
      --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 "$CARRY"/wheels/*.whl
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$CARRY"/wheels/*.whl
  fi
  {
    echo "# $(date -u +%FT%TZ) device $DEV"
    nvidia-smi 2>&1 || echo "(no nvidia-smi)"
    "$PY" -m pip check 2>&1 || true
    "$PY" - <<'EOF'
import torch, transformers, peft, tinker, tinker_cookbook, rlcli.server.engine.core  # noqa
print("python", __import__("sys").version.split()[0], "torch", torch.__version__,
      "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
      "transformers", transformers.__version__, "peft", peft.__version__,
      "tinker", tinker.__version__, "rlcli from", rlcli.server.engine.core.__file__)
from packaging.version import Version
assert Version(transformers.__version__) <= Version("5.5.4"), \
    f"transformers {transformers.__version__} is past the project's pin: the carried one is not first"
EOF
  } 2>&1 | tee "$OUT/env.txt"
  if [ "$DEV" = cuda ]; then "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA device")'; fi
  if [ -f "$CARRY/smollm2/model.safetensors" ]; then
    rm -rf "$MODEL" && cp -r "$CARRY/smollm2" "$MODEL" && echo "model: real SmolLM2 weights"
  else
    "$PY" benchmarks/model_shape.py "$CARRY/smollm2-shape" "$MODEL" && echo "model: SmolLM2's shape, random weights"
  fi
}

phase_tests() {
  mapfile -t files < <(grep -l -E 'mark\.cuda\b' tests/*.py || true)
  if [ "${#files[@]}" = 0 ]; then
    echo "no test file uses pytest.mark.cuda: no CUDA-marked test to run" | tee "$OUT/pytest_cuda.log"
    return 0
  fi
  "$PY" -m pytest -m cuda -q -p no:cacheprovider "${files[@]}" 2>&1 | tee "$OUT/pytest_cuda.log"
}

phase_sampling() {  # $1: bfloat16 | float32
  local short=${1/bfloat16/bf16}; short=${short/float32/fp32}
  local shapes=8x64,16x256 rounds=2
  if [ "$CPU" = 1 ]; then shapes=2x4; rounds=1; fi
  # transformers would compile its forward for the static cache on CUDA, once per batch size
  # and dtype (minutes): off, so generate_static is the static cache alone, as on CPU.
  "$PY" benchmarks/sampling_smollm2.py --device "$DEV" --model-dir "$MODEL" --dtype "$1" \
    --shapes "$shapes" --rounds "$rounds" --skip staggered --generate-compile off \
    --name "sampling_smollm2_${DEV}_${short}"
}

phase_sft() {
  local extra=(--steps 3)
  if [ "$CPU" = 1 ]; then extra=(--steps 1 --batch 1 --seq-len 16); fi
  "$PY" benchmarks/sft_step_smollm2.py --device "$DEV" --model "$MODEL" \
    --variants defaults,no_checkpointing_mb4096 "${extra[@]}" --name "sft_step_smollm2_${DEV}"
}

case "${1:-}" in
  _phase) shift; "phase_$1" "${@:2}"; exit $? ;;
  "") ;;
  *) echo "usage: OUT=DIR bash benchmarks/device_check.sh" >&2; exit 2 ;;
esac

exec > >(tee -a "$OUT/device_check.log") 2>&1
SUMMARY=()
collect() {  # receipts to $OUT, whatever happened
  cp -f benchmarks/results/sampling_smollm2_"${DEV}"_*.json "benchmarks/results/sft_step_smollm2_${DEV}.json" \
    "$OUT"/ 2>/dev/null || true
  local joined
  joined=$(IFS=,; echo "${SUMMARY[*]}")
  printf '{"device": "%s", "budget_s": %s, "elapsed_s": %s, "phases": {%s}}\n' \
    "$DEV" "$BUDGET" "$SECONDS" "$joined" > "$OUT/summary.json"
}
trap collect EXIT

run_phase() {  # NAME LIMIT_S [ARGS]: runs phase_NAME under a time limit; never stops the script
  local name=$1 limit=$2 left rc=0 t0=$SECONDS
  shift 2
  left=$((BUDGET - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped (${left} s of the ${BUDGET} s budget left)"
    SUMMARY+=("\"$name${1:+_$1}\": {\"rc\": null, \"skipped\": true}")
    return 0
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name${1:+ $1} (limit ${limit} s) at $(date -u +%T)"
  timeout --kill-after=10 "$limit" bash "$0" _phase "$name" "$@" || rc=$?
  echo "== $name${1:+ $1}: exit $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (time limit)')"
  SUMMARY+=("\"$name${1:+_$1}\": {\"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit}")
  collect
  if [ "$name" = setup ] && [ "$rc" != 0 ]; then
    echo "setup failed: nothing else can run"
    exit 1
  fi
}

run_phase setup 150
run_phase tests 90
run_phase sampling 150 bfloat16
run_phase sft 120
run_phase sampling 120 float32
echo "done in $SECONDS s; receipts in $OUT: $(ls "$OUT" | tr '\n' ' ')"
