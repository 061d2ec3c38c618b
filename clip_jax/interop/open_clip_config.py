"""OpenCLIP's parsed training flags (`open_clip_flags.parse`) -> a run config, and a run config -> OpenCLIP's
command line (to run both frameworks side by side): the conversions of `open_clip_flags.FLAGS`, both ways."""

import argparse
import math
import os
import re
import time

import ml_collections

from clip_jax.errors import InvalidInput
from clip_jax.interop.open_clip_flags import GLOBAL_LOSS, FLAGS, MAPPED, NO_OP, REFUSED, WEIGHT_SUFFIXES
from clip_jax.run_config import default_config

# OpenCLIP's --precision -> clip_jax's policy; its bf16 is pure_bf16 here, said in a line (`notes`)
PRECISIONS = {"amp": "fp16", "amp_bf16": "bf16", "amp_bfloat16": "bf16", "bf16": "pure_bf16",
              "pure_bf16": "pure_bf16", "fp32": "fp32"}
OPEN_CLIP_PRECISIONS = {"fp16": "amp", "bf16": "amp_bf16", "pure_bf16": "pure_bf16", "fp32": "fp32"}


def _three(values, flag: str) -> tuple[float, float, float]:
    if len(values) == 1:
        values = values * 3
    if len(values) != 3:
        raise InvalidInput(f"{flag} takes one value or three (R G B), not {len(values)}")
    return tuple(float(v) for v in values)


def _precision(value: str) -> str:
    if value not in PRECISIONS:
        raise InvalidInput(f"--precision {value}: OpenCLIP's pure float16 has no clip_jax policy; use --precision amp "
                           "(fp16: float32 params, float16 compute under a loss scale) or amp_bf16")
    return PRECISIONS[value]


def _pretrained(value: str) -> str:
    if value and not (os.path.exists(value) or os.sep in value or value.endswith(WEIGHT_SUFFIXES)):
        raise InvalidInput(f"--pretrained {value} is an OpenCLIP hub tag and clip_jax downloads nothing: download "
                           f"the model's open_clip_model.safetensors (or open_clip_pytorch_model.bin) of tag {value!r} "
                           "from the Hugging Face hub and give its path")
    return value


def _resume(value: str | None) -> str:
    if value and value.endswith((".pt", ".pth")):
        raise InvalidInput(f"--resume {value} is an OpenCLIP checkpoint, which a clip_jax run cannot continue: start "
                           f"from its weights with --pretrained {value} (a fresh optimizer and schedule)")
    return value or ""


def _aug_cfg(pairs: dict) -> ml_collections.ConfigDict:
    aug = default_config().aug_cfg
    for key, value in pairs.items():
        if key not in aug:
            raise InvalidInput(f"--aug-cfg {key}: no such augmentation setting; known: {', '.join(aug)}")
        aug[key] = tuple(value) if isinstance(value, list) else value
    return aug


def _image_size(sizes) -> int:
    if not sizes:
        return 0
    if len(sizes) > 2 or len(set(sizes)) != 1:
        raise InvalidInput(f"--force-image-size {' '.join(map(str, sizes))}: clip_jax trains square images; give one "
                           "size")
    return sizes[0]


def _dataset_type(args) -> str:
    if args.dataset_type != "auto":
        return args.dataset_type
    return "csv" if (args.train_data or "").rsplit(".", 1)[-1] in ("csv", "tsv") else "webdataset"


def _keep(args) -> int:
    """OpenCLIP keeps every checkpoint it saves unless --delete-previous-checkpoint."""
    if args.delete_previous_checkpoint or args.save_frequency <= 0:  # frequency 0: the last epoch's only
        return 1
    return max(1, math.ceil(args.epochs / args.save_frequency))


