"""What a loader process imports: wlb_opt.batch without the executor, and a stream that plans and
packs without it (fresh interpreters)."""
from __future__ import annotations

import subprocess
import sys


def test_batch_is_not_imported_by_wlb_opt_and_imports_no_executor():
    code = ("import sys, wlb_opt; assert 'wlb_opt.batch' not in sys.modules, 'import wlb_opt imported it'; "
            "import wlb_opt.batch; bad = sorted(m for m in sys.modules if m.startswith('wlb_opt.executor')); "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_the_stream_plans_and_packs_without_the_executor():
    code = ("import sys, numpy as np, torch, wlb_opt as wlb\n"
            "docs = [(i, np.arange(n) % 50) for i, n in enumerate([30, 50, 7, 21, 12])]\n"
            "stream = wlb.WLBStream(docs, wlb.WLBPacker(2, 64, thresholds=[]), 100, cp=2)\n"
            "step = next(iter(stream)); step.tokens(0); step.inputs(0, 1)\n"
            "bad = sorted(m for m in sys.modules if m.startswith('wlb_opt.executor'))\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
