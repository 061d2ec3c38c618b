"""OpenAI's RN50x4 (OpenCLIP's ModifiedResNet, 288 px) trained on LAION-2B with the ViT-L/14 recipe of
configs/l14_laion2b.py, field by field: the same data, epochs, schedule, optimizer and global batch.

96 nodes x 4 A100-40GB, one process per GPU, 6 CPUs each (as launch/l14_laion2b.sbatch, with this config):

    srun --nodes=96 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=6 \\
        python -m clip_jax.train --config configs/rn50x4_laion2b.py

Per-GPU batch 224, as the L/14 run: 224 x 384 GPUs = 86,016 per step, the global batch the contrastive loss sees
(its negatives) kept from the recipe. It fits: `python -m clip_jax.plan --config=configs/rn50x4_laion2b.py
--gpu=a100-40gb --gpus=384` (XLA:GPU's memory analysis of this step, bf16, every bottleneck block rematerialised)
puts it at 13.1 GiB of an A100-40GB's 36.8 usable; 710 would fit (benchmarks/RESULTS.md, section 16), so 224 keeps
the recipe's global batch with room to spare, not the most a GPU holds. BatchNorm normalises over the whole
global batch of the step (see clip_jax.training.train_step), so the statistics are those of 86,016 images, not of one
GPU's 224.

Images are normalised with OpenAI's mean and std, as OpenCLIP does for its RN models (the default config's).
"""

from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD
from clip_jax.run_config import default_config


def get_config():
    c = default_config()
    c.model = "RN50x4"  # image_size 288
    c.image_mean = OPENAI_MEAN
    c.image_std = OPENAI_STD

    c.train_data = "/data/laion2B-en/{00000..23295}.tar"
    c.train_num_samples = 200_000_000
    c.dataset_resampled = True
    c.workers = 6

    c.batch_size = 224
    c.epochs = 160
    c.lr = 1e-3
    c.warmup = 10_000
    c.wd = 0.2
    c.beta1 = 0.9
    c.beta2 = 0.98
    c.eps = 1e-6

    c.precision = "bf16"
    c.grad_checkpointing = True
    c.on_instability = "rollback_fp32"

    c.name = "rn50x4-laion2b"
    c.resume = "latest"
    c.save_frequency = 1
    c.keep = 5
    c.zeroshot_frequency = 1
    c.zeroshot_data = "/data/imagenet/val"  # ImageNet-1k validation in class folders
    c.report_to = "tensorboard"
    c.seed = 0
    return c
