"""Server-subprocess start-up for the real-server tier on CPU (see README.md beside this file).

Loads tests/torchvision_stub.py by path (no tests/ directory on sys.path, no pytest) and
installs its torchvision import hook; a real importable torchvision wins.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_STUB = Path(__file__).resolve().parents[2] / "torchvision_stub.py"


def _install() -> None:
    spec = importlib.util.spec_from_file_location("kvpub_torchvision_stub", _STUB)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.install_torchvision_stub()


_install()
