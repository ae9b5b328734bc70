"""The analytic memory estimate, FLOPs per step and peak FLOP/s, on tiny real models."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import math  # noqa: E402

import keras  # noqa: E402
import pytest  # noqa: E402

from models.spec import DataSpec  # noqa: E402
from runner.estimate import (  # noqa: E402
    calibration,
    chunked_core,
    graph_walk,
    memory,
    resident,
    small_tensors,
    timeline,
    transformer_form,
)
from runner.measure import flops
from runner.techniques import checkpointing, precision  # noqa: E402
from runner.track.compare import PARTS  # noqa: E402  (every part the estimate has)
from runner.train.job import build_model  # noqa: E402
from runner.train.optimizer import build_optimizer  # noqa: E402
from tests.conftest import compose_config, tiny_overrides  # noqa: E402

# What runner/data.py gives the tiny transformer (synthetic tokens) and a tiny CNN.
TOKENS = DataSpec("tokens", (8,), 16, per_token=True, vocab_size=16)
IMAGES = DataSpec("image", (32, 32, 3), 10)
# The scalars an optimizer keeps beside its slots (iteration, learning rate, loss scale).
SCALAR_BYTES = 64


@pytest.fixture
def fresh_session():
    """Keras's global state cleared, for the tests that build models (clear_session collects
    garbage: seconds on a busy worker, spent only where a model is built)."""
    keras.backend.clear_session()
    yield


def built(model_name="transformer", *extra):
    """(model, optimizer, cfg, spec) as runner.train.run makes them on the CPU."""
    cfg = compose_config(tiny_overrides(model_name) + list(extra))
    spec = TOKENS if model_name == "transformer" else IMAGES
    with precision.policy(cfg.precision):
        model = build_model(cfg.model, spec)
        optimizer = precision.wrap_optimizer(build_optimizer(cfg.trainer), cfg.precision)
        optimizer.build(model.trainable_variables)
    return model, optimizer, cfg, spec


def trainable_bytes(model):
    return sum(math.prod(v.shape) * 4 for v in model.trainable_variables)


def activations(*extra):
    return memory.estimate_memory(*built("transformer", *extra))["activations"]


@pytest.mark.parametrize("extra", [[], ["precision=mixed", "accum=4"], ["precision=bf16"]])
@pytest.mark.usefixtures("fresh_session")
def test_parts_sum_to_total(extra):
    parts = memory.estimate_memory(*built("transformer", *extra))
    assert set(parts) == set(PARTS) | {"total"}
    assert all(v >= 0 for v in parts.values())
    assert parts["total"] == sum(parts[k] for k in PARTS)


@pytest.mark.parametrize(
    "optimizer, slots", [("adam", 2), ("adamw", 2), ("sgd", 1)], ids=["adam", "adamw", "sgd"]
)
@pytest.mark.usefixtures("fresh_session")
def test_optimizer_slots(optimizer, slots):
    model, opt, cfg, spec = built("transformer", f"trainer.optimizer={optimizer}")
    parts = memory.estimate_memory(model, opt, cfg, spec)
    extra = parts["optimizer"] - slots * trainable_bytes(model)
    assert 0 <= extra <= SCALAR_BYTES
    assert parts["params"] == parts["gradients"] == trainable_bytes(model)


@pytest.mark.usefixtures("fresh_session")
def test_loss_scale_optimizer_counts_inner_slots():
    model, opt, cfg, spec = built("transformer", "precision=mixed")
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    parts = memory.estimate_memory(model, opt, cfg, spec)
    extra = parts["optimizer"] - 2 * trainable_bytes(model)
    assert 0 <= extra <= SCALAR_BYTES
    # Every gradient waits for the check: none at the loss (the head's are its backward's),
    # the head's at the last layer's backward, all but the embedding's at the first layer's,
    # and at the end the scaled gradients beside their quotients by the scale.
    every = trainable_bytes(model)
    alive = memory._gradients_alive(model.trainable_variables, opt, cfg, spec, 2 * every)
    head = (cfg.model.h + 1) * spec.num_classes * 4
    assert alive == (0, head, every - spec.vocab_size * cfg.model.h * 4, 2 * every)
    assert parts["gradients"] in alive


@pytest.mark.usefixtures("fresh_session")
def test_a_loss_scaled_cnn_holds_both_copies_of_its_gradients_only_after_its_backward():
    # The walk's moment holds the scaled gradients made so far, the end both copies of all
    # (timeline.Executor.waits_for; tests/test_gradient_graph.py measures it): never
    # both copies beside the walk's own gradients.
    model, opt, cfg, spec = built("mobilenet", "precision=mixed")
    parts = memory.estimate_memory(model, opt, cfg, spec)
    every = trainable_bytes(model)
    assert 0 < parts["gradients"] <= 2 * every, (parts["gradients"], every)


@pytest.mark.parametrize("accum, copies", [(1, 0), (4, 1)])
@pytest.mark.usefixtures("fresh_session")
def test_accumulation_buffer(accum, copies):
    model, opt, cfg, spec = built("transformer", f"accum={accum}")
    parts = memory.estimate_memory(model, opt, cfg, spec)
    assert parts["accumulation"] == copies * trainable_bytes(model)


@pytest.mark.usefixtures("fresh_session")
def test_what_the_pipeline_holds_counts_on_a_cpu_not_on_a_gpu():
    # The data part (what runner/data/examples.py's held_bytes says the pipeline keeps) and the
    # input micro-batches: on a GPU the pipeline's buffers are host memory, and the device
    # holds the step's own micro-batch only.
    model, opt, cfg, _ = built("mobilenet")
    spec = DataSpec("image", (32, 32, 3), 10, held_bytes=123_456)
    cpu = memory.estimate_memory(model, opt, cfg, spec)
    gpu = memory.estimate_memory(model, opt, cfg, spec, on_gpu=True)
    assert (cpu["data"], gpu["data"]) == (123_456, 0)
    micro_batch = cfg.data.batch_size * 32 * 32 * 3 * 4
    moved = (calibration.INPUT_MICRO_BATCHES - 1) * micro_batch
    assert cpu["activations"] - gpu["activations"] == moved


def test_a_gpus_name_is_told_from_a_cpus():
    # runner.train.device.describe names a GPU by its model, without the word "GPU"
    assert memory.on_gpu("NVIDIA H200") and memory.on_gpu("/GPU:0")
    assert not memory.on_gpu("CPU AMD EPYC (2 cores)")


@pytest.mark.usefixtures("fresh_session")
def test_the_allocators_share_is_counted_on_a_step_without_xla_only():
    for name in ("mobilenet", "transformer"):
        model, opt, cfg, spec = built(name)
        parts = memory.estimate_memory(model, opt, cfg, spec)
        step = parts["activations"] + parts["workspace"] + parts["gradients"]
        # beside the job's small tensors in their 256-byte chunks (small_tensors.py)
        small = small_tensors.small_tensors_bytes(model, opt, cfg.accum)
        assert parts["allocator"] - small == int(calibration.ALLOCATOR_WASTE * step) > 0, name
        assert small > 0, name
        # under XLA the buffers are its plan's
        assert memory.estimate_memory(model, opt, cfg, spec, cpu_xla=True)["allocator"] == 0


@pytest.mark.usefixtures("fresh_session")
def test_masks_only_when_pruning():
    model, opt, cfg, spec = built("transformer")
    assert memory.estimate_memory(model, opt, cfg, spec)["masks"] == 0
    cfg = compose_config(tiny_overrides("transformer") + ["pruning=polynomial"])
    masks = memory.estimate_memory(model, opt, cfg, spec)["masks"]
    h, vocab = cfg.model.h, TOKENS.num_classes
    # q, k, v, attention output (h x h each), mlp_up and mlp_down (4h^2 each), logits (h x vocab).
    assert masks == (4 * h * h + 8 * h * h + h * vocab) * 4


def kept(*extra) -> dict[str, int]:
    """transformer_form.kept for the tiny transformer (no model built: cfg and spec only)."""
    cfg = compose_config(tiny_overrides("transformer") + list(extra))
    p = memory.ACTIVATION_BYTES[cfg.precision.policy]
    return transformer_form.kept(cfg, TOKENS, p, memory.attention_block(cfg, TOKENS))


def layers_and_head(*extra) -> int:
    held = kept(*extra)
    return held["backward"] + held["head"]


# Korthikanti et al. 2022 per layer, written out for s=8, b=4, h=16, a=2, L=1 (the tiny config):
# sbh = 512, as^2b = 512. fp32, no dropout: 16*512*4 + 512*4 = 34816; embedding + final norm
# 2*512*4 = 4096; head: the cross-entropy's float32 gradient b*s*classes*4 = 4*8*16*4 = 2048.
FP32_NO_DROPOUT = 34816 + 4096 + 2048
# Dropout adds 2sbh + as^2b mask bytes and as^2b more elements: 1024 + 512 + 512*4 = 3584.
FP32_DROPOUT = FP32_NO_DROPOUT + 3584
# bf16 halves everything but the float32 head: 16*512*2 + 512*2 + 2*512*2 + 4096.
BF16_NO_DROPOUT = 17408 + 2048 + 2048


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([], FP32_NO_DROPOUT),
        (["model.dropout=0.1"], FP32_DROPOUT),
        (["precision=bf16"], BF16_NO_DROPOUT),
        (["precision=mixed"], BF16_NO_DROPOUT),
    ],
    ids=["fp32", "fp32_dropout", "bf16", "fp16"],
)
def test_transformer_activations_match_formula(extra, expected):
    assert layers_and_head(*extra) == expected


def test_transformer_activations_halve_16_bit_part():
    head = 4 * 8 * 16 * 4
    assert layers_and_head("precision=bf16") - head == (layers_and_head() - head) / 2


@pytest.mark.parametrize("s, b, h, a", [(48, 3, 40, 5), (20, 2, 64, 8)])
def test_16_bit_layer_with_dropout_is_korthikantis_34_plus_5as_over_h(s, b, h, a):
    # Asymmetric sizes (s != h, as/h not 1): swapping the sbh and as^2b coefficients fails.
    assert a * s != h and s != h
    expected = s * b * h * (34 + 5 * a * s / h)
    assert transformer_form.layer_bytes(s, b, h, a, 2, 0.1) == expected


def test_selective_drops_the_attention_core_but_one():
    # 3 layers, s=8, b=4, h=16, a=2: the core is as^2b*4 = 2048 bytes at fp32, no dropout.
    full = kept("model.layers=3")
    selective = kept("model.layers=3", "checkpointing=selective")
    assert full["backward"] - selective["backward"] == 2 * 2 * 8 * 8 * 4 * 4
    # the forward pass ends with no core kept: the last layer's is rebuilt in its backward
    assert full["forward"] - selective["forward"] == 3 * 2 * 8 * 8 * 4 * 4


def test_transformer_activations_linear_in_batch():
    small, large = kept("data.batch_size=4"), kept("data.batch_size=8")
    assert all(large[k] == 2 * small[k] for k in ("forward", "backward", "head"))


def test_checkpointing_blocks_shrinks_activations():
    layers = ["model.layers=4"]
    full = kept(*layers)["backward"]
    blocks = kept(*layers, "checkpointing.policy=blocks")
    sbhp = 8 * 4 * 16 * 4
    edges = 2 * sbhp
    assert blocks["backward"] < full
    # 4 block inputs kept + one block recomputed at a time; the forward ends with the inputs.
    assert blocks["backward"] == 4 * sbhp + (full - edges) / 4 + edges
    assert blocks["forward"] == 4 * sbhp + edges


@pytest.mark.usefixtures("fresh_session")
def test_the_transformers_peak_is_its_loss_or_its_last_layers_backward_not_both():
    """Without XLA the head's gradient (the logits' buffer) is freed once the logits layer's
    gradients exist, before the layers' backward peaks (allocator traces of 28 drawn
    transformers): the estimate is the larger of the two moments, not their sum. With many
    classes and one layer under `blocks` the loss is the peak: what the forward pass kept, the
    head and its backward; with few classes, the last layer's backward."""
    big = ["data.vocab_size=4096", "checkpointing=blocks"]
    cfg = compose_config(tiny_overrides("transformer") + big)
    spec = DataSpec("tokens", (8,), 4096, per_token=True, vocab_size=4096)
    held = transformer_form.kept(cfg, spec, 4, None)
    act, work, _ = transformer_form.activations(cfg, spec, 4, None)
    assert (act, work) == (held["forward"] + held["head"], held["head_backward"])
    assert held["head"] == 4 * 8 * 4096 * 4 and held["head_backward"] == (32 * 16 + 16 * 4096) * 4
    cfg = compose_config(tiny_overrides("transformer") + ["checkpointing=blocks"])
    held = transformer_form.kept(cfg, TOKENS, 4, None)
    act, work, _ = transformer_form.activations(cfg, TOKENS, 4, None)
    # here the last layer's MLP backward: GELU's output gradient and two float32 products
    assert (act, work) == (held["backward"], 48 * 8 * 4 * 16)
    parts = memory.estimate_memory(*built("transformer", "checkpointing=blocks"))
    assert (parts["activations"], parts["workspace"]) == (act, work)


