"""What a path holds, opened as a model: `open_model(path, model=None)`.

Every command that takes a model (`zeroshot`, `benchmark`, `embed`, `export`, `finetune`, `convert`, `similarity`)
and every `pretrained` start opens it here. `FORMATS` is the table of what clip_jax reads as a model, each entry a
`ModelSource` that recognises its kind of path and reads it:

- `RunDirectory`: a clip_jax run (its `config.json` beside `checkpoints/`): its newest complete checkpoint, the model
  and the mean/std it trained with;
- `CheckpointFolder`: a run's `checkpoints` folder (its newest complete checkpoint) or one `checkpoints/STEP`;
- `OpenClipFolder`: an exported model folder, OpenCLIP's `local-dir:` (`open_clip_config.json` beside its weights);
- `HfFolder`: a transformers CLIPModel folder (a `config.json` naming a `model_type`, `model.safetensors`);
- `WeightsFile`: an OpenCLIP state_dict or clip_jax params (`.pt`, `.pth`, `.bin`, `.safetensors`, `.npz`), which
  does not say which model it holds.

A path is exactly one of them: one that does not exist, a folder or file that is none of them, one that is two at
once, or a run with no complete checkpoint yet is refused when it is opened, in one line saying what is there and
what is expected (`path_problems`: the same line for a config check). Runs and checkpoints are read from s3://
and gs:// too, the other formats from a local path. A new format is a `ModelSource` here and a line in `FORMATS`.
"""

import difflib
import functools
import json
import os
import re

from clip_jax.errors import InvalidInput, MissingInput, UserError
from clip_jax.interop import hf_folder, open_clip_folder
from clip_jax.interop.array_files import holds_clip_jax, read_arrays, unflatten
from clip_jax.interop.opened_model import OpenedModel, add_budget_argument  # noqa: F401 - opened here
from clip_jax.interop.pretrained import clip_jax_variables, open_clip_variables
from clip_jax.models.config import CLIPConfig, as_trained, is_resnet
from clip_jax.models.registry import get_model_config
from clip_jax.runtime import storage
from clip_jax.runtime.run_layout import CHECKPOINTS, TOKENIZER
from clip_jax.runtime.run_layout import CONFIG as RUN_CONFIG
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".npz")
_STEP = re.compile(r"\d+")


class ModelSource:
    """One kind of path clip_jax reads a model from: an entry of `FORMATS`."""

    kind = ""  # what such a path is, in words: "a clip_jax run directory"
    expected = ""  # how to give one, in the list of what a path may be
    remote = False  # read from s3:// and gs:// too

    def __init__(self, path: str):
        self.path = path

    @staticmethod
    def holds(path: str) -> bool:
        """Whether `path` is one (an existing path; on a bucket, only for a `remote` kind)."""
        raise NotImplementedError

    def check(self) -> None:
        """Raises, saying what is there, when the path is of this kind but holds no model yet (a run that has not
        saved a complete checkpoint); `open_model` asks before anything else is read."""

    def model_config(self) -> CLIPConfig | None:
        """The model the path holds; None when it does not say."""
        return None

    def preprocessing(self) -> dict:
        """The `mean` and `std` (those it says) the model was trained with."""
        return {}

    def variables(self, config: CLIPConfig) -> dict:
        """Host variables of `config` (`{"params": ...}`, and `"batch_stats"` for a ResNet image tower), fitted to it
        (`clip_jax.interop.pretrained`) and refused, naming keys and shapes, when they are another model's."""
        raise NotImplementedError


def run_directory(path: str) -> str | None:
    """The run directory a run path names (the run, its `checkpoints`, or `checkpoints/STEP`), or None."""
    path = storage.absolute(path)
    for candidate in (path, storage.dirname(path), storage.dirname(storage.dirname(path))):
        if RunDirectory.holds(candidate):
            return candidate
    return None


def read_run_config(path: str):
    """The training config (a ConfigDict) of the run `path` names (see `run_directory`), with every field: those
    the run's version of clip_jax did not have yet at their defaults."""
    from clip_jax.run_config import saved_run_config

    run_dir = run_directory(path)
    if run_dir is None:
        raise MissingInput(f"{path} is not in a clip_jax run directory (no {RUN_CONFIG} beside {CHECKPOINTS}/)")
    config_path = storage.join(run_dir, RUN_CONFIG)
    try:
        return saved_run_config(json.loads(storage.read_text(config_path)))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{config_path} is not valid JSON: {e}") from None


