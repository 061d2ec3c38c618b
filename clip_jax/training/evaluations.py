"""The evaluations a run makes as it trains: zero-shot classification (`zeroshot_data`), validation (`val_data`) and
a linear probe (`linear_probe_data`).

One rule says when each is due (`epoch_due`): at the end of every `frequency`-th epoch, but not at the run's last
step, after which the loop runs all of them once (`final`). Each evaluates the current params (with a ResNet image
tower's running statistics) in fp32 compute, on the run's model at its image size, over the trainer's mesh; every
process gets the same numbers. A stop signal cuts an evaluation short within one batch: each is handed the
trainer's `should_stop` and asks it before every batch it encodes (`runtime.stop_signals`); the run resumed from
that step's checkpoint makes the evaluations its metrics lack first (`owed`).

The linear probe is CLIP_benchmark's `linear_probe` task with its defaults (`evaluation.linear_probe`): the image
features of the dataset's `train` split (encoded on the mesh), a linear classifier fitted on them on the host (its
weight decay searched on a stratified fifth, then refit on all of train), scored on the `test` split as `lp_acc1`,
`lp_acc5` and `lp_mean_per_class_recall`; every process fits the same classifier from the same features.
"""

import functools
from collections.abc import Callable

import jax
import numpy as np

from clip_jax.models import create_model, get_model_config
from clip_jax.models.config import as_trained
from clip_jax.runtime.stop_signals import CutShort, never

ZEROSHOT, VALIDATION, LINEAR_PROBE = "zeroshot", "validation", "linear_probe"
# of the metric names each evaluation records
RESULT_PREFIX = {ZEROSHOT: "zeroshot_", VALIDATION: "val_", LINEAR_PROBE: "lp_"}
PROBE_VAL_PROPORTION = 0.2  # the share of the train split the probe's weight decay is searched on


def eval_model(config):
    """The model a training config's evaluations run: the model at the run's image size (its params are the run's;
    the sigmoid loss's logit_bias and patch dropout play no part in an evaluation)."""
    return as_trained(get_model_config(config.model), image_size=config.force_image_size)


