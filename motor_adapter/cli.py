"""``motor-kv-adapter`` (console script ``motor_adapter.cli:main``, and ``python -m motor_adapter.cli``).

A thin re-export kept at the documented path; the code lives in :mod:`motor_adapter.tools.cli`.
"""

import sys

from motor_adapter.tools.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
