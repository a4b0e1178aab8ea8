"""SGLang's entry point ``sglang_kvpub.plugin:register`` (group ``sglang.srt.plugins``).

A thin re-export kept at the path operators and SGLang's loader know; the code lives in
:mod:`sglang_kvpub.engine.plugin`.
"""

from sglang_kvpub.engine.plugin import *  # noqa: F403
from sglang_kvpub.engine.plugin import __all__ as __all__
