"""OpenCLIP's training step, as its `train_one_epoch` runs it: the baseline of the train-step benchmarks.

AdamW with OpenCLIP's two parameter groups (no weight decay for 1-d parameters, norms, biases and the logit scale),
`ClipLoss`, optional bf16 autocast (OpenCLIP's `amp_bf16`), and the logit-scale clamp after every update.
"""

import math


def open_clip_optimizer(model, *, lr: float = 1e-3, weight_decay: float = 0.2):
    import torch

    def excluded(name, p):  # OpenCLIP's weight-decay rule
        return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name

    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [{"params": [p for n, p in named if excluded(n, p)], "weight_decay": 0.0},
         {"params": [p for n, p in named if not excluded(n, p)], "weight_decay": weight_decay}],
        lr=lr, betas=(0.9, 0.98), eps=1e-6)


def make_open_clip_step(model, optimizer, images, tokens, *, bf16: bool = False):
    """`step() -> loss`: one update on the fixed batch (images NCHW, tokens int64, on the model's device)."""
    import torch
    from open_clip.loss import ClipLoss

    loss_fn = ClipLoss()

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=bf16):
            image_features, text_features, logit_scale = model(images, tokens)
            loss = loss_fn(image_features, text_features, logit_scale)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        return loss

    return step
