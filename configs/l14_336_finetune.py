"""ViT-L/14 fine-tuned from 224 to 336 px, as OpenAI's L/14@336 was made: the LAION-2B recipe's weights start a new
run at image size 336, the vision positional embedding resized from 16 x 16 to 24 x 24 patches on load (bicubic,
class token kept), with a low learning rate and a short warmup.

    python -m clip_jax.train --config configs/l14_336_finetune.py \\
        --config.pretrained=/weights/CLIP-ViT-L-14-laion2B-s32B-b82K/open_clip_pytorch_model.bin

`pretrained` may equally name a run directory of configs/l14_laion2b.py or a folder from `python -m clip_jax.export`.
Export the result with `python -m clip_jax.export logs/l14-336-finetune OUT_DIR`: OpenCLIP loads it as
`local-dir:OUT_DIR` at 336 px.
"""

from clip_jax.run_config import default_config


def get_config():
    c = default_config()
    c.model = "ViT-L-14"
    c.image_mean = (0.5, 0.5, 0.5)  # what the pretrained weights were trained with
    c.image_std = (0.5, 0.5, 0.5)
    c.train_data = "/data/laion2B-en/{00000..23295}.tar"
    c.dataset_resampled = True
    c.workers = 6
    c.batch_size = 128
    c.precision = "bf16"
    c.grad_checkpointing = True
    c.resume = "latest"
    c.zeroshot_data = "/data/imagenet/val"
    # The 224 px weights (see the docstring); check_config names this path if it does not exist.
    c.pretrained = "/weights/CLIP-ViT-L-14-laion2B-s32B-b82K/open_clip_pytorch_model.bin"
    c.force_image_size = 336  # the model stays ViT-L-14 (same weights); ViT-L-14-336 names the same architecture
    c.train_num_samples = 20_000_000
    c.epochs = 1
    c.lr = 1e-5
    c.warmup = 500
    c.name = "l14-336-finetune"
    return c