def run_model(run_config, run_dir: str | None = None) -> CLIPConfig:
    """The model a run trained, as its step was built (`StepSpec.for_model`: at the run's image size, with its
    loss's head and its forced patch dropout), its model config file named when it is gone; reading the tokenizer
    kept in `run_dir` when it has one (a local run's `tokenizer/`)."""
    force = run_config.force_patch_dropout  # -1: the model config's rate
    try:
        model = get_model_config(run_config.model)
    except MissingInput as e:
        raise MissingInput(f"{e}: the run's model config is gone; give the model with --model") from None
    from clip_jax.text.model_tokenizer import with_run_tokenizer

    kept = os.path.join(run_dir, TOKENIZER) if run_dir and not storage.is_remote(run_dir) else None
    return as_trained(with_run_tokenizer(model, run_config, kept), image_size=run_config.force_image_size,
                      siglip_head=run_config.loss == "siglip",
                      patch_dropout=None if force is None or force < 0 else force)


class _RunCheckpoints(ModelSource):
    """A run's checkpoints: the run's model and mean/std when they are in a run; `_checkpoint` says which step."""

    remote = True

    @functools.cached_property
    def run_config(self):
        return read_run_config(self.path) if run_directory(self.path) is not None else None

    def model_config(self) -> CLIPConfig | None:
        return None if self.run_config is None else run_model(self.run_config, run_directory(self.path))

    def preprocessing(self) -> dict:
        c = self.run_config
        return {} if c is None else {"mean": tuple(c.image_mean), "std": tuple(c.image_std)}

    def _checkpoint(self) -> tuple[str, int]:
        raise NotImplementedError

    @functools.cached_property
    def checkpoint(self) -> tuple[str, int]:
        """(checkpoints folder, step) of the checkpoint read: the one found when the path was opened."""
        return self._checkpoint()

    def check(self) -> None:
        _ = self.checkpoint  # found, or refused in one line

    def variables(self, config: CLIPConfig) -> dict:
        from clip_jax.runtime.checkpoints import read_step_variables

        directory, step = self.checkpoint
        return clip_jax_variables(read_step_variables(directory, step), config, self.path)


def _newest(directory: str, what: str) -> tuple[str, int]:
    from clip_jax.runtime.checkpoints import latest_complete_step

    step = latest_complete_step(directory)
    if step is None:
        raise MissingInput(f"{what} has no complete checkpoint yet ({directory} holds none): let the run save one, "
                           "or give another run or checkpoint")
    return directory, step


class RunDirectory(_RunCheckpoints):
    kind = "a clip_jax run directory"
    expected = f"a clip_jax run directory ({RUN_CONFIG} beside {CHECKPOINTS}/: its newest checkpoint)"

    @staticmethod
    def holds(path: str) -> bool:
        return (storage.isfile(storage.join(path, RUN_CONFIG)) and storage.isdir(storage.join(path, CHECKPOINTS))
                and not hf_folder.is_hf_folder(path))

    def _checkpoint(self) -> tuple[str, int]:
        return _newest(storage.join(self.path, CHECKPOINTS), f"the clip_jax run {self.path}")


def _is_step(path: str) -> bool:
    return bool(_STEP.fullmatch(storage.basename(path))) and storage.isdir(storage.join(path, "state"))


class CheckpointFolder(_RunCheckpoints):
    kind = "a clip_jax checkpoint"
    expected = f"one of its checkpoints (RUN/{CHECKPOINTS}/STEP, or RUN/{CHECKPOINTS}: the newest)"

    @staticmethod
    def holds(path: str) -> bool:
        if not storage.isdir(path):
            return False
        return (_is_step(path) or storage.basename(path) == CHECKPOINTS
                or any(_is_step(storage.join(path, name)) for name in storage.listdir(path) if _STEP.fullmatch(name)))

    def _checkpoint(self) -> tuple[str, int]:
        from clip_jax.runtime.checkpoints import is_complete

        if not _is_step(self.path):
            return _newest(self.path, f"the checkpoints folder {self.path}")
        directory, name = storage.dirname(storage.absolute(self.path)), storage.basename(self.path)
        if not is_complete(directory, name):
            raise MissingInput(f"checkpoint {self.path} was never completed (its save was interrupted: no "
                               f"{storage.COMMIT_FILE}); give an earlier step, or the run for its newest")
        return directory, int(name)


