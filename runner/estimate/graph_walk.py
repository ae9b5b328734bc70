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
  (kernel_copies.xla_kernel_bytes).
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

from dataclasses import dataclass, field

from runner.estimate import conv_scratch, kernel_copies, layer_rules, model_graph, sequence_rules
from runner.estimate.timeline import Executor, Timeline, in_flight, slot_products
from runner.techniques.checkpointing import RematInfo

# Elementwise in inference (a frozen BatchNormalization is x * inv + offset): their kernels
# write their output over an input no other operation reads (walk_step's forward).
IN_PLACE = {"BatchNormalization", "ReLU", "Activation:relu", "Activation:relu6", "Add", "Rescaling"}


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


@dataclass
class _Graph:
    """A model's operations as the walk reads them (model_graph.operations), at micro-batch b
    and p bytes a 16-bit-policy element, with what it knows of each: which op made each tensor,
    which backward runs (backward_runs), each op's checkpointing segment."""

    ops: list
    consumers: dict
    elements: dict
    b: int
    p: int
    executor: Executor
    producer: dict = field(default_factory=dict)
    needs: set = field(default_factory=set)
    runs: list = field(default_factory=list)
    segment: dict = field(default_factory=dict)  # op name -> its segment
    ends: dict = field(default_factory=dict)  # segment -> its last op's index
    scale_kept: bool = True  # sequence_rules.forward_keeps_scaled_softmax

    @property
    def n(self) -> int:
        return len(self.ops)

    def width(self, op) -> int:
        """Bytes an element an op computes in."""
        return 4 if getattr(op, "compute_dtype", None) == "float32" else self.p

    def last_alive(self, i: int, op) -> int:
        """A segment's tensors exist during its own backward only."""
        return self.ends[self.segment[op.name]] if op.name in self.segment else self.n - 1

    def weight_gradient_ends(self, c: int) -> int:
        """Where reader c's backward is done with its input: a layer with weights computes its
        weight gradient beside the backward of the operation that produced its input (it and
        the input gradient both wait only for c's output gradient: inter-op parallelism). A
        filter gradient through an im2col buffer (conv_scratch) runs long, past the short
        backward of an elementwise activation of a kernel's output (a convolution's own ReLU),
        beside the kernel layer's backward: two filter gradients' buffers at once."""
        op_c, ins_c = self.ops[c][1], self.ops[c][2]
        if not getattr(op_c, "trainable_weights", None) or not ins_c:
            return c
        if ins_c[0] not in self.producer:
            return c
        made_by = self.producer[ins_c[0]]
        before = self.ops[made_by][2][0] if self.ops[made_by][2] else None
        slow = self.executor.conv_threads and conv_scratch.im2col(op_c)
        in_place = layer_rules.kind(self.ops[made_by][1]) in layer_rules.GRADIENT_IN_PLACE
        if slow and in_place and before in self.producer:
            if kernel_copies.kernel_elements(self.ops[self.producer[before]][1]):
                return self.producer[before]
        return made_by


@dataclass
class _Tally:
    """What the walk holds at each op: kept for the backward and its workspace, at each op's
    backward (kept, work) and during the forward (fkept, fwork); `crossing`: the tensors kept
    through the forward pass."""

    kept: Timeline
    work: Timeline
    fkept: Timeline
    fwork: Timeline
    crossing: set = field(default_factory=set)


def _read(model, b: int, p: int, remat: RematInfo, executor: Executor, input_gradient) -> _Graph:
    ops, consumers, elements = model_graph.operations(model)
    g = _Graph(ops, consumers, elements, b, p, executor)
    g.scale_kept = sequence_rules.forward_keeps_scaled_softmax(model.name)
    g.segment = {name: s for s, names in enumerate(remat.segment_ops) for name in names}
    for i, op, _, _ in ops:
        if op.name in g.segment:
            g.ends[g.segment[op.name]] = i
    g.producer = {t: i for i, _, _, outs in ops for t in outs}
    g.needs, g.runs = backward_runs(ops, g.producer, input_gradient)
    return g


