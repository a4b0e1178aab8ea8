"""The three tiers a hit is counted in (Motor's npu / cpu / disk), and which medium is which tier.

:class:`TierHit` is the one hit triple of the project: the prefix index returns it, the
router's scoring and the ``/query`` answer read it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TIER_NPU", "TIER_CPU", "TIER_DISK", "TIERS", "TierHit", "tier_of_medium"]

TIER_NPU, TIER_CPU, TIER_DISK = "npu", "cpu", "disk"
TIERS = (TIER_NPU, TIER_CPU, TIER_DISK)

# Names seen from SGLang, vLLM, LMCache and Motor's conductor configuration.
_MEDIUM_TIERS = {
    "gpu": TIER_NPU,
    "npu": TIER_NPU,
    "xpu": TIER_NPU,
    "hbm": TIER_NPU,
    "device": TIER_NPU,
    "cpu": TIER_CPU,
    "cpu_pinned": TIER_CPU,
    "host": TIER_CPU,
    "memory": TIER_CPU,
    "disk": TIER_DISK,
    "external": TIER_DISK,
    "ssd": TIER_DISK,
    "nvme": TIER_DISK,
    "nof_ssd": TIER_DISK,
    "dfs": TIER_DISK,
}


def tier_of_medium(medium: str | None) -> str:
    """The tier of an event's medium (case-insensitive).

    ``None`` is device memory (engines before SGLang 0.5.9 only published HBM).  An unknown
    medium name maps to ``disk``: it is surely not HBM (every engine calls HBM ``GPU``), and
    the lowest tier never overstates a hit (Motor weighs disk 0 by default).
    """
    if medium is None:
        return TIER_NPU
    return _MEDIUM_TIERS.get(medium.lower(), TIER_DISK)


@dataclass(frozen=True)
class TierHit:
    """Blocks of a prompt one rank holds: NPU prefix, then CPU, then disk continuation."""

    npu_blocks: int
    cpu_blocks: int
    disk_blocks: int

    @property
    def total_blocks(self) -> int:
        return self.npu_blocks + self.cpu_blocks + self.disk_blocks
