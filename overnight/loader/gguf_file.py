"""A GGUF file read: its header (metadata and tensor table) and its tensors' payloads dequantized to
float32 numpy arrays.

The header is parsed here with `struct` rather than `gguf.GGUFReader`: the reader builds a numpy view per
array element, which costs about 4 s for the 98k strings of a 49k-token vocabulary; this parser takes a
few tens of milliseconds. Tensor payloads stay memory-mapped and go through `gguf.quants.dequantize`.

File layout (GGUF v2/v3, little-endian):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 value type, value)           strings are u64 length + UTF-8 bytes
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32), then the tensor data; offsets are relative to it.

dims[0] is the fastest-varying axis, so the numpy shape is the reversed dims: [out, in] for a linear layer,
which is already HF's layout.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from overnight.errors import ModelLoadError

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES = {t: np.dtype(f) for t, f in _SCALAR_FORMATS.items()}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: reversed GGUF dims
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]  # arrays of numbers are lists, strings are str
    tensors: dict[str, GGUFTensorInfo]


class _Cursor:
    """Sequential little-endian reads over the mapped header."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        # Vocabularies hold byte pieces that are not valid UTF-8 on their own.
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type == GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if item_type == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(count)]
            dtype = _NUMPY_DTYPES[GGUFValueType(item_type)]
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return items.tolist()
        return self.scalar(_SCALAR_FORMATS[GGUFValueType(vtype)])


def read_gguf_file(path: str) -> GGUFFile:
    """Parse the header of a GGUF file (metadata and tensor table); cached per file version."""
    st = os.stat(path)
    return _read_gguf_file(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_gguf_file(path: str, size: int, mtime_ns: int) -> GGUFFile:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(
                f"{path}: GGUF version {version} is not supported (need 2 or 3, little-endian)"
            )
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
            cur.pos += 8 * n_dims
            raw.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in raw:
        ggml_type = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        nbytes = int(np.prod(dims)) // block_size * type_size
        tensors[name] = GGUFTensorInfo(name, ggml_type, tuple(reversed(dims)), data_start + offset, nbytes)
    return GGUFFile(path, metadata, tensors)


@functools.cache
def dequantizable(ggml_type: GGMLQuantizationType) -> bool:
    """Whether gguf.quants.dequantize reads this type (tried on one zero block)."""
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


def f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32: files store 1e-5 as 9.99999975e-06."""
    return float(str(np.float32(value)))


# Values dequantized per call: large enough to amortize numpy's per-call overhead, small enough that the
# temporaries stay in cache (whole-tensor calls on big embeddings are slower and need gigabytes).
_CHUNK_VALUES = 1 << 18


def dequantize_tensor(raw: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """A tensor's raw bytes -> a fresh, writable float32 array of its numpy shape."""
    block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
    out = np.empty(int(np.prod(info.shape)), dtype=np.float32)
    step_blocks = max(1, _CHUNK_VALUES // block_size)
    for first in range(0, out.size // block_size, step_blocks):
        n_blocks = min(step_blocks, out.size // block_size - first)
        chunk = raw[first * type_size : (first + n_blocks) * type_size]
        # One row of whole blocks; the quant kernels vectorize over the blocks of a row.
        values = dequantize(chunk.reshape(1, -1), info.ggml_type)
        out[first * block_size : (first + n_blocks) * block_size] = values.reshape(-1)
    return out.reshape(info.shape)


def read_tensor(data: np.ndarray, info: GGUFTensorInfo, path: str) -> np.ndarray:
    try:
        return dequantize_tensor(data[info.offset : info.offset + info.nbytes], info)
    except NotImplementedError as e:
        raise ModelLoadError(f"{path}: cannot dequantize {info.name} ({info.ggml_type.name}): {e}") from e
