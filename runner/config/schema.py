"""The config's schema: one dataclass per kind of option, which every YAML in conf/ extends.

Each option file names its schema in its defaults list (`base_<option>`, stored by
runner.config.store), so a typo'd key or a wrong type fails at compose time. Nothing here
imports TensorFlow: bad input is rejected before the slow import.
"""

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from runner.schedules import Schedule

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("constant", "cosine")
CHECKPOINTING_POLICIES = ("none", "blocks", "sqrt", "every", "selective")
STRATEGIES = ("none", "mirrored", "multi_worker")  # distribution.strategy
PRECISION_NAMES = ("fp32", "mixed", "bf16")  # conf/precision/*.yaml
JIT_CHOICES = ("auto", "true", "false")
IMAGE_MODELS = ("mobilenet", "efficientnet")
DEPLOY_NAMES = ("none", "litert")
DEPLOY_VARIANTS = ("saved_model", "float32", "float16", "dynamic_int8", "int8", "sparse")


@dataclass
class TransformerConfig:
    name: str = "transformer"
    h: int = 128
    layers: int = 2
    heads: int = 4
    dropout: float = 0.0
    attention: str = "standard"  # or chunked: exact, memory linear in the sequence length
    attention_block: int = 128  # chunked: keys per block
    weights: str | None = None


@dataclass
class MobileNetConfig:
    name: str = "mobilenet"
    version: str = "v2"
    alpha: float = 1.0
    weights: str | None = None


@dataclass
class EfficientNetConfig:
    name: str = "efficientnet"
    variant: str = "B0"
    weights: str | None = None


@dataclass
class KerasAppConfig:
    """Any keras.applications model by name (models/keras_app.py): fed raw [0, 255] pixels, it
    applies the application's own preprocess_input in front of itself."""

    _target_: str = "models.keras_app.build_keras_app"
    name: str = "MobileNetV3Small"
    weights: str | None = None
    input_kind: str = "image"
    input_range: list[float] = field(default_factory=lambda: [0.0, 255.0])


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    policy: str = "float32"
    # Dynamic loss scaling (float16 only): Keras LossScaleOptimizer's defaults.
    loss_scaling: bool = False
    initial_scale: float = 32768.0
    dynamic_growth_steps: int = 2000


@dataclass
class CheckpointingConfig:
    policy: str = "none"  # none | blocks | sqrt | every | selective
    every: int = 2  # policy=every: blocks per recomputed segment


@dataclass
class DistributionConfig:
    """How many replicas train the job (runner/techniques/distribution.py, issue 18)."""

    strategy: str = "none"  # none | mirrored | multi_worker
    devices: list[str] | None = None  # mirrored: the devices; null: every GPU, else every CPU
    logical_cpus: int = 0  # >= 2: split the CPU into that many logical devices (no GPU needed)


@dataclass
class DeployConfig:
    """The kept model measured where it runs (runner/deploy/, issue 49); deploy=none: not."""

    name: str = "none"  # none | litert
    variants: list[str] = field(default_factory=list)  # of DEPLOY_VARIANTS
    batch_size: int = 32  # latency is timed at batch 1 and at this batch
    threads: int | None = None  # the runtime's threads; null: the machine's cores
    calibration_batches: int = 10  # int8: batches of the job's own training split
    repeats: int = 50  # timed calls per latency
    warmup: int = 5  # untimed calls before them
    warmup_s: float = 0.5  # and untimed calls for at least this long
    min_time_s: float = 1.0  # timed calls for at least this long, even past `repeats`
    rounds: int = 3  # each variant measured this many times, round-robin, each a fresh process


