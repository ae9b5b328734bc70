"""The backward walk: what a functional model's train step holds at its peak, without XLA.

The estimate (runner/estimate/memory.py) asks one question of a graph model: at which moment
of the backward pass do the activations still kept, the gradients in flight and the operation
then running hold the most, and how much is that? The walk answers it operation by operation,
from the last to the first, as TensorFlow's executor runs a step:
- a tensor the backward pass keeps (runner/estimate/layer_rules.py's rules, from TensorFlow's
  gradient functions) is alive until the backward of the earliest operation that reads it
  has run, then freed; what an operation keeps of its own (a 16-bit norm's float32 copy, the
  tensors GELU's gradient reads) is freed with its own backward;
- while an operation's backward runs, its workspace is alive (layer_rules.workspace_bytes: the
  gradient of its output beside the gradients of its inputs, a norm's float32 temporaries,
  a grouped convolution's XLA buffer);
- a layer with weights computes its weight gradient beside the backward of the operation
  that produced its input: both gradients wait only for its output gradient, and the
  executor runs them in parallel, so its input and its output gradient stay alive that long
  (the U-Net's allocation trace: the decoder convolution's filter gradient finished after
  the concatenation's and the upsampling's backward, its 6 MiB input alive until then);
- a convolution's filter gradient through TensorFlow's im2col buffer (conv_scratch) runs long:
  past the short backward of the convolution's own ReLU, beside the backward of the convolution
  before it, so two filter gradients' buffers are alive at once (four Conv2D(32, 3,
  activation="relu"), 48 px, batch 16, oneDNN off: 78.3-80.8 MiB, two 27.8 MiB buffers);
- a tensor read by operations on both sides of the one running (a skip connection: ResNet's
  shortcut, U-Net's encoder features) has its gradient waiting for the earlier ones;
- under a 16-bit policy every kernel's 16-bit copy is cast when the step starts (the casts
  read only variables) and waits for its layer's input gradient, a rebuilt segment's kernels
  twice (the forward's copy and the recomputation's); so the walk also weighs each
  operation's forward, where a checkpointed model with small activations can peak
  (MobileNetV2 under `blocks` in bfloat16, seen in the allocator's trace);
- in a step XLA compiles on a CPU (Executor.cpu_xla) those copies are float32 ones instead,
  each convolution kernel's transpose and, under a 16-bit policy, its rounded cast
  (_xla_kernel_bytes).
With checkpointing, a segment keeps only the tensors crossing its edges; the tensors kept
inside it exist only while its own backward runs (it is recomputed then).
TensorFlow computes only the gradients a trainable weight needs: an operation no weight went
into (a frozen backbone's, a Rescaling of the input) runs no backward and keeps nothing for
one, and computes as in inference (IN_PLACE); a backbone nested as one layer of the model is
walked as its own operations, a layer called twice (a siamese pair's shared weights) at each
call (its gradient counted once, step_timeline), and a layer's own activation as an Activation
layer after it (runner/estimate/model_graph.py).

Counting every kept tensor at once beside the largest single workspace, as the estimate did
before, overstated models whose largest workspace comes early, when the backward has freed
most of what the later layers kept (DenseNet121 under checkpointing=blocks).
"""

import math

from runner.estimate import conv_scratch, layer_rules, model_graph
from runner.estimate.timeline import Executor, Timeline, in_flight, slot_products
from runner.techniques.checkpointing import RematInfo

# Elementwise in inference (a frozen BatchNormalization is x * inv + offset): their kernels
# write their output over an input no other operation reads (walk_step's forward).
IN_PLACE = {"BatchNormalization", "ReLU", "Activation:relu", "Activation:relu6", "Add", "Rescaling"}


def _kernel_elements(op) -> int:
    """Elements of the kernels a layer reads in its compute dtype (a convolution's, a
    depthwise convolution's, a Dense layer's), whose casts its input gradient reads."""
    return sum(math.prod(k.shape) for k in layer_rules.kernels(op))


def _convolves(op) -> bool:
    return any(k is not None for k in layer_rules.conv_kernels(op))


def _xla_kernel_bytes(op, grad_in: bool) -> int:
    """Bytes of a convolution's kernels that a step XLA compiles on a CPU copies when it starts
    and keeps until the layer's backward, in place of the executor's 16-bit casts: each kernel
    as float32 under a 16-bit policy (XLA on a CPU convolves in float32: the cast is rounded
    and converted back), and each dense (not depthwise) kernel's float32 transpose, which its
    input gradient's convolution reads (none where that gradient is not computed: grad_in
    false, a layer reading the model's input). A Dense kernel keeps its 16-bit cast (the
    walk's). Read off XLA's scheduled
    buffer assignments: EfficientNetV2B2's step (bfloat16, 55 px, batch 4) computes 96
    kernel transposes and its float32 conversions before its first convolution, all read
    in the backward pass and alive at its peak (29.9 MiB of transposes, 26.2 of
    conversions, no bfloat16 kernel); keras MobileNet's (float32) held the transposes of its
    1x1 kernels whose backward had not run (9.0 MiB); a depthwise kernel [kh, kw, C, 1] is
    read as [kh, kw, 1, C], the same bytes in float32 (a copy in 16 bits)."""
    depthwise, full = layer_rules.conv_kernels(op)
    # The estimate's width under XLA on a CPU is float32's or more: the layer's own dtype says
    # whether its kernel is cast to 16 bits.
    converted = getattr(op, "compute_dtype", "float32") in ("bfloat16", "float16")
    elements = math.prod(depthwise.shape) if depthwise is not None and converted else 0
    if full is not None:
        elements += math.prod(full.shape) * (int(converted) + int(grad_in))
    return elements * 4


