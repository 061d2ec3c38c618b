"""One way to build a train step: a `StepSpec` says what decides the compiled step, `build_step` builds it on a
mesh, and the trainer, the planner, the benchmarks and the tests all run what it returns.

    spec = StepSpec.from_config(config, platform="gpu", total_steps=schedule.total_steps)
    spec = StepSpec.for_model("ViT-L-14", "bf16", fsdp=True)  # or from a model name and the fields that differ
    mesh = mesh_for(spec)                     # 1-D over every device, or the FSDP grid when the weights need one
    step = build_step(spec, mesh)
    state = step.init(seed=0)                 # or step.state_from_params(params)
    state, metrics = step(state, global_batch)
    compiled = step.compile(per_device_batch=64)  # ahead of time from abstract inputs (XLA:GPU on GPU meshes)

A spec is a frozen, hashable value: the planner keys its compiles on it and varies one field at a time with
`dataclasses.replace`. The step function itself (`clip_jax.training.train_step.make_train_step`, or for a spec with a
`ClassifierHead` the fine-tuning step of `clip_jax.training.classification_step`) stays pure; this module only
assembles its parts: the model under the precision policy, remat and attention kernel; the optimizer and its
learning-rate schedule (with layer-wise decay when asked); the train state's shapes and shardings (FSDP or
replicated, said here explicitly, never guessed back from shardings).
"""

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from clip_jax.errors import InvalidInput
from clip_jax.models import CLIPConfig, create_model, get_model_config, init_variables, is_resnet, param_shapes
from clip_jax.models.config import as_trained
from clip_jax.models.naflex import image_input_shape, patch_budget
from clip_jax.models.fused_layer_norm import FUSED_KERNELS
from clip_jax.models.attention import choose_attention_impl
from clip_jax.models.precision import get_policy, model_grad_dtype, model_residual_dtype
from clip_jax.optim.lock import LockSpec, check_resnet_lock, locked_optimizer, stop_locked_gradients
from clip_jax.runtime import xla_gpu
from clip_jax.runtime.mesh import batch_sharding, create_mesh, data_parallel_size, state_shardings
from clip_jax.text.model_tokenizer import with_run_tokenizer
from clip_jax.training import classification_step
from clip_jax.training.loss import LOSSES
from clip_jax.training.loss_scale import LossScaleSpec
from clip_jax.training.optimizer_spec import OPTIMIZERS, OptimizerSpec  # noqa: F401  (the names step specs take)
from clip_jax.training.policy_state import initial_policy_state
from clip_jax.training.spike_telemetry import every_n_steps, step_telemetry
from clip_jax.training.train_step import TrainState, init_train_state, make_forward, make_train_step

