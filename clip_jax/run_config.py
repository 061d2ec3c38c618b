"""The training config: every field with its default (`default_config`).

Field names are OpenCLIP's command-line flags with underscores (`--train-data` -> `train_data`), so an OpenCLIP
launch script translates line by line; fields OpenCLIP lacks are named in the same style. The files in `configs/`
start from `default_config()` and change what their run needs; `clip_jax.training.config_checks.check_config`
checks a config before anything is built. A run's saved `config.json` reads back with every field
(`saved_run_config`), also one written before a field existed.
"""

import ml_collections

from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # Model and preprocessing.
    c.model = "ViT-B-32"  # a registered name or an OpenCLIP model-config .json
    # A folder holding the model's SentencePiece tokenizer (tokenizer.json or spiece.model: a SigLIP model's); "":
    # the pretrained folder's when it holds one, else the model config's (CLIP's BPE unless it names another)
    c.tokenizer = ""
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
    # | sgd: plain SGD at the schedule's rate (no moments, no weight decay)
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
    c.precision = "bf16"  # fp32 | bf16 | pure_bf16 | fp16 | fp8 (H100, H200: models/precision.py); may change on resume
    # Gradients summed across devices in float32 (as OpenCLIP's DDP) | bfloat16 (half the all-reduce bytes, a 16-bit
    # policy's compute dtype; under fp32 they are float32 whatever this says)
    c.grad_reduce_dtype = "float32"
    # The residual stream between the transformer blocks: auto (float32 under fp16, else the compute dtype) | compute
    # (the compute dtype) | float32 (as OpenCLIP's autocast keeps it: more activation memory, see models.precision)
    c.residual_dtype = "auto"
    # fp16's dynamic loss scale (GradScaler's rule, training/loss_scale.py): its first value, and the finite steps in
    # a row after which it doubles (an overflow skips the step and halves it); other precisions ignore them
    c.loss_scale_init = 65536.0
    c.loss_scale_growth_interval = 2000
    c.grad_checkpointing = True  # rematerialise every residual block ...
    # ... under this jax.checkpoint policy; "auto": on GPUs the fastest that fits (training/remat_choice.py)
    c.remat_policy = "nothing_saveable"
    c.fsdp = False  # shard params and optimizer state over the data axis (ZeRO-3)
    c.attention_impl = "auto"  # auto (cuDNN's fused attention on a GPU in bf16, else XLA's) | xla | cudnn
    # The blocks' residual adds and LayerNorms: off (XLA's fusions) | pallas (Triton kernels, GPU only; not yet timed
    # on a GPU: models/fused_layer_norm.py) | pallas_interpret (the same kernels through Pallas's slow interpreter)
    c.fused_kernels = "off"
    # Each tower's residual blocks compiled one after another instead of as a loop: the blocks' saved activations
    # stay where they were written, no copying into and out of per-layer stacks (fewer memory-bound passes, a
    # larger program; benchmarks/RESULTS.md section 36)
    c.unroll_layers = False

    # Run directory, checkpoints, resumption.
    c.logs = "./logs"
    c.name = ""  # run name; "" makes one from the model and the start time
    c.resume = ""  # "latest" (start fresh when there is none), or a checkpoint / run directory
    # "exact": continue the data streams where the checkpoint left off (on any process count that divides
    # data_streams); "allow_reseed": the same when possible, else restore the train state only and read on with new
    # data iterators seeded from (seed, step): no replay of the run's first samples
    c.resume_data = "exact"
    # The data is read as this many streams, fixed at the run's start (kept by its checkpoints): a multiple of the
    # process count dividing the global batch; each global batch takes an equal share from every stream, so a resume
    # on any process count dividing it reads the same samples. 0: chosen to leave room for fewer processes
    c.data_streams = 0
    # A run's global batch (batch_size x devices at its start) and schedule are kept on resume, on any device count
    # that divides it (batch_size re-derived per device). N > 0: continue at global batch N from the checkpoint's
    # samples, the remaining steps re-planned to end at the planned sample count, the learning rate going on by
    # samples (0: keep the run's)
    c.resume_global_batch = 0
    c.save_frequency = 1  # save every this many (virtual) epochs
    c.save_every_steps = 0  # and every this many steps (0: off)
    c.keep = 3  # checkpoints kept

    # Evaluation.
    # "demo" (bundled Fashion-MNIST test split), an image folder (ImageNet val layout), a classification dataset in
    # CLIP_benchmark's webdataset layout (its test split), or ""
    c.zeroshot_data = ""
    c.zeroshot_frequency = 1  # evaluate every this many epochs (0: only at the end), when zeroshot_data is set
    c.zeroshot_samples = 0  # evaluate on the first N images only (0: all)
    # A linear probe of the image features (CLIP_benchmark's `linear_probe` task: lp_acc1, lp_acc5,
    # lp_mean_per_class_recall): a classification dataset in CLIP_benchmark's webdataset layout with `train` and
    # `test` splits (its weight decay searched on a fifth of train), or ""
    c.linear_probe_data = ""
    c.linear_probe_frequency = 1  # probe every this many epochs (0: only at the end), when linear_probe_data is set

    # Metrics.
    # tensorboard | wandb | tensorboard,wandb | none (the console always gets progress lines)
    c.report_to = "tensorboard"
    c.log_every_n_steps = 100
    # each log line's record in metrics.jsonl holds sample_digest: a hash of the step's sample keys (a run read
    # as data streams; the same on any topology that continues it exactly)
    c.log_sample_digest = True
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
    instability_fields(c)

    c.seed = 0
    return c


def instability_fields(c: ml_collections.ConfigDict) -> None:
    """The fields that say what a run does when it turns unstable (pretraining's and fine-tuning's)."""
    c.nan_patience = 3  # consecutive non-finite steps before rolling back
    c.loss_spike_factor = 0.0  # roll back when the loss exceeds this x its recent mean (0: off)
    # rollback | rollback_fp32 (continue in fp32, as the reference run did) | rollback_bf16 (in bf16, as the other
    # team did) | stop
    c.on_instability = "rollback"


def saved_run_config(fields: dict) -> ml_collections.ConfigDict:
    """A run config from the fields a run saved (its `config.json`): `default_config()` with them in place, so
    fields added since that run have their defaults; JSON lists become the tuples the defaults hold."""
    return _filled(default_config(), fields)


def _filled(config: ml_collections.ConfigDict, fields: dict) -> ml_collections.ConfigDict:
    for key, value in fields.items():
        default = config.get(key)
        if isinstance(default, ml_collections.ConfigDict) and isinstance(value, dict):
            value = _filled(default, value)
        elif isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        config[key] = value
    return config