def test_a_chunked_cores_backward_is_counted_after_its_layers_mlp_half_is_freed():
    """chunked_core.workspace is the core's own (measured on the core alone); when the core's
    backward runs, its layer's MLP activations (10sbh elements, and the two residual dropout
    masks) are freed. The standard core's fitted constants were fitted with them counted."""
    s, b, h = 256, 4, 16
    spec = DataSpec("tokens", (s,), 16, per_token=True, vocab_size=16)
    sbh = s * b * h
    for dropout in (0.0, 0.1):
        extra = ["model.attention=chunked", "model.attention_block=64", f"model.dropout={dropout}"]
        cfg = compose_config(tiny_overrides("transformer") + extra)
        held = transformer_form.kept(cfg, spec, 4, 64)
        act, work, _ = transformer_form.activations(cfg, spec, 4, 64)
        freed = 10 * sbh * 4 + (2 * sbh if dropout else 0)
        assert (act, work) == (
            held["backward"] - freed,
            chunked_core.workspace(s, b, h, 2, 4, dropout, 64),
        )
        assert act + work > held["backward"] + transformer_form.mlp_workspace(sbh, 4)
    cfg = compose_config(tiny_overrides("transformer") + ["data.seq_len=256"])
    act, work, _ = transformer_form.activations(cfg, spec, 4, None)
    core = transformer_form.core_workspace(s, b, h, 2, 4, 0.0)
    assert (act, work) == (transformer_form.kept(cfg, spec, 4, None)["backward"], core)


