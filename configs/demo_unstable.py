"""The instability lab: the demo's tiny CLIP on the bundled Fashion-MNIST, set up to spike within a few CPU minutes:
pure bf16 (weights, moments and activations), a short warm-up to a learning rate 2.5x the demo's, AdamW with a slow
second moment (beta2 0.999) and a small eps (1e-8), no clipping and no automatic rollback. The loss first falls a
little, then jumps (steps 17-18, at a learning rate near 3e-3) and collapses to chance for the rest of its 80
steps.

    .venv/bin/python -m clip_jax.train --config configs/demo_unstable.py

`benchmarks/instability_lab.py` runs it beside the treatments (rollback, fp32, StableAdamW, gradient clipping,
qk_norm, scaled cosine attention) and tabulates what each does; results in benchmarks/RESULTS.md.
"""

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _demo_config():
    spec = importlib.util.spec_from_file_location("demo_config", os.path.join(HERE, "demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config():
    c = _demo_config()  # the demo's data, model, batch and evaluation; what follows makes it unstable
    c.precision = "pure_bf16"
    c.lr = 5e-3  # 2.5x the demo's rate ...
    c.warmup = 30  # ... reached after 30 steps; the trouble starts near 3e-3
    c.beta2 = 0.999  # a second moment that lags behind a sudden change of the gradients (Wortsman et al. 2023)
    c.eps = 1e-8
    c.batch_size = 64
    c.train_num_samples = 5120  # 80 steps of 64
    c.grad_clip_norm = 0.0
    c.opt = "adamw"
    c.nan_patience = 1_000_000  # no rollback: non-finite steps are skipped and counted, the run goes on
    c.loss_spike_factor = 0.0
    c.name = "demo_unstable"
    c.resume = ""
    c.save_every_steps = 10
    c.log_every_n_steps = 1  # every step's loss, for the loss curves
    c.zeroshot_samples = 1000
    return c
