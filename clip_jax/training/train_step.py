"""The train state and the jitted, sharded train step.

`step(state, batch) -> (state, metrics)` takes a global batch split over the mesh axis `"data"`
(`{"images": [B, H, W, 3] float32, "tokens": [B, context_length] int32}`), computes CLIP's contrastive loss
(or SigLIP's sigmoid loss) over the whole batch, and applies one optimizer update. With `accum_steps = k > 1` the
batch is processed as k micro-batches while the loss still sees every negative of the full batch (OpenCLIP's
`--accum-freq`):

1. features of every micro-batch, without gradients;
2. loss and its gradient with respect to the features (and the shared scale and bias), on the full batch;
3. per micro-batch, the forward again and a backward (a VJP) seeded with that micro-batch's feature gradients;
   the parameter gradients add up to the full-batch gradient.

Patch dropout (`patch_dropout > 0`): the step draws the patches each sample keeps for the whole global batch from
`patch_dropout_key(seed, state.step)` and adds them to the batch as `kept_patches` [B, K]. They are split into
micro-batches with the images, so phases 1 and 3 drop the same patches, and a sample keeps the same patches
whatever the accumulation or the device count. The key is a function of the run's seed and the step counter only:
no RNG state is saved, and a resumed run draws the same patches at the same step.

Dynamic loss scaling (`fp16`, `training.loss_scale`): the backward starts from the state's loss scale, under
accumulation in phase 2 (the feature gradients seeding each micro-batch's backward are scaled); the gradients are
unscaled in float32 before the global norm, the spike telemetry and the optimizer read them. A step whose gradients
overflow is skipped as a non-finite one is, and the scale moves by GradScaler's rule.

BatchNorm (a ResNet image tower): the forward runs in train mode and normalises with the statistics of the whole
global batch, not of each device's part. Inside this jitted GSPMD step a mean over the batch axis of a batch split
over the devices is an all-reduce that XLA inserts, so the statistics, the loss and the gradients do not depend on
the device count (OpenCLIP under plain DDP normalises per device instead; SyncBatchNorm is the global choice there).
The updated running statistics are the state's `batch_stats`, kept from before the step when it is skipped.

BatchNorm with `accum_steps = k > 1`: each micro-batch is normalised with its own statistics (those of the
micro-batch across every device), as it would be had it been a step's whole batch, and the running statistics move
once per micro-batch, in order (k updates a step, `num_batches_tracked` counting k). Phase 1 makes those updates;
phase 3 recomputes each micro-batch's forward with the same batch statistics (so its features, and their gradients,
are phase 1's) and leaves the running statistics alone. OpenCLIP's `--accum-freq` under torch normalises the same
way, but its train-mode no-grad pass and its grad pass both update the running statistics, 2k updates a step; one
update per micro-batch is what the running statistics would see without the accumulation pass, and no more.

A locked ResNet image tower (`image_eval_mode`, OpenCLIP's `--lock-image` with `--lock-image-freeze-bn-stats`) runs
with its BatchNorm in eval mode: normalised with the running statistics, which stay as they are (a frozen
BatchNorm, torch's `FrozenBatchNorm2d`). Its outputs then do not depend on the batch's composition. A tower locked
without that flag (OpenCLIP's `--lock-image` alone) keeps its BatchNorm in train mode: `freeze` stops the params'
gradients, and the running statistics move with every batch as in an unlocked tower.
"""

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from clip_jax.models.config import is_resnet
from clip_jax.models.precision import get_policy
from clip_jax.models.vit import kept_patch_count, kept_patch_indices
from clip_jax.optim.adamw import clamp_logit_scale
from clip_jax.runtime.mesh import (LAYER_STACK_KEY, batch_axes, batch_sharding, data_parallel_size, fsdp_leaf_spec,
                                   is_split, path_names, replicated)
from clip_jax.training.loss import LOSSES
from clip_jax.training.loss_scale import next_loss_scale, unscaled, value_and_grads


class TrainState(NamedTuple):
    """Everything a run needs to continue: a plain pytree of arrays, as Orbax saves it."""

    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: batches consumed (updates applied, or skipped as non-finite)
    batch_stats: Any = None  # BatchNorm's running statistics (a ResNet image tower); None: the model has none
    # What the precision policy owns (fp16's loss scale), replicated and saved by name; None under a policy that owns
    # nothing, whose states and checkpoints are as before the slot existed (`training.policy_state`)
    policy_state: Any = None