@pytest.mark.usefixtures("fresh_session")
def test_unknown_checkpointing_policy_fails():
    with pytest.raises(ValueError, match="checkpointing.policy=bogus"):
        activations("checkpointing.policy=bogus")


@pytest.mark.usefixtures("fresh_session")
def test_cnn_activations_proportional_to_batch():
    model, opt, cfg, spec = built("mobilenet")
    small = memory.estimate_memory(model, opt, cfg, spec)["activations"]
    cfg.data.batch_size *= 2
    large = memory.estimate_memory(model, opt, cfg, spec)["activations"]
    assert small > 0 and large == 2 * small


@pytest.mark.usefixtures("fresh_session")
def test_transformer_flops_palm_formula():
    model, _, cfg, spec = built("transformer", "accum=2")
    h, s, b = cfg.model.h, spec.seq_len, cfg.data.batch_size
    n = model.count_params() - spec.vocab_size * h - s * h  # minus token + position embeddings
    expected = (6 * n + 12 * cfg.model.layers * h * s) * b * 2 * s
    assert flops.model_flops_per_step(model, cfg, spec) == expected


def tiny_cnn():
    # Conv2D 3x3, 3 -> 4 channels on 8x8: 6*6*4 outputs x 27 MACs = 3888; Dense 144 -> 5: 720.
    return keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(4, 3),
            keras.layers.Flatten(),
            keras.layers.Dense(5),
        ]
    )


