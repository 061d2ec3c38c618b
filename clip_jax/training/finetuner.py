"""Classification fine-tuning with WiSE-FT: `python -m clip_jax.finetune --config configs/demo_finetune.py`.

config -> data (a CLIP_benchmark classification set: train, test and a shifted set) -> pretrained CLIP -> the head
(the zero-shot classifier of templates x class names, or a linear probe first: LP-FT) -> full fine-tuning of the image
tower and head on the mesh (`finetune_step`: AdamW, layer-wise learning-rate decay, EMA) -> the WiSE-FT sweep
(`wise_ft`) -> the export of `export_alpha`'s model with its head.

The run lives in `LOGS/NAME/` as a trainer's does: `config.json`, `checkpoints/STEP/` (the state; no data position,
the batches being a function of the step: `finetune_data`), `metrics.jsonl` and TensorBoard events, then
`wise_ft.json`, `wise_ft.csv`, `wise_ft.png` and `export/` (the OpenCLIP folder, both towers, with
`classification_head.npz`: `interop.classification_head`). `resume="latest"` continues the newest checkpoint; a
finished run only sweeps and exports again. SIGTERM or Ctrl-C between steps saves and exits 0.
"""

import time

import jax
import ml_collections
import numpy as np

from clip_jax.errors import InvalidInput
from clip_jax.evaluation import clip_benchmark
from clip_jax.evaluation.benchmark import classification_metrics
from clip_jax.evaluation.classification import ZeroShotEvaluator
from clip_jax.evaluation.encoder import replicate
from clip_jax.evaluation.linear_probe import ProbeOptions, fit_classifiers, search_weight_decay, validation_split
from clip_jax.evaluation.shifts import SHIFTS
from clip_jax.interop.classification_head import write_head
from clip_jax.interop.export import export_open_clip
from clip_jax.interop.opener import open_model
from clip_jax.models import create_model, is_resnet
from clip_jax.ops.run_outputs import RunOutputs
from clip_jax.optim.adamw import warmup_cosine_schedule
from clip_jax.runtime import ownership, storage
from clip_jax.runtime.checkpoints import CheckpointMeta, RunCheckpoints
from clip_jax.runtime.mesh import create_mesh, make_global_batch, replicated
from clip_jax.training import finetune_step as ft
from clip_jax.training import wise_ft
from clip_jax.training.config_checks import report_targets
from clip_jax.training.evaluations import PROBE_VAL_PROPORTION, eval_batch_size
from clip_jax.training.finetune_config import check_finetune_config
from clip_jax.training.finetune_data import train_batches
from clip_jax.runtime.stop_signals import StopSignal
from clip_jax.training.run_setup import NewRunDirectory

EXPORT = "export"
RUN_ENTRIES = ["config.json", "checkpoints", "metrics.jsonl", "tensorboard", wise_ft.TABLE_JSON, wise_ft.TABLE_CSV,
               wise_ft.PLOT, EXPORT]


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


def load_model(c):
    """(model in fp32, its config, CLIP params on the host, mean, std) of `pretrained`."""
    opened = open_model(c.pretrained, c.model or None, what="pretrained")
    model_config = opened.config
    if is_resnet(model_config):
        raise InvalidInput(f"{model_config.name}: fine-tuning with layer-wise learning-rate decay needs a ViT image "
                           "tower; a ResNet tower is not supported")
    mean, std = opened.normalization()
    params = jax.tree.map(lambda p: np.asarray(p, np.float32), opened.variables()["params"])
    return create_model(model_config), model_config, params, mean, std


