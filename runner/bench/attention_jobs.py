"""The whole-model jobs of `python -m runner.bench attention` (issue 29): the transformer of
its acceptance (h=128, 4 layers, 8 heads, batch 4, float32, the transformer's default XLA) with
standard or chunked attention, and the runner's figures each job reads (the steady step peak
`mem/peak_bytes` and the p50 step time `speed/step_time_s_p50`, as a user's run logs them).
"""

import os
import statistics
from collections.abc import Iterator
from contextlib import contextmanager

from runner.config import compose_config
from runner.plan.line import CAP
from runner.train.optimizer import resolve_jit

MODEL = [
    "model=transformer",
    "data.vocab_size=256",
    "model.h=128",
    "model.layers=4",
    "model.heads=8",
    "data.batch_size=4",
    "precision=fp32",
]
KINDS = {"standard": ["model.attention=standard"], "chunked": ["model.attention=chunked"]}
# What a timed job does besides its steps kept small: one validation batch, no model kept.
LEAN = ["trainer.eval_batches=1", "trainer.save_model=false", "trainer.progress=false"]
PEAK, STEP = "mem/peak_bytes", "speed/step_time_s_p50"


def overrides(kind: str, seq: int, extra: list[str]) -> list[str]:
    """A job's overrides: the model, the attention kind, the sequence length, then `extra`
    (the command line's, which win)."""
    return [*MODEL, *KINDS[kind], f"data.seq_len={seq}", *LEAN, *extra]


def compose(kind: str, seq: int, extra: list[str]):
    return compose_config(overrides(kind, seq, extra))


def block_size(extra: list[str]) -> int:
    """The chunked core's keys per block as these jobs compose it (model.attention_block)."""
    return int(compose("chunked", 128, extra).model.attention_block)


@contextmanager
def cpu_limit(mib: int) -> Iterator[None]:
    """TF_CPU_BFC_MEM_LIMIT_IN_MB set for the fresh processes started inside (TensorFlow reads it
    when its CPU allocator is made, so only a new process obeys it), restored after."""
    saved = os.environ.get(CAP)
    os.environ[CAP] = str(mib)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(CAP)
        else:
            os.environ[CAP] = saved


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def describe(extra: list[str], seq: int = 128) -> str:
    """The model as these jobs compose it, in a few words (the command line's overrides in)."""
    cfg = compose("standard", seq, extra)
    m = cfg.model
    xla = resolve_jit(cfg.trainer.jit_compile, m.name, False)  # as on this CPU
    return (
        f"transformer h={m.h}, {m.layers} layers, {m.heads} heads, batch {cfg.data.batch_size}, "
        f"{cfg.precision.name}, XLA {'on' if xla else 'off'}, block {m.attention_block}"
    )
