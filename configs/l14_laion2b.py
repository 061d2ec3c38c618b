"""OpenCLIP's ViT-L/14 on LAION-2B (CLIP-ViT-L-14-laion2B-s32B-b82K: 75.3% ImageNet zero-shot), field by field.

96 nodes x 4 A100, one process per GPU, 6 CPUs each (launch/l14_laion2b.sbatch holds the full job):

    srun --nodes=96 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=6 \\
        python -m clip_jax.train --config configs/l14_laion2b.py

224 per GPU x 384 GPUs = 86,016 per step; 160 virtual epochs of 200M samples = 32B samples, ~372K steps.
The same command resumes after preemption (resume="latest").
"""

from clip_jax.run_config import default_config


def get_config():
    c = default_config()
    c.model = "ViT-L-14"
    c.image_mean = (0.5, 0.5, 0.5)
    c.image_std = (0.5, 0.5, 0.5)

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

    c.precision = "bf16"  # the reference ran fp16 AMP, hit NaNs at epoch ~75 and resumed in fp32; bf16 avoids it
    c.grad_checkpointing = True
    c.on_instability = "rollback_fp32"

    c.name = "l14-laion2b"
    c.resume = "latest"
    c.save_frequency = 1
    c.keep = 5
    c.zeroshot_frequency = 1
    c.zeroshot_data = "/data/imagenet/val"  # ImageNet-1k validation in class folders
    c.report_to = "tensorboard"
    c.seed = 0
    return c
