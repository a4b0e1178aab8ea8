"""Which ``--load-balance-method`` SGLang runs when the plugin dispatches, and why.

The plugin's cache-aware dispatch hooks SGLang's ``round_robin`` / ``total_requests`` /
``total_tokens`` controller methods.  SGLang 0.5.23 resolves ``--load-balance-method auto``
to ``follow_bootstrap_room`` on a ``--disaggregation-mode prefill`` server: the rank is
``bootstrap_room % dp_size`` and the decode derives it the same way, so a rank chosen by
content would break the pairing ("follow_bootstrap_room conflict", HTTP 500).

So on a PD prefill with ``auto`` the launcher declares ``round_robin`` instead (one
resolution, before SGLang publishes its config, so the DP controller, the prefill
schedulers' KV senders and the bootstrap server all read the same method).  With any
method other than ``follow_bootstrap_room`` each prefill request registers its real rank
with the bootstrap server (``/register_dp_rank``) and the decode, told the method by that
server, asks for it (``/query_dp_ranks``): the decode pairs with the rank the dispatcher
chose.  An explicit ``--load-balance-method follow_bootstrap_room`` is the operator's
choice: dispatch stays off and says so (start line, ``/server_info``, ``check-config``).

Pure: no SGLang import; :func:`plan_dispatch` is called by the launcher hook
(engine/plugin.py), the DP controller, ``/server_info``, ``sglang-kvpub check-config`` and
``motor-kv-adapter check-config`` (motor_adapter/config_check.py).
See docs/dispatch.md ("PD prefill and decode").
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "AUTO",
    "FOLLOW_BOOTSTRAP_ROOM",
    "HOOKED_METHODS",
    "PD_PREFILL_METHOD",
    "DispatchPlan",
    "plan_dispatch",
    "sglang_auto_method",
]

AUTO = "auto"
FOLLOW_BOOTSTRAP_ROOM = "follow_bootstrap_room"
# The controller methods the dispatch hook wraps (engine/dispatch_hook.py DISPATCH_TARGETS).
HOOKED_METHODS = frozenset({"round_robin", "total_requests", "total_tokens"})
# What the launcher declares on a PD prefill whose method is ``auto``: SGLang's non-PD
# default, which the hook replaces and which falls back to plain round robin if the
# dispatcher switches itself off (guard.py).
PD_PREFILL_METHOD = "round_robin"

_PD_PAIRING = "each request registers its rank with the bootstrap server, and the decode queries it"
_PD_AUTO = (
    f"PD prefill: --load-balance-method auto resolved to {PD_PREFILL_METHOD}, not follow_bootstrap_room; {_PD_PAIRING}"
)


def sglang_auto_method(disaggregation_mode: str | None) -> str:
    """What SGLang 0.5.23 resolves ``auto`` to (``arg_groups/serving_hook.py``)."""
    return FOLLOW_BOOTSTRAP_ROOM if disaggregation_mode == "prefill" else "round_robin"


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """The outcome for one server: is cache-aware dispatch on, under which method, why."""

    on: bool
    method: str  # the load-balance method SGLang's DP controller runs
    switch_to: str | None  # the launcher declares this method; None: leave SGLang's
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {"on": self.on, "load_balance_method": self.method, "reason": self.reason}

    def line(self) -> str:
        state = "on" if self.on else "off"
        return f"cache-aware DP dispatch {state} (--load-balance-method {self.method}): {self.reason}"


def plan_dispatch(
    *,
    dp_dispatch: str,
    requested_method: str | None,
    disaggregation_mode: str | None,
    num_dp_ranks: int,
    resolved_method: str | None = None,
    switchable: bool = True,
) -> DispatchPlan:
    """Decides dispatch for a server.

    ``requested_method``: the operator's ``--load-balance-method`` (``auto`` when not
    given); ``resolved_method``: what SGLang's config says now (``None``: not resolved yet,
    derived from ``requested_method`` as SGLang would).  A method already switched by the
    launcher (requested ``auto``, resolved ``round_robin`` on a prefill) reads as on.
    ``switchable``: False where the method can no longer change (a running DP controller).
    """
    requested = (requested_method or AUTO).lower()
    derived = sglang_auto_method(disaggregation_mode) if requested == AUTO else requested
    resolved = (resolved_method or derived).lower()
    prefill = disaggregation_mode == "prefill"
    if dp_dispatch != "cache_aware":
        return DispatchPlan(False, resolved, None, f'dp_dispatch "{dp_dispatch}": SGLang\'s method dispatches')
    if num_dp_ranks <= 1:
        return DispatchPlan(False, resolved, None, "one DP rank: nothing to choose")
    if resolved == FOLLOW_BOOTSTRAP_ROOM:
        if requested == AUTO and prefill and switchable:
            return DispatchPlan(True, PD_PREFILL_METHOD, PD_PREFILL_METHOD, _PD_AUTO)
        if requested == AUTO:
            return DispatchPlan(
                False,
                resolved,
                None,
                "SGLang's controller runs follow_bootstrap_room: the launcher did not switch auto "
                "(the plugin was not enabled in the launching process, or its check failed: see its log)",
            )
        return DispatchPlan(
            False,
            resolved,
            None,
            "--load-balance-method follow_bootstrap_room was asked for: the rank is bootstrap_room % dp_size "
            "(leave it unset, or set round_robin, for cache-aware dispatch)",
        )
    if resolved not in HOOKED_METHODS:
        return DispatchPlan(False, resolved, None, f"--load-balance-method {resolved} is not hooked by sglang_kvpub")
    if prefill and requested == AUTO:
        reason = _PD_AUTO
    elif prefill:
        reason = f"PD prefill: {_PD_PAIRING}"
    else:
        reason = "requests with a routed_dp_rank keep it"
    return DispatchPlan(True, resolved, None, reason)
