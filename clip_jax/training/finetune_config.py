"""The classification fine-tuning config (`python -m clip_jax.finetune`): every field with its default
(`default_finetune_config`), and its checks (`check_finetune_config`), which name every problem at once before
anything is built.
"""

import os

import ml_collections

from clip_jax.errors import InvalidInput, UserError
from clip_jax.evaluation.shifts import SHIFTS
from clip_jax.interop.opener import did_you_mean
from clip_jax.run_config import instability_fields
from clip_jax.training.config_checks import INSTABILITY_ACTIONS, choice_problems, report_to_problems

HEAD_INITS = ("zeroshot", "linear_probe")
MAKE_DATA = ("", "fashion-mnist")
INVERT = "invert"


def default_finetune_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # The model: an exported folder or a clip_jax run directory / checkpoint (its model and mean/std with it), or an
    # OpenCLIP / clip_jax weights file with `model` naming the architecture (mean/std then OpenAI's).
    c.pretrained = ""
    c.model = ""

    # The data: a classification dataset in CLIP_benchmark's webdataset layout (classnames.txt, templates, splits).
    c.data = ""
    c.make_data = ""  # "fashion-mnist": write `data` from the bundled Fashion-MNIST when it is missing
    c.train_split = "train"
    c.test_split = "test"
    c.train_samples = 0  # fine-tune on the first N train images (0: all)
    c.test_samples = 0  # score on the first N test images (0: all)
    # The distribution shift each model is also scored on: "invert" (the test images inverted, 255 - x), "vflip"
    # (the test images upside down), a CLIP_benchmark folder whose `test_split` has the same classes, or "" (none)
    c.shift_data = INVERT

    # The head: "zeroshot" (the zero-shot classifier of the templates x class names, times 100) or "linear_probe"
    # (LP-FT: a linear probe on the pretrained features first, CLIP_benchmark's, its weight decay searched on a fifth
    # of the train images)
    c.head_init = "zeroshot"

    # Optimisation (full fine-tuning of the image tower and the head; the text tower stays as it is).
    c.batch_size = 32  # per device
    c.epochs = 2
    c.lr = 1e-4
    c.warmup = 20
    c.wd = 0.1
    c.beta1 = 0.9
    c.beta2 = 0.999
    c.eps = 1e-8
    c.grad_clip_norm = 1.0  # 0: no clipping
    c.layer_decay = 0.75  # layer-wise learning-rate decay (clip_jax.optim.layer_decay); 1: off
    c.ema_decay = 0.999  # the EMA of the weights the run ends with; 0: the last weights
    c.workers = 4  # image decoding threads

    # WiSE-FT: theta(alpha) = (1 - alpha) * zero-shot + alpha * fine-tuned, each alpha scored on the test split and
    # on the shifted set; the model of `export_alpha` is exported with its head.
    c.alphas = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    c.export_alpha = 0.5
    c.export_dir = ""  # "": RUN_DIR/export

    # Run directory, checkpoints, metrics (as the trainer's).
    c.logs = "./logs"
    c.name = "finetune"
    c.resume = "latest"  # "latest": continue the run's newest checkpoint, or start; "": refuse a run that has one
    c.save_every_steps = 100  # and at the end (0: at the end only)
    c.keep = 2
    c.log_every_n_steps = 10
    c.report_to = "tensorboard"
    instability_fields(c)  # a non-finite step's update is skipped; so many in a row roll back, as pretraining's
    c.seed = 0
    return c


def check_finetune_config(c: ml_collections.ConfigDict) -> None:
    """An InvalidInput naming every mistake (one line for one)."""
    problems = []
    if not c.pretrained:
        problems.append("pretrained is empty: give an exported folder, a clip_jax run directory or a weights file "
                        "(with model)")
    elif not os.path.exists(c.pretrained):
        problems.append(f"pretrained={c.pretrained!r} does not exist{did_you_mean(c.pretrained)}" + (
            " (train the demo first: python -m clip_jax.train --config configs/demo.py)"
            if c.pretrained.rstrip("/").endswith("logs/demo") else
            ": give the run directory of a finished training run, an exported folder or a weights file (with model)"))
    if c.make_data not in MAKE_DATA:
        problems.append(f"make_data={c.make_data!r}: choose one of {MAKE_DATA}")
    if not c.data:
        problems.append("data is empty: give a CLIP_benchmark classification dataset folder with train and test splits")
    elif not c.make_data:
        problems += split_problems("data", c.data, (c.train_split, c.test_split))
    if c.shift_data and c.shift_data not in SHIFTS:
        problems += [f"{p} (or one of the named shifts {tuple(SHIFTS)})"
                     for p in split_problems("shift_data", c.shift_data, (c.test_split,))]
    if c.head_init not in HEAD_INITS:
        problems.append(f"head_init={c.head_init!r}: choose one of {HEAD_INITS}")
    for field in ("batch_size", "epochs", "keep", "log_every_n_steps", "nan_patience"):
        if c[field] < 1:
            problems.append(f"{field}={c[field]} must be at least 1")
    for field in ("warmup", "lr", "wd", "grad_clip_norm", "train_samples", "test_samples", "save_every_steps",
                  "workers", "loss_spike_factor"):
        if c[field] < 0:
            problems.append(f"{field}={c[field]} must not be negative")
    if not 0 < c.layer_decay <= 1:
        problems.append(f"layer_decay={c.layer_decay} must be in (0, 1] (1: no decay)")
    if not 0 <= c.ema_decay < 1:
        problems.append(f"ema_decay={c.ema_decay} must be in [0, 1) (0: no EMA)")
    alphas = tuple(c.alphas)
    if not alphas or any(not 0 <= a <= 1 for a in alphas):
        problems.append(f"alphas={alphas}: give mixing weights in [0, 1]")
    if not 0 <= c.export_alpha <= 1:
        problems.append(f"export_alpha={c.export_alpha} must be in [0, 1]")
    if c.resume not in ("", "latest"):
        problems.append(f"resume={c.resume!r}: 'latest' (continue the run's newest checkpoint) or ''")
    if not c.name:
        problems.append("name is empty: the run directory is logs/NAME")
    problems += report_to_problems(c)
    problems += choice_problems(c, (("on_instability", INSTABILITY_ACTIONS),))
    if problems:
        raise InvalidInput("bad config: " + problems[0] if len(problems) == 1 else
                           "bad config:\n  " + "\n  ".join(problems))


def split_problems(field: str, root: str, splits) -> list[str]:
    """A line when `root` is not a CLIP_benchmark classification folder with each of `splits`."""
    if not os.path.isdir(root):
        return [f"{field}={root!r} does not exist: give a CLIP_benchmark classification dataset folder"]
    from clip_jax.evaluation import clip_benchmark

    for split in splits:
        try:
            clip_benchmark.check_training_layout(root, split, needed_by="fine-tuning")
        except UserError as e:
            return [f"{field}={root!r} has no usable {split!r} split: {e}"]
    return []