class Finetuner:
    """Holds the run's parts; `run()` fine-tunes (or continues), sweeps and exports. Use it as a context manager."""

    def __init__(self, config: ml_collections.ConfigDict, stop: StopSignal | None = None):
        check_finetune_config(config)
        self.c, self.stop = config, stop
        self.is_main = jax.process_index() == 0
        self.run_dir = storage.absolute(storage.join(config.logs, config.name))
        ownership.refuse_foreign(self.run_dir, RUN_ENTRIES, writing=f"the fine-tuning run {config.name!r}",
                                 change="give the run another --config.name, or another --config.logs")
        self.new_dir = NewRunDirectory(self.run_dir)  # before any write
        self.model, self.model_config, clip_params, self.mean, self.std = load_model(config)  # before make_data
        self.train_set, self.test_set, self.shift_set = open_sets(config)
        self.mesh = create_mesh()
        self.global_batch = config.batch_size * self.mesh.size
        self.steps_per_epoch = len(self.train_set) // self.global_batch
        if self.steps_per_epoch < 1:
            raise InvalidInput(f"the {len(self.train_set)} train images of {self.train_set.name} make no batch of "
                               f"{self.global_batch} (batch_size {config.batch_size} x {self.mesh.size} devices): "
                               "lower batch_size")
        self.total_steps = config.epochs * self.steps_per_epoch
        self.evaluators = {name: ZeroShotEvaluator(self.model, s, self.mesh, batch_size=eval_batch_size(self.mesh),
                                                   mean=self.mean, std=self.std, num_threads=config.workers or None)
                           for name, s in (("test", self.test_set), ("shift", self.shift_set)) if s is not None}
        self.say(f"zero-shot classifier of {len(self.test_set.class_names)} classes x "
                 f"{len(self.test_set.prompts[0])} templates")
        self.zero_shot, self.frozen = ft.split_params(
            clip_params, ft.zeroshot_head(self.evaluators["test"].classifier(clip_params)))
        self.checkpoints = self.outputs = None
        try:
            self._open()
        except BaseException:
            self.close(failed=True)
            raise

    def _open(self) -> None:
        c = self.c
        self.learning_rate_fn = warmup_cosine_schedule(c.lr, c.warmup, self.total_steps)
        self.optimizer = ft.finetune_optimizer(
            self.zero_shot, self.learning_rate_fn, weight_decay=c.wd, layer_decay=c.layer_decay,
            image_layers=self.model_config.vision.layers, b1=c.beta1, b2=c.beta2, eps=c.eps,
            grad_clip_norm=c.grad_clip_norm or None)
        self.step_fn = ft.make_finetune_step(self.model, self.optimizer, self.mesh, ema_decay=c.ema_decay,
                                             learning_rate_fn=self.learning_rate_fn)
        if self.is_main:
            ownership.record(self.run_dir, RUN_ENTRIES)
        self.checkpoints = RunCheckpoints(storage.join(self.run_dir, "checkpoints"), keep=c.keep)
        latest = self.checkpoints.latest_step()
        if latest is not None and not c.resume:
            raise InvalidInput(f"run directory {self.run_dir} already has checkpoints: continue it with "
                               "--config.resume=latest, or start another run with --config.name=...")
        self.frozen = replicate(self.frozen, self.mesh)
        if latest is None:
            self.state = jax.jit(lambda p: ft.init_state(p, self.optimizer), out_shardings=replicated(self.mesh))(
                self._initial_params())
        else:
            abstract = jax.eval_shape(lambda p: ft.init_state(p, self.optimizer), self.zero_shot)
            abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated(self.mesh)),
                                    abstract)
            self.state, _ = self.checkpoints.restore(latest, abstract)
            self.say(f"resumed {self.run_dir}/checkpoints/{latest}")
        self.step = int(jax.device_get(self.state.step))
        if self.is_main:
            storage.write_text(storage.join(self.run_dir, "config.json"), c.to_json(indent=2))
        self.outputs = RunOutputs(self.run_dir, is_main=self.is_main, targets=report_targets(c.report_to),
                                  config=c.to_dict(), resumed_at=self.step if latest is not None else None)

    def _initial_params(self) -> dict:
        """The zero-shot image tower with the zero-shot head, or (LP-FT) with a linear probe's head."""
        if self.c.head_init != "linear_probe":
            return self.zero_shot
        features, labels = ZeroShotEvaluator(self.model, self.train_set, self.mesh, mean=self.mean, std=self.std,
                                             batch_size=eval_batch_size(self.mesh),
                                             num_threads=self.c.workers or None).image_features(
            ft.clip_params(self.zero_shot, self.frozen))
        options, num_classes = ProbeOptions(seed=self.c.seed), len(self.train_set.class_names)
        keep, held = validation_split(labels, PROBE_VAL_PROPORTION, self.c.seed)
        decay, _ = search_weight_decay((features[keep], labels[keep]), (features[held], labels[held]), num_classes,
                                       options)
        weights, bias = fit_classifiers(features, labels, num_classes, [decay], options)
        self.say(f"LP-FT: the head is a linear probe of the pretrained features (weight decay {decay:.3g})")
        return {**self.zero_shot, "head": {"weights": weights[0], "bias": bias[0]}}

    def say(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def close(self, failed: bool = False) -> None:
        """Closes what the run opened; a `failed` set-up that made the run directory and left nothing in it to keep
        takes that directory back (as the trainer's does)."""
        try:
            if self.checkpoints is not None:
                self.checkpoints.close()
        finally:
            outputs, self.checkpoints, self.outputs = self.outputs, None, None
            if outputs is not None:
                outputs.close(failed)
            if failed and self.is_main:
                self.new_dir.remove_if_unused()

    def __enter__(self) -> "Finetuner":
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)

    # -- training -----------------------------------------------------------------------------------------------

    def _save(self) -> None:
        meta = CheckpointMeta(step=self.step, model=self.model_config.name, precision="fp32",
                              global_batch=self.global_batch, samples_seen=self.step * self.global_batch,
                              epoch=self.step / self.steps_per_epoch, process_count=jax.process_count(),
                              data_seed=self.c.seed)
        self.checkpoints.save(self.step, self.state, None, meta, force=True)
        self.outputs.sync(self.step)

    def train(self) -> bool:
        """Fine-tunes to the last step (True), or saves and returns False at a stop signal."""
        c, start = self.c, self.step
        if start >= self.total_steps:
            return True
        self.say(f"fine-tuning {self.model_config.name} on {self.train_set.name} ({len(self.train_set)} images): "
                 f"global batch {self.global_batch}, {self.steps_per_epoch} steps/epoch x {c.epochs} epochs = "
                 f"{self.total_steps} steps, layer decay {c.layer_decay:g}, EMA {c.ema_decay:g}")
        batches = train_batches(self.train_set.source, global_batch=self.global_batch,
                                steps_per_epoch=self.steps_per_epoch, start=start, stop=self.total_steps,
                                seed=c.seed, image_size=self.model_config.vision.image_size, mean=self.mean,
                                std=self.std, num_threads=c.workers, process_index=jax.process_index(),
                                process_count=jax.process_count())
        clock, window = time.perf_counter(), 0
        for rows in batches:
            if self.stop is not None and self.stop.agreed():
                self._save()
                self.checkpoints.wait()
                self.say(f"{self.stop.received or 'stop signal'}: saved checkpoint {self.step} in {self.run_dir}; "
                         "exiting. Continue with the same command (resume='latest')")
                return False
            self.state, metrics = self.step_fn(self.state, self.frozen, make_global_batch(rows, self.mesh))
            self.step += 1
            window += 1
            if self.step % c.log_every_n_steps == 0 or self.step == self.total_steps:
                scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
                elapsed = time.perf_counter() - clock
                scalars["samples_per_sec"] = window * self.global_batch / max(elapsed, 1e-9)
                scalars["epoch"] = self.step / self.steps_per_epoch
                self.say(f"step {self.step}/{self.total_steps} | epoch {scalars['epoch']:.2f} | loss "
                         f"{scalars['loss']:.4f} | acc {scalars['train_acc1']:.3f} | lr {scalars['lr']:.3g} | gnorm "
                         f"{scalars['grad_norm']:.3g} | {scalars['samples_per_sec']:,.0f} samples/s")
                self.outputs.record(self.step, scalars)
                clock, window = time.perf_counter(), 0
            if self.step == self.total_steps or (c.save_every_steps and self.step % c.save_every_steps == 0):
                self._save()
        self.checkpoints.wait()
        return True

    # -- WiSE-FT and export -------------------------------------------------------------------------------------

    def score(self, params: dict) -> dict[str, dict[str, float]]:
        """Each set's `acc1`, `acc5`, `mean_per_class_recall` of the model `params` (image tower and head)."""
        clip = ft.clip_params(params, self.frozen)
        head = params["head"]
        out = {}
        for name, evaluator in self.evaluators.items():
            features, labels = evaluator.image_features(clip)
            out[name] = classification_metrics(features @ np.asarray(head["weights"]) + np.asarray(head["bias"]),
                                               labels)
        return out

    def finish(self) -> dict:
        """The sweep, its table and plot, and the export of `export_alpha`'s model; the chosen row."""
        c = self.c
        fine_tuned = jax.tree.map(np.asarray, jax.device_get(self.state.ema))
        rows = wise_ft.sweep(self.zero_shot, fine_tuned, tuple(c.alphas), self.score, say=self.say)
        sets = {"test": self.test_set.name, **({"shift": self.shift_set.name} if self.shift_set is not None else {})}
        chosen = wise_ft.interpolate(self.zero_shot, fine_tuned, c.export_alpha)
        export_dir = c.export_dir or storage.join(self.run_dir, EXPORT)
        if self.is_main:
            table = wise_ft.write_table(self.run_dir, rows, sets)
            wise_ft.write_plot(self.run_dir, rows, sets)
            self.say(f"WiSE-FT table: {table[0]}, {table[1]}")
            clip = jax.device_get(ft.clip_params(chosen, self.frozen))
            export_open_clip(clip, self.model_config, export_dir, mean=self.mean, std=self.std)
            write_head(export_dir, chosen["head"]["weights"], chosen["head"]["bias"], self.test_set.class_names,
                       alpha=c.export_alpha)
            self.say(f"exported alpha {c.export_alpha:g} with its classification head to {export_dir}")
        row = next((r for r in rows if abs(r["alpha"] - c.export_alpha) < 1e-9), None)
        if row is None:
            row = {"alpha": c.export_alpha, **{f"{name}_{k}": v for name, metrics in self.score(chosen).items()
                                               for k, v in metrics.items()}}
        if "shift_acc1" in rows[0]:
            verdict = wise_ft.summary(rows)
            self.say(f"shifted top-1: zero-shot {verdict['zero_shot']:.4f}, fine-tuned {verdict['fine_tuned']:.4f}, "
                     f"best alpha {verdict['best_alpha']:g} {verdict['best']:.4f}"
                     + (" (beats both endpoints)" if verdict["beats_both_endpoints"] else ""))
        self.outputs.record(self.step, {f"wise_ft_{k}": v for k, v in row.items()})
        return {"step": self.step, "rows": rows, "export_dir": export_dir, **row}

    def run(self) -> dict:
        if not self.train():
            return {"stopped_at": self.step}
        return self.finish()


def finetune(config: ml_collections.ConfigDict, stop: StopSignal | None = None) -> dict:
    with Finetuner(config, stop) as finetuner:
        return finetuner.run()
