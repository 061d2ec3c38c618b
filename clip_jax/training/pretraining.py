"""CLIP pretraining as a task of the run loop (`clip_jax.training.task`): image-caption shards through the Grain
pipeline (`clip_jax.data`: its position saved with every checkpoint, so a resumed run reads on exactly), the
contrastive step (the softmax or sigmoid loss) from `build_step`, the config's evaluations (zero-shot, validation,
the linear probe) and MFU in its log lines. Configs: `clip_jax.run_config`, `configs/demo.py`.
"""

import dataclasses
import logging
from collections.abc import Sequence

import jax
import numpy as np

from clip_jax import data
from clip_jax.data import streams as stream_layout
from clip_jax.models.flops import train_flops
from clip_jax.models.precision import bf16_recommendation, check_gpu_precision
from clip_jax.runtime.checkpoints import read_stream_positions
from clip_jax.runtime.hardware import device_compute_capability, gpu_for_device_kind, peak_flops
from clip_jax.runtime.run_layout import RUN_ENTRIES, TOKENIZER
from clip_jax.text.model_tokenizer import tokenizer_for
from clip_jax.training import data_resume
from clip_jax.training.config_checks import check_config
from clip_jax.training.evaluations import Evaluations, Scheduled, configured, eval_setting
from clip_jax.training.remat_choice import step_spec
from clip_jax.training.run_setup import check_run_locations, data_filter_settings, run_entries
from clip_jax.training.run_tokenizer import check_run_tokenizer, keep_run_tokenizer
from clip_jax.training.sample_digest import global_digest
from clip_jax.training.schedule import make_schedule
from clip_jax.training.step_factory import StepSpec, build_step, mesh_for

log = logging.getLogger("clip_jax.train")


