"""The training config: every field with its default, and the checks that run before anything is compiled.

Field names are OpenCLIP's command-line flags with underscores (`--train-data` -> `train_data`), so an OpenCLIP
launch script translates line by line; fields OpenCLIP lacks are named in the same style. The files in `configs/`
start from `default_config()` and change what their run needs.
"""

import os

import ml_collections

from clip_jax.errors import InvalidInput, UserError
from clip_jax.loss import LOSSES
from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD

PRECISIONS = ("fp32", "bf16", "pure_bf16")
INSTABILITY_ACTIONS = ("rollback", "rollback_fp32", "stop")
REPORT_TO = ("tensorboard", "wandb")  # report_to: "none", one of these, or both joined by "," (OpenCLIP's flag)
RESUME_DATA = ("exact", "allow_reseed")


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

    # Optimisation. batch_size is per device, as in OpenCLIP (per GPU).
    c.batch_size = 64
    c.accum_freq = 1
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
    c.report_to = "tensorboard"  # tensorboard | none (the console always gets progress lines)
    c.log_every_n_steps = 100
    c.peak_tflops_per_device = 0.0  # for MFU; 0: looked up from the device kind

    # Operating a long run: telemetry, validation during training, Weights & Biases.
    c.telemetry = True  # GPU (NVML), device memory and host fields in each log line; a warning at >90% memory
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
    if not c.train_data:
        problems.append("train_data is empty: give the shard pattern, e.g. "
                        "--config.train_data='/data/{00000..00099}.tar'")
    if c.precision not in PRECISIONS:
        problems.append(f"precision={c.precision!r}: choose one of {PRECISIONS}")
    if c.on_instability not in INSTABILITY_ACTIONS:
        problems.append(f"on_instability={c.on_instability!r}: choose one of {INSTABILITY_ACTIONS}")
    if c.resume_data not in RESUME_DATA:
        problems.append(f"resume_data={c.resume_data!r}: choose one of {RESUME_DATA}")
    problems.extend(report_to_problems(c))
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
        if "://" in str(c[field]):
            problems.append(f"{field}={c[field]!r}: remote run directories (s3://, gs://) are not supported yet; give "
                            "a local or mounted path")
    if c.resume and c.resume != "latest" and "://" not in c.resume and not os.path.exists(c.resume):
        problems.append(f"resume={c.resume!r} does not exist: give a checkpoint or run directory, or 'latest'")
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
    if problems:
        raise InvalidInput("bad config:\n  " + "\n  ".join(problems))


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
        from clip_jax.wandb_report import project_problem

        problem = project_problem(c.wandb_project)
        if problem:
            return [problem]
    return []