class OpenClipFolder(ModelSource):
    kind = "an exported model folder"
    expected = (f"an exported model folder ({open_clip_folder.EXPORT_CONFIG} beside "
                f"{open_clip_folder.EXPORT_WEIGHTS}: python -m clip_jax.export)")

    @staticmethod
    def holds(path: str) -> bool:
        if not os.path.isdir(path):
            return False
        if os.path.isfile(os.path.join(path, open_clip_folder.EXPORT_CONFIG)):
            return True  # beside transformers' files too: an export of clip_jax's is read as OpenCLIP's
        return (any(os.path.isfile(os.path.join(path, name)) for name in open_clip_folder.FOLDER_WEIGHTS)
                and not hf_folder.is_hf_folder(path))

    def model_config(self) -> CLIPConfig:
        return open_clip_folder.folder_model_config(self.path)

    def preprocessing(self) -> dict:
        return open_clip_folder.folder_preprocessing(self.path)

    def variables(self, config: CLIPConfig) -> dict:
        open_clip_folder.read_export_config(self.path)  # an exported folder is whole: its config says how to preprocess
        return _file_variables(open_clip_folder.folder_weights_file(self.path), config)


class HfFolder(ModelSource):
    kind = "a transformers CLIPModel folder"  # or SiglipModel folder: the model its config.json names
    expected = f"a transformers CLIPModel or SiglipModel folder ({hf_folder.CONFIG} and {hf_folder.WEIGHTS[0]})"

    @staticmethod
    def holds(path: str) -> bool:
        return (os.path.isdir(path) and hf_folder.is_hf_folder(path)
                and not os.path.isfile(os.path.join(path, open_clip_folder.EXPORT_CONFIG)))

    def model_config(self) -> CLIPConfig:
        return hf_folder.hf_model_config(self.path)

    def preprocessing(self) -> dict:
        note = hf_folder.missing_processor_note(self.path, self.model_config().vision.image_size)
        if note is not None:
            print(f"note: {note}")  # as the export's notes: errors alone go to stderr
        return hf_folder.hf_preprocessing(self.path)

    def variables(self, config: CLIPConfig) -> dict:
        held = self.model_config()
        hf_folder.check_hf_model(self.path, held, config)
        return open_clip_variables(hf_folder.read_hf_state_dict(self.path, held), config,
                                   hf_folder.hf_weights_file(self.path))


class WeightsFile(ModelSource):
    kind = "a weights file"
    expected = f"a weights file ({', '.join(WEIGHT_SUFFIXES)}: OpenCLIP's state_dict or clip_jax's params)"

    @staticmethod
    def holds(path: str) -> bool:
        return os.path.isfile(path) and path.endswith(WEIGHT_SUFFIXES)

    @functools.cached_property
    def arrays(self) -> dict:
        """Name -> array, as the file holds them."""
        return read_arrays(self.path)

    def holds_clip_jax(self) -> bool:
        """Whether the file holds clip_jax's params (or variables), not an OpenCLIP state_dict."""
        return holds_clip_jax(self.arrays)

    def variables(self, config: CLIPConfig) -> dict:
        return _file_variables(self.path, config, self)


def _file_variables(path: str, config: CLIPConfig, file: WeightsFile | None = None) -> dict:
    """Host variables of `config` from a weights file, OpenCLIP's or clip_jax's."""
    file = file or WeightsFile(path)
    if not file.holds_clip_jax():
        return open_clip_variables(file.arrays, config, path)
    tree = unflatten(file.arrays)  # checked once fitted (another image size, a logit_bias to add)
    return clip_jax_variables(tree if "params" in tree else {"params": tree}, config, path)


FORMATS: tuple[type[ModelSource], ...] = (RunDirectory, CheckpointFolder, OpenClipFolder, HfFolder, WeightsFile)
EXPECTED = ", ".join(f.expected for f in FORMATS[:-1]) + f", or {FORMATS[-1].expected}"