# A mapped flag's fields from the whole namespace, where they are not {flag.field: value}.
CONVERSIONS = {
    "train_data": lambda a: {"train_data": a.train_data or ""},
    "train_data_upsampling_factors": lambda a: {"train_data_upsampling_factors": a.train_data_upsampling_factors or ""},
    # OpenCLIP's frequency 0 evaluates never, clip_jax's only at the end: never is no data
    "val_data": lambda a: {"val_data": (a.val_data or "") if a.val_frequency else ""},
    "train_num_samples": lambda a: {"train_num_samples": a.train_num_samples or 0},
    "val_num_samples": lambda a: {"val_num_samples": a.val_num_samples or 0},
    "dataset_type": lambda a: {"dataset_type": _dataset_type(a)},
    "imagenet_val": lambda a: {"zeroshot_data": (a.imagenet_val or "") if a.zeroshot_frequency else ""},
    "aug_cfg": lambda a: {"aug_cfg": _aug_cfg(a.aug_cfg)},
    "batch_size": lambda a: {"batch_size": a.batch_size * a.accum_freq},
    "grad_clip_norm": lambda a: {"grad_clip_norm": a.grad_clip_norm or 0.0},
    "siglip": lambda a: {"loss": "siglip" if a.siglip else "clip"},
    "model": lambda a: {"model": a.model + ("-quickgelu" if a.force_quick_gelu else "")},
    "force_quick_gelu": lambda a: {},  # with model
    "pretrained": lambda a: {"pretrained": _pretrained(a.pretrained)},
    "force_image_size": lambda a: {"force_image_size": _image_size(a.force_image_size)},
    "force_patch_dropout": lambda a: {"force_patch_dropout": -1.0 if a.force_patch_dropout is None
                                      else a.force_patch_dropout},
    "image_mean": lambda a: {} if a.image_mean is None else {"image_mean": _three(a.image_mean, "--image-mean")},
    "image_std": lambda a: {} if a.image_std is None else {"image_std": _three(a.image_std, "--image-std")},
    "precision": lambda a: {"precision": _precision(a.precision)},
    "name": lambda a: {"name": a.name or ""},
    "resume": lambda a: {"resume": _resume(a.resume)},
    "save_frequency": lambda a: {"save_frequency": a.save_frequency if a.save_frequency > 0 else a.epochs},
    "delete_previous_checkpoint": lambda a: {"keep": _keep(a)},
    "report_to": lambda a: {"report_to": {"": "none", "all": "tensorboard,wandb"}.get(a.report_to, a.report_to)},
}


def _given(args: argparse.Namespace, name: str) -> bool:
    flag = FLAGS[name]
    return getattr(args, name) not in (flag.default, *flag.passes)


def refusal(args: argparse.Namespace) -> str | None:
    """The line refusing the first refused flag `args` gives, else None."""
    if args.local_loss and not args.gather_with_grad:
        return ("--local-loss without --gather-with-grad is refused: its gradients differ from the global loss's; "
                f"drop it, or add --gather-with-grad ({FLAGS['gather_with_grad'].why})")
    if "timm" in args.opt:
        return f"--opt {args.opt} is refused: timm's optimizers are not in clip_jax; its opt: adamw, stable_adamw, sgd"
    for flag in FLAGS.values():
        if flag.kind == REFUSED and _given(args, flag.name):
            nearest = f"; the nearest clip_jax field: {flag.field}" if flag.field else ""
            return f"{flag.option} is refused: {flag.why}{nearest}"
    return None


def notes(args: argparse.Namespace) -> list[str]:
    """One line for each no-op flag `args` gives, and for conversions a user should see."""
    lines = [f"{flag.option} has no effect: {flag.why}" for flag in FLAGS.values()
             if flag.kind == NO_OP and _given(args, flag.name) and flag.name not in ("local_loss", "gather_with_grad")]
    if args.gather_with_grad:
        both = "--local-loss --gather-with-grad have" if args.local_loss else "--gather-with-grad has"
        lines.append(f"{both} no effect: {GLOBAL_LOSS}")
    if args.precision == "bf16":
        lines.append("--precision bf16 runs as pure_bf16: every parameter bfloat16, LayerNorms' and embeddings' "
                     "included, where OpenCLIP's lowers only its Linear, Conv and attention weights and keeps "
                     "those float32")
    if args.seed != FLAGS["seed"].default:
        lines.append(f"--seed {args.seed} seeds the whole run: OpenCLIP's per-rank offset (seed + rank) has no effect, "
                     "one program runs over all devices")
    return lines


def run_config(args: argparse.Namespace, devices_per_process: int = 1) -> ml_collections.ConfigDict:
    """The run config of OpenCLIP's parsed flags (an InvalidInput for a refused flag); `devices_per_process` turns
    OpenCLIP's workers per GPU into clip_jax's per process. `name` is left "" when --name is not given
    (`open_clip_name` makes OpenCLIP's once the run's start time is known)."""
    problem = refusal(args)
    if problem:
        raise InvalidInput(problem)
    c = default_config()
    for flag in FLAGS.values():
        if flag.kind != MAPPED:
            continue
        convert = CONVERSIONS.get(flag.name, lambda a, flag=flag: {flag.field: getattr(a, flag.name)})
        for key, value in convert(args).items():
            c[key] = value
    c.workers = args.workers * devices_per_process
    return c


