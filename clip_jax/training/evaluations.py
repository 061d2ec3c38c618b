"""The evaluations a run makes as it trains: zero-shot classification (`zeroshot_data`), validation (`val_data`), a
linear probe (`linear_probe_data`), and any evaluator the caller adds (`Scheduled`).

Each is an `Evaluator` (`clip_jax.evaluation.evaluator`: a name and `run(weights, should_stop) -> metrics`), made at
its first use from the run's `EvalSetting`: the run's model at its image size in fp32 compute, over the trainer's
mesh, with the run's mean/std; every process gets the same numbers. One rule says when each is due (`epoch_due`): at
the end of every `frequency`-th epoch, but not at the run's last step, after which the loop runs all of them once
(`final`). A stop signal cuts an evaluation short within one batch: each is handed the trainer's `should_stop` and
asks it before every batch it encodes (`runtime.stop_signals`); the run resumed from that step's checkpoint makes
the evaluations its metrics lack first (`owed`).

The linear probe is CLIP_benchmark's `linear_probe` task with its defaults (`evaluation.linear_probe`): the image
features of the dataset's `train` split (encoded on the mesh), a linear classifier fitted on them on the host (its
weight decay searched on a stratified fifth, then refit on all of train), scored on the `test` split as `lp_acc1`,
`lp_acc5` and `lp_mean_per_class_recall`; every process fits the same classifier from the same features.
"""

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from clip_jax.evaluation.evaluator import EvalSetting, Evaluator
from clip_jax.models import create_model, get_model_config
from clip_jax.models.config import as_trained
from clip_jax.runtime.stop_signals import CutShort, never
from clip_jax.text.model_tokenizer import with_run_tokenizer

ZEROSHOT, VALIDATION, LINEAR_PROBE = "zeroshot", "validation", "linear_probe"
# of the metric names each evaluation records
RESULT_PREFIX = {ZEROSHOT: "zeroshot_", VALIDATION: "val_", LINEAR_PROBE: "lp_"}
PROBE_VAL_PROPORTION = 0.2  # the share of the train split the probe's weight decay is searched on


def eval_model(config):
    """The model a training config's evaluations run: the model at the run's image size (its params are the run's;
    the sigmoid loss's logit_bias and patch dropout play no part in an evaluation)."""
    return as_trained(with_run_tokenizer(get_model_config(config.model), config), image_size=config.force_image_size)


def epoch_due(step: int, epochs_ended: int, frequency: int, total_steps: int) -> bool:
    """Whether an evaluation run every `frequency` epochs (0: never during training) is due after `step`, which
    completes epoch number `epochs_ended` (0: none; `Schedule.epochs_ended`)."""
    if not frequency or step == total_steps or not epochs_ended:
        return False
    return epochs_ended % frequency == 0


