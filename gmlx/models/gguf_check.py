"""A structural walk of a GGUF file before mlx reads it, and its metadata and tensor table read.

`mx.load` trusts the header: random bytes after the magic crash the process (a segfault, seen
with mlx 0.32). Walking the header, the metadata and the tensor table here, checking each
length against the file size, turns a corrupt or truncated file into a ValueError instead.

read_table reads the same walk's values: the gguf package's reader made a numpy view per
metadata item, ~20 us each, and a vocabulary is 100-400k strings (SmolLM2's 98k: 2.1-2.4 s, now 0.04).
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4
# GGUF metadata value types: id -> struct format of a scalar; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, data, path: Path):
        self.data, self.offset, self.path = data, 0, path

    def skip(self, num_bytes: int) -> int:
        """Move past num_bytes; returns where they start."""
        if num_bytes < 0 or self.offset + num_bytes > len(self.data):
            raise ValueError(f"GGUF {self.path}: corrupt or truncated (a field at byte {self.offset} "
                             f"runs past the end of the {len(self.data)}-byte file)")
        start = self.offset
        self.offset += num_bytes
        return start

    def take(self, num_bytes: int) -> bytes:
        start = self.skip(num_bytes)
        return self.data[start : self.offset]

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))[0]

    def string(self) -> bytes:
        return self.take(self.unpack("Q"))

    def strings(self, count: int, is_decoded: bool = True) -> list[str] | None:
        """The next count strings decoded as UTF-8 (ValueError naming the file where one is not), or
        with is_decoded False just past them, uncopied. A vocabulary's 100-400k strings are a walk's
        whole cost, so this loop keeps to locals."""
        data, offset, end, unpack_from = self.data, self.offset, len(self.data), _U64.unpack_from
        texts = [] if is_decoded else None
        try:
            for _ in range(count):
                start = offset + 8
                next_offset = start + unpack_from(data, offset)[0] if start <= end else end + 1
                if next_offset > end:
                    self.offset = offset
                    self.skip(end - offset + 1)  # raises: the string at offset runs past the end
                if is_decoded:
                    texts.append(data[start:next_offset].decode("utf-8"))
                offset = next_offset
        except UnicodeDecodeError:
            raise ValueError(f"GGUF {self.path}: corrupt (a string at byte {offset} is not UTF-8)") from None
        self.offset = offset
        return texts


@dataclass(frozen=True)
class TensorEntry:
    """A tensor as the file's table lists it."""

    name: str
    dims: tuple[int, ...]  # GGUF's order: the innermost (a row's values) first
    kind: str  # its type's name: F32, Q4_K, ...
    offset: int  # of its bytes in the file
    num_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Its dimensions outermost first, as numpy and mlx order them."""
        return tuple(reversed(self.dims))


def read_table(path: str | Path) -> tuple[dict, list[TensorEntry]]:
    """The file's metadata (key -> Python value: numbers, str, lists) and tensor table, with the
    checks of check_gguf_structure; ValueError naming the file where they fail."""
    with _mapped(path) as cursor:
        return _table(cursor, is_read=True)


def check_gguf_structure(path: str | Path) -> frozenset[str]:
    """The names of the file's tensor types (Q4_K, F32, ...); ValueError naming the file unless its
    header, metadata and tensor table are whole."""
    with _mapped(path) as cursor:
        return frozenset(tensor.kind for tensor in _table(cursor, is_read=False)[1])


def read_context_length(path: str | Path) -> int | None:
    """The model's context (metadata `<architecture>.context_length`), read without mlx (the HTTP
    gateway's process has none); None where the file does not say."""
    with _mapped(path) as cursor:
        num_tensors, num_values = _header(cursor, len(cursor.data))
        for _ in range(num_values):
            key = cursor.string()
            value = _skip_value(cursor, cursor.unpack("I"))
            if key.endswith(b".context_length") and isinstance(value, int) and value > 0:
                return value
    return None