def in_open_clip_terms(message: str) -> str:
    """`message` with each `--config.FIELD=` that an OpenCLIP flag sets to the same value written as that flag."""
    same = {flag.field: flag.option for flag in FLAGS.values() if flag.kind == MAPPED and flag.name != "workers"
            and (flag.name not in CONVERSIONS or flag.name in ("name", "resume"))}
    return re.sub(r"--config\.(\w+)=", lambda m: f"{same[m[1]]}=" if m[1] in same else m[0], message)


def open_clip_name(args: argparse.Namespace, stamp: float) -> str:
    """OpenCLIP's name of a run started at `stamp` (seconds since the epoch, local time) without --name."""
    date = time.strftime("%Y_%m_%d-%H_%M_%S", time.localtime(stamp))
    return "-".join([date, f"model_{args.model.replace('/', '-')}", f"lr_{args.lr}", f"b_{args.batch_size}",
                     f"j_{args.workers}", f"p_{args.precision}"])


# A mapped flag's value from a run config, where it is not config[flag.field]; None: the flag is left out.
REVERSE = {
    "train_num_samples": lambda c: c.train_num_samples or None,
    "val_num_samples": lambda c: c.val_num_samples or None,
    "imagenet_val": lambda c: c.zeroshot_data or None,
    "aug_cfg": lambda c: [f"{key}={_literal(value)}" for key, value in c.aug_cfg.items()
                          if value != default_config().aug_cfg[key]] or None,
    "batch_size": lambda c: c.batch_size // c.accum_freq,
    "grad_clip_norm": lambda c: c.grad_clip_norm or None,
    "siglip": lambda c: c.loss == "siglip",
    "force_quick_gelu": lambda c: False,  # the model's name says it
    "force_image_size": lambda c: [c.force_image_size] if c.force_image_size else None,
    "force_patch_dropout": lambda c: None if c.force_patch_dropout == -1 else c.force_patch_dropout,
    "precision": lambda c: OPEN_CLIP_PRECISIONS.get(c.precision),
    "delete_previous_checkpoint": lambda c: c.keep == 1,
    "report_to": lambda c: None if c.report_to == "none" else c.report_to,
    # clip_jax's 0 (only at the end): OpenCLIP evaluates every N epochs and at the last
    "zeroshot_frequency": lambda c: c.zeroshot_frequency or c.epochs,
    "val_frequency": lambda c: c.val_frequency or c.epochs,
}


def _literal(value) -> str:
    return repr(list(value) if isinstance(value, tuple) else value).replace(" ", "")


def command_line(config: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
    """OpenCLIP's flags for `config` (one device per process: its workers per GPU), and "FIELD=VALUE" for each
    field that differs from clip_jax's default and that no flag carries."""
    args = []
    for flag in FLAGS.values():
        if flag.kind != MAPPED:
            continue
        value = REVERSE[flag.name](config) if flag.name in REVERSE else config[flag.field]
        if value is None or value is False or value == "" or value == flag.default:
            continue  # left out: OpenCLIP's default reads back as the same value
        if value is True:
            args.append(flag.option)
        elif isinstance(value, (list, tuple)):
            args += [flag.option, *map(str, value)]
        else:
            args.append(f"{flag.option}={value}")
    carried = flag_fields(config) | {"zeroshot_frequency", "val_frequency"}  # 0: as the number of epochs
    defaults = default_config()
    unflagged = [f"{key}={config[key]!r}" for key in config if key not in carried and config[key] != defaults[key]]
    return args, unflagged


def flag_fields(config: ml_collections.ConfigDict) -> set[str]:
    """The fields of `config` OpenCLIP's flags carry: every mapped flag's, but `keep` other than 1 (OpenCLIP keeps
    one checkpoint or all), a precision OpenCLIP lacks (fp8), an empty `name` (OpenCLIP makes one) and an evaluation
    frequency 0 (only at the end: OpenCLIP's is the number of epochs)."""
    fields = {flag.field for flag in FLAGS.values() if flag.kind == MAPPED}
    fields -= {field for field in ("zeroshot_frequency", "val_frequency") if not config[field]}
    if config.keep != 1:
        fields.discard("keep")
    if config.precision not in OPEN_CLIP_PRECISIONS:
        fields.discard("precision")
    if not config.name:
        fields.discard("name")
    return fields
