"""Embeddings of an image-text collection in clip-retrieval's layout: `python -m clip_jax.embed`.

    python -m clip_jax.embed --input_dataset "/data/laion/{00000..00099}.tar" --input_format webdataset \\
        --output_folder embeddings/ --clip_model exported/ --enable_metadata True

The flags are clip-retrieval's (`clip-retrieval inference`), and so is the output, which its kNN-index tools
(autofaiss, `clip-retrieval index`) read: `img_emb/img_emb_N.npy` and `text_emb/text_emb_N.npy` (float16,
L2-normalised) and `metadata/metadata_N.parquet` (`image_path` (the sample's key for webdataset input), `caption`,
then the fields of the sample's `.json` with `--enable_metadata`), row for row; how the input is split into parts
and how they are numbered: `clip_jax.evaluation.embed_parts`.

`--clip_model` (or `--pretrained`) is what clip_jax's other tools take as a model: an exported folder, a clip_jax
run directory (its newest checkpoint), a transformers CLIPModel folder, or an OpenCLIP checkpoint file with
`--model NAME`. The batch is split over
this process's devices; in a multi-process run (SLURM, or `CLIP_JAX_*` variables: `clip_jax.runtime.processes`)
each process writes its own parts. A run continues a folder that a killed run left: the parts already written are
kept. Bad samples are skipped and counted by reason, as in training.
"""

import argparse
import collections
import concurrent.futures
import os
import sys
import threading
import time

import numpy as np

from clip_jax.data import webdataset
from clip_jax.data.naflex import NaFlexResize
from clip_jax.data.transforms import normalize
from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.evaluation import embed_parts, embed_reader, embed_writer
from clip_jax.evaluation.batches import pad_rows
from clip_jax.evaluation.encoder import ShardedEncoder, round_up, shard_rows
from clip_jax.interop.opened_model import add_budget_argument
from clip_jax.runtime import entry, storage

PROGRESS_EVERY_S = 10.0


def _flag_bool(value: str) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not True or False")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m clip_jax.embed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input_dataset", required=True, help="a folder (files) or a shard pattern (webdataset)")
    parser.add_argument("--output_folder", required=True)
    parser.add_argument("--input_format", default="files", help="files or webdataset")
    parser.add_argument("--clip_model", "--pretrained", dest="clip_model", required=True,
                        help="an exported model folder, a clip_jax run directory, a transformers CLIPModel folder or "
                             "an OpenCLIP checkpoint")
    parser.add_argument("--model", help="the model of an OpenCLIP checkpoint file (a name or model-config .json)")
    add_budget_argument(parser)
    for name, default in (("enable_text", True), ("enable_image", True), ("enable_metadata", False)):
        parser.add_argument(f"--{name}", type=_flag_bool, nargs="?", const=True, default=default,
                            help=f"True or False (default {default})")
    parser.add_argument("--batch_size", type=int, default=256, help="samples per step over this process's devices")
    parser.add_argument("--write_batch_size", type=int, default=10**6, help="samples per output part")
    parser.add_argument("--output_partition_count", type=int, help="parts (default: from --write_batch_size)")
    parser.add_argument("--wds_number_file_per_input_file", type=int, default=10000,
                        help="samples a shard is taken to hold when the parts are counted")
    parser.add_argument("--wds_image_key", default="jpg;png;jpeg;webp", help="image extensions, in order")
    parser.add_argument("--wds_caption_key", default="txt", help="caption extension, or json:FIELD")
    parser.add_argument("--num_prepro_workers", type=int, default=4,
                        help="threads decoding images (and as many tokenizing)")
    return parser.parse_args(argv)


def load_model(clip_model: str, model_name: str | None, max_num_patches: int | None = None):
    """(model, params, image mean, image std, resize mode) of what `--clip_model` names (a NaFlex model's resize
    at `max_num_patches`, None: its own budget)."""
    from clip_jax.interop.opener import open_model

    opened = open_model(clip_model, model_name, what="--clip_model", max_num_patches=max_num_patches)
    return read_model(opened, f"--clip_model {clip_model}", model_name)


