"""Precision policies: which dtype the parameters keep and which dtype the matmuls run in."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clip_jax.models import create_model, init_params
from clip_jax.models.precision import POLICIES, cast_params, get_policy
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.step_factory import OptimizerSpec, StepSpec, build_step

GLOBAL_BATCH = 16  # 2 rows per device: the loss's logits are [2, 16]


@pytest.fixture(scope="module")
def policy_model(tiny_model_config):
    """`policy_model(name)`: the tiny model computing and keeping its parameters as the policy says."""

    def build(name):
        policy = get_policy(name)
        return create_model(tiny_model_config, dtype=policy.compute_dtype, param_dtype=policy.param_dtype)

    return build


def matmul_precisions(stablehlo: str) -> list[tuple[str, str]]:
    """(input dtype the matmul runs in, the line) for every dot_general and convolution."""
    found = []
    for line in stablehlo.splitlines():
        if "stablehlo.dot_general" not in line and "stablehlo.convolution" not in line:
            continue
        operands = line.rsplit(" : (", 1)[1].split(") ->")[0]  # "tensor<2x32xbf16>, tensor<32x96xbf16>"
        dtypes = {tensor.split("x")[-1] for tensor in re.findall(r"tensor<([^>]*)>", operands)}
        runs_in = (
            "bf16" if dtypes == {"bf16"} or "lhs_precision_type = bf16" in line else "/".join(sorted(dtypes))
        )
        found.append((runs_in, line))
    return found


@pytest.fixture(scope="module")
def fp32_params(policy_model):
    return jax.tree.map(np.asarray, init_params(policy_model("fp32"), jax.random.key(0)))


@pytest.fixture(scope="module")
def batch(random_batch):
    return random_batch(GLOBAL_BATCH)


@pytest.fixture(scope="module")
def steps(fp32_params, batch, policy_model):
    """Per policy: (stablehlo of the step, state after one AdamW step, metrics), from the same weights."""
    mesh = create_mesh()
    results = {}
    for name in POLICIES:
        step = build_step(StepSpec(policy_model("fp32").config, name, optimizer=OptimizerSpec(lr=1e-3)), mesh)
        state = step.state_from_params(cast_params(fp32_params, get_policy(name)))
        global_batch = make_global_batch(batch, mesh)
        lowered = step.update.lower(state, global_batch)
        state, metrics = lowered.compile()(state, global_batch)
        stablehlo = lowered.as_text()
        results[name] = (stablehlo, state, {k: float(v) for k, v in metrics.items()})
    return results


def test_switching_policy_keeps_the_parameter_tree(policy_model):
    def abstract_params(name):
        model = policy_model(name)
        return jax.eval_shape(lambda rng: init_params(model, rng), jax.random.key(0))

    trees = {name: abstract_params(name) for name in POLICIES}
    structures = {name: jax.tree.structure(tree) for name, tree in trees.items()}
    assert structures["fp32"] == structures["bf16"] == structures["pure_bf16"]
    assert {leaf.dtype for leaf in jax.tree.leaves(trees["bf16"])} == {jnp.dtype(jnp.float32)}
    assert {leaf.dtype for leaf in jax.tree.leaves(trees["pure_bf16"])} == {jnp.dtype(jnp.bfloat16)}
    # a checkpoint written under one policy loads under another by casting
    cast = jax.eval_shape(lambda t: cast_params(t, get_policy("pure_bf16")), trees["fp32"])
    assert jax.tree.map(lambda a: a.dtype, cast) == jax.tree.map(lambda a: a.dtype, trees["pure_bf16"])


def test_fp32_policy_runs_every_matmul_in_fp32(steps):
    precisions = matmul_precisions(steps["fp32"][0])
    assert len(precisions) > 20
    assert {runs_in for runs_in, _ in precisions} == {"f32"}


def test_bf16_policy_runs_tower_matmuls_in_bf16_and_only_the_loss_in_fp32(steps):
    fp32_count = len(matmul_precisions(steps["fp32"][0]))
    precisions = matmul_precisions(steps["bf16"][0])
    in_fp32 = [line for runs_in, line in precisions if runs_in == "f32"]
    in_bf16 = [line for runs_in, line in precisions if runs_in == "bf16"]
    # the loss: local x global logits both ways, forward (2) and backward (4), each touching a [2, 16] operand
    assert len(in_fp32) == 6
    assert all("2x16xf32" in line for line in in_fp32)
    assert len(in_bf16) == fp32_count - 6


def test_bf16_policy_keeps_fp32_params_and_optimizer_state(steps):
    _, state, _ = steps["bf16"]
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    adam = state.opt_state[1][0]
    assert {leaf.dtype for leaf in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.float32)}


def test_pure_bf16_policy_keeps_bf16_params(steps):
    _, state, _ = steps["pure_bf16"]
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("name, tolerance", [("bf16", 0.01), ("pure_bf16", 0.02)])
def test_bf16_loss_is_close_to_fp32(steps, name, tolerance):
    fp32_metrics, metrics = steps["fp32"][2], steps[name][2]
    assert metrics["loss"] == pytest.approx(fp32_metrics["loss"], rel=tolerance)
    assert metrics["loss"] != fp32_metrics["loss"]  # it did compute in another precision


def test_unknown_policy_is_named_in_the_error():
    with pytest.raises(ValueError, match="unknown precision policy 'fp16'.*bf16"):
        get_policy("fp16")
