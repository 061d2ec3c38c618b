"""OpenCLIP 3.3's training flags (`open_clip_train`'s command line) as a run config, and a run config as those flags.

Every flag OpenCLIP's parser defines is in `FLAGS`, as one of three kinds:

- `mapped`: it sets a run config field, its value converted where the meanings differ (`--batch-size` is OpenCLIP's
  micro-batch per GPU, clip_jax's `batch_size` the step's batch per device: times `--accum-freq`);
- `no-op`: clip_jax always does what it asks, or it has no meaning here; said once, in one line, with the reason;
- `refused`: clip_jax cannot do what it asks; refused by name, with the reason and the nearest setting. A refused
  flag given with OpenCLIP's default value (or one of the values clip_jax does) passes.

A flag left out takes OpenCLIP's default, and OpenCLIP's derived values (Adam's `beta2`/`eps` by whether the model
is a ViT) follow its rules. `python -m clip_jax.open_clip_train` (`clip_jax.training.open_clip_command`) runs them.
"""

import argparse
import ast
import dataclasses
import difflib
from collections.abc import Callable, Sequence

from clip_jax.errors import InvalidInput

MAPPED, NO_OP, REFUSED = "mapped", "no-op", "refused"
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".npz")


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str  # the flag's destination, as OpenCLIP's parser names it (`batch_size` for --batch-size)
    kind: str  # MAPPED | NO_OP | REFUSED
    field: str  # the run config field it sets (mapped), or the nearest one (refused); "" where there is none
    why: str  # the conversion (mapped), or the reason (no-op, refused)
    default: object = None  # OpenCLIP's default
    type: object = str  # bool (a switch), str, int, float, a tuple of choices, "floats+" / "ints+", "key=value"
    passes: tuple = ()  # values besides the default that a refused flag lets through (what clip_jax does anyway)

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


def _flags(*rows) -> dict[str, Flag]:
    return {row[0]: Flag(*row) for row in rows}


_PRECISIONS = ("amp", "amp_bf16", "amp_bfloat16", "bf16", "fp16", "pure_bf16", "pure_fp16", "fp32")
GLOBAL_LOSS = "the loss is always the exact global one (every device's features gathered, gradients through them)"

