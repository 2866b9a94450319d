"""Where a benchmark figure comes from: one dict of the machine, the software and the code, which
every benchmark writes into its JSON (a figure without them cannot be compared or repeated).

:func:`environment` keys: ``python``, ``torch``, ``machine`` (the architecture), ``cpu``
(:func:`cpu_name`), ``threads`` (torch's intra-op threads), ``code`` (the short commit, with
``-dirty`` when tracked files differ from it; None outside a git checkout), ``date`` (UTC), and
``gpu`` for a CUDA device. :func:`write` writes a result JSON.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from pathlib import Path

import torch

from custom_ops.cpu import cpu_info

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    """The processor's model name and CPU count (``platform.processor()`` where /proc/cpuinfo
    has no model name)."""
    info = cpu_info()
    return (
        f"{info['model name']}, {info['cpus']} CPUs"
        if "model name" in info
        else platform.processor()
    )


def versions() -> dict:
    """Python's and torch's versions."""
    return {"python": platform.python_version(), "torch": torch.__version__}


def code() -> str | None:
    """The checkout's short commit, ``-dirty`` when a tracked file differs from it (git
    describe's convention); None when there is no git or no checkout (a copied tree)."""

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        )
        return out.stdout.strip()

    try:
        commit = git("rev-parse", "--short=7", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def environment(device: str | torch.device | None = None) -> dict:
    """The keys above; ``gpu`` when ``device`` is a CUDA device."""
    out = {
        **versions(),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "code": code(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device is not None and torch.device(device).type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def write(path: str | Path, body: dict) -> None:
    """``body`` as JSON at ``path`` (indented by 1, as the files of benchmarks/results), and say
    so."""
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
    print(f"wrote {path}")
