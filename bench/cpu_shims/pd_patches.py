"""Test-only runtime patches of two SGLang 0.5.23 bugs that bite PD disaggregation on CPU alone.

Installed by ``sitecustomize.py`` beside this file in server subprocesses started with
``KVPUB_CPU_PD_PATCHES=1`` (the PD tier, ``bench/pd_rig.py``), and nowhere else.  Each patch
is applied right after SGLang's own module is imported (a post-import hook: the modules are
not loaded yet when ``sitecustomize`` runs) and changes one thing:

1. ``sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.supports_host_tensor_indices``
   -> ``False``.  Upstream cause: with it ``True`` the prefill's send path
   (``disaggregation/prefill.py``, the host-tensor-indices branch) copies the page indices
   into *pinned* host memory and records a ``torch.cuda.Event``; neither exists without
   CUDA ("Tried to instantiate dummy base class Event").  ``False`` takes SGLang's other
   branch (indices as they are), which is what every non-Mooncake sender does.
2. ``sglang.srt.disaggregation.common.conn.CommonKVManager.__init__``: with plain DP (no DP
   attention) set ``attn_dp_rank`` to the replica's ``system_dp_rank``.  Upstream cause:
   the KV manager takes ``attn_dp_rank`` from the parallel context, which is 0 in every
   replica when attention-DP is off, so every replica registers itself with the bootstrap
   server as rank 0 and ``/register_dp_rank`` posts rank 0 for every request (the decode
   then pairs with rank 0 whatever rank served the prefill; with ``follow_bootstrap_room``
   it reports a conflict on rank 1).  With ``--enable-dp-attention`` (the report's
   deployment) the value is right; DP attention does not run on CPU here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["ENV", "install_pd_patches"]

ENV = "KVPUB_CPU_PD_PATCHES"


def _no_host_tensor_indices(module: types.ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


def _replica_rank_as_dp_rank(module: types.ModuleType) -> None:
    manager = module.CommonKVManager
    original = manager.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self, "attn_dp_size", 1) == 1 and getattr(self, "system_dp_size", 1) > 1:
            self.attn_dp_rank = self.system_dp_rank

    manager.__init__ = __init__


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.disaggregation.mooncake.conn": _no_host_tensor_indices,
    "sglang.srt.disaggregation.common.conn": _replica_rank_as_dp_rank,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the target modules through the other finders and patches them once executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                execute = loader.exec_module

                def exec_module(module: types.ModuleType, execute: Any = execute, patch: Any = patch) -> None:
                    execute(module)
                    patch(module)

                loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


def install_pd_patches() -> None:
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
