"""WiSE-FT on the demo: the demo's trained CLIP fine-tuned to classify Fashion-MNIST, a few minutes on 2 CPU cores.

    .venv/bin/python -m clip_jax.train --config configs/demo.py              # first: the demo run, logs/demo
    .venv/bin/python -m clip_jax.finetune --config configs/demo_finetune.py

It starts from the demo's trained run (`logs/demo`, its newest checkpoint: a model that already does zero-shot, so
that the zero-shot end of the sweep means something; nothing is downloaded). The first run writes Fashion-MNIST in
CLIP_benchmark's layout under data/clip_benchmark/fashion-mnist (about half a minute), then fine-tunes on the first
10,000 train images, the head initialised from the zero-shot classifier, and sweeps WiSE-FT's alpha on the first
2,000 test images and on the same images upside down, a shift the demo never saw (its zero-shot model keeps 48%
top-1 there, where on inverted images, `shift_data = "invert"`, it is at chance). Table and plot:
logs/demo-finetune/wise_ft.{json,csv,png}; the alpha-0.5 model with its head: logs/demo-finetune/export/.
"""

import os

from clip_jax.training.finetune_config import default_finetune_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def get_config():
    c = default_finetune_config()
    c.pretrained = os.path.join(ROOT, "logs", "demo")
    c.data = os.path.join(ROOT, "data", "clip_benchmark", "fashion-mnist")
    c.make_data = "fashion-mnist"
    c.train_samples = 10_000
    c.test_samples = 2_000
    c.shift_data = "vflip"  # the test images upside down: the zero-shot model keeps about half its accuracy there
    c.batch_size = 128  # per device: 128 on this CPU's one device
    c.epochs = 2
    c.lr = 1e-3
    c.warmup = 10
    c.wd = 0.1
    c.layer_decay = 0.75
    c.ema_decay = 0.99
    c.workers = 2
    c.logs = os.path.join(ROOT, "logs")
    c.name = "demo-finetune"
    c.save_every_steps = 50
    c.log_every_n_steps = 10
    return c