def _keep_output(g: _Graph, tally: _Tally, i: int, op, outs: list, size: int, keepers) -> None:
    """Its output, kept until the earliest backward that reads it: its own (a ReLU's), a
    reader's whose gradient reads its input, or a later segment's (it recomputes from it)."""
    kind = layer_rules.kind(op)
    # (reader, where its backward is done with the tensor, bytes an element)
    readers = [(i, i, g.width(op))] if kind in layer_rules.KEEPS_OUTPUT and g.runs[i] else []
    for c in sorted({c for t in outs for c in g.consumers.get(t, [])}):
        reader = g.ops[c][1]
        if not g.runs[c]:  # no backward reads it (a frozen layer's)
            continue
        other_segment = reader.name in g.segment and g.segment[reader.name] != g.segment.get(
            op.name
        )
        if layer_rules.kind(reader) in keepers:
            readers.append((c, g.weight_gradient_ends(c), g.width(reader)))
        elif other_segment:
            readers.append((c, c, g.width(reader)))
    if not readers:
        return
    release = min(done for _, done, _ in readers)
    inside = op.name in g.segment and all(
        g.segment.get(g.ops[c][1].name) == g.segment[op.name] for c, _, _ in readers
    )
    last = g.last_alive(i, op) if inside else g.n - 1
    nbytes = size * max(w for _, _, w in readers)
    tally.kept.add(release, last, nbytes)
    if last == g.n - 1:  # kept through the forward pass too
        tally.fkept.add(i + 1, g.n - 1, nbytes)
        tally.crossing.update(outs)


def _keep_own(g: _Graph, tally: _Tally, i: int, op, ins: list, size: int, inputs: list) -> None:
    """What it keeps of its own, freed by its own backward; and its kernel's copies: the
    executor casts every kernel to 16 bits when the step starts, a rebuilt segment's twice
    (its forward's copy, and its recomputation's, which waits); XLA makes each copy of a
    kernel once, for the forward and the recomputation alike."""
    kind, width, half = layer_rules.kind(op), g.width(op), g.p < 4
    grad_in = any(t in g.needs for t in ins)  # its input gradient is computed
    scaled = getattr(op, "scale", False)
    own = layer_rules.own_kept_bytes(
        kind, size, sum(inputs), width, half, scaled, op, grad_in, g.scale_kept
    )
    own *= g.runs[i]
    made = [t not in g.producer for t in ins]  # the model's inputs
    own += kernel_copies.input_cast_bytes(op, inputs, made, g.width(op)) * g.runs[i]
    tally.kept.add(i, g.last_alive(i, op), own)
    if op.name not in g.segment:
        tally.fkept.add(i + 1, g.n - 1, own)
    cast = kernel_copies.kernel_elements(op) * g.p if width < 4 else 0
    xla = g.executor.cpu_xla
    copy = (
        kernel_copies.xla_kernel_bytes(op, grad_in) if xla and kernel_copies.convolves(op) else cast
    )
    tally.kept.add(i, g.n - 1, copy * g.runs[i])
    tally.work.add(i, i, cast)  # its 16-bit weight gradient, beside its float32 cast
    tally.fkept.add(0, g.n - 1, copy)
    if op.name in g.segment and not xla:
        tally.fkept.add(0, i, copy)


def _forward(g: _Graph, tally: _Tally, i: int, op, ins: list, size: int, inputs: list) -> None:
    """Its forward: its inputs (those not kept) and output, a norm's float32 temporaries. A
    layer whose backward never runs (frozen) computes as in inference: a norm takes no
    moments, and an elementwise layer writes its output over an input that dies in it
    (TensorFlow's elementwise kernels forward a buffer whose only reader they are)."""
    kind, width, frozen = layer_rules.kind(op), g.width(op), not g.runs[i]
    norm = kind in layer_rules.NORMS and not frozen
    temporaries = (2 if g.p < 4 else 1) * inputs[0] * 4 if norm else 0
    loose = sum(g.elements[t] * g.b for t in ins if t not in tally.crossing) * width
    sole = ins[0] not in tally.crossing and len(g.consumers.get(ins[0], [])) == 1
    if frozen and kind in IN_PLACE and sole:
        loose -= min(inputs[0], size) * width
    tally.fwork.add(i, i, size * width + loose + temporaries)


