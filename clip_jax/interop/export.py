"""Export a model as the folder OpenCLIP and transformers load:
`python -m clip_jax.export RUN_DIR_OR_CHECKPOINT OUT_DIR`.

    python -m clip_jax.export logs/my-run exported/        # the run's newest checkpoint
    python -m clip_jax.export logs/my-run exported/ --step 4000
    python -m clip_jax.export open_clip_pytorch_model.bin exported/ --model ViT-L-14 --mean 0.5 0.5 0.5 \\
        --std 0.5 0.5 0.5

OUT_DIR gets `open_clip_config.json` (`model_cfg`: the architecture in OpenCLIP's model-config format;
`preprocess_cfg`: mean, std, interpolation, resize mode and image size; `model_name`, which OpenCLIP does not
read: the model's name, e.g. the run's `demo-tiny`, as the commands reading the folder report it) and
`open_clip_model.safetensors` (the OpenCLIP state_dict, float32). Then
`open_clip.create_model_and_transforms("local-dir:OUT_DIR")` builds the model with its weights and the preprocessing
the run trained with, and clip_jax takes OUT_DIR wherever it takes a checkpoint. From a run, the model and the
mean/std come from the run's `config.json`.

Beside them, as LAION's published models do, the same model in transformers' layout (`clip_jax.interop.hf_folder`:
`config.json`, `model.safetensors`, `preprocessor_config.json` and the tokenizer's files), which
`transformers.CLIPModel.from_pretrained(OUT_DIR)` and `CLIPProcessor.from_pretrained(OUT_DIR)` load. A model
transformers' CLIPModel cannot hold (a ResNet image tower, OpenCLIP's custom-block options, a SigLIP logit_bias,
...) gets OpenCLIP's files only and a one-line note saying why; `--no-transformers` leaves them out.
"""

import argparse
import json
import os
import sys

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.interop import hf_folder
from clip_jax.interop.open_clip_folder import (EXPORT_CONFIG, EXPORT_WEIGHTS, INTERPOLATION, RESIZE_MODE,
                                               export_config)
from clip_jax.interop.opener import CheckpointFolder, RunDirectory, model_source, open_model, run_directory
from clip_jax.models.config import CLIPConfig, is_resnet
from clip_jax.models.open_clip_json import open_clip_model_cfg
from clip_jax.runtime import entry, ownership, storage
from clip_jax.runtime.run_layout import CHECKPOINTS


def preprocess_cfg(image_size: int, mean, std, resize_mode: str = RESIZE_MODE) -> dict:
    return {"size": int(image_size), "mode": "RGB", "mean": [float(x) for x in mean], "std": [float(x) for x in std],
            "interpolation": INTERPOLATION, "resize_mode": resize_mode}


# The cleaning OpenCLIP names nearest to each of clip_jax's that it has no name for: transformers' SiglipTokenizer
# lowercases and strips punctuation as "canonicalize" does (which also fixes text with ftfy, unescapes HTML and reads
# "_" as a space); its cased form and Gemma's "none" keep the case, as "whitespace" does (which strips no
# punctuation and collapses whitespace). The export's transformers files keep the tokenizer's own cleaning.
OPEN_CLIP_CLEAN = {"siglip": "canonicalize", "siglip-cased": "whitespace", "none": "whitespace"}


def _model_tokenizer(model: CLIPConfig):
    """The SentencePiece tokenizer a SigLIP model reads (None: CLIP's BPE), its files copied into the export: OpenCLIP
    reads an exported folder's tokenizer from the folder itself (`local-dir:`), transformers too."""
    from clip_jax.text.model_tokenizer import tokenizer_for
    from clip_jax.text.sentencepiece_tokenizer import SentencePieceTokenizer

    tokenizer = tokenizer_for(model)  # checked: the folder is there and its vocabulary is the model's
    if tokenizer.folder is None:
        return None
    return SentencePieceTokenizer.from_folder(tokenizer.folder, model.text.context_length, clean=tokenizer.clean)


