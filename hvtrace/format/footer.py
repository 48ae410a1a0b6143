"""A Parquet footer's column statistics, read without pyarrow's decoder.

pyarrow decodes a column chunk's statistics in C++ where an exception cannot reach Python: a
crafted footer whose ``min``/``max`` of an integer column hold one byte instead of four or eight
aborts the whole process (``terminate called after throwing an instance of
'parquet::ParquetException'``, exit 134) the moment ``ColumnChunkMetaData.statistics`` is
touched. This module reads the footer's Thrift (compact protocol) itself, bounded in depth and
length, and returns each row group's statistics of the fixed-width integer columns as plain
integers, or says why the footer is unusable; nothing of pyarrow's statistics is ever decoded.

Part of the format (:mod:`hvtrace.format`): standard library only.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

#: The trailer of a Parquet file: the footer's length (4 bytes, little-endian) and ``PAR1``.
_TRAILER_BYTES: Final = 8
#: Longest footer read (hvtrace's are tens of kilobytes; 64 MiB is far past any real one).
MAX_FOOTER_BYTES: Final = 64 << 20
#: Deepest nesting of Thrift structures and lists accepted (the format's own is under 10).
_MAX_DEPTH: Final = 32

# Thrift compact protocol type codes
_BOOL_TRUE, _BOOL_FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY = 1, 2, 3, 4, 5, 6, 7, 8
_LIST, _SET, _MAP, _STRUCT = 9, 10, 11, 12

#: Parquet physical types of a fixed width: code -> bytes of a statistic (BOOLEAN, INT32, INT64,
#: INT96, FLOAT, DOUBLE).
_FIXED_WIDTHS: Final = {0: 1, 1: 4, 2: 8, 3: 12, 4: 4, 5: 8}
#: Physical types whose statistics are little-endian signed integers (INT32, INT64).
_INT_TYPES: Final = (1, 2)


class FooterError(ValueError):
    """The footer cannot be parsed, or states something no valid Parquet file does; ``group``:
    the first row group concerned (None: the whole footer)."""

    def __init__(self, msg: str, group: int | None = None) -> None:
        super().__init__(msg)
        self.group = group


@dataclass(frozen=True)
class ColumnStats:
    """One column chunk's statistics as far as they are usable (None: absent)."""

    min: int | None
    max: int | None
    null_count: int | None