def read_model(opened, named: str, model_name: str | None):
    """(model, params, image mean, image std, the eval transform's resize mode) of an `OpenedModel`, its variables
    read now; `named`: the option and path that gave it, for the message when they do not fit the model."""
    from clip_jax.models import create_model
    from clip_jax.models.variables import eval_variables

    try:
        params = eval_variables(**opened.variables())
    except InvalidInput as e:
        raise InvalidInput(f"{named}: {e}" + ("" if model_name else " (--model NAME)")) from None
    return create_model(opened.config), params, *opened.normalization(), opened.resize_mode


class Progress:
    """A line with the samples embedded and samples/s: every `PROGRESS_EVERY_S` seconds and after each part."""

    def __init__(self, parts: int, prefix: str):
        self.parts, self.prefix = parts, prefix
        self.samples, self.parts_done = 0, 0
        self.start = self.last = time.perf_counter()

    def rate(self) -> float:
        return self.samples / max(time.perf_counter() - self.start, 1e-9)

    def add(self, samples: int, part_done: str | None = None) -> None:
        self.samples += samples
        self.parts_done += part_done is not None
        now = time.perf_counter()
        if part_done is not None or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            done = f", part {part_done} written" if part_done is not None else ""
            print(f"{self.prefix}{self.samples:,} samples, {self.rate():.1f} samples/s, {self.parts_done}/"
                  f"{self.parts} parts{done}", file=sys.stderr, flush=True)


def _inputs(args) -> tuple[list, int]:
    """(the inputs parts are taken from: samples or shards, the sample count the parts are counted from)."""
    if args.input_format == "files":
        samples = embed_parts.folder_samples(args.input_dataset, enable_image=args.enable_image,
                                             enable_text=args.enable_text)
        return samples, len(samples)
    urls = embed_parts.shard_urls(args.input_dataset)
    return urls, len(urls) * args.wds_number_file_per_input_file


def run(args, process_index: int = 0, process_count: int = 1) -> dict:
    """Writes this process's parts that are not written yet; returns counts of what it did."""
    import jax

    from clip_jax.text.model_tokenizer import tokenizer_for
    from clip_jax.runtime.mesh import create_mesh

    embed_parts.check_format(args.input_format)
    if not (args.enable_image or args.enable_text):
        raise InvalidInput("--enable_image False and --enable_text False: nothing to embed")
    if args.batch_size < 1:
        raise InvalidInput(f"--batch_size {args.batch_size}: give at least 1")
    # before the model loads: on disk a real write, on a bucket its credentials, endpoint and the right to write
    storage.check_output_folder(args.output_folder, what="the embeddings",
                                change="give --output_folder a folder you can write to",
                                probe=f".clip_jax_write_probe-{process_index}")
    fmt = webdataset.SampleFormat.parse(args.wds_image_key, args.wds_caption_key)
    inputs, estimate = _inputs(args)
    if estimate == 0:
        raise MissingInput(f"--input_dataset {args.input_dataset}: no samples found (images with .txt captions)")
    parts = args.output_partition_count or embed_parts.partition_count(estimate, args.write_batch_size)
    model, params, mean, std, resize_mode = load_model(args.clip_model, args.model, args.max_num_patches)
    record = {"clip_model": os.path.abspath(args.clip_model), "weights": embed_writer.weights_digest(params),
              "input_dataset": args.input_dataset if "://" in args.input_dataset else os.path.abspath(
                  args.input_dataset), "input_format": args.input_format, "parts": parts,
              "enable_image": args.enable_image, "enable_text": args.enable_text,
              "enable_metadata": args.enable_metadata,
              **({"max_num_patches": resize_mode.max_num_patches} if isinstance(resize_mode, NaFlexResize) else {})}
    embed_writer.check_output(args.output_folder, record)
    if process_index == 0:
        embed_writer.claim_output(args.output_folder, record)
    if process_count > 1:  # no process writes a part before the folder is claimed
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("clip_jax.embed: output folder claimed")

    mesh = create_mesh(jax.local_devices())
    encoder = ShardedEncoder(model, mesh)
    placed = encoder.place(params)
    rows = round_up(args.batch_size, mesh.size)  # every step has this shape
    kinds = [kind for kind, on in (("img_emb", args.enable_image), ("text_emb", args.enable_text)) if on]
    kinds.append("metadata")
    mine = embed_parts.process_parts(parts, process_index, process_count)
    todo = [p for p in mine if not embed_parts.is_written(embed_parts.part_paths(args.output_folder, p, parts,
                                                                                  kinds))]
    prefix = f"embed (process {process_index}/{process_count}): " if process_count > 1 else "embed: "
    progress = Progress(len(todo), prefix)
    skipped: collections.Counter = collections.Counter()
    tokenize = tokenizer_for(model.config) if args.enable_text else None  # checked before any part is read
    lock = threading.Lock()  # the tokenizer's cache is not shared between threads

    def tokens(texts):
        with lock:
            return tokenize(texts)

    config = model.config
    with concurrent.futures.ThreadPoolExecutor(max(1, args.num_prepro_workers)) as pool:
        for part in todo:
            samples = _part_samples(args, fmt, embed_parts.part_inputs(inputs, part, parts), skipped)
            batches = embed_reader.batches(samples, skipped, pool, batch_size=rows,
                                           image_size=config.vision.image_size if args.enable_image else None,
                                           tokenize=tokens if args.enable_text else None,
                                           num_threads=args.num_prepro_workers, resize_mode=resize_mode)
            _embed_part(encoder, placed, batches, rows, mean, std, args,
                        embed_parts.part_paths(args.output_folder, part, parts, kinds), progress,
                        embed_parts.part_number(part, parts))
    return {"parts": parts, "parts_written": len(todo), "parts_kept": len(mine) - len(todo),
            "samples": progress.samples, "skipped": dict(sorted(skipped.items())), "samples_per_s": progress.rate(),
            "max_num_patches": resize_mode.max_num_patches if isinstance(resize_mode, NaFlexResize) else None}