def model_source(path, what: str = "") -> ModelSource:
    """The `ModelSource` of what `path` holds; `what` names the path in an error (a flag: "--pretrained")."""
    path = os.fspath(path)
    named = f"{what} {path}" if what else path
    remote = storage.is_remote(path)
    if not storage.exists(path):
        raise MissingInput(f"{named} does not exist{did_you_mean(path)}: give {EXPECTED}")
    found = [f for f in FORMATS if (f.remote or not remote) and f.holds(path)]
    if len(found) > 1:
        raise InvalidInput(f"{named} is both {found[0].kind} and {found[1].kind}: give a path that holds one model "
                           "(move the other out)")
    if found:
        return found[0](path)
    if remote:
        raise InvalidInput(f"{named} is not a clip_jax run or checkpoint, which are all clip_jax reads from a bucket: "
                           "copy an exported folder or weights file to a local path first")
    if not storage.isdir(path):
        raise InvalidInput(f"{named} is a file of an unknown checkpoint format: give {EXPECTED}")
    names = storage.listdir(path)
    there = f"a folder of {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}" if names else "an empty folder"
    raise MissingInput(f"{named} is {there}: no complete checkpoint in it, neither an exported model folder nor any "
                       f"other model clip_jax reads; give {EXPECTED}")


def did_you_mean(path: str) -> str:
    """" (did you mean PATH?)" for a local path that is not there when its folder holds a name close to its own (a
    typo: logs/dmeo beside logs/demo), else ""."""
    folder, name = os.path.split(os.path.normpath(path))
    if storage.is_remote(path) or not os.path.isdir(folder or "."):
        return ""
    try:
        close = difflib.get_close_matches(name, os.listdir(folder or "."), n=1, cutoff=0.75)
    except OSError:  # a folder that cannot be listed
        return ""
    return f" (did you mean {os.path.join(folder, close[0])}?)" if close else ""


def path_problems(path, what: str) -> list[str]:
    """[] when `path` holds a model (that `open_model` opens given the model's name), else the one line saying what
    is there: for a config check that names every problem before anything is built."""
    try:
        model_source(path, what).check()
    except UserError as e:
        return [str(e)]
    return []


def open_model(path, model=None, *, what: str = "", max_num_patches: int | None = None) -> OpenedModel:
    """The model `path` holds (see the module docstring). `model` (a name, OpenCLIP model config or `CLIPConfig`)
    is the model to read the weights as, fitted to it; None: the one the path holds, which a weights file does not
    say. `what` names the path in an error (a flag: "--pretrained"). `max_num_patches`: a NaFlex model's patch budget
    (a command's `--max_num_patches`; None: the model's own), refused for another model (`OpenedModel.at_budget`)."""
    from clip_jax.text.model_tokenizer import with_folder_tokenizer

    source = model_source(path, what)
    source.check()
    config = source.model_config() if model is None else get_model_config(model)
    if config is None:
        named = f"{what} {source.path}" if what else source.path
        raise InvalidInput(f"{named} is {source.kind}, which does not say which model it holds: name the model "
                           "(--model NAME, e.g. ViT-L-14)")
    # a SigLIP folder's tokenizer files are its model's tokenizer, whichever model config reads its weights
    opened = OpenedModel(source, with_folder_tokenizer(config, source.path if os.path.isdir(source.path) else None))
    return opened.at_budget(max_num_patches)


def load_pretrained(path: str, name_or_config) -> dict:
    """Host params (numpy, float32) of the model `name_or_config` from `path` (any model path: see the module
    docstring). A ResNet image tower also needs its BatchNorm statistics: `load_pretrained_variables`."""
    config = get_model_config(name_or_config)
    if is_resnet(config):
        raise InvalidInput(f"{config.name} has a ResNet image tower: its weights are params and BatchNorm "
                           "statistics; load both with load_pretrained_variables")
    return load_pretrained_variables(path, config)["params"]


def load_pretrained_variables(path: str, name_or_config) -> dict:
    """Host variables of the model `name_or_config` from `path`: `{"params": ...}`, and `"batch_stats"`
    (BatchNorm's running statistics) for a ResNet image tower; what `model.apply` takes."""
    return open_model(path, name_or_config, what="pretrained").variables()
