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


def test_a_reader_that_leaves_early_is_not_bad_input():
    """`wlb-opt pack | head -1`: the pipe closes under the command (its output is larger than the
    pipe holds), which stops quietly."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-m", "wlb_opt.cli", "pack", "--dist", "real", "--n-micro", "4096", "--window", "1024"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.readline()
    proc.stdout.close()  # the reader leaves
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 1), err
    assert "error" not in err and "Traceback" not in err, err