@contextlib.contextmanager
def _mapped(path: str | Path):
    path = Path(path)
    with open(path, "rb") as file:
        if path.stat().st_size < 24:
            raise ValueError(f"GGUF {path}: corrupt or truncated (only {path.stat().st_size} bytes)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            yield _Cursor(data, path)


def _header(cursor: _Cursor, file_size: int) -> tuple[int, int]:
    """(tensors, metadata values) from the header, past it."""
    path = cursor.path
    if bytes(cursor.take(4)) != _MAGIC:
        raise ValueError(f"GGUF {path}: not a GGUF file (no GGUF magic at the start)")
    version = cursor.unpack("I")
    if version not in _VERSIONS:
        raise ValueError(f"GGUF {path}: corrupt or unsupported (format version {version})")
    num_tensors, num_values = cursor.unpack("Q"), cursor.unpack("Q")
    if num_tensors > file_size // 24 or num_values > file_size // 12:
        raise ValueError(f"GGUF {path}: corrupt ({num_tensors} tensors, {num_values} metadata values "
                         f"cannot fit in {file_size} bytes)")
    return num_tensors, num_values


def _table(cursor: _Cursor, is_read: bool) -> tuple[dict, list[TensorEntry]]:
    """The metadata (only general.alignment unless is_read: the rest skipped, not decoded) and the
    tensor table, each length checked against the file's."""
    file_size = len(cursor.data)
    num_tensors, num_values = _header(cursor, file_size)
    metadata = {}
    for _ in range(num_values):
        key = cursor.strings(1)[0]
        is_kept = is_read or key == "general.alignment"
        value = _value(cursor, cursor.unpack("I"), is_kept)
        if is_kept:
            metadata[key] = value
    alignment = metadata.get("general.alignment")
    alignment = alignment if isinstance(alignment, int) and alignment > 0 else _DEFAULT_ALIGNMENT
    infos = [_tensor_info(cursor) for _ in range(num_tensors)]
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = [TensorEntry(name, dims, kind, data_start + offset, num_bytes)
               for name, num_bytes, offset, kind, dims in infos]
    for tensor in tensors:
        if tensor.offset + tensor.num_bytes > file_size:
            raise ValueError(f"GGUF {cursor.path}: truncated (tensor {tensor.name} ends at byte "
                             f"{tensor.offset + tensor.num_bytes}, the file has {file_size})")
    return metadata, tensors


def _skip_value(cursor: _Cursor, value_type: int):
    """Past a metadata value: a scalar's value, None for a string or an array (not decoded)."""
    return _value(cursor, value_type, is_read=False)


def _value(cursor: _Cursor, value_type: int, is_read: bool):
    if value_type in _SCALARS:
        return cursor.unpack(_SCALARS[value_type])
    if value_type == _STRING:
        return cursor.strings(1)[0] if is_read else cursor.strings(1, is_decoded=False)
    if value_type == _ARRAY:
        item_type, count = cursor.unpack("I"), cursor.unpack("Q")
        if item_type in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[item_type])
            items = cursor.take(count * dtype.itemsize)
            return np.frombuffer(items, dtype=dtype).tolist() if is_read else None
        if item_type == _STRING:
            return cursor.strings(count, is_decoded=is_read)
        raise ValueError(f"GGUF {cursor.path}: corrupt (array of value type {item_type})")
    raise ValueError(f"GGUF {cursor.path}: corrupt (metadata value type {value_type} at byte {cursor.offset})")


def _tensor_info(cursor: _Cursor) -> tuple[str, int, int, str, tuple[int, ...]]:
    """A tensor's name, bytes, offset in the data, type name and dimensions (innermost first)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name = cursor.string().decode("utf-8", "replace")
    num_dims = cursor.unpack("I")
    if not 1 <= num_dims <= _MAX_DIMS:
        raise ValueError(f"GGUF {cursor.path}: corrupt (tensor {name} has {num_dims} dimensions)")
    dims = [cursor.unpack("Q") for _ in range(num_dims)]
    type_id = cursor.unpack("I")
    offset = cursor.unpack("Q")
    try:
        kind = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise ValueError(f"GGUF {cursor.path}: tensor {name} has unknown type {type_id}") from None
    num_elements = 1
    for dim in dims:
        num_elements *= dim
    return name, num_elements // block_size * type_size, offset, kind.name, tuple(dims)