HAND_MACS = 3888 + 720


@pytest.mark.usefixtures("fresh_session")
def test_cnn_flops_from_profiler():
    spec = DataSpec("image", (8, 8, 3), 5)
    cfg = compose_config(tiny_overrides("mobilenet") + ["accum=2"])
    model = tiny_cnn()
    assert flops.kernel_macs(model) == HAND_MACS
    forward = flops.graph_forward_flops(model, spec)
    # The profiler counts 2 per MAC plus the bias adds (144 + 5).
    assert 2 * HAND_MACS <= forward <= 1.05 * 2 * HAND_MACS
    step = flops.model_flops_per_step(model, cfg, spec)
    assert step == 3 * forward * cfg.data.batch_size * 2


@pytest.mark.parametrize(
    "name, policy, tf32, peak, source",
    [
        ("NVIDIA H200", "mixed_bfloat16", True, 989e12, "table:H200"),
        ("NVIDIA H200", "float32", True, 494.7e12, "table:H200:tf32"),
        ("NVIDIA H100 80GB HBM3", "float32", False, 67e12, "table:H100"),
        ("NVIDIA A100-SXM4-80GB", "mixed_float16", True, 312e12, "table:A100"),
        ("NVIDIA A100-SXM4-80GB", "float32", True, 156e12, "table:A100:tf32"),
        ("NVIDIA A10", "float32", False, 31.2e12, "table:A10"),
        ("NVIDIA L4", "mixed_bfloat16", False, 121e12, "table:L4"),
        ("Tesla T4", "mixed_float16", True, 65e12, "table:T4"),
        ("Tesla V100-SXM2-16GB", "float32", True, 15.7e12, "table:V100"),  # no TF32 cores
    ],
)
def test_gpu_peak_table(name, policy, tf32, peak, source, tmp_path):
    assert flops.peak_flops(name, policy, tmp_path, tf32) == (peak, source)


