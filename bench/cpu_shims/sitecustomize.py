"""Server-subprocess start-up for the real-server tier on CPU (see README.md beside this file).

This directory is first on the server's PYTHONPATH, so the torchvision import hook beside this
file is importable by name; a real importable torchvision wins.  With ``KVPUB_CPU_PD_PATCHES=1``
(the PD tier only) the two PD patches of ``pd_patches.py`` are installed too.
"""

from __future__ import annotations

import os

from torchvision_stub import install_torchvision_stub

install_torchvision_stub()
if os.environ.get("KVPUB_CPU_PD_PATCHES") == "1":
    from pd_patches import install_pd_patches

    install_pd_patches()