@dataclasses.dataclass(frozen=True)
class ClassifierHead:
    """A step that fine-tunes for classification (`training.classification_step`): the image tower and a linear
    head of `classes` outputs trained with cross-entropy on labelled images, the text tower no part of it, and the
    EMA of the trained weights (`ema_decay`; 0: the weights themselves) carried in the state."""

    classes: int
    ema_decay: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What decides the compiled train step, besides the batch and the mesh. `model` is the model as the step trains
    it; a spec is built from a model name or OpenCLIP config with `for_model`, from a training config with
    `from_config`, which give it the siglip head and patch dropout rate its `loss` and `patch_dropout` ask for."""

    model: CLIPConfig
    precision: str = "fp32"
    remat_policy: str = "none"  # applied to every residual block; "none": keep all activations
    attention_impl: str = "xla"  # the kernel, as chosen: "xla" or "cudnn" (see `choose_attention_impl`)
    fsdp: bool = False  # params and optimizer state split over the devices (ZeRO-3), else replicated
    # "clip": OpenCLIP's softmax loss; "siglip": the sigmoid loss, whose model has a logit_bias (`for_model` gives
    # a model config without init_logit_bias OpenCLIP's --siglip head: scale ln 10, bias -10)
    loss: str = "clip"
    optimizer: OptimizerSpec = OptimizerSpec()
    accum_steps: int = 1  # micro-batches per step, the loss still over the whole batch (OpenCLIP's accum_freq)
    # Patch dropout in training: None keeps the model config's `vision.patch_dropout`; a rate replaces it there
    # (OpenCLIP's --force-patch-dropout; `for_model`), so `model` holds the rate the step runs with, FLOPs count it.
    patch_dropout: float | None = None
    seed: int = 0  # the run's seed: each step's kept patches are drawn from (seed, step)
    # Spike telemetry (clip_jax.training.spike_telemetry) as metrics["telemetry"] on every this many steps (the
    # trainer's logging steps); 0: off, no telemetry in the metrics
    telemetry_every: int = 0
    # Locked towers (LiT, OpenCLIP's --lock-image / --lock-text): their params get no update and no optimizer state.
    lock: LockSpec = LockSpec()
    grad_reduce_dtype: str = "float32"  # gradients summed across devices in this dtype (see models.precision)
    residual_dtype: str = "auto"  # the residual stream's dtype: "compute", "float32", "auto" (float32 under fp16)
    head: ClassifierHead | None = None  # a classification fine-tuning step; None: CLIP's contrastive step
    # the residual blocks' adds and LayerNorms: "off" (XLA's fusions) or "pallas" (Pallas kernels for a GPU, not yet
    # timed on one; models.fused_layer_norm); "pallas_interpret" runs those kernels through Pallas's interpreter
    fused_kernels: str = "off"
    unroll_layers: bool = False  # the towers' blocks unrolled, not scanned (models.layers.Transformer)
    loss_scale: LossScaleSpec = LossScaleSpec()  # a policy with `loss_scaling` (fp16): its dynamic loss scale
    # A NaFlex image tower's patch budget: its images are NaFlex rows [B, max_num_patches, P * P * 3 + 2]
    # (clip_jax.models.naflex); None for any other tower, which refuses one.
    max_num_patches: int | None = None

    def __post_init__(self):
        if not isinstance(self.model, CLIPConfig):
            raise InvalidInput(f"StepSpec's model is a CLIPConfig, the model as the step trains it; got "
                               f"{type(self.model).__name__}: build the spec with StepSpec.for_model(name_or_config)")
        model_grad_dtype(get_policy(self.precision), self.grad_reduce_dtype)  # fails on a bad name
        model_residual_dtype(get_policy(self.precision), self.residual_dtype)
        if self.attention_impl not in ("xla", "cudnn"):
            raise ValueError(f"attention_impl={self.attention_impl!r}: a step compiles with 'xla' or 'cudnn' "
                             "(resolve 'auto' with choose_attention_impl)")
        if self.fused_kernels not in FUSED_KERNELS:
            raise InvalidInput(f"fused_kernels={self.fused_kernels!r}: choose one of {FUSED_KERNELS}")
        if self.loss not in LOSSES:
            raise InvalidInput(f"loss {self.loss!r}: choose one of {tuple(LOSSES)}")
        if self.accum_steps < 1:
            raise InvalidInput(f"accum_steps must be >= 1, got {self.accum_steps}")
        if self.telemetry_every < 0:
            raise InvalidInput(f"telemetry_every must be >= 0 (0: off), got {self.telemetry_every}")
        if self.max_num_patches is not None:
            patch_budget(self.model.vision, self.max_num_patches, self.model.name)
        if is_resnet(self.model):
            _check_resnet_step(self)
        if self.head is not None:
            _check_classifier_step(self)
        if self.model != self._trained(self.model):
            raise InvalidInput(f"{self.model.name} is not the model this step trains (loss {self.loss!r}, "
                               f"patch_dropout {self.patch_dropout}): build the spec with StepSpec.for_model, which "
                               "gives the model the head and patch dropout rate they ask for")

    def _trained(self, model: CLIPConfig) -> CLIPConfig:
        return as_trained(model, siglip_head=self.loss == "siglip", patch_dropout=self.patch_dropout)

    @classmethod
    def for_model(cls, model, *fields, image_size: int | None = None, **named) -> "StepSpec":
        """The spec of `model` (anything `get_model_config` takes) at `image_size` (None: its own) as a step with
        these fields trains it: OpenCLIP's --siglip head under the sigmoid loss (a model with a logit_bias keeps its
        own), `patch_dropout` in place of the config's rate (a ViT's). The one way a spec's model is derived."""
        model = as_trained(get_model_config(model), image_size=image_size,
                           siglip_head=named.get("loss", "clip") == "siglip", patch_dropout=named.get("patch_dropout"))
        return cls(model, *fields, **named)

    @classmethod
    def from_config(cls, config, *, platform: str, total_steps: int | None = None,
                    precision: str | None = None, compute_capability: tuple[int, int] | None = None,
                    lr_segments: tuple = ()) -> "StepSpec":
        """The step a training config describes, for devices of `platform` ("gpu", "cpu") of `compute_capability`
        (None: unknown), on which "auto" attention depends. `precision` replaces the config's (a rollback);
        `total_steps` and `lr_segments`: the learning-rate schedule's (`OptimizerSpec`)."""
        precision = precision or config.precision
        if config.fused_kernels == "pallas" and platform != "gpu":
            raise InvalidInput(f"fused_kernels='pallas' compiles Triton kernels for a GPU, not for {platform}: set "
                               "--config.fused_kernels=off (or pallas_interpret, the same kernels interpreted)")
        optimizer = OptimizerSpec.from_config(config, total_steps, lr_segments)
        force_patch_dropout = config.force_patch_dropout  # -1: the model config's rate
        model = with_run_tokenizer(get_model_config(config.model), config)  # the tokenizer changes no parameter
        return cls.for_model(model, precision, config.remat_policy if config.grad_checkpointing else "none",
                             choose_attention_impl(config.attention_impl, platform,
                                                   get_policy(precision).compute_dtype, compute_capability),
                             image_size=config.force_image_size, fsdp=bool(config.fsdp), loss=config.loss,
                             optimizer=optimizer, accum_steps=config.accum_freq,
                             patch_dropout=None if force_patch_dropout is None or force_patch_dropout < 0
                             else force_patch_dropout, seed=config.seed, lock=lock_spec(config),
                             telemetry_every=config.log_every_n_steps if config.spike_telemetry else 0,
                             grad_reduce_dtype=config.grad_reduce_dtype, residual_dtype=config.residual_dtype,
                             fused_kernels=config.fused_kernels, unroll_layers=config.unroll_layers,
                             loss_scale=LossScaleSpec(config.loss_scale_init, config.loss_scale_growth_interval))

    def create_model(self):
        policy = get_policy(self.precision)
        return create_model(self.model, dtype=policy.compute_dtype, param_dtype=policy.param_dtype,
                            remat_policy=self.remat_policy, attention_impl=self.attention_impl,
                            grad_dtype=model_grad_dtype(policy, self.grad_reduce_dtype),
                            residual_dtype=model_residual_dtype(policy, self.residual_dtype), fp8=policy.fp8,
                            fused_kernels=self.fused_kernels, unroll_layers=self.unroll_layers)

    def describe(self) -> str:
        patch_dropout = self.model.vision.patch_dropout
        return (f"{self.precision}, remat {self.remat_policy}, fsdp {'on' if self.fsdp else 'off'}, "
                f"attention {self.attention_impl}" + (f", loss {self.loss}" if self.loss != "clip" else "")
                + (f", patch dropout {patch_dropout:g}" if patch_dropout else "")
                + (f", fused kernels {self.fused_kernels}" if self.fused_kernels != "off" else "")
                + (", layers unrolled" if self.unroll_layers else "")
                + (f", {self.max_num_patches} patches an image" if self.max_num_patches else ""))


