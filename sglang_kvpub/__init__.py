"""sglang-kvpub: one instance-level KV-event stream for all data-parallel ranks of an SGLang server.

Importing this package never imports SGLang or torch; the SGLang edge lives in
:mod:`sglang_kvpub.engine` and is loaded only inside SGLang processes.
"""

__version__ = "0.1.0"
