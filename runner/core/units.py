"""Byte sizes as users write them (8GiB, 512MiB) and as tfmemlab prints them."""

import re

from runner.core.errors import PlanError

UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
BYTES_ALLOWED = "bytes or a number with a unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 8GiB"


def parse_bytes(text, key: str = "plan.budget") -> int:
    """`8GiB`, `512MiB`, `2.5GB`, `1048576` -> bytes; a one-line PlanError naming the key."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if not match or (unit and unit not in UNITS):
        raise PlanError(f"{key}={text}: expected {BYTES_ALLOWED}")
    return int(float(match.group(1)) * UNITS[unit or "B"])


def mib(n: float) -> float:
    return n / 2**20


def size(n: float) -> str:
    """A size for a message: KiB below one MiB, else MiB with one decimal."""
    return f"{n / 2**10:.0f} KiB" if n < 2**20 else f"{mib(n):.1f} MiB"