def init_train_state(params, optimizer: optax.GradientTransformation, batch_stats=None,
                     policy_state=None) -> TrainState:
    return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32), batch_stats, policy_state)


def make_forward(model, mesh: Mesh, *, fsdp: bool, batch_norm: str | None = None) -> Callable:
    """`forward(params, batch) -> (image_features, text_features, logit_scale)` as the train step runs it.

    `batch_norm` (a ResNet image tower, whose BatchNorm statistics are an input and an output): None for a model
    without; "batch": train mode, `forward(params, batch, batch_stats) -> (outputs, updated batch_stats)`, normalised
    with the batch's statistics; "running": eval mode, `forward(params, batch, batch_stats) -> (outputs,
    batch_stats)`, normalised with the running statistics, returned as they came.

    Under FSDP the split parameters are gathered (constrained to replicated) right where they are used, so that
    every activation stays split over the batch. Left to XLA's sharding propagation, a weight's split spreads
    into the activations instead: a kernel split on its output dimension makes XLA compute that matmul for the
    whole global batch, all-gathering the batch rather than the weight, and the memory per device then grows
    with the device count (benchmarks/RESULTS.md section 7).

    The residual blocks are gathered one layer at a time, inside the scan (the model's `layer_params_hook`):
    under remat the backward gathers each layer again, so one layer's full weights are live at a time (ZeRO-3);
    without remat the gathered weights are kept for the backward, as a replica would hold them. The gradient
    of a gather is the layer's gradient summed over devices, of which each keeps its slice in the split
    gradient buffer: `gather_whole`'s gradient is constrained to the split layout, a reduce-scatter, so each
    device receives only its slice of the summed gradient (the plain transpose of a constraint to replicated made
    XLA:GPU all-reduce each layer's whole gradient and slice it: twice the traffic).
    The few leaves outside the blocks (embeddings, projections, final norms) are gathered once,
    at the start. (Gathering the whole tree at the start was simpler, but holds every full weight through the
    step: more memory than layer by layer, RESULTS section 7.) A ResNet image
    tower has no scanned stack: its conv kernels are gathered once, at the start, like those leaves.
    """
    if batch_norm not in (None, "batch", "running"):
        raise ValueError(f"batch_norm={batch_norm!r}: None, 'batch' or 'running'")
    if fsdp:
        model = model.clone(layer_params_hook=partial(gather_whole, mesh=mesh))

    def gathered(params):
        if not fsdp:
            return params
        return jax.tree_util.tree_map_with_path(
            lambda path, p: p if LAYER_STACK_KEY in path_names(path) else gather_whole(p, mesh), params
        )

    def forward(params, batch):
        return model.apply({"params": gathered(params)}, batch["images"], batch["tokens"], batch.get("kept_patches"))

    def batch_norm_forward(params, batch, batch_stats):
        variables = {"params": gathered(params), "batch_stats": batch_stats}
        if batch_norm == "running":
            return model.apply(variables, batch["images"], batch["tokens"], train=False), batch_stats
        outputs, updated = model.apply(variables, batch["images"], batch["tokens"], train=True,
                                       mutable=["batch_stats"])
        return outputs, updated["batch_stats"]

    return forward if batch_norm is None else batch_norm_forward


def patch_dropout_key(seed: int, step: jax.Array) -> jax.Array:
    """The key a step draws its kept patches from: the run's seed and the step counter, nothing else."""
    return jax.random.fold_in(jax.random.key(seed), step)


def gather_whole(tree, mesh: Mesh, layers: int | None = None):
    """Every leaf of `tree` whole on every device: an all-gather where FSDP splits it (`fsdp_leaf_spec`; for one
    layer's leaves inside the scan, `layers` says how many the stack holds: their spec is the stack's without the
    layer axis). Its gradient goes back to the split layout directly, a reduce-scatter."""

    def gather(leaf):
        if layers is None:
            spec = fsdp_leaf_spec(mesh, leaf.shape)
        else:
            spec = P(*fsdp_leaf_spec(mesh, (layers, *leaf.shape), stacked=True)[1:])
        return _gathered(leaf, NamedSharding(mesh, spec)) if is_split(spec) else leaf

    return jax.tree.map(gather, tree)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gathered(leaf, split: NamedSharding):
    return jax.lax.with_sharding_constraint(leaf, replicated(split.mesh))


