"""The step's memory-bound work (issue 54): ViT-L/14's bf16 step on an H200, compiled without one, no longer writes
the MLP's float32 hidden gradient (GELU' written out)."""

import pytest

from clip_jax import plan as planner
from clip_jax.runtime import hlo_kernels, xla_gpu
from clip_jax.runtime.hardware import get_gpu
from clip_jax.runtime.hlo_text import parse
from clip_jax.runtime.mesh import create_mesh
from clip_jax.training.step_factory import StepSpec

BATCH = 256
MLP_HIDDEN_F32 = f"f32[{BATCH},257,4096]"  # ViT-L/14 at 224: 257 tokens, 4096 wide


@pytest.fixture(scope="module")
def vit_l_step_on_an_h200():
    """ViT-L/14, bf16, dots_saveable, cuDNN attention, 256 per H200: the optimized HLO (one compile, a minute)."""
    spec = StepSpec.for_model("ViT-L-14", "bf16", "dots_saveable", attention_impl="cudnn")
    return planner.compile_train_step(spec, create_mesh(xla_gpu.devices(get_gpu("h200"), 1, 1)), BATCH).as_text()


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_vit_l_step_writes_no_float32_mlp_hidden_gradient(vit_l_step_on_an_h200):
    writers = [f"{instruction.name} {instruction.shape}"
               for instruction, _, _ in hlo_kernels.launched(parse(vit_l_step_on_an_h200))
               if MLP_HIDDEN_F32 in instruction.shape]
    assert writers == [], "the GELU backward writes its float32 gradient and reads it back: " + ", ".join(writers)
