"""TensorFlow-free reads of a user's data files, so that bad input is one line before TF loads.

Which files a path or glob names; how many records a TFRecord file holds, from the records'
length fields only (the data itself is seeked over, never held); the features of a TFRecord
file's first record (a tf.train.Example read from the protobuf wire format by hand), and the
range of an int64 feature over every record (a label: the classes); and the arrays of an .npz
file, from their headers only. (A `_target_`'s module: runner/core/targets.py.)
"""

import functools
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


def _int64s(body) -> list[int]:
    """The values of an Int64List (packed or not), as signed 64-bit integers."""
    values = []
    for _, wire, value in _fields(body):
        if wire == 2:  # packed varints
            i = 0
            while i < len(value):
                v, i = _varint(value, i)
                values.append(v)
        else:
            values.append(value)
    return [v - (1 << 64) if v >= 1 << 63 else v for v in values]


def _int64_feature(example, name: bytes) -> list[int] | None:
    """The values of the int64 feature `name` of a serialized tf.train.Example; None when it
    has no such feature, or one of another kind."""
    for number, _, features in _fields(example):
        if number != 1:  # Example.features
            continue
        for _, _, entry in _fields(features):  # Features.feature: map<string, Feature>
            key, feature = b"", None
            for field, _, value in _fields(entry):
                if field == 1:
                    key = bytes(value)
                elif field == 2:
                    feature = value
            if key == name and feature is not None:
                for which, _, body in _fields(feature):
                    return _int64s(body) if which == 3 else None  # Feature.int64_list
    return None


@functools.lru_cache(maxsize=64)
def _one_int64_range(path: str, name: str, size: int, mtime_ns: int) -> tuple[int, int] | None:
    """(smallest, largest) of the feature over the file's records; None for no record. The
    file's size and time are the cache's key: the check and the build read it once."""
    found = None
    with open(path, "rb") as f:
        for index, (offset, length) in enumerate(_records(path)):
            f.seek(offset)
            values = _int64_feature(memoryview(f.read(length)), name.encode())
            if values is None or len(values) != 1:
                held = "no int64 value" if values is None else f"{len(values)} values"
                raise ValueError(f"record {index} of {path} holds {held} under it")
            (v,) = values
            found = (v, v) if found is None else (min(found[0], v), max(found[1], v))
    return found


def int64_range(paths: list[str], name: str) -> tuple[int, int] | None:
    """(smallest, largest) value of the int64 feature `name`, one value per record, over every
    record of these TFRecord files (each record parsed, none kept); None when they hold no
    record. ValueError naming the first record without exactly one value."""
    ranges = []
    for path in paths:
        stat = os.stat(path)
        ranges.append(_one_int64_range(path, name, stat.st_size, stat.st_mtime_ns))
    ranges = [r for r in ranges if r is not None]
    return (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None


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