def _check_resnet_step(spec: StepSpec) -> None:
    """What the step of a ResNet image tower (BatchNorm statistics in the train state) is not built with: patch
    dropout (no patches) and a partly unlocked image tower (locked whole or not at all, as OpenCLIP's)."""
    if spec.patch_dropout:
        raise InvalidInput(f"{spec.model.name}: patch_dropout={spec.patch_dropout} is a ViT option; a ResNet image "
                           "tower has no patches to drop: leave it out")
    check_resnet_lock(spec.lock)


def _check_classifier_step(spec: StepSpec) -> None:
    """What a classification fine-tuning step is not built with: a ResNet image tower (no layer-wise decay over it),
    accumulation, locked towers, FSDP (its weights are replicated)."""
    if is_resnet(spec.model):
        raise InvalidInput(f"{spec.model.name}: fine-tuning with layer-wise learning-rate decay needs a ViT image "
                           "tower; a ResNet tower is not supported")
    if spec.accum_steps != 1 or spec.lock.any or spec.fsdp:
        raise InvalidInput("a classification fine-tuning step takes no accum_steps, lock or fsdp: leave them out")


def fresh_train_state(model, optimizer: optax.GradientTransformation, rng: jax.Array, policy_state=None) -> TrainState:
    """A freshly initialised train state: params, optimizer state, (a ResNet image tower) batch_stats, policy_state."""
    variables = init_variables(model, rng)
    return init_train_state(variables["params"], optimizer, variables.get("batch_stats"), policy_state)


