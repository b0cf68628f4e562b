"""Where a benchmark's JSON came from: the command line that wrote it, the code and the machine.

Every benchmark stores `provenance(name, argv)` under the key "provenance" of its JSON (and
`wlb-opt profile` under its cost model's meta), so that `wlb-opt bench report` can print each
table beside the command that reproduces it, the code that ran it and the machine whose
numbers it shows.
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path


def machine() -> dict:
    """Platform, Python, CPU count, and the torch version and accelerator when torch is installed."""
    info = dict(platform=platform.platform(), python=platform.python_version(), cpu_count=os.cpu_count())
    try:
        import torch
    except ImportError:
        info.update(torch=None, accelerator=None)
    else:
        cuda = torch.cuda.is_available()
        info.update(torch=torch.__version__, accelerator=torch.cuda.get_device_name() if cuda else None)
    return info


def code() -> dict:
    """The package's version and, when it runs from a git checkout, the commit (short hash, and
    "dirty" when tracked files outside docs/ differ from it); elsewhere (an installed wheel, a copy without
    its .git) the WLB_OPT_COMMIT environment variable's value, else None (scripts/gpu_check.sh
    on a device machine, whose copy of the tree has no .git, is told the commit that way)."""
    from . import __version__

    root = Path(__file__).resolve().parent.parent
    commit = os.environ.get("WLB_OPT_COMMIT") or None
    try:
        run = dict(cwd=root, capture_output=True, text=True, timeout=10, check=True)
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], **run).stdout.strip()
        if not top or Path(top).resolve() != root:  # a copy inside another repository's work tree
            return dict(version=__version__, commit=commit)
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], **run).stdout.strip()
        # the code's state: results and docs a benchmark run rewrites do not make the code dirty
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
                                 **run).stdout.strip()
        commit = head + (" dirty" if changed else "") if head else None
    except (OSError, subprocess.SubprocessError):
        pass
    return dict(version=__version__, commit=commit)


def command(name: str, argv: list[str] | None, program: tuple[str, ...] = ("wlb-opt", "bench")) -> str:
    """The `wlb-opt bench NAME ...` line (`program` NAME ...); `argv` None means the arguments
    of this process."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join([*program, name.replace("_", "-"), *args])


def provenance(name: str, argv: list[str] | None, program: tuple[str, ...] = ("wlb-opt", "bench")) -> dict:
    """{"command": the command line, "code": `code()`, "machine": `machine()`} for the JSON of
    benchmark `name` (`program`: the words before NAME, `("wlb-opt",)` for `wlb-opt profile`)."""
    return dict(command=command(name, argv, program), code=code(), machine=machine())
