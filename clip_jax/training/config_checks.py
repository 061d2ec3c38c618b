"""The checks of a training config (`clip_jax.run_config`) that run before anything is built: `check_config` names
every problem at once, each with what to do.
"""

import os

import ml_collections

from clip_jax.errors import InvalidInput, UserError
from clip_jax.interop.opener import did_you_mean, path_problems
from clip_jax.models.attention import ATTENTION_CHOICES
from clip_jax.models.fused_layer_norm import FUSED_KERNELS
from clip_jax.models.remat import remat_policy_names
from clip_jax.models.precision import GRAD_REDUCE_DTYPES, POLICIES, RESIDUAL_DTYPES, model_grad_dtype, open_clip_hint
from clip_jax.run_config import default_config
from clip_jax.runtime import storage
from clip_jax.training.loss import LOSSES
from clip_jax.training.remat_choice import AUTO
from clip_jax.training.step_factory import OPTIMIZERS

PRECISIONS = ("fp32", "bf16", "pure_bf16", "fp16", "fp8")
INSTABILITY_ACTIONS = ("rollback", "rollback_fp32", "rollback_bf16", "stop")
REPORT_TO = ("tensorboard", "wandb")  # report_to: "none", one of these, or both joined by "," (OpenCLIP's flag)
RESUME_DATA = ("exact", "allow_reseed")
# The fields that take one of a list of names, with their lists.
CHOICES = (("precision", PRECISIONS), ("on_instability", INSTABILITY_ACTIONS), ("resume_data", RESUME_DATA),
           ("opt", OPTIMIZERS), ("loss", tuple(LOSSES)), ("attention_impl", ATTENTION_CHOICES),
           ("grad_reduce_dtype", GRAD_REDUCE_DTYPES), ("residual_dtype", RESIDUAL_DTYPES),
           ("remat_policy", (*remat_policy_names(), AUTO)), ("fused_kernels", FUSED_KERNELS))


def choice_problems(c: ml_collections.ConfigDict, choices) -> list[str]:
    """One line for each (field, names) of `choices` whose value in `c` is not among its names."""
    return [f"{field}={c[field]!r}: choose one of {names}" + (open_clip_hint(c[field]) if field == "precision" else "")
            for field, names in choices if c[field] not in names]


def check_config(c: ml_collections.ConfigDict, *, num_devices: int, process_count: int = 1) -> None:
    """Raises ValueError naming the field and what to do, for every mistake that can be seen before compiling."""
    problems = []
    if not c.train_data and c.dataset_type != "synthetic":
        problems.append("train_data is empty: give the shard pattern, e.g. "
                        "--config.train_data='/data/{00000..00099}.tar'")
    problems.extend(choice_problems(c, CHOICES[:3]))
    problems.extend(report_to_problems(c))
    problems.extend(choice_problems(c, CHOICES[3:]))
    if c.precision in POLICIES and c.grad_reduce_dtype in GRAD_REDUCE_DTYPES:
        try:  # a loss-scaled policy sums its gradients in float32
            model_grad_dtype(POLICIES[c.precision], c.grad_reduce_dtype)
        except InvalidInput as e:
            problems.append(str(e))
    for field in ("batch_size", "accum_freq", "epochs", "save_frequency", "keep", "log_every_n_steps",
                  "nan_patience", "loss_scale_growth_interval"):
        if c[field] < 1:
            problems.append(f"{field}={c[field]} must be at least 1")
    for field in ("warmup", "workers", "train_num_samples", "save_every_steps", "zeroshot_frequency", "lr", "wd",
                  "grad_clip_norm", "loss_spike_factor", "zeroshot_samples", "val_num_samples", "val_frequency",
                  "linear_probe_frequency", "resume_global_batch", "data_streams"):
        if c[field] < 0:
            problems.append(f"{field}={c[field]} must not be negative")
    if not c.loss_scale_init > 0:
        problems.append(f"loss_scale_init={c.loss_scale_init} must be positive (fp16's first loss scale, e.g. "
                        "65536)")
    force = c.force_patch_dropout  # None, like -1: the model's
    if force is not None and not (force < 1 and (force >= 0 or force == -1)):
        problems.append(f"force_patch_dropout={c.force_patch_dropout}: give a rate in [0, 1), or -1 for the model "
                        "config's patch_dropout")
    if c.batch_size >= 1 and c.accum_freq >= 1 and c.batch_size % c.accum_freq:
        problems.append(f"batch_size={c.batch_size} (per device) is not divisible by accum_freq={c.accum_freq}")
    if c.resume_global_batch > 0 and c.resume_global_batch % num_devices:
        problems.append(f"resume_global_batch={c.resume_global_batch} does not divide over {num_devices} devices: "
                        f"give a multiple of {num_devices} (0: keep the run's global batch)")
    if num_devices % process_count:
        problems.append(f"{num_devices} devices do not split evenly over {process_count} processes")
    if len(c.image_mean) != 3 or len(c.image_std) != 3:
        problems.append("image_mean and image_std need 3 values each")
    for field in ("logs", "resume"):
        problem = storage.scheme_problem(str(c[field]))
        if problem:
            problems.append(f"{field}={problem}")
    if c.resume and c.resume != "latest" and "://" not in c.resume and not os.path.exists(c.resume):
        problems.append(f"resume={c.resume!r} does not exist: give a checkpoint or run directory, or 'latest'")
    if c.pretrained and "://" in c.pretrained:
        problems.append(f"pretrained={c.pretrained!r}: pretrained weights are read from a local path; copy them "
                        "there first (a run directory on a bucket: its checkpoint folder)")
    elif c.pretrained and not os.path.exists(c.pretrained):
        problems.append(f"pretrained={c.pretrained!r} does not exist{did_you_mean(c.pretrained)}: give an OpenCLIP "
                        "checkpoint, an exported folder or a clip_jax run directory")
    elif c.pretrained:  # what is there when it holds no model: before the demo's data is written
        problems += path_problems(c.pretrained, "pretrained")
    if c.force_image_size < 0:
        problems.append(f"force_image_size={c.force_image_size} must not be negative (0: the model's)")
    for lock, unlocked in (("lock_image", "lock_image_unlocked_groups"), ("lock_text", "lock_text_unlocked_layers")):
        if c[unlocked] < 0:
            problems.append(f"{unlocked}={c[unlocked]} must not be negative")
        elif c[unlocked] and not c[lock]:
            problems.append(f"{unlocked}={c[unlocked]} has no effect without {lock}=True")
    if c.zeroshot_data and c.zeroshot_data != "demo" and not os.path.isdir(c.zeroshot_data):
        problems.append(f"zeroshot_data={c.zeroshot_data!r} is neither 'demo' nor an image folder nor a "
                        "CLIP_benchmark dataset folder")
    elif c.zeroshot_data and c.zeroshot_data != "demo":
        from clip_jax.evaluation import clip_benchmark

        if clip_benchmark.is_dataset_folder(c.zeroshot_data):
            try:
                clip_benchmark.check_training_layout(c.zeroshot_data)
            except UserError as e:
                problems.append(f"zeroshot_data={c.zeroshot_data!r}: {e}")
    problems += linear_probe_problems(c)
    problems += data_problems(c)
    if problems:  # one line for one problem, else a line for each
        raise InvalidInput("bad config: " + problems[0] if len(problems) == 1 else
                           "bad config:\n  " + "\n  ".join(problems))