@pytest.mark.parametrize("name", ["NVIDIA L40S", "NVIDIA A10G", "/GPU:0"])
def test_unknown_gpu_is_nan(name, tmp_path):
    value, source = flops.peak_flops(name, "float32", tmp_path)
    assert math.isnan(value) and source == "unknown"


@pytest.mark.parametrize(
    "args, expected",
    [
        ((1e12, 2.0, 1e12), 0.5),
        ((1e12, 0.0, 1e12), math.nan),
        ((1e12, 1.0, math.nan), math.nan),
        ((math.nan, 1.0, 1e12), math.nan),
        ((1e12, None, 1e12), math.nan),
    ],
)
def test_mfu(args, expected):
    value = flops.mfu(*args)
    assert (math.isnan(value) and math.isnan(expected)) or value == expected


@pytest.mark.usefixtures("fresh_session")
def test_workspace_without_xla_is_the_largest_float32_temporary():
    model, opt, cfg, spec = built("transformer", "model.layers=3")
    # s=8, b=4, h=16, a=2: GELU's backward (48sbh = 24576 bytes in float32: its output
    # gradient and two float32 products) beats the scores' 3.2as^2b = 1638.
    assert memory.estimate_memory(model, opt, cfg, spec)["workspace"] == 48 * 512
    bf16 = built("transformer", "model.layers=3", "precision=bf16")
    assert memory.estimate_memory(*bf16)["workspace"] == 56 * 512  # float32 copies
    # 16 heads at 64 tokens: as^2b = 16*64*64*4 = 262144 elements against sbh = 4096. The
    # scores' temporaries (per element by precision and dropout, fitted) win over GELU's
    # (48 or 56 sbh), the same for every policy.
    long = DataSpec("tokens", (64,), 16, per_token=True, vocab_size=16)
    for policy_name, dropout, per_score in (
        ("fp32", 0, 3.2),
        ("fp32", 0.1, 3.6),
        ("bf16", 0, 5.0),
        ("mixed", 0.1, 3.4),
    ):
        for policy in ("none", "blocks", "selective"):
            extra = [f"precision={policy_name}", f"model.dropout={dropout}", "model.heads=16"]
            cfg = compose_config(
                tiny_overrides("transformer") + extra + [f"checkpointing={policy}"]
            )
            p = memory.ACTIVATION_BYTES[cfg.precision.policy]
            _, work, _ = transformer_form.activations(cfg, long, p, None)
            assert work == int(per_score * 262144), (policy_name, dropout, policy)


def xla(*extra, spec=TOKENS):
    """The estimate of the tiny transformer compiled by XLA for a CPU."""
    model, optimizer, cfg, _ = built("transformer", *extra)
    return memory.estimate_memory(model, optimizer, cfg, spec, True)


# runner/estimate/xla_fitted.py written out for s=8, b=4, h=16, a=2 (sbh = as^2b = 512): a layer
# keeps (16 + 4) x 512 + 512 elements of 4 bytes = 43008, embedding and final norm 2 x 512 x 4.
XLA_LAYER, XLA_EDGES = 43008, 4096


