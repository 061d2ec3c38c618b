"""clip_jax: CLIP training in JAX/Flax at LAION scale, compatible with OpenCLIP checkpoints."""

from setuptools import find_packages, setup

setup(
    name="clipjax-train",
    version="0.1.0",
    description="CLIP training in JAX/Flax at LAION scale, compatible with OpenCLIP checkpoints",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["clip_jax", "clip_jax.*"]),
    package_data={"clip_jax": ["text/*.txt.gz", "text/*.txt", "evaluation/*.json"]},
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "grain>=0.2.18",
        "ml-collections>=1.1.0",
        "tensorboard>=2.21",
        "tensorflow-datasets>=4.9.10",
        "numpy>=2.0",
        "tokenizers>=0.23",
        "sentencepiece>=0.2",  # SigLIP's spiece.model and Gemma's tokenizer.model (clip_jax/text/)
        "ftfy>=6.3",
        "regex>=2026.1.1",
        "pillow>=12.0",
        "safetensors>=0.8",
        "fsspec>=2026.1.0",
        "psutil>=5.9",  # host CPU and RAM in the training log (clip_jax.ops.device_telemetry)
        "pyarrow>=14",  # LAION's parquet metadata: data.check --parquet, make_shards filter-parquet
    ],
    extras_require={
        # XLA:GPU: the planner compiles for GPUs without one (clip_jax.runtime.xla_gpu), and training runs on NVIDIA GPUs.
        # jaxlib's CUDA 13 plugin and NVIDIA's libraries: about 4.4 GB of wheels (most of them shared with torch's
        # CUDA build, which the test extra brings).
        # nvidia-ml-py: GPU utilisation, memory, temperature and power in the training log (clip_jax.ops.device_telemetry).
        "gpu": ["jax[cuda13]", "nvidia-ml-py>=12"],
        # report_to=wandb; python -m clip_jax.report (its PNG).
        "wandb": ["wandb>=0.19"],
        "report": ["matplotlib>=3.8"],
        # Run directories on object storage (logs/resume = s3://..., gs://...): fsspec's filesystems for the files
        # Orbax and the trainer write besides arrays (TensorStore, already installed, writes the arrays).
        "remote": ["s3fs>=2024.2", "gcsfs>=2024.2"],
        # The parity tests run the real OpenCLIP package; pip takes these torch builds from local files where present.
        "test": [
            "pytest>=9.0",
            # The suite runs in two worker processes, a test module to each (.ci/run): one waits on a subprocess or a
            # compile while the other computes.
            "pytest-xdist>=3.6",
            "torch==2.14.1",
            "torchvision==0.29.1",
            "open-clip-torch==3.3.0",
            "webdataset>=1.0.2",
            # LAION's clip-benchmark (installed by .ci/setup.sh without its dependencies) imports scikit-learn in its
            # classification metrics; the tests also use it as an independent reference for balanced accuracy and AP.
            "scikit-learn>=1.0,<2",
            # W&B offline mode and the report PNG are tested end to end.
            "wandb>=0.19",
            "matplotlib>=3.8",
            # Remote run directories are tested against a local S3 server (moto); gs:// is tested without gcsfs
            # (its missing-package message and the same commit scheme), as no local GCS server is on PyPI.
            "s3fs>=2024.2",
            "moto[server]>=5.0",
            # An export's transformers files are loaded by transformers' own CLIPModel and CLIPProcessor, and a
            # folder transformers wrote is read back (the export itself needs neither transformers nor torch).
            "transformers>=5",
        ],
        # Benchmarks only: benchmarks/instability_lab.py plots its loss curves.
        "bench": ["matplotlib>=3.8"],
    },
)
