"""Server-subprocess start-up for the real-server tier on CPU (see README.md beside this file).

This directory is first on the server's PYTHONPATH, so the torchvision import hook beside this
file is importable by name; a real importable torchvision wins.
"""

from __future__ import annotations

from torchvision_stub import install_torchvision_stub

install_torchvision_stub()
