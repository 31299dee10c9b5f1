"""Read a TensorFlow checkpoint (tensor bundle V2) without TensorFlow.

A checkpoint ``PREFIX`` is ``PREFIX.index`` plus ``PREFIX.data-<i>-of-<n>``. The index is a
LevelDB-format table (sorted string keys -> values, in blocks) whose values are
``BundleEntryProto`` messages: dtype, shape, which data file, byte offset and size; the
entry with the empty key is the ``BundleHeaderProto`` (number of data files, byte order).
The data files hold each tensor's raw little-endian bytes. This module decodes exactly that
much (uncompressed tables, whole tensors, numeric dtypes), which is what ``tf.train.Saver``
writes, the MLPerf phase-1 checkpoint included, and so spares users a 600 MB install to
convert one file. Anything else raises ``BundleError``; the caller may then try TensorFlow.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np

_TABLE_MAGIC = 0xDB4775248B80FB57  # LevelDB table footer magic, little-endian fixed64
_FOOTER = 48  # two block handles padded to 40 bytes + 8 bytes of magic
# TensorFlow DataType enum -> numpy dtype (little-endian); the numeric types weights use.
_DTYPES = {1: "<f4", 2: "<f8", 3: "<i4", 4: "u1", 5: "<i2", 6: "i1", 9: "<i8", 10: "?", 17: "<u2", 19: "<f2",
           22: "<u4", 23: "<u8"}


class BundleError(ValueError):
    """The file is not a checkpoint this reader understands; names the file."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(buf):
            raise IndexError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _proto_fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: ints for varint/fixed, bytes for length-delimited."""
    out, pos = [], 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            v, pos = _varint(buf, pos)
        elif wire == 1:
            v, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        elif wire == 5:
            v, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        elif wire == 2:
            n, pos = _varint(buf, pos)
            v, pos = buf[pos:pos + n], pos + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((field, v))
    return out


def _block(data: bytes, handle: bytes, where: str) -> bytes:
    offset, p = _varint(handle, 0)
    size, _ = _varint(handle, p)
    if offset + size + 5 > len(data):
        raise BundleError(f"{where}: block at {offset}+{size} runs past the end of the file (truncated?)")
    if data[offset + size] != 0:  # trailer: compression type, then a masked crc32c
        raise BundleError(f"{where}: compressed table block (type {data[offset + size]}); not supported here")
    return data[offset:offset + size]


def _block_entries(block: bytes) -> list[tuple[bytes, bytes]]:
    num_restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end = len(block) - 4 - 4 * num_restarts
    out, pos, key = [], 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        vlen, pos = _varint(block, pos)
        key = key[:shared] + block[pos:pos + unshared]  # keys are prefix-compressed
        pos += unshared
        out.append((key, block[pos:pos + vlen]))
        pos += vlen
    return out


def read_index(index_path: str | Path) -> dict[str, bytes]:
    """All (key, value) pairs of a bundle's ``.index`` table."""
    where = str(index_path)
    data = Path(index_path).read_bytes()
    if len(data) < _FOOTER or struct.unpack_from("<Q", data, len(data) - 8)[0] != _TABLE_MAGIC:
        raise BundleError(f"{where}: not a TensorFlow checkpoint index (bad table footer)")
    try:
        footer = data[-_FOOTER:]
        _, p = _varint(footer, 0)  # metaindex handle (unused: no filters in a bundle)
        _, p2 = _varint(footer, p)
        index_handle = footer[p2:]
        entries: dict[str, bytes] = {}
        for _, handle in _block_entries(_block(data, index_handle, where)):
            for key, value in _block_entries(_block(data, handle, where)):
                entries[key.decode("utf-8")] = value
        return entries
    except (IndexError, struct.error, UnicodeDecodeError) as e:
        raise BundleError(f"{where}: corrupt checkpoint index ({e})") from None


def read_bundle(prefix: str | Path, keep: Callable[[str], bool] | None = None) -> dict[str, np.ndarray]:
    """The tensors of checkpoint ``prefix`` (those ``keep`` accepts) as numpy arrays.

    Reads only the bytes of the kept tensors (the phase-1 checkpoint is 3x the model:
    its optimizer slots need not be read to import the weights).
    """
    prefix = str(prefix)
    entries = read_index(prefix + ".index")
    header = dict(_proto_fields(entries.pop("", b"")))
    num_shards = int(header.get(1, 1))
    if header.get(2, 0) != 0:
        raise BundleError(f"{prefix}.index: big-endian checkpoint; not supported here")
    out = {}
    files: dict[int, BinaryIO] = {}
    try:
        for name, value in entries.items():
            if keep is not None and not keep(name):
                continue
            try:
                f = dict(_proto_fields(value))
            except (IndexError, ValueError, struct.error) as e:
                raise BundleError(f"{prefix}.index: entry {name!r} is corrupt ({e})") from None
            if 7 in f:
                raise BundleError(f"{prefix}: tensor {name!r} is stored in slices; not supported here")
            dtype = _DTYPES.get(int(f.get(1, 0)))
            if dtype is None:
                raise BundleError(f"{prefix}: tensor {name!r} has TF dtype {f.get(1)}; not a numeric type read here")
            dims = [dict(_proto_fields(d)).get(1, 0) for k, d in _proto_fields(f.get(2, b"")) if k == 2]
            shard, offset, size = int(f.get(3, 0)), int(f.get(4, 0)), int(f.get(5, 0))
            if shard not in files:
                path = Path(f"{prefix}.data-{shard:05d}-of-{num_shards:05d}")
                try:
                    files[shard] = path.open("rb")
                except OSError as e:
                    raise BundleError(f"{path}: cannot read checkpoint data ({e.strerror})") from None
            files[shard].seek(offset)
            raw = files[shard].read(size)
            count = int(np.prod(dims)) if dims else 1
            if len(raw) != size or size != count * np.dtype(dtype).itemsize:
                raise BundleError(f"{prefix}: tensor {name!r}: {len(raw)} bytes at {offset}, expected "
                                  f"{count * np.dtype(dtype).itemsize} for shape {dims} (truncated data file?)")
            out[name] = np.frombuffer(raw, dtype=dtype).reshape(dims).copy()
    finally:
        for fh in files.values():
            fh.close()
    return out
