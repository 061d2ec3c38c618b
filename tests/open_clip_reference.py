"""Random-init OpenCLIP models for parity tests, with every norm and bias moved away from its init."""

import numpy as np
import open_clip
import torch

TINY = {  # several heads per tower, a non-default mlp_ratio, a non-square-free grid
    "embed_dim": 48,
    "vision_cfg": {"image_size": 32, "layers": 3, "width": 96, "patch_size": 8, "head_width": 24, "mlp_ratio": 2.5},
    "text_cfg": {"context_length": 20, "vocab_size": 600, "width": 64, "heads": 4, "layers": 2, "mlp_ratio": 3.0},
}
# Real token ids (the tokenizer's) need the full vocabulary and context; the towers stay tiny.
TINY_77 = {**TINY, "text_cfg": {**TINY["text_cfg"], "context_length": 77, "vocab_size": 49408}}


def open_clip_model(name_or_config, seed: int = 0) -> torch.nn.Module:
    """An OpenCLIP model in eval mode whose LayerNorms, biases and 1-d params are perturbed, logit_scale changed."""
    torch.manual_seed(seed)
    if isinstance(name_or_config, str):
        model = open_clip.create_model(name_or_config)
    else:
        model = open_clip.CLIP(**name_or_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "logit_scale":
                p.fill_(2.9)
            elif p.ndim < 2 or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def state_dict_numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def random_inputs(image_size: int, context_length: int, vocab_size: int, batch: int, seed: int = 0):
    """NHWC images and token rows ending in the largest id (EOT) at varied positions, zero padded."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch, image_size, image_size, 3)).astype(np.float32)
    tokens = np.zeros((batch, context_length), np.int32)
    for row in range(batch):
        length = int(rng.integers(2, context_length + 1))
        tokens[row, 0] = vocab_size - 2  # start of text
        tokens[row, 1:length - 1] = rng.integers(1, vocab_size - 2, length - 2)
        tokens[row, length - 1] = vocab_size - 1  # end of text
    return images, tokens


def open_clip_features(model: torch.nn.Module, images: np.ndarray, tokens: np.ndarray):
    """Normalised image and text features and exp(logit_scale) from OpenCLIP's own forward."""
    with torch.no_grad():
        image_f, text_f, scale = model(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
                                       torch.from_numpy(tokens).long())
    return image_f.numpy(), text_f.numpy(), float(scale)


def open_clip_flops(name_or_config) -> tuple[int, int]:
    """(image, text) FLOPs of one sample through OpenCLIP's own towers as torch's FlopCounterMode counts them: 2 a
    multiply-add of every matmul and convolution, norms and softmax left out. The model is built on the meta
    device, so nothing is allocated or computed. A convolution counts its zero padding too (the kernel at every
    output cell), which clip_jax's count of a ResNet leaves out."""
    from torch.utils.flop_counter import FlopCounterMode

    config = open_clip.get_model_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    size, context = config["vision_cfg"]["image_size"], config["text_cfg"].get("context_length", 77)
    with torch.device("meta"), torch.no_grad():
        model = open_clip.CLIP(**config).eval()
        counts = []
        for encode, inputs in ((model.encode_image, torch.zeros(1, 3, size, size)),
                               (model.encode_text, torch.zeros(1, context, dtype=torch.long))):
            with FlopCounterMode(display=False) as counter:
                encode(inputs)
            counts.append(counter.get_total_flops())
    return counts[0], counts[1]
