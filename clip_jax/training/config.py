"""The training config: every field with its default, and the checks that run before anything is compiled.

Field names are OpenCLIP's command-line flags with underscores (`--train-data` -> `train_data`), so an OpenCLIP
launch script translates line by line; fields OpenCLIP lacks are named in the same style. The files in `configs/`
start from `default_config()` and change what their run needs.
"""

import os

import ml_collections

from clip_jax.data.normalization import OPENAI_MEAN, OPENAI_STD
from clip_jax.errors import InvalidInput, UserError
from clip_jax.runtime import storage
from clip_jax.training.loss import LOSSES

PRECISIONS = ("fp32", "bf16", "pure_bf16")
INSTABILITY_ACTIONS = ("rollback", "rollback_fp32", "stop")
REPORT_TO = ("tensorboard", "wandb")  # report_to: "none", one of these, or both joined by "," (OpenCLIP's flag)
RESUME_DATA = ("exact", "allow_reseed")
OPTIMIZERS = ("adamw", "stable_adamw")


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # Model and preprocessing.
    c.model = "ViT-B-32"  # a registered name or an OpenCLIP model-config .json
    c.image_mean = OPENAI_MEAN
    c.image_std = OPENAI_STD

    # Data: webdataset shards ("/data/{00000..23295}.tar", sources joined with "::").
    c.train_data = ""
    c.train_data_upsampling_factors = ""  # per-source weights "1::2" (resampled mode)
    c.train_num_samples = 0  # samples per (virtual) epoch; 0: counted from the shards' *_stats.json
    c.dataset_resampled = True  # draw shards with replacement (else every shard once per epoch)
    c.workers = 4  # data worker processes per training process
    c.shuffle_window = 1000
    # "fashion-mnist": write the shards train_data names from the bundled Fashion-MNIST training split when they
    # are missing, once however many processes start together (the demo); "": they must exist
    c.make_train_data = ""
    # Data sources and sample filters (clip_jax/data/filters.py, csv_source.py, synthetic.py).
    c.dataset_type = "webdataset"  # webdataset | csv (train_data: the csv/tsv file) | synthetic (random batches)
    # keep samples whose .json metadata satisfy this, e.g. "punsafe < 0.5 and NSFW != 'NSFW'" ("": all)
    c.train_data_filter = ""
    c.train_data_min_image_size = 0  # drop images whose shorter side is below this many pixels (0: off)
    c.train_data_min_caption_chars = 0  # drop captions shorter than this many characters (0: off)
    c.train_data_image_key = "jpg;png;jpeg;webp"  # webdataset image extensions, in preference order
    c.train_data_caption_key = "txt"  # webdataset caption: an extension, or "json:FIELD" (e.g. json:caption)
    c.max_image_pixels = 0  # skip (and count) images declaring more pixels: a decompression bomb guard (0: off)
    c.csv_img_key = "filepath"
    c.csv_caption_key = "title"
    c.csv_separator = "\t"
    # OpenCLIP's --aug-cfg. Without use_timm: crop scale, colour jitter (brightness, contrast, saturation, hue)
    # applied with color_jitter_prob, greyscale with gray_scale_prob. With use_timm: scale, ratio (the crop's aspect
    # range), re_prob / re_count (random erasing). 0 / all zeros: unset
    c.aug_cfg = ml_collections.ConfigDict(
        {"scale": (0.9, 1.0), "color_jitter": (0.0, 0.0, 0.0, 0.0), "color_jitter_prob": 0.0, "gray_scale_prob": 0.0,
         "use_timm": False, "ratio": (0.0, 0.0), "re_prob": 0.0, "re_count": 0})

    # Optimisation. batch_size is per device, as in OpenCLIP (per GPU).
    c.batch_size = 64
    c.accum_freq = 1
    # adamw | stable_adamw: AdamW whose per-tensor step shrinks when RMS(g / sqrt(v)) > 1 (clip_jax.optim.stable_adamw)
    c.opt = "adamw"
    c.epochs = 32
    c.lr = 5e-4
    c.warmup = 10_000
    c.wd = 0.2
    c.beta1 = 0.9
    c.beta2 = 0.98
    c.eps = 1e-6
    c.grad_clip_norm = 0.0  # 0: no clipping
    # clip: the softmax loss | siglip: the sigmoid loss (OpenCLIP's --siglip: a model config without
    # init_logit_bias gets a logit_bias, -10, and the scale ln 10)
    c.loss = "clip"
    # Patch dropout (FLIP) in training: the model config's vision patch_dropout, or this rate in [0, 1) instead
    # (0 for a final unmasked phase); -1: the model's. Eval never drops patches.
    c.force_patch_dropout = -1.0

    # Starting from pretrained weights and fine-tuning.
    # A new run's params start from these weights (fresh optimizer, schedule and data; on resume the checkpoint
    # wins): an OpenCLIP checkpoint (.pt/.bin/.safetensors), a folder written by `python -m clip_jax.export`, or a
    # clip_jax run directory / checkpoint. "": a fresh initialisation
    c.pretrained = ""
    # Train at this image size instead of the model config's (OpenCLIP's --force-image-size; 0: the model's): the
    # pretrained vision positional embedding is resized bicubically, class token kept (224 -> 336 px for L/14@336)
    c.force_image_size = 0
    # LiT: lock the image tower but its last `lock_image_unlocked_groups` groups (OpenCLIP's grouping: the stem,
    # each block, the last block with ln_post, the projection). A locked ResNet tower (locked whole) keeps its
    # BatchNorm in train mode, its running statistics updated, unless `lock_image_freeze_bn_stats` (OpenCLIP's
    # --lock-image-freeze-bn-stats) puts it in eval mode, statistics unchanged; a ViT has no BatchNorm
    c.lock_image = False
    c.lock_image_unlocked_groups = 0
    c.lock_image_freeze_bn_stats = False
    # Lock the text tower but its last `lock_text_unlocked_layers` groups (embeddings, blocks, the last block with
    # ln_final, the projection). Locked params get no update and no optimizer state
    c.lock_text = False
    c.lock_text_unlocked_layers = 0

    # Precision and memory.
    c.precision = "bf16"  # fp32 | bf16 | pure_bf16; may change when resuming
    c.grad_checkpointing = True  # rematerialise every residual block ...
    c.remat_policy = "nothing_saveable"  # ... under this jax.checkpoint policy
    c.fsdp = False  # shard params and optimizer state over the data axis (ZeRO-3)
    c.attention_impl = "auto"  # auto (cuDNN's fused attention on a GPU in bf16, else XLA's) | xla | cudnn

    # Run directory, checkpoints, resumption.
    c.logs = "./logs"
    c.name = ""  # run name; "" makes one from the model and the start time
    c.resume = ""  # "latest" (start fresh when there is none), or a checkpoint / run directory
    # "exact": continue the data stream where the checkpoint left off (needs the process count and workers that
    # saved it); "allow_reseed": the same when possible, else restore the train state only and read on with new
    # data iterators seeded from (seed, step): no replay of the run's first samples
    c.resume_data = "exact"
    c.save_frequency = 1  # save every this many (virtual) epochs
    c.save_every_steps = 0  # and every this many steps (0: off)
    c.keep = 3  # checkpoints kept

    # Evaluation.
    # "demo" (bundled Fashion-MNIST test split), an image folder (ImageNet val layout), a classification dataset in
    # CLIP_benchmark's webdataset layout (its test split), or ""
    c.zeroshot_data = ""
    c.zeroshot_frequency = 1  # evaluate every this many epochs (0: only at the end), when zeroshot_data is set
    c.zeroshot_samples = 0  # evaluate on the first N images only (0: all)

    # Metrics.
    # tensorboard | wandb | tensorboard,wandb | none (the console always gets progress lines)
    c.report_to = "tensorboard"
    c.log_every_n_steps = 100
    c.peak_tflops_per_device = 0.0  # for MFU; 0: looked up from the device kind
    # Per-block gradient and update RMS, Adam's RMS ratio, the last blocks' q/k weight norms: computed on every
    # log_every_n_steps-th step only, written with the other metrics (clip_jax.training.spike_telemetry)
    c.spike_telemetry = True

    # Operating a long run: telemetry, validation during training, Weights & Biases.
    # GPU (NVML), device memory and host fields in each log line; a warning at >90% memory
    c.device_telemetry = True
    c.val_data = ""  # held-out webdataset shards of image-caption pairs ("/data/val/{0..7}.tar"), or ""
    c.val_num_samples = 0  # validate on the first N images only (0: all)
    c.val_frequency = 1  # validate every this many epochs (0: only at the end), when val_data is set
    c.wandb_project = "clip_jax"  # W&B project (report_to includes wandb); WANDB_MODE=offline runs without network

    # Faults.
    c.nan_patience = 3  # consecutive non-finite steps before rolling back
    c.loss_spike_factor = 0.0  # roll back when the loss exceeds this x its recent mean (0: off)
    c.on_instability = "rollback"  # rollback | rollback_fp32 (continue in fp32, as the reference run did) | stop

    c.seed = 0
    return c


