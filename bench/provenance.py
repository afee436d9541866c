"""What every benchmark JSON records about its run: when, where, with what code and which command.

bench/RESULTS.md cites figures with date, machine and command; the raw JSON beside them carries the same, so a file
found on its own still says what it measured.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import torch


def _git_commit() -> str | None:
    """EP_COMM_SOURCE_COMMIT when set (a copy of a working tree whose .git, if any, is not that tree's: the device
    machine's copy carried an older HEAD), else HEAD of the checkout this script runs from, with "+dirty" for local
    changes; None outside a git checkout."""
    if os.environ.get("EP_COMM_SOURCE_COMMIT"):
        return os.environ["EP_COMM_SOURCE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        if not commit:
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata() -> dict:
    """date (UTC), command line, host, git commit, torch and CUDA versions, and the visible GPUs."""
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "host": platform.node(),
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": gpus,
    }