FLAGS = _flags(
    # Data.
    ("train_data", MAPPED, "train_data", "as is ('::' joins sources)"),
    ("train_data_upsampling_factors", MAPPED, "train_data_upsampling_factors", "as is"),
    ("val_data", MAPPED, "val_data", "as is; none with --val-frequency 0 (never)"),
    ("train_num_samples", MAPPED, "train_num_samples", "none: 0 (counted from the shards' stats)", None, int),
    ("val_num_samples", MAPPED, "val_num_samples", "none: 0 (all)", None, int),
    ("dataset_type", MAPPED, "dataset_type", "auto: csv for a .csv/.tsv train_data, else webdataset", "auto",
     ("webdataset", "csv", "synthetic", "auto")),
    ("dataset_resampled", MAPPED, "dataset_resampled", "as is (off unless given)", False, bool),
    ("csv_separator", MAPPED, "csv_separator", "as is", "\t"),
    ("csv_img_key", MAPPED, "csv_img_key", "as is", "filepath"),
    ("csv_caption_key", MAPPED, "csv_caption_key", "as is", "title"),
    ("imagenet_val", MAPPED, "zeroshot_data", "the image folder zero-shot evaluates on; none with "
     "--zeroshot-frequency 0 (never)"),
    ("imagenet_v2", REFUSED, "zeroshot_data", "one zero-shot set per run: give ImageNet-v2 to python -m "
     "clip_jax.zeroshot"),
    ("workers", MAPPED, "workers", "per GPU there, per process here: times the devices per process", 4, int),
    ("aug_cfg", MAPPED, "aug_cfg", "KEY=VALUE pairs onto aug_cfg's keys", {}, "key=value"),
    # Optimisation.
    ("batch_size", MAPPED, "batch_size", "OpenCLIP's micro-batch: times --accum-freq", 64, int),
    ("accum_freq", MAPPED, "accum_freq", "as is", 1, int),
    ("epochs", MAPPED, "epochs", "as is", 32, int),
    ("lr", MAPPED, "lr", "none: 5e-4", None, float),
    ("beta1", MAPPED, "beta1", "none: 0.9", None, float),
    ("beta2", MAPPED, "beta2", "none: 0.98 for a ViT (the model name holds 'vit'), else 0.999", None, float),
    ("eps", MAPPED, "eps", "none: 1e-6 for a ViT, else 1e-8", None, float),
    ("wd", MAPPED, "wd", "as is", 0.2, float),
    ("warmup", MAPPED, "warmup", "as is", 10000, int),
    ("opt", MAPPED, "opt", "adamw as is; timm's optimizers refused", "adamw"),
    ("grad_clip_norm", MAPPED, "grad_clip_norm", "none: 0 (no clipping)", None, float),
    ("siglip", MAPPED, "loss", "loss='siglip' (else 'clip')", False, bool),
    ("momentum", REFUSED, "opt", "timm's optimizers only; clip_jax's are adamw, stable_adamw, sgd", None, float),
    ("lr_scheduler", REFUSED, "warmup", "clip_jax's schedule is cosine after a linear warmup", "cosine", str,
     ("cosine",)),
    ("epochs_cooldown", REFUSED, "epochs", "no cooldown schedule: the cosine decays to 0 at the last epoch", None,
     int),
    ("lr_cooldown_end", REFUSED, "lr", "no cooldown schedule", 0.0, float),
    ("lr_cooldown_power", REFUSED, "lr", "no cooldown schedule", 1.0, float),
    ("skip_scheduler", REFUSED, "lr", "the learning rate always follows the warmup and cosine", False, bool),
    ("loss_dist_impl", REFUSED, "loss", GLOBAL_LOSS),
    ("local_loss", NO_OP, "", f"with --gather-with-grad (without it refused: its gradients differ from the global "
     f"loss's): {GLOBAL_LOSS}", False, bool),
    ("gather_with_grad", NO_OP, "", GLOBAL_LOSS, False, bool),
    ("coca_caption_loss_weight", REFUSED, "loss", "no CoCa model", 2.0, float),
    ("coca_contrastive_loss_weight", REFUSED, "loss", "no CoCa model", 1.0, float),
    ("distill_model", REFUSED, "pretrained", "no distillation"),
    ("distill_pretrained", REFUSED, "pretrained", "no distillation"),
    # Model.
    ("model", MAPPED, "model", "as is (a registered name or a model-config .json)", "RN50"),
    ("pretrained", MAPPED, "pretrained", "a weights file or folder; a hub tag refused (nothing downloads)", ""),
    ("force_quick_gelu", MAPPED, "model", "the model's -quickgelu name", False, bool),
    ("force_image_size", MAPPED, "force_image_size", "one size (or two equal ones); none: 0", None, "ints+"),
    ("force_patch_dropout", MAPPED, "force_patch_dropout", "none: -1 (the model's)", None, float),
    ("image_mean", MAPPED, "image_mean", "three values (one: repeated); none: OpenAI's", None, "floats+"),
    ("image_std", MAPPED, "image_std", "three values (one: repeated); none: OpenAI's", None, "floats+"),
    ("lock_image", MAPPED, "lock_image", "as is", False, bool),
    ("lock_image_unlocked_groups", MAPPED, "lock_image_unlocked_groups", "as is", 0, int),
    ("lock_image_freeze_bn_stats", MAPPED, "lock_image_freeze_bn_stats", "as is", False, bool),
    ("lock_text", MAPPED, "lock_text", "as is", False, bool),
    ("lock_text_unlocked_layers", MAPPED, "lock_text_unlocked_layers", "as is", 0, int),
    ("lock_text_freeze_layer_norm", NO_OP, "", "LayerNorm keeps no running statistics; a locked layer's are "
     "frozen with it", False, bool),
    ("pretrained_image", REFUSED, "pretrained", "no ImageNet-pretrained image towers (timm's)", False, bool),
    ("force_context_length", REFUSED, "model", "set text_cfg's context_length in a model-config .json", None, int),
    ("force_custom_text", REFUSED, "model", "set custom_text in a model-config .json", False, bool),
    ("image_interpolation", REFUSED, "", "images are resized bicubic", None, ("bicubic", "bilinear", "random"),
     ("bicubic",)),
    ("image_resize_mode", REFUSED, "", "evaluation resizes the shortest side, then crops the centre", None,
     ("shortest", "longest", "squash"), ("shortest",)),
    ("use_bnb_linear", REFUSED, "precision", "no bitsandbytes layers; fp8 runs the blocks' matmuls in FP8"),
    # Precision and memory.
    ("precision", MAPPED, "precision", "amp: fp16; amp_bf16, amp_bfloat16: bf16; bf16, pure_bf16: pure_bf16; "
     "fp32: fp32; fp16, pure_fp16 refused", "amp", _PRECISIONS),
    ("grad_checkpointing", MAPPED, "grad_checkpointing", "as is (off unless given)", False, bool),
    ("torchscript", REFUSED, "", "XLA compiles the step; python -m clip_jax.export writes OpenCLIP's files",
     False, bool),
    ("torchcompile", NO_OP, "", "XLA always compiles the step", False, bool),
    ("trace", REFUSED, "", "XLA compiles the step; python -m clip_jax.export writes OpenCLIP's files", False, bool),
    ("use_bn_sync", NO_OP, "", "BatchNorm statistics are over the global batch already", False, bool),
    # Distribution.
    ("device", NO_OP, "", "JAX runs on the platform it finds (JAX_PLATFORMS picks one)", "cuda"),
    ("dist_url", NO_OP, "", "the processes join from SLURM's or JAX's environment"),
    ("dist_backend", NO_OP, "", "the processes join from SLURM's or JAX's environment"),
    ("horovod", REFUSED, "", "the processes join from SLURM's or JAX's environment: launch with srun", False, bool),
    ("ddp_static_graph", NO_OP, "", "XLA compiles one static program", False, bool),
    ("no_set_device_rank", NO_OP, "", "JAX gives each process its devices", False, bool),
    ("seed", MAPPED, "seed", "as is (no per-rank offset: one program over all devices)", 0, int),
    # Run directory, checkpoints.
    ("logs", MAPPED, "logs", "as is", "./logs/"),
    ("name", MAPPED, "name", "none: OpenCLIP's (date-model_-lr_-b_-j_-p_)"),
    ("resume", MAPPED, "resume", "a checkpoint or run directory, or latest; an OpenCLIP .pt refused"),
    ("save_frequency", MAPPED, "save_frequency", "0: at the end only", 1, int),
    ("save_most_recent", NO_OP, "", "--resume latest finds the newest checkpoint", False, bool),
    ("delete_previous_checkpoint", MAPPED, "keep", "keep=1; left out, every checkpoint is kept", False, bool),
    ("remote_sync", REFUSED, "logs", "give --logs s3://... or gs://...: checkpoints go there directly"),
    ("remote_sync_frequency", REFUSED, "logs", "checkpoints go to a bucket --logs directly", 300, int),
    ("remote_sync_protocol", REFUSED, "logs", "checkpoints go to a bucket --logs directly", "s3", ("s3", "fsspec")),
    ("copy_codebase", NO_OP, "", "the run uses the installed clip_jax", False, bool),
    ("cache_dir", NO_OP, "", "nothing downloads"),
    # Evaluation and metrics.
    ("zeroshot_frequency", MAPPED, "zeroshot_frequency", "as is", 2, int),
    ("val_frequency", MAPPED, "val_frequency", "as is", 1, int),
    ("report_to", MAPPED, "report_to", "none given: 'none'; all: tensorboard,wandb", ""),
    ("wandb_project_name", MAPPED, "wandb_project", "as is", "open-clip"),
    ("wandb_notes", REFUSED, "wandb_project", "no W&B notes field", ""),
    ("log_every_n_steps", MAPPED, "log_every_n_steps", "as is", 100, int),
    ("log_local", NO_OP, "", "process 0 writes the run's log", False, bool),
    ("debug", NO_OP, "", "the run logs at INFO", False, bool),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise InvalidInput(message)


class _KeyValues(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        pairs = {}
        for value in values:
            key, _, text = value.partition("=")
            try:
                pairs[key] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                pairs[key] = text
        setattr(namespace, self.dest, pairs)


def parser(extra: Callable[[argparse.ArgumentParser], None] = lambda p: None) -> argparse.ArgumentParser:
    """OpenCLIP's flags, spelled and defaulted as its parser has them; `extra` adds a command's own options."""
    p = _Parser(prog="python -m clip_jax.open_clip_train", description=__doc__.split("\n\n")[0])
    for flag in FLAGS.values():
        if flag.type is bool:
            p.add_argument(flag.option, action="store_true", default=flag.default)
        elif flag.type == "key=value":
            p.add_argument(flag.option, nargs="*", default=flag.default, action=_KeyValues)
        elif isinstance(flag.type, tuple):
            p.add_argument(flag.option, choices=flag.type, default=flag.default)
        elif isinstance(flag.type, str):
            p.add_argument(flag.option, nargs="+", type=float if flag.type == "floats+" else int, default=None)
        else:
            p.add_argument(flag.option, type=flag.type, default=flag.default)
    extra(p)
    return p


def parse(argv: Sequence[str], p: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """OpenCLIP's namespace from `argv`, with its derived Adam settings; an unknown flag is an InvalidInput naming
    the closest one."""
    p = p or parser()
    args, unknown = p.parse_known_args(list(argv))
    if unknown:
        options = [flag.option for flag in FLAGS.values()]
        name = unknown[0].split("=", 1)[0]
        close = difflib.get_close_matches(name, options, n=1)
        raise InvalidInput(f"{name}: no such OpenCLIP flag" + (f"; did you mean {close[0]}?" if close else ""))
    vit = "vit" in args.model.lower()
    for key, value in (("lr", 5e-4), ("beta1", 0.9), ("beta2", 0.98 if vit else 0.999),
                       ("eps", 1e-6 if vit else 1e-8)):
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args
