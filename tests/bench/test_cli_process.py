"""The real wlb-opt process answers bad input with exit status 2 and no traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bad_input_cli_cases import SUBPROCESS_CASES


@pytest.mark.parametrize("argv, fragment", SUBPROCESS_CASES, ids=["table2_steps", "profile_dtype", "cost_missing",
                                                                 "lengths_dir"])
def test_the_real_process_exits_2_without_a_traceback(argv, fragment):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-m", "wlb_opt.cli", *argv], capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and fragment in res.stderr, res.stderr
