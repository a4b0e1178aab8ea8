"""Loading one of the project's C extensions: the one way both halves bind and check theirs.

An extension is used only when it imports, has every name its caller reads, binds to the
xxhash package's XXH3 (``bind``: the same code the Python path hashes with), and computes
the chained block keys the Python loops compute on a few prompts.  Otherwise the caller
gets None and its Python paths answer; ``KVPUB_NATIVE=0`` turns every extension off.
"""

from __future__ import annotations

import importlib
import logging
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["load_extension"]

log = logging.getLogger(__name__)
_U32 = 0xFFFFFFFF
_PROMPTS = ((16, 4), (300, 128), (1100, 1024))  # (ids, block size): one, a few and many blocks
ChainedKeys = Callable[[bytes, int, int, int, int, int], list[int]]


def load_extension(
    module_name: str,
    names: Sequence[str],
    *,
    reference: ChainedKeys,
    seed: int,
    what: str,
) -> Any:
    """``module_name`` bound and checked, or None.  ``reference``: the Python loops'
    ``(raw, block_size, seed, parent, start, end) -> keys``; ``what`` names the helpers in
    the log."""
    if os.environ.get("KVPUB_NATIVE", "1").strip() == "0":
        return None
    try:
        from xxhash import _xxhash  # type: ignore[attr-defined]

        module = importlib.import_module(module_name)
        module.bind(_xxhash.__file__)
        for name in names:
            getattr(module, name)
    except (ImportError, AttributeError, OSError) as exc:
        log.debug("%s unavailable (%s): the Python paths answer", what, exc)
        return None
    for size, block in _PROMPTS:
        ids = [(i * 2_654_435_761) & _U32 for i in range(size)]
        raw = struct.pack(f"<{size}I", *ids)
        blocks = size // block
        if module.chain_keys(raw, block, 7, seed, 0, blocks) != reference(raw, block, 7, seed, 0, blocks):
            log.warning("%s disagree with the Python loops: not used", what)
            return None
    return module
