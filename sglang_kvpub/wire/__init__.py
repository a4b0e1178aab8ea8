"""The instance-stream contract and its codec (``sglang_kvpub.wire``, the documented import path).

Everything a consumer of the stream needs is importable from here: the contract
(:mod:`~sglang_kvpub.wire.contract`), the codec beside it (:mod:`~sglang_kvpub.wire.codec`)
and tool output (:mod:`~sglang_kvpub.wire.tool_json`).
"""

from sglang_kvpub.wire.codec import *  # noqa: F403
from sglang_kvpub.wire.codec import __all__ as _codec_all
from sglang_kvpub.wire.contract import *  # noqa: F403
from sglang_kvpub.wire.contract import __all__ as _contract_all
from sglang_kvpub.wire.rank_order import *  # noqa: F403
from sglang_kvpub.wire.rank_order import __all__ as _order_all
from sglang_kvpub.wire.removal import *  # noqa: F403
from sglang_kvpub.wire.removal import __all__ as _removal_all
from sglang_kvpub.wire.tool_json import *  # noqa: F403
from sglang_kvpub.wire.tool_json import __all__ as _json_all

__all__ = [*_contract_all, *_codec_all, *_order_all, *_removal_all, *_json_all]
