"""A structural walk of a GGUF file before mlx reads it.

`mx.load` trusts the header: random bytes after the magic crash the process (a segfault, seen
with mlx 0.32). Walking the header, the metadata and the tensor table here, checking each
length against the file size, turns a corrupt or truncated file into a ValueError instead.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from pathlib import Path

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

    def skip_strings(self, count: int) -> None:
        """Past count strings without copying them: a vocabulary's ~100k are the walk's whole
        cost, so this loop keeps to locals."""
        data, offset, end, unpack_from = self.data, self.offset, len(self.data), _U64.unpack_from
        for _ in range(count):
            next_offset = offset + 8 + unpack_from(data, offset)[0] if offset + 8 <= end else end + 1
            if next_offset > end:
                self.offset = offset
                self.skip(end - offset + 1)  # raises: the string at offset runs past the end
            offset = next_offset
        self.offset = offset


def check_gguf_structure(path: str | Path) -> frozenset[str]:
    """The names of the file's tensor types (Q4_K, F32, ...); ValueError naming the file unless its
    header, metadata and tensor table are whole."""
    with _mapped(path) as cursor:
        return _walk(cursor, len(cursor.data))


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


def _walk(cursor: _Cursor, file_size: int) -> frozenset[str]:
    path = cursor.path
    num_tensors, num_values = _header(cursor, file_size)
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(num_values):
        key = cursor.string()
        value_type = cursor.unpack("I")
        value = _skip_value(cursor, value_type)
        if key == b"general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    tensors = [_tensor_info(cursor) for _ in range(num_tensors)]
    data_start = -(-cursor.offset // alignment) * alignment
    for name, num_bytes, offset, _ in tensors:
        if data_start + offset + num_bytes > file_size:
            raise ValueError(f"GGUF {path}: truncated (tensor {name} ends at byte "
                             f"{data_start + offset + num_bytes}, the file has {file_size})")
    return frozenset(kind for *_, kind in tensors)


def _skip_value(cursor: _Cursor, value_type: int):
    if value_type in _SCALARS:
        return cursor.unpack(_SCALARS[value_type])
    if value_type == _STRING:
        cursor.skip_strings(1)
        return None
    if value_type == _ARRAY:
        item_type, count = cursor.unpack("I"), cursor.unpack("Q")
        if item_type in _SCALARS:
            cursor.take(count * struct.calcsize("<" + _SCALARS[item_type]))
        elif item_type == _STRING:
            cursor.skip_strings(count)
        else:
            raise ValueError(f"GGUF {cursor.path}: corrupt (array of value type {item_type})")
        return None
    raise ValueError(f"GGUF {cursor.path}: corrupt (metadata value type {value_type} at byte {cursor.offset})")


def _tensor_info(cursor: _Cursor) -> tuple[str, int, int, str]:
    """A tensor's name, bytes, offset in the data and type name."""
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
    return name, num_elements // block_size * type_size, offset, kind.name
