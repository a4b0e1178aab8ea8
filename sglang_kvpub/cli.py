"""``sglang-kvpub`` (console script ``sglang_kvpub.cli:main``, and ``python -m sglang_kvpub.cli``).

A thin re-export kept at the documented path; the code lives in :mod:`sglang_kvpub.tools.cli`.
"""

import sys

from sglang_kvpub.tools.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