def epoch_due(step: int, steps_per_epoch: int, frequency: int, total_steps: int) -> bool:
    """Whether an evaluation run every `frequency` epochs (0: never during training) is due after `step`."""
    if not frequency or step == total_steps or step % steps_per_epoch:
        return False
    return (step // steps_per_epoch) % frequency == 0


def eval_batch_size(mesh) -> int:
    """The global batch of zero-shot evaluation and validation: about 256 images, a multiple of the devices."""
    return max(mesh.size, (256 // mesh.size) * mesh.size)


def open_zeroshot_evaluator(config, mesh):
    """The zero-shot evaluator of `config.zeroshot_data` ("demo", a CLIP_benchmark classification folder, or an
    ImageNet validation folder), its first `zeroshot_samples` images when set."""
    from clip_jax.evaluation import ZeroShotEvaluator, clip_benchmark, open_classification_set

    if config.zeroshot_data != "demo" and clip_benchmark.is_dataset_folder(config.zeroshot_data):
        dataset = clip_benchmark.open_training_set(config.zeroshot_data)
    else:
        kind, location = ("demo", None) if config.zeroshot_data == "demo" else ("imagenet-val", config.zeroshot_data)
        dataset = open_classification_set(kind, location)
    if config.zeroshot_samples:
        dataset = dataset.head(config.zeroshot_samples)
    return ZeroShotEvaluator(create_model(eval_model(config)), dataset, mesh,
                             batch_size=eval_batch_size(mesh), mean=tuple(config.image_mean),
                             std=tuple(config.image_std))


class Evaluations:
    """The run's evaluations; `say` prints a result line (process 0's console). The validation set is read now, so
    a bad one stops the run before it trains; the zero-shot set, its prompts and compiled towers at first use."""

    def __init__(self, config, mesh, *, steps_per_epoch: int, total_steps: int, loss_batch_size: int,
                 say: Callable[[str], None]):
        self.config, self.mesh, self.say = config, mesh, say
        self.steps_per_epoch, self.total_steps, self.loss_batch_size = steps_per_epoch, total_steps, loss_batch_size
        self.val_set = None
        if config.val_data:
            from clip_jax.evaluation.validation import open_validation_set

            self.val_set = open_validation_set(config.val_data, config.val_num_samples)

    @property
    def names(self) -> tuple[str, ...]:
        """The evaluations this run makes."""
        return (((ZEROSHOT,) if self.config.zeroshot_data else ()) + ((VALIDATION,) if self.val_set is not None else ())
                + ((LINEAR_PROBE,) if self.config.linear_probe_data else ()))

    def due(self, step: int) -> tuple[str, ...]:
        """The evaluations due after `step`."""
        frequency = {ZEROSHOT: self.config.zeroshot_frequency, VALIDATION: self.config.val_frequency,
                     LINEAR_PROBE: self.config.linear_probe_frequency}
        return tuple(name for name in self.names
                     if epoch_due(step, self.steps_per_epoch, frequency[name], self.total_steps))

    def run(self, names, weights, step: int, *, should_stop: Callable[[], bool] = never) -> dict[str, float]:
        """`zeroshot_top1`, `zeroshot_top5`, `val_*`, `lp_*` of `weights` (params, or a ResNet's eval variables).
        Cut short once `should_stop()` answers True before a batch: `CutShort.done` holds the results of the
        evaluations that finished."""
        results = {}
        try:
            for name in names:
                evaluate = {ZEROSHOT: self.zeroshot, VALIDATION: self.validate, LINEAR_PROBE: self.linear_probe}[name]
                results.update(evaluate(weights, step, should_stop))
        except CutShort as cut:
            cut.done = results
            raise
        return results

    def run_and_record(self, names, weights, step: int, *, should_stop: Callable[[], bool],
                       record: Callable[[int, dict], None]) -> dict[str, float] | None:
        """`run`, its results recorded (`record(step, results)`); None when `should_stop()` cut it short (what
        finished is recorded; the rest is `owed` to the run resumed from this step)."""
        try:
            results, cut = self.run(names, weights, step, should_stop=should_stop), False
        except CutShort as e:
            results, cut = e.done, True
        if results:
            record(step, results)
        return None if cut else results

    def missing(self, names, record: dict) -> tuple[str, ...]:
        """Those of `names` whose results `record` (what metrics.jsonl holds for a step) lacks."""
        return tuple(name for name in names if not any(key.startswith(RESULT_PREFIX[name]) for key in record))

    def owed(self, step: int, resumed_here: bool, record: dict) -> tuple[str, ...]:
        """The evaluations due at `step` that a run resumed there from its own checkpoint has no results of in
        `record` (what its metrics.jsonl holds for the step, read by process 0): a stop cut them short, or the run
        died first. Process 0's answer is every process's (evaluations are collectives)."""
        due = self.due(step) if resumed_here else ()
        if not due:
            return ()
        owed = self.missing(due, record)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            flags = multihost_utils.broadcast_one_to_all(np.array([name in owed for name in due], np.int32))
            owed = tuple(name for name, flag in zip(due, np.asarray(flags)) if flag)
        return owed

    @functools.cached_property
    def zeroshot_evaluator(self):
        return open_zeroshot_evaluator(self.config, self.mesh)

    def zeroshot(self, weights, step: int, should_stop: Callable[[], bool]) -> dict[str, float]:
        evaluator = self.zeroshot_evaluator
        result = {f"zeroshot_{k}": float(v) for k, v in evaluator(weights, should_stop=should_stop).items()
                  if k.startswith("top")}
        self.say(f"zero-shot on {evaluator.dataset.name} at step {step}: " +
                 ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        return result

    @functools.cached_property
    def val_model(self):
        return create_model(eval_model(self.config))  # fp32 compute on the run's params, as zero-shot

    def validate(self, weights, step: int, should_stop: Callable[[], bool]) -> dict[str, float]:
        """Contrastive loss and retrieval recall@1/5/10 on `val_data`, as `val_*` metrics."""
        from clip_jax.evaluation.validation import validate

        c = self.config
        metrics = validate(self.val_model, weights, self.val_set, self.mesh, batch_size=eval_batch_size(self.mesh),
                           loss_batch_size=self.loss_batch_size, mean=tuple(c.image_mean), std=tuple(c.image_std),
                           loss=c.loss, should_stop=should_stop)
        result = {f"val_{k}": float(v) for k, v in metrics.items() if k != "num_images"}
        self.say(f"validation on {metrics['num_images']} images at step {step}: " +
                 ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        return result

    @functools.cached_property
    def probe_sets(self):
        """(train, test) `BenchmarkDataset`s of `linear_probe_data`, scanned at the first probe."""
        from clip_jax.evaluation import clip_benchmark

        root = self.config.linear_probe_data
        return tuple(clip_benchmark.open_dataset(clip_benchmark.check_training_layout(root, split,
                                                                                      needed_by="the linear probe"))
                     for split in ("train", "test"))

    def linear_probe(self, weights, step: int, should_stop: Callable[[], bool]) -> dict[str, float]:
        """CLIP_benchmark's linear probe of the image features under `weights` (see the module docstring)."""
        from clip_jax.evaluation.benchmark import evaluate_linear_probe
        from clip_jax.evaluation.linear_probe import ProbeOptions

        c = self.config
        train, test = self.probe_sets
        result = evaluate_linear_probe(self.val_model, weights, train, test, self.mesh,
                                       val_proportion=PROBE_VAL_PROPORTION, options=ProbeOptions(seed=c.seed),
                                       mean=tuple(c.image_mean), std=tuple(c.image_std), should_stop=should_stop)
        self.say(f"linear probe on {test.name} ({result.num_train} train images, weight decay "
                 f"{result.weight_decay:.3g}) at step {step}: " +
                 ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items()))
        return dict(result.metrics)