def _backward(g: _Graph, tally: _Tally, i: int, op, ins: list, outs: list, size, inputs) -> None:
    """Its backward's workspace (with a convolution's im2col buffers), and its output's
    gradient waiting: for its weight gradient's end, and for earlier readers of a tensor
    read on both sides of it (a skip connection)."""
    kind, width = layer_rules.kind(op), g.width(op)
    grad_done = g.weight_gradient_ends(i)
    xla = g.executor.cpu_xla
    tally.work.add(i, i, layer_rules.workspace_bytes(op, kind, size, inputs, width, xla))
    if g.executor.conv_threads:
        threads = g.executor.conv_threads
        grad_in = any(t in g.needs for t in ins)
        tally.work.add(i, i, conv_scratch.scratch_bytes(op, g.b, width, grad_in, threads))
        if grad_done < g.producer.get(ins[0], i):  # its filter gradient outlasts a ReLU
            filter_scratch = conv_scratch.scratch_bytes(op, g.b, width, False, threads)
            tally.work.add(grad_done, i - 1, filter_scratch)
    tally.work.add(grad_done, i - 1, size * width)  # its output gradient
    for t in outs:
        readers_of_t = g.consumers.get(t, [])
        if len(readers_of_t) > 1:
            tally.work.add(i + 1, max(readers_of_t) - 1, g.elements[t] * g.b * width)


def _peak(g: _Graph, tally: _Tally) -> tuple[int, int, int]:
    """(kept, workspace, gradients) at the step's peak: the backward's moment that holds the
    most with the gradients in flight, or the forward's where it holds more (no gradient
    exists there yet), or the end of a step that waits for every gradient."""
    held, transient = tally.kept.values(), tally.work.values()
    products, forward_products = slot_products(g.ops, g.n, g.executor)
    flight = in_flight(g.ops, g.n, g.executor).values()
    product_values = products.values()
    grads = [a + c for a, c in zip(flight, product_values, strict=True)]
    peak = max(range(g.n), key=lambda i: held[i] + transient[i] + grads[i])
    fheld, ftransient = tally.fkept.values(), tally.fwork.values()
    fpeak = max(range(g.n), key=lambda i: fheld[i] + ftransient[i])
    backward_peak = held[peak] + transient[peak] + grads[peak]
    # Once a waiting step's backward has ended: its gradients and their copies (waits_for)
    # beside what the update reads only (the slot products alive then), no activation.
    end = g.executor.waits_for + (product_values[0] if g.n else 0)
    forward_peak = fheld[fpeak] + ftransient[fpeak] + forward_products
    if end > max(backward_peak, forward_peak):
        return 0, 0, end
    if forward_peak > backward_peak:
        return fheld[fpeak], ftransient[fpeak], forward_products
    return held[peak], transient[peak], grads[peak]


def walk_step(
    model, b: int, p: int, remat: RematInfo, executor: Executor, input_gradient: bool = False
) -> tuple[int, int, int]:
    """As walk, with the weight gradients in flight (Executor) in the peak's choice: (activations
    kept, workspace, gradients and their updates' temporaries) at the peak, the backward's or,
    where it holds more, the forward's (no gradient exists there yet). A training step
    differentiates its weights only; input_gradient: the model's inputs too."""
    g = _read(model, b, p, remat, executor, input_gradient)
    keepers = layer_rules.input_keepers(half=p < 4)
    tally = _Tally(*(Timeline(g.n) for _ in range(4)))
    for i, op, ins, outs in g.ops:  # the forward pass, op by op
        size = sum(g.elements[t] for t in outs) * b
        inputs = [g.elements[t] * b for t in ins]
        _keep_output(g, tally, i, op, outs, size, keepers)
        _keep_own(g, tally, i, op, ins, size, inputs)
        _forward(g, tally, i, op, ins, size, inputs)
        if g.runs[i]:  # a frozen layer runs no backward
            _backward(g, tally, i, op, ins, outs, size, inputs)
    return _peak(g, tally)