def _part_samples(args, fmt, part_input: list, skipped: collections.Counter):
    needs = {"need_image": args.enable_image, "need_text": args.enable_text}
    if args.input_format == "files":
        return embed_reader.folder_part(part_input, skipped, **needs)
    return embed_reader.shard_part(part_input, skipped, fmt, **needs)


def _embed_part(encoder, placed, batches, rows, mean, std, args, paths, progress, number) -> None:
    """Encodes one part's batches and writes the part (nothing when none of its samples is good)."""
    image_out, text_out, samples = [], [], []
    for batch in batches:
        n = len(batch.samples)
        image_f = text_f = None
        if batch.images is not None:  # dispatched first; the host waits once both towers are queued
            images = normalize(pad_rows(batch.images, rows), mean, std)
            image_f = encoder.image_features(placed, shard_rows(images, encoder.mesh))
        if batch.tokens is not None:
            text_f = encoder.text_features(placed, pad_rows(batch.tokens, rows))
        if image_f is not None:
            image_out.append(np.asarray(image_f)[:n].astype(np.float16))
        if text_f is not None:
            text_out.append(np.asarray(text_f)[:n].astype(np.float16))
        samples.extend(batch.samples)
        progress.add(n)
    if not samples:
        progress.add(0, part_done=f"{number} (no good samples: not written)")
        return
    table = embed_writer.metadata_table([s.image_path for s in samples] if args.enable_image else None,
                                        [s.caption for s in samples] if args.enable_text else None,
                                        [s.metadata for s in samples] if args.enable_metadata else None)
    embed_writer.write_part(paths, image_embeddings=np.concatenate(image_out) if image_out else None,
                            text_embeddings=np.concatenate(text_out) if text_out else None, table=table)
    progress.add(0, part_done=number)


@entry.command(stopped="while embedding: the parts written are kept, and the same command continues")
def main(argv=None) -> int:
    import jax

    from clip_jax.runtime import processes

    args = parse_args(argv)
    processes.initialize_from_environment()
    summary = run(args, jax.process_index(), jax.process_count())
    skipped = ", ".join(f"{reason} {count}" for reason, count in summary["skipped"].items()) or "none"
    print(f"embedded {summary['samples']:,} samples into {summary['parts_written']} parts of {summary['parts']} "
          f"({summary['parts_kept']} written before kept) in {args.output_folder}, "
          f"{summary['samples_per_s']:.1f} samples/s"
          + (f", images at {summary['max_num_patches']} patches" if summary["max_num_patches"] else "")
          + f"; skipped: {skipped}")
    return 0

