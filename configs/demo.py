"""The embedded demo: a tiny CLIP trained on the bundled Fashion-MNIST in a few minutes on 2 CPU cores.

    .venv/bin/python -m clip_jax.train --config configs/demo.py

It ends with a zero-shot top-1 on the 10,000 held-out test images (chance: 10%).
"""

import os

from clip_jax.run_config import default_config

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    c = default_config()
    c.model = os.path.join(HERE, "models", "demo-tiny.json")  # OpenCLIP's format: 28 px images, 7 px patches
    # The 60,000 training images in 12 shards of 5,000, written from Debian's dataset-fashion-mnist by the first
    # run (about half a minute; when several processes start together one writes, the others wait), then reused.
    c.train_data = os.path.join(HERE, "..", "data", "fashion-mnist", "train", "{00000..00011}.tar")
    c.make_train_data = "fashion-mnist"
    c.train_num_samples = 30_000  # half the training set: a few minutes on 2 cores
    c.dataset_resampled = False  # shards in a shuffled order, each read once
    c.workers = 1
    c.batch_size = 256  # per device
    c.epochs = 1
    c.lr = 2e-3
    c.warmup = 50
    c.wd = 0.1
    c.precision = "fp32"
    c.grad_checkpointing = False
    c.name = "demo"
    c.resume = "latest"  # a second run continues this one (or, when it is complete, only evaluates again)
    c.save_every_steps = 100
    c.log_every_n_steps = 20
    c.zeroshot_data = "demo"
    c.zeroshot_frequency = 0  # only at the end
    return c