def lock_spec(config) -> LockSpec:
    """The towers a training config locks."""
    return LockSpec(image=bool(config.lock_image), image_unlocked_groups=int(config.lock_image_unlocked_groups),
                    image_freeze_bn_stats=bool(config.lock_image_freeze_bn_stats), text=bool(config.lock_text),
                    text_unlocked_layers=int(config.lock_text_unlocked_layers))


def mesh_for(spec: StepSpec, devices=None) -> Mesh:
    """The mesh `spec` trains on over `devices` (default: all): 1-D, or under FSDP a (replica, data) grid where the
    device count divides no dimension of some large weight (`create_mesh`)."""
    return create_mesh(devices, fsdp_params=param_shapes(create_model(spec.model)) if spec.fsdp else None)


@dataclasses.dataclass(frozen=True)
class Step:
    """A `StepSpec` built on a mesh: call it as `step(state, batch) -> (state, metrics)` (the jitted update; the
    old state is donated)."""

    spec: StepSpec
    mesh: Mesh
    model: Any
    optimizer: optax.GradientTransformation
    learning_rate_fn: Callable
    abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings: nothing allocated
    update: Callable

    @property
    def shardings(self) -> TrainState:
        return jax.tree.map(lambda s: s.sharding, self.abstract_state)

    def __call__(self, state: TrainState, batch: dict):
        return self.update(state, batch)

    def init(self, seed: int | jax.Array) -> TrainState:
        """A fresh train state, initialised directly in its shardings: no device ever holds more than its part."""
        if self.spec.head is not None:
            raise InvalidInput("a classification fine-tuning step starts from pretrained weights: state_from_params")
        rng = jax.random.key(seed) if isinstance(seed, int) else seed
        policy_state = initial_policy_state(self.spec)
        init = lambda rng: fresh_train_state(self.model, self.optimizer, rng, policy_state)  # noqa: E731
        return jax.jit(init, out_shardings=self.shardings)(rng)

    def state_from_params(self, params, batch_stats=None) -> TrainState:
        """The train state of existing weights (fresh optimizer state, step 0), laid out on the mesh; a ResNet
        image tower's also needs its BatchNorm statistics; a classifier step's are CLIP's with a `head`."""
        if self.spec.head is not None:
            init = lambda params: classification_step.init_state(params, self.optimizer)  # noqa: E731
            return jax.jit(init, out_shardings=self.shardings)(params)
        if (batch_stats is None) != (self.abstract_state.batch_stats is None):
            raise InvalidInput(f"{self.spec.model.name}: batch_stats are needed exactly when the image tower is a "
                               "ResNet (its BatchNorm statistics)")
        policy_state = initial_policy_state(self.spec)
        init = lambda params, stats: init_train_state(params, self.optimizer, stats, policy_state)  # noqa: E731
        return jax.jit(init, out_shardings=self.shardings)(params, batch_stats)

    def abstract_batch(self, per_device_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The global batch as the data pipeline delivers it, split over the mesh."""
        config = self.spec.model
        rows, sharding = per_device_batch * data_parallel_size(self.mesh), batch_sharding(self.mesh)
        image = image_input_shape(config.vision, self.spec.max_num_patches, config.name)  # NaFlex: its rows
        images = jax.ShapeDtypeStruct((rows, *image), jnp.float32, sharding=sharding)
        if self.spec.head is not None:
            return {"images": images, "labels": jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding)}
        return {"images": images,
                "tokens": jax.ShapeDtypeStruct((rows, config.text.context_length), jnp.int32, sharding=sharding)}

    def compile(self, per_device_batch: int):
        """The step compiled from abstract inputs (by XLA:GPU when the mesh's devices are compile-only GPUs)."""
        return _compile(self.update.lower(self.abstract_state, self.abstract_batch(per_device_batch)), self.mesh)

    def forward(self) -> Callable:
        """`forward(params, batch) -> (image_features, text_features, logit_scale[, logit_bias])` as the step runs
        it; a ResNet image tower's, `forward(params, batch, batch_stats) -> (outputs, batch_stats)` in train mode
        (BatchNorm on the batch's statistics, the running ones updated)."""
        return make_forward(self.model, self.mesh, fsdp=self.spec.fsdp,
                            batch_norm="batch" if is_resnet(self.spec.model) else None)

    def compile_forward(self, per_device_batch: int):
        """Both towers' forward pass as the step runs it (what a forward's FLOPs are counted on), compiled."""
        inputs = (self.abstract_state.params, self.abstract_batch(per_device_batch))
        if is_resnet(self.spec.model):
            inputs += (self.abstract_state.batch_stats,)
        return _compile(jax.jit(self.forward()).lower(*inputs), self.mesh)


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device from XLA's memory analysis of a compiled program."""

    argument: int
    output: int
    alias: int  # outputs written into donated arguments (the train state)
    temp: int

    @property
    def total(self) -> int:
        # What the program holds at once; XLA:CPU's peak_memory_in_bytes is not meaningful.
        return self.argument + self.output - self.alias + self.temp

    @classmethod
    def of(cls, compiled) -> "StepMemory":
        m = compiled.memory_analysis()
        return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes)


def _compile(lowered, mesh: Mesh):
    if mesh.devices.flat[0].platform == "gpu":
        return xla_gpu.compile_lowered(lowered)
    return lowered.compile()


def build_step(spec: StepSpec, mesh: Mesh) -> Step:
    """The model, optimizer, train-state layout and jitted step of `spec` on `mesh`."""
    if spec.fused_kernels == "pallas" and spec.head is not None and mesh.size > 1:
        # the classifier's step does not run the kernels per device: XLA would gather every device's rows for them
        raise InvalidInput(f"fused_kernels='pallas' in a classifier fine-tuning step runs on one device only, not a "
                           f"mesh of {mesh.size}: set --config.fused_kernels=off")
    model = spec.create_model()
    learning_rate_fn = spec.optimizer.learning_rate_fn()
    if spec.head is not None:
        return _classifier_step(spec, mesh, model, learning_rate_fn)
    optimizer = spec.optimizer.create(learning_rate_fn)
    if spec.optimizer.layer_decay != 1:
        optimizer = spec.optimizer.with_layer_decay(optimizer, param_shapes(model), spec.model.vision.layers)
    optimizer = locked_optimizer(optimizer, spec.lock, spec.model.vision.layers, spec.model.text.layers)
    shapes = jax.eval_shape(lambda rng: fresh_train_state(model, optimizer, rng, initial_policy_state(spec)),
                            jax.random.key(0))
    shardings = state_shardings(shapes, mesh, fsdp=spec.fsdp)
    abstract_state = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                  shapes, shardings)
    telemetry = None
    if spec.telemetry_every:
        telemetry = every_n_steps(
            partial(step_telemetry, b2=spec.optimizer.b2, eps=spec.optimizer.eps), spec.telemetry_every)
    freeze = partial(stop_locked_gradients, lock=spec.lock, image_layers=spec.model.vision.layers,
                     text_layers=spec.model.text.layers) if spec.lock.any else None
    update = make_train_step(spec, model, optimizer, learning_rate_fn, mesh, shardings, telemetry=telemetry,
                             freeze=freeze)
    return Step(spec, mesh, model, optimizer, learning_rate_fn, abstract_state, update)


def _classifier_step(spec: StepSpec, mesh: Mesh, model, learning_rate_fn: Callable) -> Step:
    """`build_step` of a spec with a `ClassifierHead`: its params, optimizer and state replicated on `mesh`."""
    params = classification_step.param_shapes(model, spec.head.classes)
    optimizer = spec.optimizer.with_layer_decay(spec.optimizer.create(learning_rate_fn),
                                                classification_step.trained(params), spec.model.vision.layers)
    shapes = jax.eval_shape(lambda p: classification_step.init_state(p, optimizer), params)
    shardings = state_shardings(shapes, mesh, fsdp=False)
    abstract_state = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                  shapes, shardings)
    update = classification_step.make_classification_step(model, optimizer, learning_rate_fn, mesh, shardings,
                                                           ema_decay=spec.head.ema_decay)
    return Step(spec, mesh, model, optimizer, learning_rate_fn, abstract_state, update)