class ClipPretraining:
    """CLIP pretraining of `config` (`clip_jax.run_config`); `evaluators`: evaluations to make besides the
    config's."""

    name, noun = "pretraining", "run"
    entries = (*RUN_ENTRIES, TOKENIZER)
    data_by_step = False
    averaged = ("loss", "accuracy", "logit_scale", "grad_norm")

    def __init__(self, config, evaluators: Sequence[Scheduled] = ()):
        self.config, self.extra_evaluators = config, tuple(evaluators)
        self.shards = self.platform_spec = self.mesh = None
        self.segments = ()  # the global batches of the run so far (`training.schedule`), from where it starts
        self.data_start, self.epoch_steps, self.streams = None, None, None

    def check(self) -> None:
        config = self.config
        check_config(config, num_devices=jax.device_count(), process_count=jax.process_count())
        check_run_locations(config)  # a bucket that cannot be used stops the run before anything is built
        # so does a model file that cannot be read, before the demo's shards are written
        device = jax.devices()[0]
        self.platform_spec = StepSpec.from_config(config, platform=device.platform,
                                                  compute_capability=device_compute_capability(device))
        tokenizer_for(self.platform_spec.model)  # a SigLIP model's tokenizer files: there, and its vocabulary
        gpu = gpu_for_device_kind(device.device_kind)  # None on a CPU: FP8 emulated, float16 products widened
        check_gpu_precision(config.precision, gpu)
        if (recommendation := bf16_recommendation(config.precision, gpu)) and jax.process_index() == 0:
            log.info(recommendation)

    def written_entries(self) -> list[str]:
        return run_entries(self.config) + ([TOKENIZER] if self.tokenizer_folder else [])  # the tokenizer's copy

    @property
    def tokenizer_folder(self) -> str | None:
        """The folder of the SentencePiece tokenizer the model reads (None: CLIP's BPE)."""
        return self.platform_spec.model.text.tokenizer

    def check_start(self, start) -> None:
        check_run_tokenizer(start.directory, self.tokenizer_folder, resuming=start.resume_from is not None)
        self.segments = start.batch.segments
        self.data_start = start.data
        self.epoch_steps = start.meta.epoch_steps if start.meta is not None else None

    def keep_files(self, directory) -> None:
        keep_run_tokenizer(directory, self.tokenizer_folder)

    def prepare_data(self, should_stop) -> None:
        """The run's shards, resolved once (written first, for the demo): the epoch length and the pipeline read
        the same shards."""
        self.shards = data.resolve_train_shards(data.TrainDataConfig.from_run_config(self.config),
                                                should_stop=should_stop)

    def build(self, precision: str | None = None):
        if self.mesh is None:
            self.schedule = make_schedule(self.config, jax.device_count(), self.shards, self.segments,
                                          epoch_steps=self.epoch_steps)
            self.streams = self._data_streams()
            # an FSDP run whose weights the device count does not divide gets a (replica, data) grid (parallel.py)
            self.mesh = mesh_for(self.platform_spec)
        step = build_step(step_spec(self.config, self.schedule, self.mesh, precision=precision), self.mesh)
        # MFU counts model FLOPs (3x forward); recomputation under remat is overhead, not useful work.
        self.flops_per_sample = train_flops(step.spec.model, max_num_patches=step.spec.max_num_patches)
        return self.schedule, self.mesh, step

    def _data_streams(self) -> int | None:
        """The run's data streams (None: a checkpoint of the per-process layout read on as it was saved)."""
        asked = self.data_start.streams if self.data_start is not None else data_resume.CHOOSE
        if asked is None:
            return None
        config, global_batch = self.config, self.schedule.global_batch
        dealt = config.dataset_type == "csv" or (config.dataset_type == "webdataset" and not config.dataset_resampled)
        limit = len(self.shards) if dealt else None  # epoch mode's shards (csv rows) are dealt: one per stream at least
        if asked == data_resume.CHOOSE:
            return stream_layout.default_streams(global_batch, jax.process_count(), jax.local_device_count(),
                                                config.workers, limit)
        stream_layout.check_streams(asked, global_batch, jax.process_count(), limit)
        return asked

    def open_data(self, seed: int, start_step: int):
        config, model = self.config, self.platform_spec.model
        cfg = data.TrainDataConfig.from_run_config(config, seed=seed)
        start = None
        if self.streams:
            cfg = dataclasses.replace(cfg, streams=self.streams)
            if self.data_start.positions is not None:
                checkpoints, step, saved_processes = self.data_start.positions
                block = stream_layout.owned(self.streams, jax.process_count(), jax.process_index())
                start = read_stream_positions(checkpoints, step, block, data_streams=self.streams,
                                              saved_processes=saved_processes)
        return data.build_train_iterator(
            cfg, shard_list=self.shards, start=start,
            global_batch_size=self.schedule.global_batch, image_size=model.vision.image_size,
            mean=tuple(config.image_mean), std=tuple(config.image_std), process_index=jax.process_index(),
            process_count=jax.process_count(), context_length=model.text.context_length,
            tokenize=tokenizer_for(model))

    def fresh_state(self, step, say):
        if not self.config.pretrained:
            return step.init(self.config.seed)
        return pretrained_state(step, self.config.pretrained, say)

    def evaluations(self, mesh, schedule, say) -> Evaluations:
        # every process: validation is a collective, and a bad validation set stops the run before it trains
        return Evaluations([*configured(self.config, schedule.global_batch), *self.extra_evaluators],
                           lambda: eval_setting(self.config, mesh), epochs_ended=schedule.epochs_ended,
                           total_steps=schedule.total_steps, say=say)

    def eval_weights(self, state):
        """The state's params, with its BatchNorm running statistics for a ResNet image tower (evaluation runs in
        eval mode)."""
        from clip_jax.models.variables import eval_variables

        return eval_variables(state.params, state.batch_stats)

    def mfu(self, samples_per_sec: float, step) -> float | None:
        peak = peak_flops(jax.devices()[0].device_kind, step.spec.precision, self.config.peak_tflops_per_device)
        if not (peak and self.flops_per_sample):
            return None
        return samples_per_sec * self.flops_per_sample / (peak * jax.device_count())

    def data_scalars(self, data_iter) -> dict:
        """The skip counters and, for a run read as data streams, the step's `sample_digest` (a collective: every
        process logs the same steps)."""
        scalars = data.skip_scalars(data_iter.skipped_samples())
        keys = getattr(data_iter, "last_keys", None)
        if self.streams and keys is not None and self.config.get("log_sample_digest", True):
            scalars["sample_digest"] = global_digest(keys)
        return scalars

    def meta_fields(self) -> dict:
        schedule = self.schedule
        return {"data_workers": self.config.workers, "data_filter": data_filter_settings(self.config),
                "data_streams": self.streams, "epoch_steps": schedule.epoch_samples // schedule.first_global_batch}

    def details(self) -> str:
        """The data streams and the process counts that can continue them exactly."""
        if not self.streams:
            return ""
        processes = jax.process_count()
        feasible = stream_layout.feasible_process_counts(self.streams, self.schedule.global_batch,
                                                         jax.local_device_count())
        near = [p for p in feasible if processes / 2 <= p <= 2 * processes]
        return (f", {_count(self.streams, 'data stream')} (exact resumes on {_listed(near)} "
                f"process{'es' if near != [1] else ''}{', among others' if len(near) < len(feasible) else ''})")

    def finish(self, state, results: dict, say, record) -> dict:
        return results


def pretrained_state(step, path: str, say):
    """A new run's state from pretrained weights: their params (fitted to this model, in its param dtypes) and,
    for a ResNet image tower, their BatchNorm statistics; a fresh optimizer state, step 0."""
    from clip_jax.interop.opener import open_model

    variables = open_model(path, step.spec.model, what="pretrained").variables()
    abstract = step.abstract_state
    in_dtypes = lambda tree, like: jax.tree.map(lambda p, a: np.asarray(p, a.dtype), tree, like)  # noqa: E731
    params = in_dtypes(variables["params"], abstract.params)
    batch_stats = None if abstract.batch_stats is None else in_dtypes(variables["batch_stats"], abstract.batch_stats)
    say(f"params{' and BatchNorm statistics' if batch_stats is not None else ''} from pretrained {path}")
    return step.state_from_params(params, batch_stats)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _listed(counts: Sequence[int]) -> str:
    """"1, 2 or 4"."""
    return ", ".join(map(str, counts[:-1])) + (" or " if len(counts) > 1 else "") + str(counts[-1])