class _Reader:
    """A bounded Thrift compact-protocol reader over ``buf``."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            raise FooterError("footer ends inside a value")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        out = shift = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 63:
                raise FooterError("varint longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def binary(self) -> bytes:
        n = self.varint()
        if n > len(self.buf) - self.pos:
            raise FooterError(f"a string of {n:,} bytes past the footer's end")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def value(self, kind: int, depth: int) -> Any:
        """Read one value of compact type ``kind``: ints, bytes, lists and ``{id: value}``."""
        if depth > _MAX_DEPTH:
            raise FooterError(f"nested over {_MAX_DEPTH} deep")
        if kind in (_BOOL_TRUE, _BOOL_FALSE):
            return kind == _BOOL_TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            self.pos += 8
            if self.pos > len(self.buf):
                raise FooterError("footer ends inside a value")
            return None
        if kind == _BINARY:
            return self.binary()
        if kind in (_LIST, _SET):
            head = self.byte()
            n, elem = head >> 4, head & 0x0F
            if n == 15:
                n = self.varint()
            if n > len(self.buf) - self.pos:  # every element takes at least one byte
                raise FooterError(f"a list of {n:,} elements past the footer's end")
            if elem in (_BOOL_TRUE, _BOOL_FALSE):
                return [self.byte() == _BOOL_TRUE for _ in range(n)]
            return [self.value(elem, depth + 1) for _ in range(n)]
        if kind == _MAP:
            n = self.varint()
            if n == 0:
                return {}
            if n > len(self.buf) - self.pos:
                raise FooterError(f"a map of {n:,} entries past the footer's end")
            kv = self.byte()
            return {
                _hashable(self.value(kv >> 4, depth + 1)): self.value(kv & 0x0F, depth + 1)
                for _ in range(n)
            }
        if kind == _STRUCT:
            return self.struct(depth + 1)
        raise FooterError(f"unknown Thrift type {kind}")

    def struct(self, depth: int) -> dict[int, Any]:
        out: dict[int, Any] = {}
        fid = 0
        while True:
            head = self.byte()
            if head == 0:
                return out
            delta, kind = head >> 4, head & 0x0F
            fid = fid + delta if delta else self.zigzag()
            out[fid] = self.value(kind, depth)


def _hashable(v: Any) -> Any:
    return repr(v) if isinstance(v, list | dict) else v


def parse_footer(raw: bytes) -> dict[int, Any]:
    """Parse a Parquet ``FileMetaData`` (Thrift compact) into ``{field id: value}``; raises
    :class:`FooterError`."""
    return _Reader(raw).struct(0)


def read_footer(path: str | os.PathLike) -> dict[int, Any]:
    """Read and parse the footer of the Parquet file at ``path``; raises :class:`FooterError`
    (or ``OSError``)."""
    with Path(path).open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size < 12:
            raise FooterError("too short for a Parquet file")
        f.seek(size - _TRAILER_BYTES)
        trailer = f.read(_TRAILER_BYTES)
        if trailer[4:] != b"PAR1":
            raise FooterError("no Parquet trailer")
        n = struct.unpack("<I", trailer[:4])[0]
        if n > min(size - 12, MAX_FOOTER_BYTES):
            raise FooterError(f"footer length {n:,} does not fit the file")
        f.seek(size - _TRAILER_BYTES - n)
        return parse_footer(f.read(n))


def _int_stat(value: Any, width: int, what: str, group: int) -> int | None:
    """A statistic of ``width`` bytes as a little-endian signed integer (None: absent); raises
    :class:`FooterError` when it holds another number of bytes."""
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) != width:
        n = len(value) if isinstance(value, bytes) else type(value).__name__
        raise FooterError(f"{what} statistic holds {n} bytes, not {width}", group)
    return int.from_bytes(value, "little", signed=True)


def column_stats(
    footer: dict[int, Any], columns: list[str], upto: int | None = None
) -> list[dict[str, ColumnStats]]:
    """Per row group, the statistics of the named top-level ``columns`` (min and max for an
    integer column only; a column the footer lacks is left out). Raises :class:`FooterError`
    when any statistic of a fixed-width column (of any name) does not have its type's width, as
    pyarrow (abort) and DuckDB (error) would find, or the footer's shape is not Parquet's.
    ``upto``: only the row groups before it."""
    out: list[dict[str, ColumnStats]] = []
    groups = footer.get(4, [])
    if not isinstance(groups, list):
        raise FooterError("row groups are not a list")
    for g, rg in enumerate(groups[:upto]):
        chunks = rg.get(1, []) if isinstance(rg, dict) else None
        if not isinstance(chunks, list):
            raise FooterError(f"row group {g} has no column list", g)
        stats: dict[str, ColumnStats] = {}
        for chunk in chunks:
            meta = chunk.get(3) if isinstance(chunk, dict) else None
            if not isinstance(meta, dict):
                continue
            path = meta.get(3)
            name = (
                b".".join(p for p in path if isinstance(p, bytes))
                if isinstance(path, list)
                else b""
            )
            what = f"row group {g}'s {name.decode('utf-8', 'replace')!r}"
            width = _FIXED_WIDTHS.get(meta.get(1))  # type: ignore[arg-type]
            st = meta.get(12)
            if not isinstance(st, dict):
                continue
            bounds = {
                k: _int_stat(st.get(k), width, f"{what} {'max' if k in (1, 5) else 'min'}", g)
                if width is not None
                else None
                for k in (1, 2, 5, 6)
            }
            if name.decode("utf-8", "replace") not in columns:
                continue
            lo = bounds[6] if bounds[6] is not None else bounds[2]
            hi = bounds[5] if bounds[5] is not None else bounds[1]
            if meta.get(1) not in _INT_TYPES or lo is None or hi is None:
                lo = hi = None
            nulls = st.get(3)
            stats[name.decode("utf-8", "replace")] = ColumnStats(
                lo, hi, nulls if isinstance(nulls, int) else None
            )
        out.append(stats)
    return out
