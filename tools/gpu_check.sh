#!/usr/bin/env bash
# The GPU check for a machine whose torch is already installed (a lent GPU machine: torch with CUDA, no package
# index, so `nox -s gpu`, which pip-installs, cannot run there). Uses `python3` (or $PYTHON) as it is, puts cx's
# sources on PYTHONPATH and runs, each under its own time limit:
#   environment     torch, CUDA, the device and which optional libraries are installed
#   gemini_offload  GeminiPlugin with everything offloaded to the host, losses against plain PyTorch
#   fp8_linear      cx's fp8 linear on sm89+ against the exact product, within a derived bound; fp8 vs bf16 TFLOP/s
#   train_mfu       a short cx-train run on the GPU and its MFU
#   gpu_tests       the tests marked `gpu` (what `nox -s gpu` runs)
# and writes a report, gpu_check_report.md, with each step's status (pass / skip / fail), seconds and result, to
# --out DIR (default: $OUT, else .gpu-check/), each step's full output beside it in gpu_check_logs/. The exit status
# is 1 if any step failed (a skip, e.g. for a missing library or a GPU too old for fp8, is no failure).
#
# Without CUDA, or with --cpu, the same steps run on the CPU (CUDA hidden), with tiny sizes: what needs CUDA skips
# itself and says so, so CI keeps this script working (tests/test_gpu_check_script.py). Total run time is capped by
# --budget SECONDS (default 450: under 8 minutes; every step gets at most what is left).
set -uo pipefail
cd "$(dirname "$0")/.."

usage="usage: tools/gpu_check.sh [--cpu] [--out DIR] [--budget SECONDS]"
mode=auto
out="${OUT:-.gpu-check}"
budget=450
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) mode=cpu ;;
    --out) out="${2:?$usage}"; shift ;;
    --budget) budget="${2:?$usage}"; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
case "$budget" in ''|*[!0-9]*) echo "--budget takes whole seconds, got '$budget'" >&2; exit 2 ;; esac

python="${PYTHON:-python3}"
sources=$(printf '%s:' "$PWD"/packages/*/src)
export PYTHONPATH="$sources${PYTHONPATH:-}"
export HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 CX_JIT_FUSED_BACKEND=aot_eager  # as `nox -s gpu` runs the tests
if [ "$mode" = auto ]; then
  if "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then mode=gpu; else mode=cpu; fi
fi
if [ "$mode" = cpu ]; then  # CUDA hidden even where there is some; the CPU settings of `nox -s tests`
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
fi

mkdir -p "$out/gpu_check_logs"
out=$(cd "$out" && pwd)
report="$out/gpu_check_report.md"
started=$SECONDS
deadline=$(( SECONDS + budget ))
rows=()
failed=0

# step NAME LIMIT COMMAND...: run COMMAND for at most LIMIT seconds (less if the budget has less left), its output to
# gpu_check_logs/NAME.log; the report's detail is its last RESULT:/SKIP:/FAIL: line (tools/gpu_check/gpu_check_step.py)
step() {
  local name=$1 limit=$2 log="$out/gpu_check_logs/$1.log" code=0 status detail
  shift 2
  local left=$(( deadline - SECONDS ))
  [ "$left" -lt "$limit" ] && limit=$left
  echo "::: $name (at most $limit s)"
  local start=$SECONDS
  if [ "$limit" -lt 5 ]; then
    code=-1; echo "FAIL: not run: the --budget of $budget s was spent" >"$log"
  else
    timeout --kill-after=15 "$limit" "$@" >"$log" 2>&1 || code=$?
  fi
  detail=$(grep -E '^(RESULT|SKIP|FAIL): ' "$log" | tail -n 1 | cut -d' ' -f2-)
  case "$code" in
    0) status=pass ;;
    77) status=skip ;;
    124|137) status=fail; detail="timed out after $limit s (budget $budget s); see gpu_check_logs/$name.log" ;;
    *) status=fail; detail="${detail:-exit status $code: $(tail -n 1 "$log")}" ;;
  esac
  [ "$status" = fail ] && failed=1
  echo "::: $name: $status in $(( SECONDS - start )) s: $detail"
  rows+=("| $name | $status | $(( SECONDS - start )) | ${detail//|/\\|} |")
}

checks=tools/gpu_check  # the open-ended test run last, so it cannot starve the others of the budget
step environment 60 "$python" "$checks/environment.py"
step gemini_offload 120 "$python" "$checks/gemini_offload.py"
step fp8_linear 120 "$python" "$checks/fp8_linear.py"
step train_mfu 180 "$python" "$checks/train_mfu.py"
step gpu_tests 300 "$python" "$checks/gpu_tests.py"

commit=$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (not a git checkout)")
{
  echo "# cx GPU check"
  echo
  echo "- result: $([ "$failed" = 0 ] && echo PASS || echo FAIL)"
  echo "- mode: $mode$([ "$mode" = cpu ] && echo " (CUDA hidden: the CUDA parts skip or run on the CPU)")"
  echo "- python: $("$python" -c 'import sys; print(sys.executable)' 2>&1)"
  echo "- commit: $commit$(git status --porcelain 2>/dev/null | grep -q . && echo ' (with uncommitted changes)')"
  echo "- finished: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(( SECONDS - started )) s of a $budget s budget"
  echo
  echo "| step | status | seconds | result |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Each step's full output: gpu_check_logs/<step>.log beside this report."
} >"$report"
echo "::: report: $report"
cat "$report"
exit "$failed"
