"""``kv_events.publishers`` in ``/server_info``: the instance stream and its views, dialable.

The shape follows SGLang's open proposal (PR #38032: one ``{"dp_rank", "endpoint"}`` entry per
publisher) with fields that say what a fanned-in stream is: ``view`` (``instance``: every
rank's batches tagged with their ``dp_rank`` - ``dp_rank`` is null on the entry, the ranks
are ``dp_ranks``; ``folded``: the instance as one cache, every batch ``dp_rank`` 0),
``fanned_in`` (always true here: one endpoint serves every rank), ``replay_endpoint``,
``event_encoding`` and, on the folded view, ``replay_reply_frames`` (3: ``[b"", seq, payload]``).
A router that registers one endpoint per rank number takes the ``dp_rank`` 0 entry: the
folded view when it is configured (docs/wire.md, "Which view").

Hosts: a wildcard bind (``*``, ``0.0.0.0``, ``::``) is advertised with the HTTP server's host
when that one is specific; else it stays a wildcard and the consumer substitutes the host it
reached ``/server_info`` on (SGLang's rule for ``endpoint_host``).
"""

from __future__ import annotations

from typing import Any, Union

from sglang_kvpub.config import PluginConfig

__all__ = ["describe_publishers"]

_WILDCARDS = ("*", "0.0.0.0", "::", "[::]", "")


def _dialable(endpoint: Union[str, None], http_host: Union[str, None]) -> Union[str, None]:
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep:
        return endpoint
    if host in _WILDCARDS and http_host and http_host not in _WILDCARDS:
        host = http_host
    return f"tcp://{host}:{port}"


def describe_publishers(config: PluginConfig, dp_size: int, http_host: Union[str, None] = None) -> list[dict[str, Any]]:
    """The entries of ``kv_events.publishers`` for this instance."""
    publishers: list[dict[str, Any]] = [
        {
            "dp_rank": None,
            "dp_ranks": list(range(dp_size)),
            "endpoint": _dialable(config.endpoint, http_host),
            "replay_endpoint": _dialable(config.replay_endpoint, http_host),
            "view": "instance",
            "fanned_in": True,
            "event_encoding": config.event_encoding,
            "rank_order": config.rank_order,
            "topic": config.topic,
        }
    ]
    if config.folded_endpoint:
        publishers.append(
            {
                "dp_rank": 0,
                "endpoint": _dialable(config.folded_endpoint, http_host),
                "replay_endpoint": _dialable(config.folded_replay_endpoint, http_host),
                "view": "folded",
                "fanned_in": True,
                "event_encoding": config.folded_event_encoding or config.event_encoding,
                "replay_reply_frames": 3,
                "topic": config.topic,
            }
        )
    return publishers
