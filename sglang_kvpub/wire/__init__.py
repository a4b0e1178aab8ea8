"""The instance-stream contract and its codec (``sglang_kvpub.wire``, the documented import path).

Everything a consumer of the stream needs is importable from here; the code lives in
:mod:`sglang_kvpub.wire.codec`.
"""

from sglang_kvpub.wire.codec import *  # noqa: F403
from sglang_kvpub.wire.codec import __all__ as __all__
