"""Classification fine-tuning with WiSE-FT as a task of the run loop (`clip_jax.training.task`):
`python -m clip_jax.finetune --config configs/demo_finetune.py`.

config -> data (a CLIP_benchmark classification set: train, test and a shifted set) -> pretrained CLIP (any path
`interop.opener` reads) -> the head (the zero-shot classifier of templates x class names, or a linear probe first:
LP-FT) -> full fine-tuning of the image tower and head on the mesh (a `StepSpec` with a `ClassifierHead`: AdamW,
layer-wise learning-rate decay, EMA, the non-finite skip) -> the WiSE-FT sweep (`wise_ft`), each alpha scored by
`evaluation.head.HeadEvaluator`s -> the export of `export_alpha`'s model with its head.

The run is the loop's: its directory (`config.json`, `checkpoints/STEP/` holding the state and no data position,
the batches being a function of the step: `data.classification`, `metrics.jsonl` with `loss`, `train_acc1`,
`grad_norm`, `learning_rate` averaged over each log window), then `wise_ft.json`, `wise_ft.csv`, `wise_ft.png` and
`export/` (the OpenCLIP folder, both towers, with `classification_head.npz`: `interop.classification_head`).
`resume="latest"` continues the newest checkpoint; a finished run only sweeps and exports again.
"""

from collections.abc import Sequence

import jax
import numpy as np

from clip_jax.data.classification import FinetuneBatches
from clip_jax.errors import InvalidInput
from clip_jax.evaluation import clip_benchmark
from clip_jax.evaluation.classification import ZeroShotEvaluator
from clip_jax.evaluation.evaluator import EvalSetting
from clip_jax.evaluation.head import HeadEvaluator
from clip_jax.evaluation.linear_probe import ProbeOptions, fit_classifiers, search_weight_decay, validation_split
from clip_jax.evaluation.shifts import SHIFTS
from clip_jax.interop.classification_head import write_head
from clip_jax.interop.export import export_open_clip
from clip_jax.interop.opener import open_model
from clip_jax.runtime import storage
from clip_jax.runtime.mesh import create_mesh
from clip_jax.runtime.run_layout import CHECKPOINTS, CONFIG, EXPORT, METRICS, RUN_ENTRIES, reported_entries
from clip_jax.training import classification_step as cs
from clip_jax.training import wise_ft
from clip_jax.training.config_checks import report_targets
from clip_jax.training.evaluations import PROBE_VAL_PROPORTION, Evaluations, Scheduled, eval_batch_size
from clip_jax.training.finetune_config import check_finetune_config
from clip_jax.training.schedule import Schedule
from clip_jax.training.step_factory import ClassifierHead, OptimizerSpec, StepSpec, build_step
from clip_jax.training.step_reads import local_values

WISE_FT_FILES = (wise_ft.TABLE_JSON, wise_ft.TABLE_CSV, wise_ft.PLOT)


def open_sets(c):
    """(train, test, shifted or None) `ClassificationSet`s of the config's data (written first for `make_data`)."""
    if c.make_data == "fashion-mnist":
        from clip_jax.evaluation.fashion_mnist_layout import write_fashion_mnist

        write_fashion_mnist(c.data, change="give --config.data another folder")
    train, test = (clip_benchmark.open_dataset(layout).classification for layout in (
        clip_benchmark.check_training_layout(c.data, split, needed_by="fine-tuning")
        for split in (c.train_split, c.test_split)))
    if c.train_samples:
        train = train.head(c.train_samples)
    if c.test_samples:
        test = test.head(c.test_samples)
    if not c.shift_data:
        return train, test, None
    if c.shift_data in SHIFTS:
        return train, test, SHIFTS[c.shift_data](test)
    shift = clip_benchmark.open_training_set(c.shift_data, c.test_split)
    if shift.class_names != test.class_names:
        raise InvalidInput(f"shift_data={c.shift_data!r} names other classes than data={c.data!r}; the shifted set "
                           "must have the fine-tuning set's classes, in its label order")
    return train, test, shift.head(c.test_samples) if c.test_samples else shift


