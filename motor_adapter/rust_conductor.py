"""What Motor's own Rust kv-conductor makes of SGLang's KV events (read from its sources, facts).

Motor 3.1 ships a Rust ``kv-conductor`` (``motor/kv_conductor/``).  Its event parser takes
positional arrays only; SGLang 0.5.20 and later publish ``KVCacheEvent`` as tagged maps, and so
does this plugin by default (``event_encoding: map``).  ``check-config`` says so, because nothing
else does: Motor only logs that its queries found nothing and falls back to load_balance.
"""

from __future__ import annotations

__all__ = ["RUST_CONDUCTOR_FIX", "RUST_CONDUCTOR_MESSAGE"]

RUST_CONDUCTOR_MESSAGE = (
    "Motor's own Rust kv-conductor (Motor 3.1, motor/kv_conductor) CANNOT read SGLang 0.5.20+ KV events - neither "
    "SGLang's own tagged-map events nor this plugin's stream (event_encoding map): every batch fails with "
    '"payload matches neither vLLM nor Mooncake batch format", nothing is indexed, and Motor falls back to '
    "load_balance. With event_encoding array it parses, but credits every event to the dp_rank it registered "
    "(the batch's dp_rank is dropped: one instance's ranks become one union) and replays only 3-frame replies"
)
RUST_CONDUCTOR_FIX = (
    "run this package's conductor where Motor's would run: `kv-conductor --host HOST --port PORT` "
    '(pip install "sglang-kvpub[motor]" in the conductor\'s image, the script linked into /usr/local/bin, '
    "/opt/motor/bin or the role script's ./ - docs/motor.md), or `motor-kv-adapter serve`; Motor's "
    "coordinator needs no change"
)