@pytest.mark.usefixtures("fresh_session")
def test_under_xla_a_cpu_keeps_what_its_memory_plan_holds():
    none = xla("model.layers=2")
    assert none["activations"] == 2 * XLA_LAYER + XLA_EDGES
    # Inside a layer's backward: 6sbh float32; at the loss: logits and their gradient
    # (2 x 4*8*16*4 = 4096) and 3sbh float32 (6144). The layer's moment is the larger.
    assert none["workspace"] == 6 * 512 * 4
    blocks = xla("model.layers=2", "checkpointing=blocks")
    assert blocks["activations"] == 2 * 512 * 4 + XLA_LAYER + XLA_EDGES  # inputs + one rebuilt
    assert blocks["workspace"] == 5 * 512 * 4
    # A vocabulary of 256: logits of 4*8*256*4 = 32768 bytes make the loss the peak's moment.
    big = DataSpec("tokens", (8,), 256, per_token=True, vocab_size=256)
    loss = xla("model.layers=2", "data.vocab_size=256", spec=big)
    assert loss["workspace"] == 2 * 32768 + 3 * 512 * 4
    rebuilt = xla("model.layers=2", "data.vocab_size=256", "checkpointing=blocks", spec=big)
    assert rebuilt["workspace"] == 2 * 32768 + 3 * 512 * 4 - XLA_LAYER  # the layer is not rebuilt


@pytest.mark.usefixtures("fresh_session")
def test_under_xla_16_bit_policies_keep_float32_and_16_bit_copies():
    # 4 heads, so that as^2b = 1024 is not sbh = 512; edges 2 x 512 x p. XLA computes the dots
    # in float32: bfloat16 keeps (20 x 4 - 4 x 2) x sbh (its GELU output in bfloat16 alone) and
    # 6 bytes an as^2b (the float32 softmax and its bfloat16 rounding); with dropout 8 (the
    # bfloat16 draw in place of the output and 32 random bits) and 2 x 512 x 2 of sbh draws.
    heads = ("model.layers=2", "model.heads=4")
    assert xla(*heads, "precision=bf16")["activations"] == 2 * (72 * 512 + 6 * 1024) + 4096
    bf16 = xla(*heads, "precision=bf16", "model.dropout=0.1")["activations"]
    assert bf16 == 2 * (72 * 512 + 2048 + 8 * 1024) + 4096
    # float16: 6 bytes an sbh element (float32 copies beside float16), 8 an as^2b, 10 with
    # dropout (16 random bits).
    fp16 = xla(*heads, "precision=mixed", "model.dropout=0.1")["activations"]
    assert fp16 == 2 * (120 * 512 + 2048 + 10 * 1024) + 2 * 512 * 6
    fp32 = xla(*heads, "model.dropout=0.1")["activations"]  # the softmax, its output, 32 bits
    assert fp32 == 2 * (80 * 512 + 4096 + 12 * 1024) + 4096


@pytest.mark.usefixtures("fresh_session")
def test_under_xla_the_scores_gradient_replaces_what_dropout_kept():
    # 8 heads of 64 tokens: as^2b = 8 x 64^2 x 4 = 131072, sbh = 64 x 4 x 16 = 4096. Without
    # dropout the attention's backward holds the scores' gradients (1.14 as^2b float32) beside
    # the core's float32 softmax, less the MLP's 13sbh float32, freed: more than the MLP's
    # moment (6sbh float32).
    spec = DataSpec("tokens", (64,), 16, per_token=True, vocab_size=16)
    shape = ("model.layers=1", "model.heads=8", "data.seq_len=64")
    plain = xla(*shape, spec=spec)["workspace"]
    assert plain == int(4.56 * 131072) - 13 * 4096 * 4
    # With dropout the core keeps 12 bytes an as^2b, more than the 8.56 of that moment: the
    # gradients take the place of dropout's output and draw, and the MLP's moment is the peak.
    dropout = xla(*shape, "model.dropout=0.1", spec=spec)["workspace"]
    assert dropout == 6 * 4096 * 4