def eval_batch_size(mesh) -> int:
    """The global batch of zero-shot evaluation and validation: about 256 images, a multiple of the devices."""
    return max(mesh.size, (256 // mesh.size) * mesh.size)


def eval_setting(config, mesh) -> EvalSetting:
    """What a run's evaluators share (see the module docstring)."""
    return EvalSetting(create_model(eval_model(config)), mesh, mean=tuple(config.image_mean),
                       std=tuple(config.image_std), batch_size=eval_batch_size(mesh))


def open_zeroshot_evaluator(config, mesh, setting: EvalSetting | None = None):
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
    s = setting or eval_setting(config, mesh)
    return ZeroShotEvaluator(s.model, dataset, mesh, batch_size=s.batch_size, mean=s.mean, std=s.std)


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """An evaluator a run makes every `frequency` epochs (0: only once trained), made by `open(setting)` at its first
    use. Its metrics are recorded as `record(metrics)` names them (default: `NAME_metric`) and found again in a
    step's record by `prefix` (default: `NAME_`); `line(evaluator, recorded, step)` is its console line."""

    name: str
    frequency: int
    open: Callable[[EvalSetting], Evaluator]
    prefix: str = ""
    record: Callable[[dict], dict] | None = None
    line: Callable[[Evaluator, dict, int], str] | None = None

    @property
    def recorded_prefix(self) -> str:
        return self.prefix or f"{self.name}_"

    def recorded(self, metrics: dict) -> dict[str, float]:
        if self.record is not None:
            return self.record(metrics)
        return {f"{self.recorded_prefix}{k}": float(v) for k, v in metrics.items()}

    def say(self, evaluator: Evaluator, recorded: dict, step: int) -> str:
        if self.line is not None:
            return self.line(evaluator, recorded, step)
        return f"{self.name} on {evaluator.name} at step {step}: " + _values(recorded)


def _values(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def configured(config, loss_batch_size: int) -> list[Scheduled]:
    """The evaluations a pretraining config asks for. The validation set is read now, so a bad one stops the run
    before it trains; every evaluator (the zero-shot set, its prompts, compiled towers) at its first use."""
    c, found = config, []
    if c.zeroshot_data:
        found.append(Scheduled(ZEROSHOT, c.zeroshot_frequency, lambda s: open_zeroshot_evaluator(c, s.mesh, s),
                               prefix=RESULT_PREFIX[ZEROSHOT], record=_zeroshot_recorded,
                               line=lambda ev, r, step: f"zero-shot on {ev.name} at step {step}: " + _values(r)))
    if c.val_data:
        from clip_jax.evaluation.validation import ValidationEvaluator, open_validation_set

        val_set = open_validation_set(c.val_data, c.val_num_samples)
        found.append(Scheduled(
            VALIDATION, c.val_frequency,
            lambda s: ValidationEvaluator(s, val_set, loss_batch_size=loss_batch_size, loss=c.loss),
            prefix=RESULT_PREFIX[VALIDATION],
            record=lambda m: {f"val_{k}": float(v) for k, v in m.items() if k != "num_images"},
            line=lambda ev, r, step: f"validation on {val_set.num_images} images at step {step}: " + _values(r)))
    if c.linear_probe_data:
        found.append(Scheduled(LINEAR_PROBE, c.linear_probe_frequency, lambda s: open_linear_probe(c, s),
                               prefix=RESULT_PREFIX[LINEAR_PROBE], record=dict, line=_probe_line))
    return found


class Evaluations:
    """A run's evaluations (`scheduled`), made at their first use from the `EvalSetting` that `setting()` makes
    (once); `say` prints a result line (process 0's console)."""

    def __init__(self, scheduled: Sequence[Scheduled], setting: Callable[[], EvalSetting], *,
                 epochs_ended: Callable[[int], int], total_steps: int, say: Callable[[str], None]):
        """`epochs_ended(step)`: the epoch that step completes, 0 when none (`Schedule.epochs_ended`)."""
        self.say, self.epochs_ended, self.total_steps = say, epochs_ended, total_steps
        self.scheduled = {s.name: s for s in scheduled}
        self.evaluators: dict[str, Evaluator] = {}  # made at first use
        self._make_setting, self._setting = setting, None

    @property
    def setting(self) -> EvalSetting:
        if self._setting is None:
            self._setting = self._make_setting()
        return self._setting

    @property
    def names(self) -> tuple[str, ...]:
        """The evaluations this run makes."""
        return tuple(self.scheduled)

    def due(self, step: int) -> tuple[str, ...]:
        """The evaluations due after `step`."""
        return tuple(name for name, s in self.scheduled.items()
                     if epoch_due(step, self.epochs_ended(step), s.frequency, self.total_steps))

    def evaluator(self, name: str) -> Evaluator:
        if name not in self.evaluators:
            self.evaluators[name] = self.scheduled[name].open(self.setting)
        return self.evaluators[name]

    def run(self, names, weights, step: int, *, should_stop: Callable[[], bool] = never) -> dict[str, float]:
        """The recorded metrics (`zeroshot_top1`, `zeroshot_top5`, `val_*`, `lp_*`, ...) of `weights` (params, or a
        ResNet's eval variables). Cut short once `should_stop()` answers True before a batch: `CutShort.done` holds
        the results of the evaluations that finished."""
        results = {}
        try:
            for name in names:
                evaluator = self.evaluator(name)
                recorded = self.scheduled[name].recorded(evaluator.run(weights, should_stop))
                self.say(self.scheduled[name].say(evaluator, recorded, step))
                results.update(recorded)
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
        return tuple(name for name in names
                     if not any(key.startswith(self.scheduled[name].recorded_prefix) for key in record))

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


def open_linear_probe(config, setting: EvalSetting) -> Evaluator:
    """CLIP_benchmark's linear probe of `linear_probe_data` (see the module docstring); its splits are scanned now,
    at the first probe."""
    from clip_jax.evaluation import clip_benchmark
    from clip_jax.evaluation.benchmark import LinearProbeEvaluator
    from clip_jax.evaluation.linear_probe import ProbeOptions

    root = config.linear_probe_data
    train, test = (clip_benchmark.open_dataset(clip_benchmark.check_training_layout(root, split,
                                                                                   needed_by="the linear probe"))
                   for split in ("train", "test"))
    return LinearProbeEvaluator(setting, train, test, val_proportion=PROBE_VAL_PROPORTION,
                                options=ProbeOptions(seed=config.seed))


def _zeroshot_recorded(metrics: dict) -> dict[str, float]:
    return {f"zeroshot_{k}": float(v) for k, v in metrics.items() if k.startswith("top")}


def _probe_line(evaluator, recorded: dict, step: int) -> str:
    result = evaluator.last
    return (f"linear probe on {evaluator.name} ({result.num_train} train images, weight decay "
            f"{result.weight_decay:.3g}) at step {step}: " + _values(recorded))
