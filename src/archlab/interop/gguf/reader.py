"""A GGUF file's header, read with every count and offset checked against the file's size first.

GGUF (llama.cpp's format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    magic "GGUF" | version u32 (2, 3) | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value type u32, value)        string = length u64 + UTF-8 bytes
    tensor_count x (name: string, n_dims u32, dims u64 x n_dims (fastest first), ggml type u32, offset u64)
    padding to `general.alignment` (default 32), then the tensor data, each at data start + offset

`gguf.GGUFReader` trusts the header: a huge array length makes it loop (and allocate) element by element,
a short file gives IndexErrors. This reader checks each claim against the bytes that remain before it
reads or allocates anything, refuses what it cannot hold as one GGUFError naming the file and the problem,
and reads arrays of numbers in one step (the 262k-entry vocabularies take milliseconds). Tensor data stay in
the file (np.memmap) until `dequantized(name)` asks for one; reading never runs code.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from archlab.errors import UserError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                      # GGML_MAX_DIMS

# value type -> struct format of a scalar (GGUF is little-endian); 8 = string, 9 = array
FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
SCALARS = {kind: np.dtype(fmt) for kind, fmt in FORMATS.items()}
STRING, ARRAY, BOOL, FLOAT32 = 8, 9, 7, 6


class GGUFError(UserError, ValueError):
    """A file that is not a GGUF file archlab can read; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: `shape` in PyTorch order (slowest first; GGUF lists dims fastest first)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int                   # absolute, in the file
    n_bytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(self.ggml_type).name


