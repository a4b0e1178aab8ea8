"""motor_adapter: the router half - subscribes to instance streams, indexes prefixes per
(instance, dp_rank, medium), and scores them the way Motor's kv_cache_affinity does.

It uses the shared core of :mod:`sglang_kvpub` (wire, hashing, index) and never imports
SGLang or torch.
"""

__version__ = "0.1.0"