def _gathered_forward(leaf, split: NamedSharding):
    return _gathered(leaf, split), None


def _gathered_backward(split: NamedSharding, _, cotangent):
    # The cotangent's per-device parts are partial sums over the local batch: constraining it to the split layout
    # makes XLA sum and split them at once. (The plain transpose of the gather constrains it to replicated: an
    # all-reduce of the whole layer, then a slice.)
    return (jax.lax.with_sharding_constraint(cotangent, split),)


_gathered.defvjp(_gathered_forward, _gathered_backward)


def split_micro_batches(x, accum_steps: int, n_shards: int):
    """[B, ...] -> [k, B / k, ...], micro-batch j taking rows j*m..(j+1)*m-1 of every shard (m = B / (n k)).

    Each micro-batch is then split over the devices as evenly as the batch was, with no data movement.
    """
    rows_per_shard = x.shape[0] // (n_shards * accum_steps)
    x = x.reshape(n_shards, accum_steps, rows_per_shard, *x.shape[1:])
    return x.swapaxes(0, 1).reshape(accum_steps, n_shards * rows_per_shard, *x.shape[3:])


def merge_micro_batches(x, n_shards: int):
    """Inverse of `split_micro_batches`: [k, B / k, ...] -> [B, ...] in the original row order."""
    accum_steps, micro_batch = x.shape[:2]
    rows_per_shard = micro_batch // n_shards
    x = x.reshape(accum_steps, n_shards, rows_per_shard, *x.shape[2:]).swapaxes(0, 1)
    return x.reshape(accum_steps * micro_batch, *x.shape[3:])


