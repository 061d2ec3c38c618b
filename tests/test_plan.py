"""The resource planner: its memory is XLA's for the very step training runs, its FLOPs match the analytic count,
the largest-batch search is exact and monotone, and bad input gets a clear message with the numbers."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from open_clip_reference import open_clip_flops
from xla_flags import FAST_COMPILE

from clip_jax import plan as planner
from clip_jax.models import get_model_config
from clip_jax.run_config import default_config
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 32, "heads": 2, "layers": 3},
}
OPEN_CLIP_L14_FORWARD = 175.33e9  # OpenCLIP's profile of ViT-L-14: 162.03 image + 13.30 text GFLOP


@pytest.fixture(scope="module")
def tiny_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def tiny_config(model_file, **fields):
    c = default_config()
    c.update(model=model_file, train_num_samples=10_000, epochs=2, workers=2, batch_size=2, precision="fp32",
             grad_checkpointing=False)
    c.update(fields)
    return c


@pytest.mark.slow
def test_planned_memory_is_xla_memory_of_the_real_sharded_step():
    """Abstract inputs (nothing allocated) give the same memory analysis as the step built from real arrays."""
    setup = StepSpec.for_model(TINY, "fp32", "nothing_saveable", fsdp=True)
    mesh = create_mesh(jax.devices()[:8])
    per_device = 3
    planned = planner.StepMemory.of(planner.compile_train_step(setup, mesh, per_device))

    # The same step built from real arrays laid out on the devices, with the trainer's optimizer and schedule.
    trainers = dataclasses.replace(setup, optimizer=OptimizerSpec(lr=5e-4, warmup=10, total_steps=1000))
    step = build_step(trainers, mesh)
    state = step.init(1)
    rng = np.random.default_rng(0)
    batch = make_global_batch({"images": rng.normal(size=(8 * per_device, 32, 32, 3)).astype(np.float32),
                               "tokens": rng.integers(1, 999, size=(8 * per_device, 16)).astype(np.int32)}, mesh)
    real = planner.StepMemory.of(step.update.lower(state, batch).compile())

    assert planned.total == pytest.approx(real.total, rel=1e-3)
    assert planned.argument == real.argument
    # The train state per device, from the tree and the sharding rule, is what the devices really hold.
    held = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state))
    assert planner.state_bytes_per_device(setup, mesh) == held
    assert real.argument == held + planner.batch_bytes_per_device(setup.model, per_device)
    # FSDP holds less than a replica: params + 2 AdamW moments in fp32, 12 bytes per parameter, plus counters.
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    replicated = planner.state_bytes_per_device(StepSpec(setup.model, "fp32"), mesh)
    assert 12 * n_params <= replicated <= 12 * n_params + 64
    assert held < 0.5 * replicated


@pytest.mark.slow
@pytest.mark.parametrize("name, remat", [("ViT-B-32", "nothing_saveable"), ("ViT-L-14", "none")])
def test_xla_flops_of_the_compiled_programs_agree_with_the_analytic_count(name, remat):
    """Every scanned block counted (XLA counts a loop body once): a few percent above the matmul-only count."""
    config = get_model_config(name)
    per_device = 8
    flops = planner.flops_per_sample(StepSpec(config, "fp32", remat), create_mesh(jax.devices()[:1]),
                                     per_device)
    assert flops.forward_analytic == sum(open_clip_flops(name))  # torch's count of OpenCLIP's own forward
    # XLA also counts norms, softmax, GELU: more, but by a few percent only.
    assert 1.0 <= flops.forward_xla / flops.forward_analytic < 1.03
    assert 1.0 <= flops.train_xla / (3 * flops.forward_analytic) < 1.05
    if name == "ViT-L-14":
        assert flops.forward_xla == pytest.approx(OPEN_CLIP_L14_FORWARD, rel=0.03)
    if remat != "none":
        # Recomputing every block costs most of a forward, not more (what no gradient needs is not recomputed).
        assert 0.4 * flops.forward_analytic < flops.remat_extra_xla <= flops.remat_extra_analytic
    else:
        assert flops.remat_extra_xla == 0


def counting(memory):
    calls = []

    def memory_of(b):
        calls.append(b)
        return memory(b)

    return memory_of, calls


@pytest.mark.parametrize("memory", [
    lambda b: 5_000 + 37 * b,  # affine, as compiled memory nearly is
    lambda b: 5_000 + 37 * b + (900 if b > 40 else 0),  # a jump (another fusion or layout from some batch on)
    lambda b: 5_000 + 20 * b + b * b // 7,  # convex: the [B_local, B_global] logits grow with the batch squared
])
def test_largest_batch_search_is_exact_monotone_and_cheap(memory):
    budgets = list(range(5_040, 60_000, 613))
    results = []
    for budget in budgets:
        memory_of, calls = counting(memory)
        found = planner.largest_fitting_batch(memory_of, budget, guess=16, limit=4096)
        brute_force = max(b for b in range(1, 4097) if memory(b) <= budget)
        assert found == brute_force, budget
        assert len(set(calls)) <= 2 * math.log2(found + 1) + 6, (budget, calls)
        results.append(found)
    assert results == sorted(results)  # more memory never fits a smaller batch


def test_largest_batch_search_stops_at_the_limit_and_rejects_batch_one():
    assert planner.largest_fitting_batch(lambda b: b, 10**9, limit=300) == 300
    with pytest.raises(planner.BatchDoesNotFit, match="batch 1 needs 5,037 bytes, more than the budget of 5,000"):
        planner.largest_fitting_batch(lambda b: 5_000 + 37 * b, 5_000)


@pytest.mark.slow
def test_bad_input_is_named_with_the_numbers(tiny_json):
    devices = jax.devices()[:2]
    with pytest.raises(ValueError, match="unknown GPU 'a100'; known: a100-40gb, a100-80gb, h100"):
        planner.plan(tiny_config(tiny_json), "a100", 2, devices=devices)
    with pytest.raises(ValueError, match=r"--gpus=0: give 1 to 4096"):
        planner.plan(tiny_config(tiny_json), "h100", 0, devices=[])
    with pytest.raises(ValueError, match=r"--price=-1.0: a price per GPU-hour cannot be negative"):
        planner.plan(tiny_config(tiny_json), "h100", 2, price=-1.0, devices=devices)
    with pytest.raises(ValueError, match="batch_size=6 \\(per device\\) must be a positive multiple of accum_freq=4"):
        planner.plan(tiny_config(tiny_json, batch_size=6, accum_freq=4), "h100", 2, devices=devices)
    with pytest.raises(ValueError, match="planning for 16 GPUs needs 16 JAX devices, 8 are there"):
        planner.plan(tiny_config(tiny_json), "h100", 16)

    # A budget too small for one sample: the message gives what one sample needs and what the GPU offers.
    fraction = 1e-4
    with pytest.raises(planner.BatchDoesNotFit) as error:
        planner.plan(tiny_config(tiny_json, batch_size=1), "rtx4090", 2, memory_fraction=fraction, devices=devices)
    message = str(error.value)
    usable = 24564 * 2**20 * fraction
    assert f"more than the {usable / 2**20:.1f} MiB usable on a rtx4090 (24.0 GiB x 0.0001)" in message
    needed = float(re.search(r"needs ([\d.]+) MiB per device at a per-device batch of 1", message).group(1))
    assert needed > usable / 2**20
    assert "fsdp=True" in message and "grad_checkpointing=True" in message


@pytest.mark.subprocess
@pytest.mark.slow
def test_command_line_plan_compiles_for_the_simulated_gpus(tmp_path, tiny_json):
    config_file = tmp_path / "tiny_run.py"
    config_file.write_text(
        "from clip_jax.run_config import default_config\n"
        "def get_config():\n"
        "    c = default_config()\n"
        f"    c.model = {tiny_json!r}\n"
        "    c.update(train_num_samples=10_000, epochs=3, workers=2, batch_size=4, precision='fp32',\n"
        "             grad_checkpointing=False)\n"
        "    return c\n")
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE}  # one CPU device
    command = [sys.executable, "-m", "clip_jax.plan", f"--config={config_file}", "--gpu=h100", "--gpus=2",
               "--compiler=cpu", "--price=2.5", "--nosearch_batch", "--json"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)

    assert "for 2 simulated devices" in result["memory_per_device"]["measured_by"]
    memory = result["memory_per_device"]
    assert memory["total_bytes"] == (memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
                                     + memory["temp_bytes"])
    assert memory["fits"] and memory["largest_batch"] is None
    run, speed = result["run"], result["throughput"]
    steps_per_epoch = math.ceil(math.ceil(10_000 / 8) / 2) * 2  # OpenCLIP's rounding to a multiple of workers
    assert run["steps"] == 3 * steps_per_epoch
    assert run["days"] == pytest.approx(run["steps"] * 8 / speed["samples_per_s"] / 86400)
    assert run["cost"] == pytest.approx(run["gpu_hours"] * 2.5)
    assert speed["samples_per_s_per_gpu"] == pytest.approx(
        speed["mfu"] * 494.5e12 / result["flops_per_sample"]["train_analytic"])
    # The JSON is every field of the typed plan under its own name: it reads back into the same plan.
    typed = planner.Plan.from_dict(result)
    assert json.loads(planner.plan_json(typed)) == result
    text = planner.format_plan(typed)
    assert "plan: tiny on 2 x h100" in text and "gradient accumulation not needed" in text
    # XLA's count of the planned step, every scanned block included; at this width the loss, norms and AdamW
    # (which only XLA counts) are a third of it: ViT-B-32's and ViT-L-14's are within 5% (above).
    flops = result["flops_per_sample"]
    assert flops["counted_at_batch"] == 4 and 1.0 <= flops["train_xla"] / flops["train_analytic"] < 1.5
    # An unknown GPU on the command line: test_xla_gpu.py's bad planner input (one line, exit status 2).
