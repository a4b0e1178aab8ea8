"""The sockets a stream goes out on: its PUB and its replay ROUTER, set up one way for the
instance stream (:mod:`sglang_kvpub.publish.fanin`) and the folded view
(:mod:`sglang_kvpub.publish.folded_view`).

The PUB never blocks the publishing thread (``LINGER`` 0; its ``SNDHWM`` bounds what waits
for a slow subscriber, beyond which ZMQ drops).  The ROUTER sets ``ROUTER_MANDATORY``: a
reply to a reader whose queue is full is refused (``zmq.Again``) rather than silently
dropped, so :class:`~sglang_kvpub.publish.replay_jobs.ReplayJobs` can retry it later.
"""

from __future__ import annotations

from typing import Any

import zmq

from sglang_kvpub.config import should_bind
from sglang_kvpub.transport.curve import apply_server

__all__ = ["open_pub", "bind_replay_router"]

_ROUTER_HWM = 1000


def open_pub(
    context: zmq.Context[Any], endpoint: str, *, bind: bool | None, hwm: int, curve: Any
) -> tuple[zmq.Socket[bytes], bool]:
    """A PUB bound to ``endpoint``, or connected to it when ``bind`` says so
    (:func:`~sglang_kvpub.config.should_bind`); returns it and whether it connects."""
    pub: zmq.Socket[bytes] = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, hwm)
    pub.setsockopt(zmq.LINGER, 0)
    apply_server(pub, curve)
    connects = not should_bind(endpoint, bind)
    try:
        if connects:
            pub.connect(endpoint)
        else:
            pub.bind(endpoint)
    except zmq.ZMQError:
        pub.close(linger=0)
        raise
    return pub, connects


def bind_replay_router(context: zmq.Context[Any], endpoint: str, curve: Any) -> zmq.Socket[bytes]:
    """The replay ROUTER bound to ``endpoint``."""
    router: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, _ROUTER_HWM)
    router.setsockopt(zmq.LINGER, 0)
    apply_server(router, curve)
    try:
        router.bind(endpoint)
    except zmq.ZMQError:
        router.close(linger=0)
        raise
    return router
