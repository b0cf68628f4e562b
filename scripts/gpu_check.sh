#!/usr/bin/env bash
# GPU check: the kernel's GPU test tier, the kernel benchmark, a profiled 7B cost model.
#
#   bash scripts/gpu_check.sh [OUT_DIR]              on a GPU machine (OUT_DIR: $OUT, else results/gpu_check;
#                                                    on the device machine give none: only $OUT comes back)
#   bash scripts/gpu_check.sh --cpu-smoke OUT_DIR    every stage's plumbing on CPU, tiny sizes, interpreter
#
# GPU_CHECK_STAGES=tests,bench,profile,cp (the default: all) runs only the stages named, to
# rerun one. WLB_OPT_COMMIT=<hash> names the commit in the results' provenance (the device
# machine's copy of the tree has no .git).
#
# Runs from a fresh copy of the repository, from its root or from anywhere, on a machine
# with python3, torch and triton but no network and no solvers: nothing is installed. The
# package is imported through a folder of symlinks that mirrors the installed layout
# (wlb_opt.kernels -> kernels/, wlb_opt.bench -> bench/, wlb_opt.solvers -> solvers/), with
# PYTHONSAFEPATH=1 and the working directory moved to OUT_DIR, so that no `wlb_opt/` folder
# of the checkout shadows it. Prerequisites are checked first (one line says what is
# missing); a stage whose prerequisite is missing is skipped and says so.
#
# Budget on one H100/H200 (about 8.5 minutes, cold compiles included; give the device call
# timeout_s=570): stage timeouts of 200 s for the tests (kernels, and a training step through
# the executor), 190 s for the kernel benchmark (its baselines stop after 150 s, and no case
# starts after 165 s), 60 s for the profile and 30 s for the CP hot path. The kernel
# benchmark and the CP hot path keep their partial JSON. Writes six files at the top of
# OUT_DIR (the device machine returns eight at most): gpu_check.log (the environment and
# every stage's output, under "==== stage" headers), tests.xml (JUnit), kernel_bench.json,
# cost_7b.json (fit, validation, attention-latency table, memory calibration; cost_tiny.json
# in the smoke run), cp_path.json, summary.json (rc per stage; 99 = skipped).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then
  SMOKE=1
  shift
  if [ -z "${1:-}" ]; then echo "usage: $0 --cpu-smoke OUT_DIR" >&2; exit 2; fi
fi
OUT_DIR="${1:-${OUT:-$REPO/results/gpu_check}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
if [ -n "${OUT:-}" ] && [[ "$OUT_DIR/" != "$(cd "$OUT" 2>/dev/null && pwd)/"* ]]; then
  echo "gpu_check: warning: writing to $OUT_DIR, outside \$OUT ($OUT): nothing of it comes back from the device machine"
fi
STAGES=",${GPU_CHECK_STAGES:-tests,bench,profile,cp},"
want() { [[ "$STAGES" == *",$1,"* ]]; }
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
section() { echo "==== $*" | tee -a "$LOG"; }
# $PYTHON, else the checkout's virtual environment when there is one (a development
# machine), else python3 (the GPU machine: torch and triton installed system-wide)
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"
else PY=python3; fi

# Stage time limits keep the GPU run inside its budget. The CPU smoke run checks plumbing,
# not speed: on a shared, loaded CPU its stages get ten minutes each instead.
limit() { if [ "$SMOKE" = 1 ]; then echo 600; else echo "$1"; fi; }

SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
mkdir -p "$SITE/wlb_opt"
for entry in "$REPO"/wlb_opt/*; do ln -s "$entry" "$SITE/wlb_opt/$(basename "$entry")"; done
for sub in kernels bench solvers; do ln -sfn "$REPO/$sub" "$SITE/wlb_opt/$sub"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1          # python -m / -c must not put the checkout's wlb_opt/ first
export TRITON_DEFAULT_FP_FUSION=1
export HYPOTHESIS_STORAGE_DIRECTORY="$SITE/hypothesis"  # not in OUT_DIR: only results come back from there
if [ "$SMOKE" = 1 ]; then export TRITON_INTERPRET=1; else export TRITON_INTERPRET=0; fi
cd "$OUT_DIR" || exit 2

# ---------------------------------------------------------------- prerequisites
PREREQ="$("$PY" - "$SMOKE" <<'EOF'
import importlib.util, sys
smoke = sys.argv[1] == "1"
missing = [m for m in ("numpy", "torch", "triton", "pytest") if importlib.util.find_spec(m) is None]
cuda = False
if "torch" not in missing:
    import torch
    cuda = torch.cuda.is_available()
if not cuda and not smoke:
    missing.append("CUDA")
print(" ".join(missing))
EOF
)" || PREREQ="python numpy torch triton pytest CUDA"  # the probe itself failed: run no stage
if [ -n "$PREREQ" ]; then echo "gpu_check: missing: $PREREQ"; else echo "gpu_check: prerequisites ok"; fi
has() { [[ " $PREREQ " != *" $1 "* ]]; }

section environment
{
  date -u
  echo "repo $REPO, commit ${WLB_OPT_COMMIT:-unknown}, mode $([ "$SMOKE" = 1 ] && echo cpu-smoke || echo gpu), missing: ${PREREQ:-none}, stages ${STAGES:1:-1}"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1
  "$PY" -c "import wlb_opt.kernels, wlb_opt.bench, wlb_opt.solvers, sys; print('wlb_opt from', wlb_opt.__file__, '| kernels from', wlb_opt.kernels.__file__, '| triton imported at import:', 'triton' in sys.modules)" 2>&1
} 2>&1 | tee -a "$LOG"

stage_rc() { echo "$1 rc=$2 in $3 s" | tee -a "$LOG"; }

# ---------------------------------------------------------------- 1. tests
tests_rc=99
STAGE_LOG="$SITE/stage.log"
if ! want tests; then
  section "tests: not selected (GPU_CHECK_STAGES)"
elif has torch && has triton && has pytest && { [ "$SMOKE" = 1 ] || has CUDA; }; then
  section tests
  start=$(date +%s)
  if [ "$SMOKE" = 1 ]; then
    # the GPU tier is collected (and skips without CUDA); the alignment checks run
    timeout -s INT -k 10 "$(limit 150)" "$PY" -m pytest -q -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
      "$REPO/tests/integration/test_kernels_gpu.py" "$REPO/tests/integration/test_executor_gpu.py" \
      "$REPO/tests/integration/test_kernels_index.py" -k "gpu or specialisation or 16_bytes" \
      --junitxml="$OUT_DIR/tests.xml" 2>&1 | tee -a "$LOG" > "$STAGE_LOG"
  else
    WLB_KERNEL_AUTOTUNE=0 timeout -s INT -k 10 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider --rootdir "$REPO" \
      -c "$REPO/pyproject.toml" "$REPO/tests/integration/test_kernels_gpu.py" \
      "$REPO/tests/integration/test_executor_gpu.py" --junitxml="$OUT_DIR/tests.xml" 2>&1 | tee -a "$LOG" > "$STAGE_LOG"
  fi
  tests_rc=${PIPESTATUS[0]}
  tail -n 15 "$STAGE_LOG"
  stage_rc tests "$tests_rc" $(( $(date +%s) - start ))
else
  section "tests: skipped (needs torch, triton, pytest$([ "$SMOKE" = 0 ] && echo ", CUDA"))"
fi

# ---------------------------------------------------------------- 2. kernel benchmark
bench_rc=99
if ! want bench; then
  section "kernel benchmark: not selected (GPU_CHECK_STAGES)"
elif has torch && has triton && { [ "$SMOKE" = 1 ] || has CUDA; }; then
  section kernel benchmark
  start=$(date +%s)
  if [ "$SMOKE" = 1 ]; then
    timeout "$(limit 120)" "$PY" -m wlb_opt.bench.kernel --cpu-smoke --out "$OUT_DIR" 2>&1 | tee -a "$LOG" > "$STAGE_LOG"
  else
    timeout -s INT -k 5 190 "$PY" -m wlb_opt.bench.kernel --out "$OUT_DIR" --budget-s 150 2>&1 | tee -a "$LOG" > "$STAGE_LOG"
  fi
  bench_rc=${PIPESTATUS[0]}
  grep -v '^{' "$STAGE_LOG" | tail -n 25  # the table, not the JSON rows (they are in kernel_bench.json)
  stage_rc bench "$bench_rc" $(( $(date +%s) - start ))
else
  section "kernel benchmark: skipped (needs torch, triton$([ "$SMOKE" = 0 ] && echo ", CUDA"))"
fi

# ---------------------------------------------------------------- 3. profile a block
# One 7B block (bf16) fitted on sampled micro-batches and validated on held-out ones, the
# attention-latency table at q lengths 128..128K over 128K keys, and the memory calibration
# (CUDA allocator peaks), all saved in cost_7b.json; its log ends with the `validation MAPE`
# line.
profile_rc=99
if ! want profile; then
  section "profile: not selected (GPU_CHECK_STAGES)"
elif has torch && { [ "$SMOKE" = 1 ] || has CUDA; }; then
  section profile a block, fit and validate a CostModel, calibrate the memory model
  start=$(date +%s)
  if [ "$SMOKE" = 1 ]; then
    args=(--model tiny --window 128 --samples 4 --holdout 3 --repeats 1 --device cpu --q-lens 16,32,64,128
          --kv-len 128 --out "$OUT_DIR/cost_tiny.json")
    stage_limit=$(limit 60)
  else
    args=(--model 7b --dtype bf16 --window 16384 --samples 16 --holdout 6 --repeats 3 --device cuda
          --q-lens 128,256,512,1024,2048,4096,8192,16384,32768,65536,131072 --kv-len 131072
          --out "$OUT_DIR/cost_7b.json")
    stage_limit=60
  fi
  WLB_KERNEL_AUTOTUNE=0 timeout -s INT -k 5 "$stage_limit" "$PY" -c \
    "import sys; from wlb_opt.profile import main; sys.exit(main(sys.argv[1:]))" "${args[@]}" \
    2>&1 | tee -a "$LOG" > "$STAGE_LOG"
  profile_rc=${PIPESTATUS[0]}
  tail -n 10 "$STAGE_LOG"
  stage_rc profile "$profile_rc" $(( $(date +%s) - start ))
else
  section "profile: skipped (needs torch$([ "$SMOKE" = 0 ] && echo ", CUDA"))"
fi

# ---------------------------------------------------------------- 4. CP hot path
cp_rc=99
if ! want cp; then
  section "CP hot path: not selected (GPU_CHECK_STAGES)"
elif has torch && { [ "$SMOKE" = 1 ] || has CUDA; }; then
  section "CP attention hot path (host index path; one-rank group, per-layer device time)"
  start=$(date +%s)
  if [ "$SMOKE" = 1 ]; then
    args=(--device cpu --tokens 4096 --repeats 3 --full --full-tokens 256 --head-dim 16)
  else
    args=(--device cuda --full --full-tokens 32768 131072)
  fi
  WLB_KERNEL_AUTOTUNE=0 timeout "$(limit 30)" "$PY" -m wlb_opt.bench.cp_path "${args[@]}" --out "$OUT_DIR" \
    2>&1 | tee -a "$LOG" > "$STAGE_LOG"
  cp_rc=${PIPESTATUS[0]}
  tail -n 6 "$STAGE_LOG"
  stage_rc cp_path "$cp_rc" $(( $(date +%s) - start ))
else
  section "CP hot path: skipped (needs torch$([ "$SMOKE" = 0 ] && echo ", CUDA"))"
fi

echo "{\"mode\": \"$([ "$SMOKE" = 1 ] && echo cpu-smoke || echo gpu)\", \"commit\": \"${WLB_OPT_COMMIT:-}\", \"missing\": \"${PREREQ}\", \"tests_rc\": $tests_rc, \"bench_rc\": $bench_rc, \"profile_rc\": $profile_rc, \"cp_path_rc\": $cp_rc}" \
  > "$OUT_DIR/summary.json"
cat "$OUT_DIR/summary.json"
# 99 = skipped; any stage that ran must pass
for rc in "$tests_rc" "$bench_rc" "$profile_rc" "$cp_rc"; do
  if [ "$rc" != 0 ] && [ "$rc" != 99 ]; then exit 1; fi
done
[ -z "$PREREQ" ] || [ "$SMOKE" = 1 ]
