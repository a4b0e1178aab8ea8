"""A store's ``token_ids`` kept as the msgpack array they arrived as: no Python int per id.

:class:`RawStored` is the contract's store (:class:`~sglang_kvpub.wire.contract.StoredFields`)
with ``token_ids`` left as msgpack bytes, for decoders given a ``token_ids`` reader and the
plugin's residency tracker (``core.residency``); :class:`MsgpackIds` is what such a reader
makes of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Union, overload

import msgspec

from sglang_kvpub.wire.contract import StoredFields

__all__ = ["MsgpackIds", "RawStored", "TokenReader"]


class RawStored(StoredFields[msgspec.Raw], tag="BlockStored", gc=False):
    """A ``BlockStored`` map whose ``token_ids`` stay msgpack bytes (an empty array by default)."""

    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")


TokenReader = Callable[[msgspec.Raw], Union[Sequence[int], None]]
_IDS = msgspec.msgpack.Decoder(list[int])


class MsgpackIds(Sequence[int]):
    """A stored event's ``token_ids`` kept as the msgpack array they arrived as (``raw``),
    ``length`` ids long: no Python int per id, no copy of the ids (the bytes are a view of the
    payload).  A ``Sequence[int]`` like the list it stands for (items and slices decode the
    array on each call: for tools and tests); the index reads ``raw`` in C
    (``hashing.tokens_u32``), and the encoder writes ``raw`` as it is, so a re-encoded batch
    has the bytes it came with.  Built by a decoder's ``token_ids`` reader that checked every
    id (``hashing.token_ids_from_msgpack``)."""

    __slots__ = ("length", "raw")

    def __init__(self, raw: msgspec.Raw, length: int) -> None:
        self.raw = raw
        self.length = length

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return _IDS.decode(self.raw)[index]

    def __iter__(self) -> Iterator[int]:
        return iter(_IDS.decode(self.raw))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MsgpackIds):
            return bytes(self.raw) == bytes(other.raw)
        return isinstance(other, list) and list(self) == other

    __hash__ = None  # type: ignore[assignment]  # equal to a list: unhashable like one

    def __repr__(self) -> str:
        return f"MsgpackIds({list(self)!r})"