def walk(model, b: int, p: int, remat: RematInfo) -> tuple[int, int]:
    """(activations kept at the peak; workspace then: the running operation's and the
    gradients waiting at skip connections) in bytes, at micro-batch b and p bytes per
    16-bit-policy element (float32 layers keep 4), of a forward+backward that differentiates
    the model's inputs (as the tests of a layer's rules measure one)."""
    held, transient, _ = walk_step(model, b, p, remat, Executor(), input_gradient=True)
    return held, transient


def backward_runs(ops, producer: dict, input_gradient: bool = False) -> tuple[set, list[bool]]:
    """(the tensors whose gradient the step computes, whether each op's backward runs).
    A tensor's gradient is computed when a trainable weight went into it: TensorFlow prunes
    the rest of the gradient graph (no input gradient of a convolution that reads a Rescaling
    of the model's input, no backward of the Rescaling). An op's backward runs when a weight
    needs its outputs' gradient."""
    needs = {t for _, _, ins, _ in ops for t in ins if t not in producer and input_gradient}
    for _, op, ins, outs in ops:
        if getattr(op, "trainable_weights", None) or any(t in needs for t in ins):
            needs.update(outs)
    return needs, [any(t in needs for t in outs) for _, _, _, outs in ops]


def walk_step(
    model, b: int, p: int, remat: RematInfo, executor: Executor, input_gradient: bool = False
) -> tuple[int, int, int]:
    """As walk, with the weight gradients in flight (Executor) in the peak's choice: (activations
    kept, workspace, gradients and their updates' temporaries) at the peak, the backward's or,
    where it holds more, the forward's (no gradient exists there yet). A training step
    differentiates its weights only; input_gradient: the model's inputs too."""
    ops, consumers, elements = model_graph.operations(model)
    n = len(ops)
    half = p < 4
    keepers = layer_rules.KEEPS_INPUT - layer_rules.NORMS if half else layer_rules.KEEPS_INPUT
    segment = {name: s for s, names in enumerate(remat.segment_ops) for name in names}
    ends = {}  # segment -> its last op's index
    for i, op, _, _ in ops:
        if op.name in segment:
            ends[segment[op.name]] = i

    def width(op) -> int:  # bytes per element an op computes in
        return 4 if getattr(op, "compute_dtype", None) == "float32" else p

    def last_alive(i: int, op) -> int:  # a segment's tensors exist during its backward only
        return ends[segment[op.name]] if op.name in segment else n - 1

    producer = {t: i for i, _, _, outs in ops for t in outs}
    needs, runs = backward_runs(ops, producer, input_gradient)

    def weight_gradient_ends(c: int) -> int:
        """Where reader c's backward is done with its input: a layer with weights computes its
        weight gradient beside the backward of the operation that produced its input (it and
        the input gradient both wait only for c's output gradient: inter-op parallelism)."""
        op_c, ins_c = ops[c][1], ops[c][2]
        if not getattr(op_c, "trainable_weights", None) or not ins_c or ins_c[0] not in producer:
            return c
        p = producer[ins_c[0]]
        # A filter gradient through an im2col buffer (conv_scratch) runs long, past the short
        # backward of an elementwise activation of a kernel's output (a convolution's own ReLU),
        # beside the kernel layer's backward: two filter gradients' buffers at once.
        before = ops[p][2][0] if ops[p][2] else None
        slow = executor.conv_threads and conv_scratch.im2col(op_c)
        if (
            slow
            and layer_rules.kind(ops[p][1]) in layer_rules.GRADIENT_IN_PLACE
            and before in producer
        ):
            if _kernel_elements(ops[producer[before]][1]):
                return producer[before]
        return p

    kept, work = Timeline(n), Timeline(n)
    # The forward pass, op by op: what it keeps for the backward so far, and what op q runs on.
    fkept, fwork, crossing = Timeline(n), Timeline(n), set()
    for i, op, ins, outs in ops:
        kind = layer_rules.kind(op)
        size = sum(elements[t] for t in outs) * b
        inputs = [elements[t] * b for t in ins]
        # Its output, kept until the earliest backward that reads it.
        # (reader, where its backward is done with the tensor, bytes an element)
        readers = [(i, i, width(op))] if kind in layer_rules.KEEPS_OUTPUT and runs[i] else []
        for c in sorted({c for t in outs for c in consumers.get(t, [])}):
            reader = ops[c][1]
            if not runs[c]:  # no backward reads it (a frozen layer's)
                continue
            # a segment keeps its inputs for its recomputation
            other_segment = reader.name in segment and segment[reader.name] != segment.get(op.name)
            if layer_rules.kind(reader) in keepers:
                readers.append((c, weight_gradient_ends(c), width(reader)))
            elif other_segment:
                readers.append((c, c, width(reader)))
        if readers:
            release = min(done for _, done, _ in readers)
            inside = op.name in segment and all(
                segment.get(ops[c][1].name) == segment[op.name] for c, _, _ in readers
            )
            last = last_alive(i, op) if inside else n - 1
            nbytes = size * max(w for _, _, w in readers)
            kept.add(release, last, nbytes)
            if last == n - 1:  # kept through the forward pass too
                fkept.add(i + 1, n - 1, nbytes)
                crossing.update(outs)
        # What it keeps of its own, freed by its own backward.
        scaled = getattr(op, "scale", False)
        grad_in = any(t in needs for t in ins)  # its input gradient is computed
        own = layer_rules.own_kept_bytes(
            kind, size, sum(inputs), width(op), half, scaled, op, grad_in
        )
        own *= runs[i]
        kept.add(i, last_alive(i, op), own)
        if op.name not in segment:
            fkept.add(i + 1, n - 1, own)
        # Its kernel's 16-bit copy: the executor casts every kernel when the step starts, a
        # rebuilt segment's twice (its forward's copy, and its recomputation's, which waits);
        # XLA makes each copy of a kernel once, for the forward and the recomputation alike.
        cast = _kernel_elements(op) * p if width(op) < 4 else 0
        copy = _xla_kernel_bytes(op, grad_in) if executor.cpu_xla and _convolves(op) else cast
        kept.add(i, n - 1, copy * runs[i])
        work.add(i, i, cast)  # its 16-bit weight gradient, beside its float32 cast
        fkept.add(0, n - 1, copy)
        if op.name in segment and not executor.cpu_xla:
            fkept.add(0, i, copy)
        # Its forward: its inputs (those not kept) and output, a norm's float32 temporaries. A
        # layer whose backward never runs (frozen) computes as in inference: a norm takes no
        # moments, and an elementwise layer writes its output over an input that dies in it
        # (TensorFlow's elementwise kernels forward a buffer whose only reader they are).
        frozen = not runs[i]
        norm = kind in layer_rules.NORMS and not frozen
        temporaries = (2 if half else 1) * inputs[0] * 4 if norm else 0
        loose = sum(elements[t] * b for t in ins if t not in crossing) * width(op)
        sole = ins[0] not in crossing and len(consumers.get(ins[0], [])) == 1
        if frozen and kind in IN_PLACE and sole:
            loose -= min(inputs[0], size) * width(op)
        fwork.add(i, i, size * width(op) + loose + temporaries)
        if frozen:
            continue  # no backward runs for it
        # Its backward's workspace, and its output's gradient waiting for earlier readers.
        grad_done = weight_gradient_ends(i)
        work.add(
            i, i, layer_rules.workspace_bytes(op, kind, size, inputs, width(op), executor.cpu_xla)
        )
        if executor.conv_threads:
            threads = executor.conv_threads
            scratch = conv_scratch.scratch_bytes(op, b, width(op), grad_in, threads)
            work.add(i, i, scratch)
            if grad_done < producer.get(ins[0], i):  # its filter gradient outlasts a ReLU
                filter_scratch = conv_scratch.scratch_bytes(op, b, width(op), False, threads)
                work.add(grad_done, i - 1, filter_scratch)
        work.add(grad_done, i - 1, size * width(op))  # its output gradient
        for t in outs:
            readers_of_t = consumers.get(t, [])
            if len(readers_of_t) > 1:
                work.add(i + 1, max(readers_of_t) - 1, elements[t] * b * width(op))
    held, transient = kept.values(), work.values()
    products, forward_products = slot_products(ops, n, executor)
    flight = in_flight(ops, n, executor).values()
    product_values = products.values()
    grads = [a + c for a, c in zip(flight, product_values, strict=True)]
    peak = max(range(n), key=lambda i: held[i] + transient[i] + grads[i])
    fheld, ftransient = fkept.values(), fwork.values()
    fpeak = max(range(n), key=lambda i: fheld[i] + ftransient[i])
    backward_peak = held[peak] + transient[peak] + grads[peak]
    # Once a waiting step's backward has ended: its gradients and their copies (waits_for)
    # beside what the update reads only (the slot products alive then), no activation.
    end = executor.waits_for + (product_values[0] if n else 0)
    if end > max(backward_peak, fheld[fpeak] + ftransient[fpeak] + forward_products):
        return 0, 0, end
    if fheld[fpeak] + ftransient[fpeak] + forward_products > backward_peak:
        return fheld[fpeak], ftransient[fpeak], forward_products
    return held[peak], transient[peak], grads[peak]
