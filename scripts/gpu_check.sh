#!/usr/bin/env bash
# GPU check: the kernel's GPU test tier, the kernel benchmark, then a profiled 7B cost model.
#
#   scripts/gpu_check.sh [OUT_DIR]        (OUT_DIR defaults to $OUT, else results/gpu_check)
#
# Sized for one H100/H200: under 8 minutes in all (tests ~3 min with configs pinned, the
# benchmark bounded by --budget-s and a hard timeout). Needs python3 with torch and triton
# (no network, no install): the package is put on PYTHONPATH through a folder of symlinks
# that mirrors the installed layout (wlb_opt.kernels -> kernels/, wlb_opt.bench -> bench/).
# Writes: env.txt, tests.log, tests.xml (JUnit), bench.log, kernel/kernel_bench.json,
# profile.log, cost_7b_h200.json (wlb-opt profile: measured cost terms and efficiency table).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$REPO/results/gpu_check}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"

SITE="$(mktemp -d)"
mkdir -p "$SITE/wlb_opt"
for entry in "$REPO"/wlb_opt/*; do ln -s "$entry" "$SITE/wlb_opt/$(basename "$entry")"; done
for sub in kernels bench solvers; do ln -sfn "$REPO/$sub" "$SITE/wlb_opt/$sub"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0
export TRITON_DEFAULT_FP_FUSION=1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  "$PY" -c "import wlb_opt.kernels, sys; print('wlb_opt.kernels from', wlb_opt.kernels.__file__, '| triton imported at import:', 'triton' in sys.modules)"
} > "$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

echo "== GPU tests (configs pinned; the autotune test re-enables tuning)"
start=$(date +%s)
WLB_KERNEL_AUTOTUNE=0 timeout 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_kernels_gpu.py --junitxml="$OUT_DIR/tests.xml" > "$OUT_DIR/tests.log" 2>&1
tests_rc=$?
tail -n 25 "$OUT_DIR/tests.log"
echo "tests rc=$tests_rc in $(( $(date +%s) - start )) s"

echo "== kernel benchmark"
start=$(date +%s)
timeout 230 "$PY" -m wlb_opt.bench.kernel --out "$OUT_DIR/kernel" --budget-s 160 > "$OUT_DIR/bench.log" 2>&1
bench_rc=$?
tail -n 30 "$OUT_DIR/bench.log"
echo "bench rc=$bench_rc in $(( $(date +%s) - start )) s"

echo "== profile one 7B block (bf16) and fit a CostModel"
start=$(date +%s)
timeout 60 "$PY" -c "from wlb_opt.profile import main; main(['--model', '7b', '--window', '16384', '--samples', '8', '--out', '$OUT_DIR/cost_7b_h200.json'])" > "$OUT_DIR/profile.log" 2>&1
profile_rc=$?
tail -n 8 "$OUT_DIR/profile.log"
echo "profile rc=$profile_rc in $(( $(date +%s) - start )) s"

rm -rf "$SITE"
echo "{\"tests_rc\": $tests_rc, \"bench_rc\": $bench_rc, \"profile_rc\": $profile_rc}" > "$OUT_DIR/summary.json"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