class _Cursor:
    """Reads the header from the file's bytes (a memory map); every read is checked against the end first."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {problem}")

    def _need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, but the file ends at {self.size} "
                            "(truncated, or the header lies)")

    def scalar(self, fmt: str, what: str) -> Any:
        self._need(struct.calcsize(fmt), what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", what))

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self._need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None

    def value(self, kind: int, key: str) -> Any:
        if kind == STRING:
            return self.string(f"the value of {key}")
        if kind in SCALARS:
            v = self.scalar(FORMATS[kind], f"the value of {key}")
            if kind == FLOAT32:      # the shortest decimal that is this float32: 1e-05, not 9.99999974738e-06
                return float(str(np.float32(v)))
            return bool(v) if kind == BOOL else v
        if kind != ARRAY:
            raise self.fail(f"metadata {key} has unknown value type {kind}")
        item = self.u32(f"the element type of {key}")
        count = self.u64(f"the length of {key}")
        if item in SCALARS:
            dtype = SCALARS[item]
            n = count * dtype.itemsize
            self._need(n, f"{key} ({count} elements)")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += n
            return values.astype(bool) if item == BOOL else values
        if item == STRING:
            if count * 8 > self.size - self.pos:     # each string holds at least its 8-byte length
                raise self.fail(f"{key} claims {count} strings, more than the {self.size - self.pos} bytes "
                                "left in the file can hold")
            return [self.string(f"{key}[{i}]") for i in range(count)]
        raise self.fail(f"metadata {key} is an array of type {item}, which archlab does not read "
                        "(nested arrays are not used by llama.cpp's models)")


class GGUFFile:
    """The header of a GGUF file (`metadata`, `tensors` by name) and lazy access to its tensor data.

    Example: f = GGUFFile("model.gguf"); f.metadata["general.architecture"] -> 'llama';
    f.dequantized("token_embd.weight").shape -> torch.Size([49152, 576])"""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.is_dir():
            raise GGUFError(f"{self.path}: a folder, not a GGUF file")
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path}: not a GGUF file ({size} bytes, shorter than a GGUF header)")
        with open(self.path, "rb") as fh:
            if fh.read(4) != MAGIC:
                raise GGUFError(f"{self.path}: not a GGUF file (it does not start with the bytes 'GGUF')")
        with open(self.path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._map, dtype=np.uint8)       # the tensor data, read where they lie
        cur = _Cursor(memoryview(self._map), self.path)
        cur.pos = 4
        self.version = cur.u32("the version")
        if self.version not in VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            hint = " (a big-endian file, which archlab does not read)" if swapped in VERSIONS else ""
            raise cur.fail(f"GGUF version {self.version} is not supported (supported: 2, 3){hint}")
        n_tensors, n_kv = cur.u64("the tensor count"), cur.u64("the metadata count")
        # each entry takes at least 13 (metadata) or 24 (tensor) bytes: refuse counts the file cannot hold
        if n_kv * 13 + n_tensors * 24 > size:
            raise cur.fail(f"the header claims {n_tensors} tensors and {n_kv} metadata entries, more than "
                           f"{size} bytes can hold (truncated, or the header lies)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("a metadata key")
            if key in self.metadata:
                raise cur.fail(f"metadata key {key!r} appears twice")
            self.metadata[key] = cur.value(cur.u32(f"the type of {key}"), key)
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment={alignment!r} is not a power of two")
        start = -(-cur.pos // alignment) * alignment           # the data start after the header's padding
        self.tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, shape, offset in infos:
            if name in self.tensors:
                raise cur.fail(f"tensor {name!r} appears twice")
            self.tensors[name] = info = self._placed(cur, name, ggml_type, shape, start, offset, alignment)
            if info.offset + info.n_bytes > size:
                raise cur.fail(f"tensor {name} ({info.n_bytes} bytes at offset {info.offset}) lies past the end "
                               f"of the file ({size} bytes): truncated, or the header lies")

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, int, tuple[int, ...], int]:
        name = cur.string("a tensor name")
        n_dims = cur.u32(f"the dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
        dims = [cur.u64(f"a dimension of tensor {name}") for _ in range(n_dims)]
        ggml_type, offset = cur.u32(f"the type of tensor {name}"), cur.u64(f"the offset of tensor {name}")
        return name, ggml_type, tuple(reversed(dims)), offset

    @staticmethod
    def _placed(cur: _Cursor, name: str, ggml_type: int, shape: tuple[int, ...], start: int, offset: int,
                alignment: int) -> TensorInfo:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise cur.fail(f"tensor {name} has unknown tensor type {ggml_type}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise cur.fail(f"tensor {name} has tensor type {qtype.name}, which has no known block size")
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if any(d == 0 for d in shape) or math.prod(shape) > 2**50:
            raise cur.fail(f"tensor {name} has impossible dimensions {list(reversed(shape))}")
        if shape[-1] % block:
            raise cur.fail(f"tensor {name}: its rows of {shape[-1]} values do not fill whole {qtype.name} blocks "
                           f"of {block}")
        if offset % alignment:
            raise cur.fail(f"tensor {name}'s offset {offset} is not a multiple of the alignment {alignment}")
        return TensorInfo(name, ggml_type, shape, start + offset, math.prod(shape) // block * block_bytes)

    def field(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        """Metadata `key` (default when absent), which must be of `kind` (int, float, str, bool, list or
        np.ndarray); a GGUFError names it otherwise."""
        if key not in self.metadata:
            return default
        value = self.metadata[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            want = " or ".join(k.__name__ for k in kinds)
            raise GGUFError(f"{self.path}: metadata {key}={_short(value)} is not a {want}")
        return value

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` (a memory-mapped view), shaped as gguf.quants expects."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        view = self.data[info.offset:info.offset + info.n_bytes]
        return view.reshape(quant_shape_to_byte_shape(info.shape, qtype))

    def dequantized(self, name: str) -> torch.Tensor:
        """Tensor `name` as float32 (Q4_0 ... Q8_0, K-quants, F16, BF16, F32: gguf.quants.dequantize), a
        GGUFError naming it when its type has no dequantizer or its values are not finite."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        try:
            values = dequantize(self.raw(name), GGMLQuantizationType(info.ggml_type)).astype(np.float32, copy=False)
        except NotImplementedError:
            raise GGUFError(f"{self.path}: tensor {name} has type {info.type_name}, "
                            "which archlab cannot dequantize") from None
        if not np.isfinite(values).all():
            raise GGUFError(f"{self.path}: tensor {name} holds values that are not finite")
        if not values.flags.writeable:       # F32 comes back as a view of the read-only file
            values = values.copy()
        return torch.from_numpy(values).reshape(info.shape)


def _short(value: Any) -> str:
    text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
    return text if len(text) <= 60 else text[:57] + "..."
