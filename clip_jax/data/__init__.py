"""Input pipeline: Grain over LAION-style webdataset tar shards, plus the demo dataset.

Training (one call per process)::

    from clip_jax import data

    cfg = data.TrainDataConfig(shards="/data/laion2B-en/{00000..23295}.tar", resampled=True,
                               train_num_samples=200_000_000, workers=6, seed=0)
    # or, from a run config (clip_jax.run_config): data.TrainDataConfig.from_run_config(config)
    shards = data.resolve_train_shards(cfg)  # once; writes the demo's shards first when cfg.make_from says so
    data.steps_per_epoch(cfg, 86_016, shards)  # virtual epoch length in steps
    it = data.build_train_iterator(cfg, shard_list=shards, global_batch_size=86_016, image_size=224,
                                   mean=(0.5,) * 3, std=(0.5,) * 3,
                                   process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(it)  # {"images": float32 [B_proc, 224, 224, 3] normalised, "tokens": int32 [B_proc, 77]}
    it.skipped_samples()  # {"corrupt_image": 3, "filter: punsafe < 0.5": 9, ...}, summed over workers
    data.skip_scalars(it.skipped_samples())  # {"skipped_samples": 3, "filtered_samples": 9, "filtered/...": 9}

Sample filters (``cfg.sample_filter``, :class:`clip_jax.data.filters.SampleFilter`) drop samples by their ``.json``
metadata, image size or caption length; ``dataset_type="csv"`` reads OpenCLIP's csv/tsv tables and
``dataset_type="synthetic"`` makes random batches (modules ``filters``, ``csv_source``, ``synthetic``;
``parquet_filter`` applies a filter expression to LAION's parquet metadata). ``cfg.augment`` is OpenCLIP's
``aug_cfg`` (``transforms.TrainAugment``).

The iterator never ends: in resampled mode each worker draws shards with replacement; in epoch mode every shard is
read once per epoch (split over processes and workers) and epochs follow each other. ``it.get_state()`` /
``it.set_state(state)`` resume exactly (the next batch is the one that would have come) when the shards, seed,
``workers``, ``shuffle_window``, ``shards_in_flight`` and process count are unchanged; Orbax saves the state next
to the model with ``ocp.args.Composite(..., data_iter=grain.checkpoint.CheckpointSave(it))`` and restores it with
``grain.checkpoint.CheckpointRestore(it)``. With ``workers > 0`` the workers are spawned processes (the launching
script needs the usual ``if __name__ == "__main__":`` guard); call ``it.close()`` when done.

Demo data: ``make_shards.fashion_mnist_shards(folder, "train")`` writes (once, however many processes ask at the
same time) and returns the pattern of Fashion-MNIST shards; a run config asks for the same with
``make_train_data="fashion-mnist"``; ``fashion_mnist.CLASS_NAMES`` / ``fashion_mnist.zeroshot_prompts`` serve its
zero-shot evaluation (``clip_jax.evaluation.demo_set``). Eval sources and batches live in ``clip_jax.evaluation``.

Modules: ``shards`` (patterns, weights, draw order), ``tar_format`` (streaming tar reader), ``webdataset`` (raw
samples from a shard's members), ``tar_dataset`` (the Grain dataset over tar shards), ``skips`` (skip reasons and
their counts), ``filter_expression`` and ``filters`` (the filter language, and the filter that applies it),
``transforms`` (decode, OpenCLIP train/eval transforms), ``train_config`` (the data config and the run's resolved
shards), ``epochs`` (samples and steps per epoch), ``pipeline`` (the Grain pipeline: decode, batch, the
iterator), ``fashion_mnist`` (the demo dataset, its class names and prompts), ``write_once`` (a folder of files
written by one of the processes that ask for it), ``shard_writer`` (shards in img2dataset's format) and
``image_folder`` (one's own images and captions, bad files left out), ``shard_checks`` (what a shard pattern
that finds no shard finds instead). Tools: ``python -m
clip_jax.data.make_shards``, ``python -m clip_jax.data.check``.
"""

from clip_jax.data.epochs import count_samples, steps_per_epoch
from clip_jax.data.pipeline import TrainIterator, build_train_dataset, build_train_iterator
from clip_jax.data.shards import ShardList, ShardPatternError, expand_braces, resolve_shards
from clip_jax.data.skips import skip_scalars
from clip_jax.data.train_config import TrainDataConfig, resolve_train_shards
from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD

__all__ = [
    "OPENAI_MEAN",
    "OPENAI_STD",
    "ShardList",
    "ShardPatternError",
    "TrainDataConfig",
    "TrainIterator",
    "build_train_dataset",
    "build_train_iterator",
    "count_samples",
    "expand_braces",
    "resolve_shards",
    "resolve_train_shards",
    "skip_scalars",
    "steps_per_epoch",
]
