"""The attention core alone, standard against chunked: the CPU allocator's peak and the time
of one forward+backward against the sequence length (issue 29), one cell per fresh process:

    python -m runner.bench attention --core          # s = 256..2048, h=128, 8 heads, b=4
    python -m runner.bench attention --core --xla --lengths 1024

The whole model is runner/bench/attention.py's.

The peak is get_memory_info('CPU:0')['peak'] after reset_memory_stats (as runner/measure
reads a step's), with q, k, v and the output gradient already allocated; "held" is the peak
less those inputs. Under XLA the pool is grown first (the BFC allocator splits a free
chunk only if it is at least twice the request, xla/tsl/framework/bfc_allocator.cc, so its
chunks round a compiled program's buffer up otherwise).
"""

import argparse
import statistics
import time

from runner.core.process import in_fresh_process
from runner.core.text import table

MIB = 2**20


def measure(kind: str, seq: int, h: int, heads: int, batch: int, block: int, xla: bool) -> dict:
    import tensorflow as tf

    from models.chunked_attention import chunked_attention_core
    from models.memory_limited import attention_core

    def core(q, k, v):
        if kind == "chunked":
            return chunked_attention_core(q, k, v, None, 0.0, True, block)
        return attention_core(q, k, v, None, 0.0, True)

    @tf.function(jit_compile=xla)
    def step(q, k, v, dout):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = core(q, k, v)
        return tape.gradient(out, [q, k, v], dout)

    if xla:  # grow the pool: a later buffer is then split from it, not given a whole chunk
        pool = tf.zeros([2 * 2**30 // 4])
        del pool
    shape = (batch, seq, heads, h // heads)
    q, k, v, dout = (tf.random.normal(shape, seed=i) for i in range(4))
    step(q, k, v, dout)  # trace (and compile)
    times = []
    for i in range(3):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        start = time.perf_counter()
        grads = step(q, k, v, dout)
        _ = [g.numpy() for g in grads]
        times.append(time.perf_counter() - start)
        if i == 0:
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        del grads
    return {"peak": peak, "inputs": before, "time": statistics.median(times)}


def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runner.bench attention --core", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--h", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--xla", action="store_true")
    return parser


def main(argv: list[str]) -> None:
    args = command_line().parse_args(argv)
    rows = []
    for seq in args.lengths:
        cells = {}
        for kind in ("standard", "chunked"):
            shape = (seq, args.h, args.heads, args.batch, args.block, args.xla)
            cells[kind] = in_fresh_process(measure, kind, *shape)
            got = cells[kind]
            rows.append(
                {
                    "s": seq,
                    "attention": kind,
                    "peak MiB": got["peak"] / MIB,
                    "held MiB": (got["peak"] - got["inputs"]) / MIB,
                    "time s": got["time"],
                    "a*s^2*b*4 MiB": args.heads * seq * seq * args.batch * 4 / MIB,
                }
            )
        std, chk = cells["standard"], cells["chunked"]
        rows[-1]["peak ratio"] = chk["peak"] / std["peak"]
        rows[-1]["time ratio"] = chk["time"] / std["time"]
    print(
        f"attention core, causal, fp32, h={args.h}, heads={args.heads}, batch={args.batch}, "
        f"block={args.block}, XLA {'on' if args.xla else 'off'}; forward+backward"
    )
    columns = ["s", "attention", "peak MiB", "held MiB", "time s", "a*s^2*b*4 MiB"]
    print(table(rows, columns + ["peak ratio", "time ratio"]))
