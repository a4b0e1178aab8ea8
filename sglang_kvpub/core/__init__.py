"""The engine-neutral core: block hashing, the prefix index, residency, dispatch policy.

Shared by the plugin and the router; imports none of SGLang, torch, ZMQ or aiohttp
(``tests/docs/test_boundaries.py`` checks it).
"""
