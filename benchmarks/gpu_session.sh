#!/usr/bin/env bash
# One GPU session, as run on a lent H200 (see the README's "GPU results" and the session notes):
# sanity decode on the device, a torch.profiler trace of real cycles, the side-by-side bench of
# exported drafts, the latency profile and its validation, then benches with a larger tree and in fp32. Every stage is bounded by `timeout` and independent of the others, so one
# failure costs only that stage; results are copied to RES after each stage.
#
#   RES=/tmp/res DRAFTS="out/draft-cpu-trial8 out/draft-cpu-trial0" bash benchmarks/gpu_session.sh
#
# Environment:
#   RES        where JSON/PNG/logs go (required)
#   DRAFTS     exported draft dirs to bench (space-separated); prompt lookup is always benched
#   EXTRA_DRAFTS  more draft specs for the first bench, comma-separated (e.g. layerskip:8)
#   HW         hardware name for the profile (default h200)
#   TARGET     target preset (default smolvlm-135m)
#   PROMPTS    bench prompts (default sharegpt:6,images:2)
#   TOKENS     max new tokens in the bench (default 64)
#   REPEATS    timed repeats per prompt and method (default 2)
#   BIG_TREE   "depth top_k total" for the second bench with a larger tree (default "5 8 48")
#   QUICK=1    CPU dry run of the script itself: --quick profile, 2 validate samples, tiny benches
#              (PROMPTS sharegpt:2,images:1, TOKENS 8, REPEATS 1 unless given); tests/test_gpu_session.py
#              runs it so on a tiny target in CI
#
# The first bench has transformers' compiled vanilla decoding (hf-compiled: static cache + torch.compile,
# CUDA graphs on the GPU) beside ours: a speed-up smaller than what compiling gives is no win.
set -u
: "${RES:?set RES to the results folder}"
DRAFTS=${DRAFTS:-}
HW=${HW:-h200}
TARGET=${TARGET:-smolvlm-135m}
if [ "${QUICK:-0}" = 1 ]; then
  PROMPTS=${PROMPTS:-sharegpt:2,images:1}
  TOKENS=${TOKENS:-8}
  REPEATS=${REPEATS:-1}
  FP32_PROMPTS=${FP32_PROMPTS:-sharegpt:1}
  FP32_TOKENS=${FP32_TOKENS:-8}
fi
PROMPTS=${PROMPTS:-sharegpt:6,images:2}
TOKENS=${TOKENS:-64}
REPEATS=${REPEATS:-2}
FP32_PROMPTS=${FP32_PROMPTS:-sharegpt:4}
FP32_TOKENS=${FP32_TOKENS:-48}
BIG_TREE=${BIG_TREE:-"5 8 48"}
PY=${PY:-python3}
mkdir -p "$RES"
LOG="$RES/session.log"
export PYTHONUNBUFFERED=1

stage() {  # stage NAME SECONDS CMD...: run CMD with a time limit, log it, never abort the script
  local name=$1 limit=$2
  shift 2
  echo "=== [$(date +%T)] $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== [$(date +%T)] $name: rc=$rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  if [ -n "${AFTER_STAGE:-}" ]; then eval "$AFTER_STAGE"; fi
}

drafts_csv=$(echo "$DRAFTS" | tr ' ' ',' | sed 's/^,*//; s/,*$//')
profile_args=()
validate_args=(--samples 20)
if [ "${QUICK:-0}" = 1 ]; then
  profile_args=(--quick)
  validate_args=(--samples 2 --cycles 2 --passes 1 --prompts fixed)
fi

{
  echo "host: $(hostname)  date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 || true
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
} >>"$LOG" 2>&1

stage sanity-vanilla 120 $PY -m decode.run --target "$TARGET" --vanilla \
  --prompt "What is the capital of France?" --max-new-tokens 16
if [ -n "$drafts_csv" ]; then
  first=${DRAFTS%% *}
  stage sanity-draft 120 $PY -m decode.run --target "$TARGET" --draft "$first" --compare --repeats 2 \
    --prompt "Describe this picture." --image skimage:astronaut --max-new-tokens 32
fi

if [ -n "$drafts_csv" ]; then  # where real cycles spend their time (the profile's components miss host work)
  stage trace 120 $PY -m hwprofile.trace --target "$TARGET" --draft "$first" --max-new-tokens 48 \
    --out "$RES/trace-$TARGET-$HW.json"
fi

stage bench 240 $PY -m decode.bench --target "$TARGET" --drafts "${drafts_csv:+$drafts_csv,}prompt-lookup,hf-generate,hf-compiled${EXTRA_DRAFTS:+,$EXTRA_DRAFTS}" \
  --prompts "$PROMPTS" --max-new-tokens "$TOKENS" --repeats "$REPEATS" -v \
  --out "$RES/bench-$TARGET-$HW-drafts.json"

stage profile 240 $PY -m hwprofile.profile --hardware "$HW" --target "$TARGET" "${profile_args[@]}" -v \
  --out "$RES/$HW-$TARGET.json"
if [ -f "$RES/$HW-$TARGET.json" ]; then
  stage validate 120 $PY -m hwprofile.validate --profile "$RES/$HW-$TARGET.json" "${validate_args[@]}" -v
fi

if [ -n "$drafts_csv" ]; then
  read -r big_depth big_k big_total <<<"$BIG_TREE"
  stage bench-big-tree 150 $PY -m decode.bench --target "$TARGET" --drafts "$drafts_csv" \
    --tree-depth "$big_depth" --top-k "$big_k" --total-tokens "$big_total" \
    --prompts "$PROMPTS" --max-new-tokens "$TOKENS" --repeats "$REPEATS" -v \
    --out "$RES/bench-$TARGET-$HW-big-tree.json"
  stage bench-fp32 90 $PY -m decode.bench --target "$TARGET" --dtype float32 --drafts "$drafts_csv,prompt-lookup" \
    --prompts "$FP32_PROMPTS" --max-new-tokens "$FP32_TOKENS" --repeats 1 -v \
    --out "$RES/bench-$TARGET-$HW-fp32.json"
fi
echo "=== [$(date +%T)] done" | tee -a "$LOG"
