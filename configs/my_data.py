"""Training on your own data: the demo's recipe (its tiny CLIP, sized for a CPU) without the demo's Fashion-MNIST.

    .venv/bin/python -m clip_jax.train --config configs/my_data.py \\
        --config.name=photos --config.train_data=data/photos/00000.tar

Copy it and change what your data needs; README.md, "Training on your own data", has the whole recipe (a folder of
images with captions, a CSV, webdataset shards you have).
"""

import os

from clip_jax.run_config import default_config

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    c = default_config()
    # The demo's model: 28 px images in 7 px patches, a few minutes on 2 CPU cores. A real run: "ViT-B-32" (224 px)
    # or any registered name / OpenCLIP model-config .json, with precision "bf16" on a GPU.
    c.model = os.path.join(HERE, "models", "demo-tiny.json")
    # Your data: webdataset shards ("data/photos/{00000..00009}.tar", as `python -m clip_jax.data.make_shards`
    # prints it), or with dataset_type = "csv" OpenCLIP's csv/tsv (filepath, title; paths relative to its folder).
    c.train_data = ""
    c.dataset_type = "webdataset"
    c.make_train_data = ""  # the demo's "fashion-mnist" would write Fashion-MNIST shards: never for your data
    c.train_num_samples = 0  # samples per epoch; 0: counted (the shards' *_stats.json, the csv's rows)
    c.dataset_resampled = False  # shards in a shuffled order, each read once per epoch
    c.workers = 1
    c.batch_size = 64  # per device
    c.epochs = 10
    c.lr = 2e-3
    c.warmup = 50  # steps; a run of fewer steps is refused, naming the largest warmup that fits
    c.wd = 0.1
    c.precision = "fp32"
    c.grad_checkpointing = False
    c.name = "my-data"  # the run directory, logs/NAME: one name for each data set
    c.resume = "latest"  # a second run continues this one (or, when it is complete, only evaluates again)
    c.save_every_steps = 100
    c.log_every_n_steps = 20
    c.zeroshot_data = ""  # the demo's zero-shot asks Fashion-MNIST's classes: an ImageNet-style folder of yours here
    return c
