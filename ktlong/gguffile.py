"""A light reader for GGUF files: metadata on demand, tensors as views of one memory mapping.

gguf's own `GGUFReader` makes a NumPy object for every element of every metadata array: for a
262K-entry vocabulary with 515K merges (Gemma 3) that is ~10 s and ~0.7 GB at its peak, paid on
every load. This reader walks the header once, keeps each field as a byte range of the mapping and
decodes a value only when it is asked for. Fields and tensors answer the parts of `GGUFReader`'s
interface that ktlong uses (`get_field(...).contents()`, `tensors`, `data`, `data_offset`).
"""

from __future__ import annotations

import os
import struct
from array import array
from typing import Any

import numpy as np

MAGIC = 0x46554747  # b"GGUF" read little-endian
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# value type -> struct format (little-endian) for the fixed-size types
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
          10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}


class Field:
    """One metadata entry: its key, its value type and where its bytes lie in the file."""

    def __init__(self, buf: Any, name: str, start: int, value: int, end: int, vtype: int,
                 sub: int = -1, count: int = 1, offsets: array | None = None) -> None:
        self._buf = buf
        self.name, self.start, self.value, self.end = name, start, value, end
        self.vtype, self.sub, self.count = vtype, sub, count
        self._offsets = offsets  # string arrays: each element's start (its u64 length)

    def __len__(self) -> int:
        return self.count

    def raw(self) -> bytes:
        """The field's bytes as stored: key, type and value (what gguf's `parts` join to)."""
        return bytes(self._buf[self.start:self.end])

    def contents(self, index: int | None = None) -> Any:
        """The value (a list for arrays), or one element of an array."""
        if self.vtype == STRING:
            return _string(self._buf, self.value)[0]
        if self.vtype != ARRAY:
            return struct.unpack_from(_FIXED[self.vtype], self._buf, self.value)[0]
        if self.sub == STRING:
            assert self._offsets is not None
            if index is not None:
                return _string(self._buf, self._offsets[index])[0]
            return [_string(self._buf, o)[0] for o in self._offsets]
        values = np.frombuffer(self._buf, _NUMPY[self.sub], self.count, self.value + 12)
        return values[index].item() if index is not None else values.tolist()


class Tensor:
    """One tensor's description and its data as a view of the mapping: [rows, row_bytes] uint8 for
    block-quantised types, the element type otherwise (GGUFReader's shapes)."""

    def __init__(self, name: str, dims: tuple[int, ...], ggml_type: int, data_offset: int,
                 mapping: np.ndarray) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.name = name
        self.tensor_type = GGMLQuantizationType(ggml_type)
        self.shape = np.array(dims, np.uint64)  # ggml order: shape[0] is the row length
        self.n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, size = GGML_QUANT_SIZES[self.tensor_type]
        self.n_bytes = self.n_elements * size // block
        self.data_offset = data_offset
        np_dims = tuple(reversed(dims))
        plain = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}.get(self.tensor_type.name)
        if plain is None:
            np_dims, plain = quant_shape_to_byte_shape(np_dims, self.tensor_type), np.uint8
        self._mapping, self._dtype, self._np_dims = mapping, plain, np_dims

    @property
    def data(self) -> np.ndarray:
        end = self.data_offset + self.n_bytes
        return self._mapping[self.data_offset:end].view(self._dtype).reshape(self._np_dims)


class GGUFFile:
    """A GGUF file's header (fields by key, tensors in file order) over a read-only mapping."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.data = np.memmap(path, mode="r")  # uint8 [file bytes]
        buf = memoryview(self.data)  # type: ignore[arg-type]
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != MAGIC:
            raise ValueError("GGUF magic invalid")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} (big-endian or unknown) is not supported")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self.fields: dict[str, Field] = {}
        off = 24
        for _ in range(n_kv):
            field = _read_field(buf, off)
            self.fields[field.name] = field
            off = field.end
        infos = []
        for _ in range(n_tensors):
            name, off = _string(buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            ggml_type, rel = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            infos.append((name, dims, ggml_type, rel))
        align = self.fields.get("general.alignment")
        alignment = int(align.contents()) if align is not None else 32
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid alignment {alignment}: must be a power of two")
        self.data_offset = off + (-off) % alignment  # where the tensors' data begins
        self.tensors = [Tensor(name, dims, t, self.data_offset + rel, self.data)
                        for name, dims, t, rel in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)


def _string(buf: Any, off: int) -> tuple[str, int]:
    """(the u64-length-prefixed UTF-8 string at `off`, the offset after it)."""
    (n,) = struct.unpack_from("<Q", buf, off)
    end = off + 8 + n
    if end > len(buf):
        raise ValueError("a string runs past the end of the file")
    return str(buf[off + 8:end], "utf-8", errors="replace"), end


def _read_field(buf: Any, start: int) -> Field:
    (n,) = struct.unpack_from("<Q", buf, start)
    name = str(buf[start + 8:start + 8 + n], "utf-8")
    value = start + 8 + n + 4
    (vtype,) = struct.unpack_from("<I", buf, value - 4)
    if vtype in _FIXED:
        return Field(buf, name, start, value, value + struct.calcsize(_FIXED[vtype]), vtype)
    if vtype == STRING:
        return Field(buf, name, start, value, _string(buf, value)[1], vtype)
    if vtype != ARRAY:
        raise ValueError(f"field {name} has unknown value type {vtype}")
    sub, count = struct.unpack_from("<IQ", buf, value)
    off = value + 12
    if sub in _FIXED:
        end = off + count * struct.calcsize(_FIXED[sub])
        if end > len(buf):
            raise ValueError(f"field {name} runs past the end of the file")
        return Field(buf, name, start, value, end, vtype, sub, count)
    if sub != STRING:
        raise ValueError(f"field {name} is an array of type {sub}, which GGUF does not define")
    offsets = array("q", bytes(8 * count))
    unpack, size = struct.Struct("<Q").unpack_from, len(buf)
    for i in range(count):
        offsets[i] = off
        off += 8 + unpack(buf, off)[0]
        if off > size:
            raise ValueError(f"field {name} runs past the end of the file")
    return Field(buf, name, start, value, off, vtype, sub, count, offsets)