@dataclass
class TrainerConfig:
    optimizer: str = "adam"
    lr: float = 1e-3
    schedule: str = "constant"  # constant | cosine (over the run's optimizer steps)
    warmup_steps: int = 0  # cosine only: linear warm-up from 0 to lr
    weight_decay: float = 0.0  # adamw only
    momentum: float = 0.9  # sgd only
    max_steps: int | None = None  # optimizer steps; None: epochs x steps per epoch
    epochs: int = 1
    eval_every: int = 0  # optimizer steps between evaluations; 0: only at the end
    eval_batches: int | None = None  # cap on validation batches; None: the whole split
    jit_compile: str = "auto"  # auto: XLA on GPUs, and on CPUs for the transformer
    seed: int = 0
    device: str = "auto"  # auto | cpu | gpu | /GPU:n | /CPU:n
    progress: bool = True
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: only on SIGTERM/SIGINT
    resume: str | None = None  # a run directory, or latest (the newest of the same job)
    deterministic: bool = False  # TensorFlow's op determinism: a resumed run ends bitwise equal
    # Before each evaluation, BatchNorm statistics re-estimated on this many training
    # micro-batches (runner/train/batchnorm.py); 0: evaluate with the moving averages.
    bn_recalibrate: int = 0
    save_model: bool = True  # the trained model kept: <run dir>/model.keras, an MLflow logged model
    # The effective batch (micro-batch x accum) accum=auto and runner.plan reach; null:
    # data.batch_size x accum as given.
    effective_batch_size: int | None = None


@dataclass
class MlflowConfig:
    tracking_uri: str = "sqlite:///outputs/mlflow.db"
    experiment: str = "tfmemlab"
    run_name: str | None = None  # None: the Hydra overrides, e.g. "precision=mixed accum=4"
    system_metrics: bool = False  # MLflow's own CPU/GPU/RAM sampling, as system/* metrics
    system_metrics_interval_s: float = 2.0


@dataclass
class SweepConfig:
    # The job the sweep's comparison divides by: a run name or job number; None: the first.
    baseline: str | None = None
    # Config groups or keys the jobs compare on purpose (e.g. [model]): the comparison does not
    # mark a difference there as unlike (runner/track/compare.py).
    varies: list[str] = field(default_factory=list)
    # Each job in a fresh process (memory figures of one job must not depend on the jobs
    # before it); false: jobs run in the sweep's process, faster to start.
    isolate: bool = True
    # A sweep directory (or `latest`) to launch again: finished jobs are skipped, stopped ones
    # go on from their checkpoints, failed ones run again (runner/sweep/resume.py).
    resume: str | None = None
    # Each job run this many times, each in a fresh process, interleaved (A B A B): the
    # comparison then gives each ratio an interval (runner/sweep/repeats.py, docs/sweeps.md).
    repeats: int = 1
    repeat: int = 0  # which of them this is: set by the sweep for each run, not by hand


@dataclass
class PlanConfig:
    # Memory budget for accum=auto and runner.plan: bytes or a unit string (8GiB, 512MiB); null:
    # the GPU's total memory, or on a CPU TF_CPU_BFC_MEM_LIMIT_IN_MB (runner/plan/).
    budget: str | None = None
    margin: float = 0.1  # the share of the budget kept free for what the prediction misses
    measure: bool = False  # runner.plan: confirm each row that fits with a short probe
    # runner.plan: time the job's own factors in probes (runner/plan/timing.py): fp32/none in
    # one micro-batch and in two, each other precision and policy alone; rows built from them.
    time_probes: bool = False
    precisions: list[str] = field(default_factory=lambda: ["fp32", "mixed", "bf16"])
    policies: list[str] = field(default_factory=lambda: ["none", "selective", "blocks", "sqrt"])
    attention: list[str] = field(default_factory=lambda: ["standard"])  # the transformer's kinds


@dataclass
class ProfileConfig:
    # Profile the job layer by layer after its timed steps (runner/measure/profile.py, issue 14).
    layers: bool = False
    steps: int = 3  # steps of the job's train step timed without XLA, after one warm-up
    repeats: int = 3  # timed forward+backward calls per layer (the median is kept)


@dataclass
class Config:
    model: Any = MISSING
    precision: PrecisionConfig = MISSING
    checkpointing: CheckpointingConfig = MISSING
    pruning: Schedule = MISSING  # one class per schedule: runner/schedules/
    distribution: DistributionConfig = MISSING
    deploy: DeployConfig = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = MISSING
    accum: Any = 1  # an integer >= 1, or auto (runner/plan/)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
