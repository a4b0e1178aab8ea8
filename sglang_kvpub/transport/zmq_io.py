"""Frame I/O on the hot paths, without pyzmq's per-call Python layer.

pyzmq's ``Socket.send`` / ``recv_multipart`` are Python wrappers around the compiled
backend socket (keyword handling, flag enums, an ``RCVMORE`` query per frame): about
1 us per frame sent and 7 us per 3-frame message received on this machine kind, against
0.3 us per frame for the backend methods they end up calling.  At thousands of batches
per second through the fan-in that difference is a fifth of its CPU, so the rank
publisher and the fan-in call the backend methods directly on their sockets (pyzmq's
``Socket`` *is* a backend socket: same object, same semantics, same exceptions -
``zmq.Again`` when a ``NOBLOCK`` call cannot proceed).

Flags are plain ints for the same reason: ``zmq.SNDMORE | zmq.NOBLOCK`` builds an enum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq
from zmq.backend import Socket as _BackendSocket

__all__ = ["NOBLOCK", "MORE_NOBLOCK", "send_frame", "recv_frame"]

NOBLOCK = int(zmq.NOBLOCK)
MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)

# ``send_frame(socket, data, flags)`` / ``recv_frame(socket, flags) -> bytes``
send_frame: Callable[[Any, bytes, int], Any] = _BackendSocket.send
recv_frame: Callable[[Any, int], bytes] = _BackendSocket.recv
