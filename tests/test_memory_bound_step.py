"""The step's memory-bound work (issue 54): ViT-L/14's bf16 step on an H200, compiled without one, no longer writes
the MLP's float32 hidden gradient (GELU' written out) and moves at most the issue's floor of bytes with the XLA
flags the project adopts; those flags reach every compile here and every GPU run's XLA_FLAGS (launch/env.sh)."""

import os
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from clip_jax import plan as planner
from clip_jax.runtime import hlo_kernels, xla_gpu
from clip_jax.runtime.hardware import get_gpu
from clip_jax.runtime.hlo_text import parse
from clip_jax.runtime.mesh import create_mesh
from clip_jax.training.step_factory import StepSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 256
MLP_HIDDEN_F32 = f"f32[{BATCH},257,4096]"  # ViT-L/14 at 224: 257 tokens, 4096 wide
# benchmarks/RESULTS.md section 34: 524.6 GB before issue 54, 434.7 with GELU' written out and the adopted flags
MEMORY_BOUND_FLOOR = 440e9


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


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_vit_l_steps_memory_bound_kernels_move_at_most_the_issues_floor(vit_l_step_on_an_h200):
    moved = sum(kernel.step_bytes for kernel in hlo_kernels.kernels(vit_l_step_on_an_h200)
                if kernel.kind not in ("gemm", "attention", "collective"))
    assert moved <= MEMORY_BOUND_FLOOR, f"{moved / 1e9:.1f} GB"


def test_the_adopted_flags_are_among_the_compile_options_and_written_as_xla_flags():
    assert xla_gpu.ADOPTED_FLAGS["xla_gpu_unsupported_enable_triton_multi_output_fusion"] is True
    assert xla_gpu.ADOPTED_FLAGS.items() <= xla_gpu.COMPILER_OPTIONS.items()
    assert xla_gpu.DEVICELESS_OPTIONS.items() <= xla_gpu.COMPILER_OPTIONS.items()
    assert xla_gpu.xla_flags_text({"a": True, "b": False, "c": 3}) == "--a=true --b=false --c=3"


@pytest.mark.gpu_compile
def test_a_deviceless_compile_is_given_the_adopted_flags(monkeypatch):
    given = []
    compile_lowered = jax.stages.Lowered.compile

    def recording(lowered, compiler_options=None, **kwargs):
        given.append(dict(compiler_options or {}))
        return compile_lowered(lowered, compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    sharding = NamedSharding(Mesh(np.array(xla_gpu.devices(get_gpu("h200"), 1, 1)), ("data",)), P())
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16, sharding=sharding)
    xla_gpu.compile_lowered(jax.jit(lambda x: (x @ x.T).sum()).lower(x))
    assert len(given) == 1 and xla_gpu.ADOPTED_FLAGS.items() <= given[0].items()


def env_sh_xla_flags(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHON")}
    result = subprocess.run(["bash", "-c", "set -euo pipefail; source launch/env.sh; echo \"$XLA_FLAGS\""],
                            env={**clean, **env}, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.subprocess
def test_every_gpu_run_gets_the_adopted_flags_first_and_a_jobs_own_flags_after_them():
    adopted = xla_gpu.xla_flags_text()
    assert env_sh_xla_flags().startswith(adopted + " --xla_gpu_enable_latency_hiding_scheduler=true")
    flag = next(iter(xla_gpu.ADOPTED_FLAGS))
    own = env_sh_xla_flags(XLA_FLAGS=f"--{flag}=false")
    assert own == f"{adopted} --{flag}=false"  # XLA takes a flag's last value: the job switched it off


@pytest.mark.subprocess
def test_env_sh_names_the_python_it_could_not_run():
    clean = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(["bash", "-c", "set -euo pipefail; source launch/env.sh; echo sourced"],
                            env={**clean, "PYTHON": "/no/such/python"}, cwd=REPO, capture_output=True, text=True)
    assert result.returncode != 0 and "sourced" not in result.stdout
    assert re.search(r"launch/env.sh: /no/such/python cannot run clip_jax.runtime.xla_gpu", result.stderr)