class ClassificationFinetuning:
    """Classification fine-tuning of `config` (`training.finetune_config`); `evaluators`: evaluations to make as
    it trains (none of its own: its sets are scored in the WiSE-FT sweep once trained)."""

    name, noun = "fine-tuning", "fine-tuning run"
    entries = RUN_ENTRIES + WISE_FT_FILES + (EXPORT,)
    data_by_step = True
    averaged = ("loss", "train_acc1", "grad_norm")

    def __init__(self, config, evaluators: Sequence[Scheduled] = ()):
        self.config, self.extra_evaluators = config, tuple(evaluators)
        self.step = self._zero_shot = None

    def check(self) -> None:
        check_finetune_config(self.config)
        c = self.config  # what the pretrained path holds, before the demo's data is written
        self.opened = open_model(c.pretrained, c.model or None, what="pretrained")

    def written_entries(self) -> list[str]:
        c = self.config
        return ([CONFIG, CHECKPOINTS, METRICS, *reported_entries(report_targets(c.report_to)), *WISE_FT_FILES]
                + ([] if c.export_dir else [EXPORT]))

    def check_start(self, start) -> None:
        pass  # its head starts from the class names tokenized once, at a fresh start: no tokenizer to keep

    def keep_files(self, directory) -> None:
        pass

    def prepare_data(self, should_stop) -> None:
        self.train_set, self.test_set, self.shift_set = open_sets(self.config)

    def build(self, precision: str | None = None):
        """The pretrained weights read, the schedule on every device and the step, built once (always fp32)."""
        if self.step is not None:
            return self.schedule, self.step.mesh, self.step
        c = self.config
        self.mean, self.std = self.opened.normalization()
        self.clip_params = jax.tree.map(lambda p: np.asarray(p, np.float32), self.opened.variables()["params"])
        mesh = create_mesh()
        global_batch = c.batch_size * mesh.size
        steps_per_epoch = len(self.train_set) // global_batch
        if steps_per_epoch < 1:
            raise InvalidInput(f"the {len(self.train_set)} train images of {self.train_set.name} make no batch of "
                               f"{global_batch} (batch_size {c.batch_size} x {mesh.size} devices): lower batch_size")
        self.schedule = Schedule(global_batch, steps_per_epoch, c.epochs * steps_per_epoch)
        head = ClassifierHead(len(self.test_set.class_names), c.ema_decay)
        spec = StepSpec.for_model(self.opened.config, "fp32", head=head, seed=c.seed,
                                  optimizer=OptimizerSpec.from_config(c, self.schedule.total_steps))
        self.step = build_step(spec, mesh)
        self.sets = {name: ZeroShotEvaluator(self.step.model, s, mesh, batch_size=eval_batch_size(mesh),
                                             mean=self.mean, std=self.std, num_threads=c.workers or None)
                     for name, s in (("test", self.test_set), ("shift", self.shift_set)) if s is not None}
        return self.schedule, mesh, self.step

    def open_data(self, seed: int, start_step: int):
        c, s = self.config, self.schedule
        return FinetuneBatches(self.train_set.source, global_batch=s.global_batch, steps_per_epoch=s.steps_per_epoch,
                               start=start_step, seed=seed, image_size=self.step.spec.model.vision.image_size,
                               mean=self.mean, std=self.std, num_threads=c.workers,
                               process_index=jax.process_index(), process_count=jax.process_count())

    def zero_shot(self, say) -> tuple[dict, dict]:
        """(the image tower with the zero-shot head, the frozen rest of the CLIP params), on the host."""
        if self._zero_shot is None:
            say(f"zero-shot classifier of {len(self.test_set.class_names)} classes x "
                f"{len(self.test_set.prompts[0])} templates")
            classifier = self.sets["test"].classifier(self.clip_params)
            self._zero_shot = cs.split_params(self.clip_params, cs.zeroshot_head(classifier))
        return self._zero_shot

    def fresh_state(self, step, say):
        """The zero-shot image tower with the zero-shot head, or (LP-FT) with a linear probe's head."""
        zero_shot, frozen = self.zero_shot(say)
        if self.config.head_init != "linear_probe":
            return step.state_from_params({**frozen, **zero_shot})
        mesh = step.mesh
        features, labels = ZeroShotEvaluator(step.model, self.train_set, mesh, mean=self.mean, std=self.std,
                                             batch_size=eval_batch_size(mesh),
                                             num_threads=self.config.workers or None).image_features(
            cs.clip_params(zero_shot, frozen))
        options, num_classes = ProbeOptions(seed=self.config.seed), len(self.train_set.class_names)
        keep, held = validation_split(labels, PROBE_VAL_PROPORTION, self.config.seed)
        decay, _ = search_weight_decay((features[keep], labels[keep]), (features[held], labels[held]), num_classes,
                                       options)
        weights, bias = fit_classifiers(features, labels, num_classes, [decay], options)
        say(f"LP-FT: the head is a linear probe of the pretrained features (weight decay {decay:.3g})")
        return step.state_from_params({**frozen, **zero_shot, "head": {"weights": weights[0], "bias": bias[0]}})

    def evaluations(self, mesh, schedule, say) -> Evaluations:
        setting = lambda: EvalSetting(self.step.model, mesh, self.mean, self.std, eval_batch_size(mesh))  # noqa: E731
        return Evaluations(self.extra_evaluators, setting, epochs_ended=schedule.epochs_ended,
                           total_steps=schedule.total_steps, say=say)

    def eval_weights(self, state) -> dict:
        """The CLIP params with the head (`evaluation.head.HeadEvaluator`'s weights)."""
        return {**state.frozen, **state.params}

    def mfu(self, samples_per_sec: float, step) -> float | None:
        return None

    def data_scalars(self, data_iter) -> dict:
        return {}

    def meta_fields(self) -> dict:
        return {}

    def details(self) -> str:
        c = self.config
        return (f", fine-tuning on {self.train_set.name} ({len(self.train_set)} images), layer decay "
                f"{c.layer_decay:g}, EMA {c.ema_decay:g}")

    # -- WiSE-FT and export -------------------------------------------------------------------------------------

    def score(self, params: dict) -> dict[str, dict[str, float]]:
        """Each set's `acc1`, `acc5`, `mean_per_class_recall` of the model `params` (image tower and head), the
        rest of the CLIP params the pretrained ones (the zero-shot head made first: `zero_shot`)."""
        weights = {**self._zero_shot[1], **params}
        return {name: HeadEvaluator(images).run(weights) for name, images in self.sets.items()}

    def finish(self, state, results: dict, say, record) -> dict:
        """The sweep, its table and plot, and the export of `export_alpha`'s model; the chosen row, recorded."""
        c = self.config
        run_dir = storage.absolute(storage.join(c.logs, c.name))
        zero_shot, frozen = self.zero_shot(say)
        fine_tuned = jax.tree.map(np.asarray, local_values(state.ema))
        rows = wise_ft.sweep(zero_shot, fine_tuned, tuple(c.alphas), self.score, say=say)
        sets = {"test": self.test_set.name, **({"shift": self.shift_set.name} if self.shift_set is not None else {})}
        chosen = wise_ft.interpolate(zero_shot, fine_tuned, c.export_alpha)
        export_dir = c.export_dir or storage.join(run_dir, EXPORT)
        if jax.process_index() == 0:
            table = wise_ft.write_table(run_dir, rows, sets)
            plot = wise_ft.write_plot(run_dir, rows, sets)
            say(f"WiSE-FT table: {table[0]}, {table[1]}" + (f"; plot: {plot}" if plot else ""))
            export_open_clip(cs.clip_params(chosen, frozen), self.step.spec.model, export_dir, mean=self.mean,
                             std=self.std)
            write_head(export_dir, chosen["head"]["weights"], chosen["head"]["bias"], self.test_set.class_names,
                       alpha=c.export_alpha)
            say(f"exported alpha {c.export_alpha:g} with its classification head to {export_dir}")
        row = next((r for r in rows if abs(r["alpha"] - c.export_alpha) < 1e-9), None)
        if row is None:
            row = {"alpha": c.export_alpha, **{f"{name}_{k}": v for name, metrics in self.score(chosen).items()
                                               for k, v in metrics.items()}}
        if "shift_acc1" in rows[0]:
            verdict = wise_ft.summary(rows)
            say(f"shifted top-1: zero-shot {verdict['zero_shot']:.4f}, fine-tuned {verdict['fine_tuned']:.4f}, "
                f"best alpha {verdict['best_alpha']:g} {verdict['best']:.4f}"
                + (" (beats both endpoints)" if verdict["beats_both_endpoints"] else ""))
        record({f"wise_ft_{k}": v for k, v in row.items()})
        return {**results, "rows": rows, "export_dir": export_dir, **row}