@pytest.mark.usefixtures("fresh_session")
def test_under_xla_dropout_masks_stay_alive_until_their_segment_is_rebuilt():
    # 4 heads, so that as^2b = 1024 is not sbh = 512. With dropout a layer keeps 20sbh, the
    # softmax output, its float32 mask and the dropout output (3 x 1024), and its two sbh masks:
    # 40960 + 12288 + 4096 = 57344 bytes; a layer's masks, drawn in the forward and alive until
    # it is rebuilt: (1024 + 2 x 512) x 4 = 8192.
    layer, mask, dropout = 57344, 8192, ("model.layers=3", "model.heads=4", "model.dropout=0.1")
    # blocks: the last layer is rebuilt first, beside the masks of the two before it.
    blocks = xla(*dropout, "checkpointing=blocks")
    assert blocks["activations"] == 3 * 512 * 4 + 2 * mask + layer + XLA_EDGES
    # every 2: segments of 2 and 1 layers; the first, rebuilt with no mask before it, holds more.
    every = xla(*dropout, "checkpointing=every")
    assert every["activations"] == 2 * 512 * 4 + 2 * layer + XLA_EDGES


@pytest.mark.usefixtures("fresh_session")
def test_under_xla_a_chunked_cores_loop_stays_alive_until_its_layer_is_rebuilt():
    # Blocks of 4 keys, 2 a sequence of 8. A chunked layer keeps 20sbh, the logsumexp (asb =
    # 64 floats) and the forward's scaled queries and blocked keys and values (3sbh):
    # 40960 + 256 + 6144 = 47360 bytes. What its forward loop leaves alive until the layer is
    # rebuilt (read off XLA's plans): 4sbh float32 copies of its operands and the running max
    # and sum (2asb): 8192 + 512 = 8704.
    layer, loop, chunked = 47360, 8704, ("model.attention=chunked", "model.attention_block=4")
    blocks = xla("model.layers=3", *chunked, "checkpointing=blocks")
    assert blocks["activations"] == 3 * 512 * 4 + 2 * loop + layer + XLA_EDGES
    # The rebuilt layer's MLP moment (5sbh float32) holds the core's backward operands besides
    # (3sbh float32 and sbh): 10240 + 8192. At the loss: logits and their gradient (4096),
    # 3sbh (6144) and the 3 layers' loops, less the rebuilt layer: 36352 - 47360 < 0.
    assert blocks["workspace"] == 5 * 512 * 4 + 4 * 512 * 4
    # With dropout a layer's two sbh masks (4096 bytes) stay alive too, as the standard's: the
    # two layers' before the rebuilt one, and the rebuilt layer's own.
    dropped = xla("model.layers=3", *chunked, "checkpointing=blocks", "model.dropout=0.1")
    assert dropped["activations"] == blocks["activations"] + 3 * 4096
    # One key block (8 >= 8 tokens): XLA removes the loops and merges the backward's scores
    # and dropout factors with the forward's; the core keeps what the standard core keeps.
    for policy in ("none", "blocks"):
        job = ("model.layers=2", "model.dropout=0.1", f"checkpointing={policy}")
        one = xla(*job, "model.attention=chunked", "model.attention_block=8")
        standard = xla(*job)
        assert (one["activations"], one["workspace"]) == (
            standard["activations"],
            standard["workspace"],
        )


@pytest.mark.usefixtures("fresh_session")
def test_under_xla_only_float32_updates_free_gradients_as_they_come():
    # One layer: its MLP's two kernels (16 x 64 floats each) are the largest variables, and
    # the third is smaller, so one kernel or three variables would give another sum.
    model, *_ = built("transformer")
    sizes = sorted((math.prod(v.shape) * 4 for v in model.trainable_variables), reverse=True)
    assert sizes[:3] == [4096, 4096, 1024]
    assert xla()["gradients"] == 8192
    assert xla("precision=bf16")["gradients"] == sum(sizes)
    # An accumulating step adds every gradient to its sum after the backward: all alive.
    assert xla("accum=2")["gradients"] == sum(sizes)
    assert memory.estimate_memory(*built("transformer"))["gradients"] == sum(sizes)


def two_block_cnn():
    """stem -> block_1 (expand 4->8, BatchNorm, ReLU, project 8->4) -> block_2 (the same) ->
    pooling -> head, on 8x8 images: 64 positions, so a tensor of c channels has 64c elements."""
    x = keras.Input((8, 8, 3))
    y = keras.layers.Conv2D(4, 1, name="stem")(x)
    for n in (1, 2):
        y = keras.layers.Conv2D(8, 1, name=f"block_{n}_expand")(y)
        y = keras.layers.BatchNormalization(name=f"block_{n}_expand_BN")(y)
        y = keras.layers.ReLU(name=f"block_{n}_relu")(y)
        y = keras.layers.Conv2D(4, 1, name=f"block_{n}_project")(y)
    y = keras.layers.GlobalAveragePooling2D(name="pool")(y)
    return keras.Model(x, keras.layers.Dense(10, name="head")(y))


