"""TensorFlow-free reads of a user's data files, so that bad input is one line before TF loads.

Which files a path or glob names; how many records a TFRecord file holds, from the records'
length fields only (the data itself is seeked over, never held); the features of a TFRecord
file's first record (a tf.train.Example read from the protobuf wire format by hand); and the
arrays of an .npz file, from their headers only. (A `_target_`'s module: runner/core/targets.py.)
"""

import glob
import os
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# tf.train.Feature's oneof: field number -> the kind of list it holds
FEATURE_KINDS = {1: "bytes", 2: "float", 3: "int64"}


def match_files(pattern: str) -> list[str]:
    """The files `pattern` names (a path or a glob, `~` expanded), sorted; [] if none."""
    pattern = os.path.expanduser(str(pattern))
    return sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())


def _records(path: str) -> Iterator[tuple[int, int]]:
    """(offset of the data, its length) of each record: a TFRecord record is a little-endian
    uint64 length, a 4-byte CRC of it, the data, and a 4-byte CRC of the data."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        offset = 0
        while offset < size:
            head = f.read(12)
            if len(head) < 12:
                raise ValueError(f"{path}: a truncated record at byte {offset}")
            (length,) = struct.unpack("<Q", head[:8])
            yield offset + 12, length
            offset += 12 + length + 4
            f.seek(offset)
        if offset != size:
            raise ValueError(f"{path}: the last record runs past the end of the file")


def count_records(paths: list[str]) -> int:
    """Records in these TFRecord files, read from their length fields only."""
    return sum(1 for path in paths for _ in _records(path))


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of a protobuf message's fields, in order."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire} is not a tf.train.Example's")
        yield number, wire, value


def _count_values(kind: str, body: bytes) -> int:
    """How many values a BytesList/FloatList/Int64List holds (packed or not)."""
    n = 0
    for _, wire, value in _fields(body):
        if kind == "int64" and wire == 2:  # packed varints
            n += sum(1 for b in value if b < 0x80)
        elif kind == "float" and wire == 2:
            n += len(value) // 4
        else:
            n += 1
    return n


def first_features(path: str) -> dict[str, tuple[str, int]]:
    """name -> (kind, number of values) of the features of the file's first tf.train.Example."""
    offset, length = next(_records(path))
    with open(path, "rb") as f:
        f.seek(offset)
        example = f.read(length)
    found = {}
    for number, _, features in _fields(example):
        if number != 1:  # Example.features
            continue
        for _, _, entry in _fields(features):  # Features.feature: map<string, Feature>
            name, kind, count = "", "?", 0
            for field, _, value in _fields(entry):
                if field == 1:
                    name = value.decode("utf-8", "replace")
                elif field == 2:
                    for which, _, body in _fields(value):
                        kind = FEATURE_KINDS.get(which, "?")
                        count = _count_values(kind, body)
            found[name] = (kind, count)
    return found


def npz_arrays(path: str) -> dict[str, tuple[tuple, Any]]:
    """key -> (shape, dtype) of each array in an .npz file, read from the headers only."""
    import numpy as np  # here: numpy's OpenBLAS starts a thread, and runner.launch's unshare
    # (which composes the config, importing this module) needs a process of one thread

    found = {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if not member.endswith(".npy"):
                continue
            with archive.open(member) as f:
                version = np.lib.format.read_magic(f)
                read = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read(f)
            found[member.removesuffix(".npy")] = (shape, dtype)
    return found
