"""`remat_policy="auto"`: on GPUs the first policy of the measured order whose step fits the usable memory, decided
by compiling the step for the GPU (deviceless here); `nothing_saveable` on any other platform."""

import dataclasses

import jax
import pytest

from clip_jax.errors import InvalidInput
from clip_jax.runtime import xla_gpu
from clip_jax.runtime.hardware import GPUS
from clip_jax.runtime.mesh import create_mesh
from clip_jax.training.remat_choice import AUTO_ORDER, choose_remat, resolve_auto_remat, usable_bytes
from clip_jax.training.step_factory import StepMemory, StepSpec, build_step

BATCH = 64


@pytest.fixture(scope="module")
def h200_mesh():
    return create_mesh(xla_gpu.devices(GPUS["h200"], 1, 1))


@pytest.fixture(scope="module")
def compiled(h200_mesh):
    """`compiled(spec, batch)`, each step compiled for the H200 once, and the list of what was asked for."""
    cache, asked = {}, []

    def compile_step(spec, batch):
        asked.append(spec.remat_policy)
        if (spec, batch) not in cache:
            cache[spec, batch] = build_step(spec, h200_mesh).compile(batch)
        return cache[spec, batch]

    compile_step.asked = asked
    return compile_step


@pytest.fixture(scope="module")
def spec(tiny_model_config):
    return StepSpec.for_model(tiny_model_config, "bf16", "auto", attention_impl="cudnn")


def test_auto_on_a_cpu_is_nothing_saveable_without_compiling(spec):
    def no_compiles(*_):
        raise AssertionError("compiled on a CPU mesh")

    resolved, choice = resolve_auto_remat(spec, create_mesh(jax.devices()[:1]), BATCH, compile_step=no_compiles)
    assert resolved.remat_policy == "nothing_saveable" and choice.tried == ()


@pytest.mark.gpu_compile
def test_auto_takes_the_first_policy_that_fits_the_gpu(spec, h200_mesh, compiled):
    sizes = {policy: StepMemory.of(compiled(dataclasses.replace(spec, remat_policy=policy), BATCH)).total
             for policy in AUTO_ORDER}
    assert sizes["dots_saveable"] > sizes["nothing_saveable"], sizes  # saving matmul outputs costs memory
    compiled.asked.clear()
    roomy = choose_remat(spec, h200_mesh, BATCH, usable=sizes["dots_saveable"], compile_step=compiled)
    assert roomy.policy == "dots_saveable" and compiled.asked == ["dots_saveable"]
    tight = choose_remat(spec, h200_mesh, BATCH, usable=sizes["dots_saveable"] - 1, compile_step=compiled)
    assert tight.policy == "nothing_saveable"
    assert tight.tried == (("dots_saveable", sizes["dots_saveable"]), ("nothing_saveable", sizes["nothing_saveable"]))
    # none fits: the policy that keeps least, for XLA's own rematerialisation to try
    assert choose_remat(spec, h200_mesh, BATCH, usable=1, compile_step=compiled).policy == "nothing_saveable"
    assert "dots_saveable" in tight.describe() and "GiB usable" in tight.describe()


@pytest.mark.gpu_compile
def test_a_compile_only_gpus_usable_memory_is_its_kinds_times_the_fraction(h200_mesh):
    assert usable_bytes(h200_mesh.devices.flat[0], 0.5) == GPUS["h200"].memory_bytes // 2


def test_a_gpu_of_unknown_memory_is_refused_naming_the_field():
    class Device:
        device_kind = "NVIDIA Imaginary 9000"

        def memory_stats(self):
            return None

    with pytest.raises(InvalidInput, match=r"remat_policy='auto' cannot tell .*Imaginary 9000.*--config.remat_policy"):
        usable_bytes(Device(), 0.9)