def linear_probe_problems(c: ml_collections.ConfigDict) -> list[str]:
    """`linear_probe_data`: a CLIP_benchmark classification folder with a `train` and a `test` split."""
    if not c.linear_probe_data:
        return []
    if not os.path.isdir(c.linear_probe_data):
        return [f"linear_probe_data={c.linear_probe_data!r} does not exist: give a CLIP_benchmark classification "
                "dataset folder with train and test splits"]
    from clip_jax.evaluation import clip_benchmark

    for split in ("train", "test"):
        try:
            clip_benchmark.check_training_layout(c.linear_probe_data, split, needed_by="the linear probe")
        except UserError as e:
            return [f"linear_probe_data={c.linear_probe_data!r} needs a {split!r} split the probe "
                    f"{'trains' if split == 'train' else 'is scored'} on: {e}"]
    return []


def data_problems(c: ml_collections.ConfigDict) -> list[str]:
    """The data fields' mistakes: dataset type, filter expression (parsed here, before anything compiles), keys."""
    from clip_jax.data import filter_expression, filters, train_config

    problems = []
    if c.dataset_type not in train_config.DATASET_TYPES:
        problems.append(f"dataset_type={c.dataset_type!r}: choose one of {train_config.DATASET_TYPES}")
    try:
        rules = filters.parse_rules(c.train_data_filter)
    except filter_expression.FilterSyntaxError as e:
        problems.append(f"train_data_filter: {e}")
    else:
        if rules and c.dataset_type != "webdataset":
            problems.append("train_data_filter reads each sample's .json, which only webdataset shards have")
    for field in ("train_data_min_image_size", "train_data_min_caption_chars", "max_image_pixels"):
        if c[field] < 0:
            problems.append(f"{field}={c[field]} must not be negative")
    if not c.train_data_image_key.strip(" ;"):
        problems.append("train_data_image_key is empty: give extensions such as 'jpg;png;webp'")
    if not c.train_data_caption_key.strip() or c.train_data_caption_key.strip() == "json:":
        problems.append("train_data_caption_key is empty: give an extension ('txt') or 'json:FIELD'")
    if c.dataset_type == "csv" and not c.csv_separator:
        problems.append("csv_separator is empty")
    try:
        train_config.augment_from_config(c.aug_cfg)
    except UserError as e:
        problems.append(str(e))
    if c.dataset_type == "synthetic" and not c.train_num_samples:
        problems.append("dataset_type='synthetic' needs train_num_samples (samples per virtual epoch)")
    problems += _unused_data_fields(c)
    return problems


def _unused_data_fields(c: ml_collections.ConfigDict) -> list[str]:
    """Fields set away from their defaults that the chosen dataset_type would silently not use."""
    if c.dataset_type == "webdataset":
        return []
    defaults = default_config()
    unused = ["make_train_data", "train_data_upsampling_factors", "train_data_image_key", "train_data_caption_key"]
    if c.dataset_type == "synthetic":  # no images are decoded or augmented
        unused += ["train_data_min_image_size", "train_data_min_caption_chars", "max_image_pixels", "aug_cfg"]
    return [f"{field}={c[field]!r} has no effect with dataset_type={c.dataset_type!r}: leave it unset"
            for field in unused if c[field] != defaults[field]]


def report_targets(report_to: str) -> tuple[str, ...]:
    """`report_to` ("tensorboard", "wandb", "tensorboard,wandb", "none" or "") as the targets it names."""
    names = tuple(n.strip() for n in str(report_to).split(",") if n.strip())
    return () if names in ((), ("none",)) else names


def report_to_problems(c) -> list[str]:
    targets = report_targets(c.report_to)
    unknown = [t for t in targets if t not in REPORT_TO]
    if unknown:
        return [f"report_to={c.report_to!r}: {', '.join(map(repr, unknown))} unknown; give 'none' or any of "
                f"{REPORT_TO} joined by ','"]
    if "wandb" in targets:
        from clip_jax.ops.wandb_writer import project_problem

        problem = project_problem(c.wandb_project)
        if problem:
            return [problem]
    return []