@pytest.mark.parametrize(
    "name, activations, workspace, copies",
    [
        ("fp32", (256 + 256 + 512 + 4 * 192) * 4, 512 * 4 + 3 * 512 * 4, 0),
        ("bf16", 6144 + 192 * 2, 7168, (3 * 4 + 4 * 8 + 8 * 4 + 4 * 8) * 2),
    ],
)
@pytest.mark.usefixtures("fresh_session")
def test_a_rebuilt_cnn_segment_peaks_in_its_batchnorms_backward(
    name, activations, workspace, copies
):
    # Inside the last rebuilt block the peak is the BatchNorm's backward: its 512-element output
    # gradient beside three float32 temporaries of its input (runner/estimate/layer_rules.py
    # NORM_TEMPORARIES). Alive then: the two segments' inputs (256 each), the expansion's
    # output the BatchNorm reads (512) and four micro-batches of input (4 x 192: the step's and
    # those the pipeline holds, calibration.INPUT_MICRO_BATCHES); the ReLU's output was freed by
    # the ReLU's backward. Under bfloat16 the segments' inputs are 16-bit (2 x 256 x 2),
    # the BatchNorm keeps its float32 copy (512 x 4) instead of the expansion's output, and its
    # output gradient is 16-bit: 512 x 2 + 3 x 512 x 4; the stem keeps its bfloat16 cast of the
    # float32 images (192 x 2: kernel_copies.input_cast_bytes). Beside them, whatever the batch, the
    # 16-bit copies of the kernels whose input gradients are still to come: the stem's, both of
    # block_1's and block_2's expansion (tests/test_kernel_copies.py).
    cfg = compose_config(
        [*tiny_overrides("mobilenet"), f"precision={name}", "checkpointing=blocks"]
    )
    with precision.policy(cfg.precision):
        model = two_block_cnn()
        _, remat = checkpointing.apply(model, "blocks", 1)
        optimizer = build_optimizer(cfg.trainer)
        optimizer.build(model.trainable_variables)
    assert remat.segments == 2
    b = cfg.data.batch_size
    # The layers' rules alone: the executor's (runner/estimate/conv_scratch.py's buffers, the
    # gradients in flight) depend on the CPU's kernels and are tested in test_conv_scratch.
    p = memory.ACTIVATION_BYTES[cfg.precision.policy]
    kept, work, _ = graph_walk.walk_step(model, b, p, remat, timeline.Executor())
    kept += resident.inputs_bytes(memory.input_shapes(model), b)  # the pipeline's micro-batches
    assert (kept, work) == (activations * b + copies, workspace * b)


LOSS_SCALED = [
    "model=transformer", "model.h=128", "model.layers=1", "model.heads=4", "data.seq_len=300",
    "data.vocab_size=4096", "data.batch_size=2", "precision=mixed", "checkpointing=none",
    "trainer.jit_compile=false", "data.train_samples=6", "data.val_samples=2",
    "trainer.max_steps=3", "trainer.save_model=false", "trainer.progress=false",
]  # fmt: skip


def test_a_loss_scaled_steps_gradients_are_not_alive_at_its_loss():
    """A loss-scaled accum=1 transformer without XLA whose loss moment (the logits' buffer, 300
    x 2 x 4,096 floats, and the head's backward: 15.7 MiB) and two copies of its gradients
    (9.8 MiB) are of a size: the step's peak is the loss, with no gradient but the head's.
    Run as a user runs it (a fresh process): 37.1 MiB measured, 36.6 estimated (1.01-1.02 in
    two runs); counting every gradient twice beside the loss, as before, the estimate was
    47.4 (0.78)."""
    from runner.bench import run_jobs

    (figures,) = run_jobs({"loss-scaled": LOSS_SCALED}, []).values()
    ratio = figures["mem/peak_bytes"] / figures["mem/estimate_bytes"]
    parts = {k: figures[k] for k in figures if k.startswith("mem/estimate/")}
    assert 0.85 <= ratio <= 1.15, (ratio, parts)