def global_norm(tree) -> jax.Array:
    """sqrt of the sum of squares of every leaf, accumulated in fp32 also for bf16 leaves."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares))


def full_batch_grads(forward: Callable, loss_fn: Callable, params, batch, batch_stats=None, loss_scale=None):
    """(loss, accuracy, logit_params, grads, batch_stats) from one forward and backward over the whole batch;
    logit_params: the forward's outputs after the features, (scale,) or (scale, bias).

    `forward(params, batch, batch_stats) -> (outputs, batch_stats)`: the statistics it returns (updated by a
    train-mode BatchNorm, or None for a model without) are returned. `loss_scale`: the backward starts from it
    (the gradients are those of the scaled loss); None: from 1."""

    def loss_on_params(params):
        (image_features, text_features, *logit_params), new_stats = forward(params, batch, batch_stats)
        loss, accuracy = loss_fn(image_features, text_features, *logit_params)
        return loss, (accuracy, tuple(logit_params), new_stats)

    (loss, (accuracy, logit_params, new_stats)), (grads,) = value_and_grads(loss_on_params, params,
                                                                          loss_scale=loss_scale)
    return loss, accuracy, logit_params, grads, new_stats


def accumulated_grads(
    forward: Callable, loss_fn: Callable, params, batch, batch_stats=None, loss_scale=None, *, accum_steps: int,
    mesh: Mesh, grad_shardings
):
    """(loss, accuracy, logit_params, grads, batch_stats) over k micro-batches, the loss still seeing the whole
    batch; `forward` and `loss_scale` as for `full_batch_grads` (scaled, the feature gradients that seed each
    micro-batch's backward, and the scale's and bias's, are those of the scaled loss).

    Equal to `full_batch_grads` up to rounding for a model without BatchNorm; holds the activations of one
    micro-batch at a time. With BatchNorm, each micro-batch is normalised with its own statistics and the running
    statistics are updated once per micro-batch, in order (see the module docstring).
    """
    n_shards = data_parallel_size(mesh)
    micro_sharding = NamedSharding(mesh, P(None, batch_axes(mesh)))  # [k, B / k, ...]

    def split(x):
        return jax.lax.with_sharding_constraint(split_micro_batches(x, accum_steps, n_shards), micro_sharding)

    micro_batches = jax.tree.map(split, batch)

    # 1. features of every micro-batch, no gradients; BatchNorm's running statistics move once per micro-batch
    def features(stats, micro_batch):
        outputs, stats = forward(params, micro_batch, stats)
        return stats, outputs

    new_stats, (image_features, text_features, *logit_params) = jax.lax.scan(features, batch_stats, micro_batches)
    image_features = merge_micro_batches(image_features, n_shards)  # [B, E]
    text_features = merge_micro_batches(text_features, n_shards)
    logit_params = tuple(p[0] for p in logit_params)  # scale (and bias): the same in every micro-batch

    # 2. the loss over the whole batch and its gradient with respect to the features, the scale (and the bias)
    (loss, accuracy), (image_grads, text_grads, *logit_grads) = value_and_grads(
        loss_fn, image_features, text_features, *logit_params, loss_scale=loss_scale)

    # 3. per micro-batch: forward again, backward seeded with its feature gradients; the sum is the gradient.
    # A train-mode BatchNorm normalises with the micro-batch's own statistics, whatever running statistics it is
    # given; the ones it returns are dropped (phase 1 made the updates).
    def backward(grad_sum, inputs):
        micro_batch, micro_image_grads, micro_text_grads = inputs
        _, pullback = jax.vjp(lambda p: forward(p, micro_batch, batch_stats)[0], params)
        # the scale (and bias) are shared: each micro-batch carries 1/k of their gradient
        (grads,) = pullback((micro_image_grads, micro_text_grads, *(g / accum_steps for g in logit_grads)))
        return jax.tree.map(lambda total, g: total + g.astype(jnp.float32), grad_sum, grads), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zeros = jax.lax.with_sharding_constraint(zeros, grad_shardings)  # split like the params under FSDP
    grad_sum, _ = jax.lax.scan(backward, zeros, (micro_batches, split(image_grads), split(text_grads)))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grad_sum, params)
    return loss, accuracy, logit_params, grads, new_stats


def _traced_under_mesh(step: Callable, mesh: Mesh) -> Callable:
    """`step` traced with `mesh` as the context's: the Pallas kernels (`models.fused_layer_norm`) run on each
    device's own rows under `shard_map`, where XLA would gather every device's rows for them."""
    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return step(*args)
    return traced


def make_train_step(spec, model, optimizer: optax.GradientTransformation, learning_rate_fn: Callable, mesh: Mesh,
                    shardings: TrainState, *, telemetry: Callable | None = None,
                    freeze: Callable | None = None) -> Callable:
    """The jitted `step(state, batch) -> (state, metrics)` of `spec` (a `clip_jax.training.step_factory.StepSpec`:
    its `fsdp`, `accum_steps`, `loss`, the model's patch dropout, `seed` and lock); the old state is donated.
    Assembled by `clip_jax.training.step_factory.build_step`, which builds `model` and `optimizer` from the spec.

    `shardings`: the train state's shardings (split under `spec.fsdp`, else replicated). metrics: `loss`, `accuracy`
    (top-1 of the contrastive task, both directions), `logit_scale` (the exponentiated scale used in this step),
    `logit_bias` (when the model has one), `grad_norm` (global norm before clipping), `learning_rate` (of this
    update), `finite` (False when the update was skipped for a non-finite loss or gradient); under a policy with
    `loss_scaling` (fp16) also `overflow` (the update skipped for non-finite gradients of a finite loss: the scale
    was too large) and `loss_scale` (the scale after the step: the next step's). Each step's kept
    patches are drawn from (`spec.seed`, step) (see the module docstring). `freeze`: params -> params with the
    gradients into locked params stopped (`clip_jax.optim.lock.stop_locked_gradients`), so the backward skips them;
    their gradients are 0. `telemetry(step, grads, updates, new_opt_state, new_params) -> pytree`: extra statistics
    returned as `metrics["telemetry"]` (`clip_jax.training.spike_telemetry`: computed on logging steps only, zeros
    on the others). A ResNet image tower locked with `spec.lock.image_freeze_bn_stats` runs its BatchNorm in eval
    mode (see the module docstring); otherwise in train mode.
    """
    accum_steps, loss, seed = spec.accum_steps, spec.loss, spec.seed
    patch_dropout = spec.model.vision.patch_dropout
    image_eval_mode = is_resnet(spec.model) and spec.lock.image_freeze_bn_stats
    fsdp = spec.fsdp
    # StepSpec has checked these; a step built another way is a bug
    assert accum_steps >= 1 and loss in LOSSES, (accum_steps, loss)
    assert not (loss == "siglip" and model.config.init_logit_bias is None), "the sigmoid loss needs a logit_bias"
    n_shards = data_parallel_size(mesh)
    batch_norm = is_resnet(model.config)
    assert not (batch_norm and patch_dropout > 0), "a ResNet image tower has no patches to drop"
    if batch_norm:
        forward = make_forward(model, mesh, fsdp=fsdp, batch_norm="running" if image_eval_mode else "batch")
    else:
        plain_forward = make_forward(model, mesh, fsdp=fsdp)

        def forward(params, batch, batch_stats):
            return plain_forward(params, batch), batch_stats

    if freeze is not None:
        unfrozen_forward = forward

        def forward(params, batch, batch_stats):
            return unfrozen_forward(freeze(params), batch, batch_stats)

    loss_scaling = get_policy(spec.precision).loss_scaling
    loss_function = LOSSES[loss]

    def loss_fn(image_features, text_features, logit_scale, *logit_bias):
        if loss == "clip":  # a bias, when the model has one, cancels in the softmax loss: its gradient is zero
            logit_bias = ()
        return loss_function(image_features, text_features, logit_scale, *logit_bias, mesh=mesh)

    if accum_steps == 1:
        compute_grads = partial(full_batch_grads, forward, loss_fn)
    else:
        compute_grads = partial(
            accumulated_grads,
            forward,
            loss_fn,
            accum_steps=accum_steps,
            mesh=mesh,
            grad_shardings=shardings.params,
        )

    def step_kept_patches(step, batch_size):  # [B, K], split over the devices like the batch
        num_patches = model.config.vision.grid_size**2
        keep = kept_patch_count(num_patches, patch_dropout)
        kept = kept_patch_indices(patch_dropout_key(seed, step), batch_size, num_patches, keep)
        return jax.lax.with_sharding_constraint(kept, batch_sharding(mesh))

    def step(state: TrainState, batch):
        batch_size = batch["images"].shape[0]
        if batch_size % (n_shards * accum_steps):
            raise ValueError(
                f"train step: global batch {batch_size} must be divisible by devices x accum_steps = "
                f"{n_shards} x {accum_steps}"
            )
        if patch_dropout > 0:
            batch = {**batch, "kept_patches": step_kept_patches(state.step, batch_size)}
        loss_scale = state.policy_state.scale if loss_scaling else None
        loss, accuracy, logit_params, grads, batch_stats = compute_grads(state.params, batch, state.batch_stats,
                                                                         loss_scale)
        grads = jax.lax.with_sharding_constraint(grads, shardings.params)  # under FSDP: reduce-scattered
        if loss_scaling:  # nothing reads the scaled gradients
            grads = unscaled(grads, loss_scale)
        grad_norm = global_norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = clamp_logit_scale(optax.apply_updates(state.params, updates))
        # A non-finite loss or gradient skips the update: params and optimizer state stay as they were. The
        # step still counts (it consumed a batch); the trainer counts skips and decides when to roll back.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state, batch_stats = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                                      (params, opt_state, batch_stats),
                                                      (state.params, state.opt_state, state.batch_stats))
        metrics = {
            "loss": loss,
            "accuracy": accuracy,
            "logit_scale": logit_params[0],
            "grad_norm": grad_norm,
            "learning_rate": learning_rate_fn(state.step),
            "finite": finite,
        }
        if len(logit_params) > 1:
            metrics["logit_bias"] = logit_params[1]
        policy_state = state.policy_state
        if loss_scaling:
            # the scale follows the step's finiteness; a finite loss with non-finite gradients is an overflow of
            # the scaled backward, not instability
            policy_state = next_loss_scale(policy_state, finite, spec.loss_scale.growth_interval)
            metrics["overflow"] = jnp.isfinite(loss) & ~finite
            metrics["loss_scale"] = policy_state.scale
        if telemetry is not None:
            # the state after the step: the donated old params, read here, would have to be copied first
            metrics["telemetry"] = telemetry(state.step, grads, updates, opt_state, params)
        return TrainState(params, opt_state, state.step + 1, batch_stats, policy_state), metrics

    if spec.fused_kernels != "off":
        step = _traced_under_mesh(step, mesh)
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding(mesh)),
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=0,
    )