def check_config(c: ml_collections.ConfigDict, *, num_devices: int, process_count: int = 1) -> None:
    """Raises ValueError naming the field and what to do, for every mistake that can be seen before compiling."""
    problems = []
    if not c.train_data and c.dataset_type != "synthetic":
        problems.append("train_data is empty: give the shard pattern, e.g. "
                        "--config.train_data='/data/{00000..00099}.tar'")
    if c.precision not in PRECISIONS:
        problems.append(f"precision={c.precision!r}: choose one of {PRECISIONS}")
    if c.on_instability not in INSTABILITY_ACTIONS:
        problems.append(f"on_instability={c.on_instability!r}: choose one of {INSTABILITY_ACTIONS}")
    if c.resume_data not in RESUME_DATA:
        problems.append(f"resume_data={c.resume_data!r}: choose one of {RESUME_DATA}")
    problems.extend(report_to_problems(c))
    if c.opt not in OPTIMIZERS:
        problems.append(f"opt={c.opt!r}: choose one of {OPTIMIZERS}")
    if c.loss not in LOSSES:
        problems.append(f"loss={c.loss!r}: choose one of {tuple(LOSSES)}")
    if c.attention_impl not in ("auto", "xla", "cudnn"):
        problems.append(f"attention_impl={c.attention_impl!r}: choose auto, xla or cudnn")
    for field in ("batch_size", "accum_freq", "epochs", "save_frequency", "keep", "log_every_n_steps",
                  "nan_patience"):
        if c[field] < 1:
            problems.append(f"{field}={c[field]} must be at least 1")
    for field in ("warmup", "workers", "train_num_samples", "save_every_steps", "zeroshot_frequency", "lr", "wd",
                  "grad_clip_norm", "loss_spike_factor", "zeroshot_samples", "val_num_samples", "val_frequency"):
        if c[field] < 0:
            problems.append(f"{field}={c[field]} must not be negative")
    force = c.force_patch_dropout  # None, like -1: the model's
    if force is not None and not (force < 1 and (force >= 0 or force == -1)):
        problems.append(f"force_patch_dropout={c.force_patch_dropout}: give a rate in [0, 1), or -1 for the model "
                        "config's patch_dropout")
    if c.batch_size >= 1 and c.accum_freq >= 1 and c.batch_size % c.accum_freq:
        problems.append(f"batch_size={c.batch_size} (per device) is not divisible by accum_freq={c.accum_freq}")
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
    if c.get("pretrained") and "://" in c.pretrained:
        problems.append(f"pretrained={c.pretrained!r}: pretrained weights are read from a local path; copy them "
                        "there first (a run directory on a bucket: its checkpoint folder)")
    elif c.get("pretrained") and not os.path.exists(c.pretrained):
        problems.append(f"pretrained={c.pretrained!r} does not exist: give an OpenCLIP checkpoint, an exported "
                        "folder or a clip_jax run directory")
    if c.get("force_image_size", 0) < 0:
        problems.append(f"force_image_size={c.force_image_size} must not be negative (0: the model's)")
    for lock, unlocked in (("lock_image", "lock_image_unlocked_groups"), ("lock_text", "lock_text_unlocked_layers")):
        if c.get(unlocked, 0) < 0:
            problems.append(f"{unlocked}={c[unlocked]} must not be negative")
        elif c.get(unlocked, 0) and not c.get(lock, False):
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
    problems += data_problems(c)
    if problems:
        raise InvalidInput("bad config:\n  " + "\n  ".join(problems))


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
