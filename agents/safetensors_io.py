"""Minimal reader/writer for the safetensors format, on numpy only.

Real Llama-2 checkpoints are fp16/bf16 safetensors; reading them with numpy memory maps keeps torch out of
the serving path. Layout: 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``), then the raw
little-endian tensor bytes; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

# dtype tag -> numpy storage dtype. BF16 is stored as uint16 and widened to float32 on read.
_STORAGE = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_WRITE_TAGS = {np.dtype(v).str.lstrip("<>|="): k for k, v in _STORAGE.items() if k != "BF16"}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit; larger means a corrupt or foreign file
METADATA_KEY = "__metadata__"


class SafetensorsError(ValueError):
    """A file that is not valid safetensors, or a tensor that cannot be read from it."""


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32: bf16 is the top half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


class SafetensorsFile(Mapping):
    """Read-only, lazily decoded view of one ``.safetensors`` file (a Mapping of name -> ndarray).

    F32/F16/int tensors come back as read-only views of the memory map (copy them to keep them past
    the file's lifetime or to write to them); BF16 tensors come back as new float32 arrays.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise SafetensorsError(f"safetensors file not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{self.path}: too short to be safetensors ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise SafetensorsError(f"{self.path}: header length {n} is invalid for a {size}-byte file")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise SafetensorsError(f"{self.path}: header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: header is not a JSON object")
        self.metadata: dict[str, str] = header.pop(METADATA_KEY, None) or {}
        self._data_start = 8 + n
        self._data_len = size - self._data_start
        self._entries = {name: self._check_entry(name, e) for name, e in header.items()}
        self._buf: np.memmap | None = None

    def _check_entry(self, name: str, entry: object) -> tuple[str, tuple[int, ...], int, int]:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise SafetensorsError(f"{where}: header entry needs dtype, shape and data_offsets, got {entry}")
        tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if tag not in _STORAGE:
            raise SafetensorsError(f"{where}: unsupported dtype {tag!r} (supported: {sorted(_STORAGE)})")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise SafetensorsError(f"{where}: invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise SafetensorsError(f"{where}: invalid data_offsets {offsets!r}")
        begin, end = offsets
        expected = int(np.prod(shape, dtype=np.int64)) * _STORAGE[tag].itemsize
        if not 0 <= begin <= end <= self._data_len or end - begin != expected:
            raise SafetensorsError(
                f"{where}: data_offsets {offsets} do not hold {tag}{shape} ({expected} bytes) within "
                f"{self._data_len} data bytes"
            )
        return tag, tuple(shape), begin, end

    def dtype_tag(self, name: str) -> str:
        return self._entry(name)[0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def _entry(self, name: str) -> tuple[str, tuple[int, ...], int, int]:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} not in {self.path}") from None

    def __getitem__(self, name: str) -> np.ndarray:
        tag, shape, begin, end = self._entry(name)
        if begin == end:
            arr = np.zeros(shape, dtype=_STORAGE[tag])
        else:
            if self._buf is None:
                self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
            start = self._data_start
            arr = self._buf[start + begin:start + end].view(_STORAGE[tag]).reshape(shape)
        return bf16_to_float32(arr) if tag == "BF16" else arr

    def __contains__(self, name: object) -> bool:  # Mapping's default would decode the tensor
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def load_file(path: str | Path) -> dict[str, np.ndarray]:
    """Read every tensor of a file into memory (owned, writable arrays)."""
    f = SafetensorsFile(path)
    return {name: np.array(f[name]) for name in f}


def save_file(tensors: Mapping[str, np.ndarray], path: str | Path,
              metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` (numpy F64/F32/F16/int/bool arrays) as safetensors.

    ``metadata`` defaults to ``{"format": "pt"}``, which Hugging Face loaders expect.
    """
    path = Path(path)
    header: dict[str, object] = {METADATA_KEY: dict(metadata if metadata is not None else {"format": "pt"})}
    arrays: list[np.ndarray] = []
    offset = 0
    for name, value in tensors.items():
        if name == METADATA_KEY:
            raise SafetensorsError(f"tensor name {METADATA_KEY!r} is reserved")
        arr = np.asarray(value)
        tag = _WRITE_TAGS.get(arr.dtype.str.lstrip("<>|="))
        if tag is None:
            raise SafetensorsError(f"tensor {name!r}: cannot write numpy dtype {arr.dtype}")
        arr = arr.astype(_STORAGE[tag], order="C", copy=False)  # not ascontiguousarray: it makes 0-d 1-d
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.reshape(-1).view(np.uint8).data)
    return path
