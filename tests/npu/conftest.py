"""NPU / GPU tier: detect the accelerator without crashing the session, skip with a reason.

torch_npu is never imported in the test process: once installed it breaks a plain
``import torch`` on hosts without CANN (``libhccl.so`` missing), so detection runs
``import torch, torch_npu`` in a child with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MODEL_ENV = "KVPUB_TEST_MODEL"
MIN_DEVICES = 2  # --dp-size 2 with DP attention

_PROBES = {
    "npu": (
        "torch_npu",
        "import torch, torch_npu\nprint(bool(torch.npu.is_available()), torch.npu.device_count())",
    ),
    "cuda": ("torch", "import torch\nprint(bool(torch.cuda.is_available()), torch.cuda.device_count())"),
}


@functools.cache
def accelerator_problem(device: str) -> str | None:
    """None when ``device`` ('npu' or 'cuda') has >= 2 usable devices, else why not."""
    module, code = _PROBES[device]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    if device == "cuda" and not glob.glob("/dev/nvidia[0-9]*") and not shutil.which("nvidia-smi"):
        return "no CUDA device (no /dev/nvidia*, no nvidia-smi)"
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired:
        return f"probing {device} timed out"
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or ["(no stderr)"]
        return f"{module} does not load: {lines[-1]}"
    available, count = out.stdout.split()[-2:]
    if available != "True":
        return f"no {device} device visible (is_available() is False)"
    if int(count) < MIN_DEVICES:
        return f"{count} {device} device(s) visible, the test needs {MIN_DEVICES} (--dp-size 2)"
    return None


def environment_problem(device: str) -> str | None:
    """Everything the real-server tier needs besides the devices themselves."""
    problem = accelerator_problem(device)
    if problem:
        return problem
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    model = os.environ.get(MODEL_ENV, "")
    if not model:
        return f"${MODEL_ENV} is not set (a local model directory, e.g. a small Qwen/Llama)"
    if not Path(model).exists():
        return f"${MODEL_ENV}={model} does not exist"
    return None


_MARK_DEVICE = {"npu": "npu", "gpu": "cuda"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for mark, device in _MARK_DEVICE.items():
            if item.get_closest_marker(mark) is None:
                continue
            problem = environment_problem(device)
            if problem:
                item.add_marker(pytest.mark.skip(reason=f"{mark} tier: {problem}"))