def export_open_clip(params, model: CLIPConfig, out_dir: str, *, mean, std, transformers: bool = True,
                     resize_mode: str = RESIZE_MODE) -> str | None:
    """Writes `params` of `model` as an OpenCLIP model folder `out_dir` (created if needed; other files in it are
    left alone, and its files are refused when clip_jax did not write them), and, with `transformers`, as a
    transformers CLIPModel folder too. Returns why the transformers files were not written (None when they were).
    A ResNet image tower's are its variables (`params` and `batch_stats`): the state_dict gets each BatchNorm's
    running_mean, running_var and num_batches_tracked."""
    from clip_jax.interop.convert import variables_to_open_clip
    from clip_jax.interop.weight_files import write_open_clip
    from clip_jax.models.variables import as_variables

    state_dict = variables_to_open_clip(as_variables(params), model)
    tokenizer = _model_tokenizer(model)
    if not is_resnet(model) and model.vision.naflex:
        _export_naflex(state_dict, model, tokenizer, out_dir, mean=mean, std=std, transformers=transformers,
                       resize_mode=resize_mode)
        return None
    skipped = "--no-transformers" if not transformers else hf_folder.hf_unsupported(model)
    tokenizer_files = {} if tokenizer is None else hf_folder.saved_tokenizer(tokenizer)  # name -> bytes, saved once
    names = [EXPORT_WEIGHTS, EXPORT_CONFIG, *tokenizer_files] + ([] if skipped else
                                                                 list(hf_folder.hf_files(model, tokenizer_files)))
    ownership.claim(out_dir, dict.fromkeys(names), writing="the export",
                    change="give another OUT_DIR (an export replaces only an earlier export of clip_jax's)")
    write_open_clip(os.path.join(out_dir, EXPORT_WEIGHTS), state_dict)
    model_cfg = open_clip_model_cfg(model)
    if tokenizer is not None:  # OpenCLIP cleans as the config says, "whitespace" when it says nothing
        model_cfg["text_cfg"]["tokenizer_kwargs"] = {"clean": OPEN_CLIP_CLEAN.get(tokenizer.clean, tokenizer.clean)}
    config = export_config(model_cfg, preprocess_cfg(model.vision.image_size, mean, std, resize_mode), model.name)
    with open(os.path.join(out_dir, EXPORT_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if skipped:
        _remove_earlier_hf_files(out_dir, keep=tokenizer_files)
        hf_folder.write_files(out_dir, tokenizer_files)
    else:
        hf_folder.write_hf_files(out_dir, state_dict, model, mean=mean, std=std, tokenizer_files=tokenizer_files,
                                 resize_mode=resize_mode)
    return skipped


NAFLEX_NOTE = ("OpenCLIP 3.3's format has no NaFlex model, so the export is the transformers Siglip2Model folder "
               "alone (no open_clip_config.json)")


def _export_naflex(state_dict, model: CLIPConfig, tokenizer, out_dir: str, *, mean, std, transformers: bool,
                   resize_mode) -> None:
    """A NaFlex model's export: transformers' Siglip2Model folder, its image processor at the model's patch budget."""
    if not transformers:
        raise InvalidInput(f"--no-transformers: {model.name} is a NaFlex model; {NAFLEX_NOTE}: leave "
                           "--no-transformers out")
    tokenizer_files = {} if tokenizer is None else hf_folder.saved_tokenizer(tokenizer)
    names = hf_folder.hf_files(model, tokenizer_files)  # refuses a model without its tokenizer
    ownership.claim(out_dir, dict.fromkeys(names), writing="the export",
                    change="give another OUT_DIR (an export replaces only an earlier export of clip_jax's)")
    hf_folder.write_hf_files(out_dir, state_dict, model, mean=mean, std=std, tokenizer_files=tokenizer_files,
                             resize_mode=resize_mode)


def _remove_earlier_hf_files(out_dir: str, keep=()) -> None:
    """An earlier export's transformers files in `out_dir` (clip_jax's only) would describe another model; `keep`:
    the tokenizer files this export writes again."""
    owned = ownership.owned_names(out_dir)
    for name in (*hf_folder.HF_FILES, *hf_folder.SIGLIP_TOKENIZER_FILES):
        if name in owned and name not in keep and os.path.isfile(os.path.join(out_dir, name)):
            ownership.remove(out_dir, name)


def export(source: str, out_dir: str, *, model=None, step: int | None = None, mean=None, std=None,
           transformers: bool = True) -> tuple[CLIPConfig, str | None]:
    """Exports `source` (a run directory or checkpoint, an OpenCLIP or clip_jax weights file, or an exported folder)
    to `out_dir`; returns the exported model's config and why transformers' files were not written (None when they
    were). `model`, `mean`, `std` replace what the run says (and are needed for a bare weights file: without them,
    OpenAI's mean and std)."""
    if step is not None:
        run_dir = run_directory(source) if isinstance(model_source(source), (RunDirectory, CheckpointFolder)) else None
        if run_dir is None:
            raise InvalidInput(f"--step names a checkpoint of a run; {source} is not a run directory")
        source = storage.join(run_dir, CHECKPOINTS, str(step))
        if not storage.isdir(source):
            raise MissingInput(f"no checkpoint of step {step}: {source} does not exist")
    opened = open_model(source, model)
    mean, std = opened.normalization(mean, std)
    if len(mean) != 3 or len(std) != 3:
        raise InvalidInput(f"mean {mean} and std {std} need 3 values each")
    storage.check_output_folder(out_dir, what="the export", change="give OUT_DIR a folder you can write to",
                                remote=False)  # before the weights are read
    skipped = export_open_clip(opened.variables(), opened.config, out_dir, mean=mean, std=std,
                               transformers=transformers, resize_mode=opened.resize_mode)
    return opened.config, skipped


@entry.command(stopped="before the export was complete")
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clip_jax.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="run directory, its checkpoints/STEP folder, an OpenCLIP checkpoint or "
                        "clip_jax params file, or an exported folder")
    parser.add_argument("out_dir", help="folder to write OpenCLIP's files (open_clip_config.json, "
                        "open_clip_model.safetensors) and transformers' (config.json, model.safetensors, ...) to")
    parser.add_argument("--step", type=int, help="the run's checkpoint of this step (default: the newest)")
    parser.add_argument("--model", help="model name or OpenCLIP model-config .json (default: the run's)")
    parser.add_argument("--mean", type=float, nargs=3, help="image mean (default: the run's)")
    parser.add_argument("--std", type=float, nargs=3, help="image std (default: the run's)")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false",
                        help="write OpenCLIP's files only, not transformers' CLIPModel files")
    args = parser.parse_args(argv)
    config, skipped = export(args.source, args.out_dir, model=args.model, step=args.step, mean=args.mean,
                             std=args.std, transformers=args.transformers)
    kind = {"siglip": "SiglipModel", "siglip2": "Siglip2Model"}.get(hf_folder.hf_model_type(config), "CLIPModel")
    if kind == "Siglip2Model":
        print(f"exported {args.source} ({config.name}, NaFlex) to {args.out_dir}: load it with "
              f"transformers.Siglip2Model.from_pretrained('{args.out_dir}')")
        print(f"note: {NAFLEX_NOTE}")
        return 0
    also = "" if skipped else f", or transformers.{kind}.from_pretrained('{args.out_dir}')"
    print(f"exported {args.source} ({config.name}, {config.vision.image_size} px) to {args.out_dir}: load it with "
          f"open_clip.create_model_and_transforms('local-dir:{args.out_dir}'){also}")
    if skipped and args.transformers:
        print(f"note: no transformers files: {config.name} has no {kind} counterpart, as {skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
