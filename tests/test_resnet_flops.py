"""FLOPs and plans of ResNet (ModifiedResNet) models: the analytic count agrees with XLA's count of the compiled
forward and train step, and the planner plans a ResNet run."""

import json

import pytest
from open_clip_reference import open_clip_flops

from clip_jax import plan as planner
from clip_jax.models import get_model_config
from clip_jax.models.flops import image_forward_flops, resnet_image_macs
from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD
from clip_jax.run_config import default_config
from clip_jax.training.step_factory import StepSpec

# Every stage with its own block count, the stem's stride-2 conv and shortcut convs of both kinds (a width change in
# layer1, a stride in the others), and a 2x2 grid for the attention pool
TINY_RN = {
    "embed_dim": 24,
    "vision_cfg": {"image_size": 64, "layers": [1, 2, 1, 2], "width": 16, "head_width": 64},
    "text_cfg": {"context_length": 8, "vocab_size": 50, "width": 16, "heads": 2, "layers": 2},
}


def resnet_macs_by_hand(image_size: int, layers, width: int, embed_dim: int, *, as_open_clip_runs=False) -> int:
    """Multiply-adds of one image through a ModifiedResNet, its convolutions written out stage by stage: the taps on
    the image only (a 3x3 conv with padding 1 on an n x n output reads (3n - 2)^2 taps per channel pair, the stem's
    stride-2 conv (3n - 1)^2), and the attention pool's one query, the mean token's. `as_open_clip_runs`: what
    OpenCLIP's forward computes, as torch's FlopCounterMode counts it: every conv's 9 taps at every output cell,
    padding included, and the pool's query, scores and output projection for every token, of which it keeps the
    first."""
    taps3 = (lambda n: (3 * n) ** 2) if as_open_clip_runs else (lambda n: (3 * n - 2) ** 2)  # noqa: E731
    stem_taps = (lambda n: (3 * n) ** 2) if as_open_clip_runs else (lambda n: (3 * n - 1) ** 2)  # noqa: E731
    size, half = image_size // 2, width // 2
    macs = stem_taps(size) * 3 * half + taps3(size) * half * half + taps3(size) * half * width
    channels, size = width, size // 2  # the stem's 2x2 average pool
    for stage, blocks in enumerate(layers):
        planes = width * 2**stage
        for block in range(blocks):
            out = size // 2 if (stage and not block) else size
            macs += size * size * channels * planes + taps3(size) * planes * planes + out * out * planes * 4 * planes
            if block == 0:
                macs += out * out * channels * 4 * planes
            channels, size = 4 * planes, out
    tokens, queries = size * size + 1, (size * size + 1 if as_open_clip_runs else 1)
    return macs + queries * channels**2 + 2 * tokens * channels**2 + 2 * queries * tokens * channels + \
        queries * channels * embed_dim


def test_analytic_count_of_rn50_by_hand():
    macs = resnet_macs_by_hand(224, (3, 4, 6, 3), 64, 1024)
    assert resnet_image_macs(get_model_config("RN50").vision, 1024) == macs
    assert image_forward_flops(get_model_config("RN50")) == 2 * macs
    # the hand count's stages are OpenCLIP's: counted as OpenCLIP runs them, they are torch's count of its forward
    assert 2 * resnet_macs_by_hand(224, (3, 4, 6, 3), 64, 1024, as_open_clip_runs=True) == open_clip_flops("RN50")[0]


def tiny_rn_forward_flops() -> int:
    """TINY_RN's forward FLOPs a sample: its image tower by hand, its text tower as torch counts OpenCLIP's."""
    image = resnet_macs_by_hand(64, (1, 2, 1, 2), 16, 24)
    open_clip_image, open_clip_text = open_clip_flops(TINY_RN)
    assert 2 * resnet_macs_by_hand(64, (1, 2, 1, 2), 16, 24, as_open_clip_runs=True) == open_clip_image
    return 2 * image + open_clip_text


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The planner's plan of a TINY_RN run with FSDP on 2 devices, XLA's FLOP counts included: they are counted on
    the forward and the train step it compiled for the memory (one train-step compile serves both tests)."""
    model_file = tmp_path_factory.mktemp("model") / "tiny_rn.json"
    model_file.write_text(json.dumps(TINY_RN))
    c = default_config()
    c.update(model=str(model_file), train_num_samples=1_000, epochs=1, workers=2, batch_size=4, precision="fp32",
             grad_checkpointing=False, fsdp=True)
    return planner.plan(c, "h100", 2, compiler="cpu", search_batch=False, xla_flops=True)


@pytest.mark.slow
def test_xla_counts_of_the_compiled_programs_agree_with_the_analytic_count(planned):
    flops = planned.flops_per_sample
    assert flops.counted_at_batch == 4
    assert flops.forward_analytic == tiny_rn_forward_flops()
    # XLA also counts BatchNorm, ReLU, the pools, norms and softmax: more, by a few percent
    assert 1.0 <= flops.forward_xla / flops.forward_analytic < 1.05
    # and in the step BatchNorm's backward and the AdamW update of each device's half of the 1.6M params (FSDP) for
    # its 4 samples: 11% at this size (15% on one device)
    assert 1.0 <= flops.train_xla / flops.train_analytic < 1.2


@pytest.mark.slow
def test_the_planner_plans_a_resnet_run(planned):
    memory = planned.memory_per_device
    assert memory.fits and memory.total_bytes > memory.state_bytes > 0
    assert planned.flops_per_sample.forward_analytic == tiny_rn_forward_flops()
    assert planned.parameters.image > 0 and planned.setup.fsdp


def _load_config(name: str):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_the_rn50x4_config_is_the_l14_recipe_with_rn50x4_at_288_and_openais_normalisation():
    rn, l14 = _load_config("rn50x4_laion2b"), _load_config("l14_laion2b")
    different = {k for k in l14 if rn[k] != l14[k]}
    assert different == {"model", "image_mean", "image_std", "name"}
    assert rn.image_mean == OPENAI_MEAN and rn.image_std == OPENAI_STD
    spec = StepSpec.from_config(rn, platform="gpu")
    assert spec.model.name == "RN50x4" and spec.model.vision.image_size == 288
    assert spec.remat_policy != "none" and spec.precision == "bf16" and not spec.fsdp
