"""Precision policies: which dtype the parameters keep and which dtype the matmuls run in."""

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import SGD
from xla_flags import FAST_CODEGEN, compiled_fast

from clip_jax.models import create_model, init_params, layers
from clip_jax.models.precision import (POLICIES, bf16_recommendation, cast_params, check_fp8, check_gpu_precision,
                                       get_policy)
from clip_jax.run_config import default_config
from clip_jax.runtime.hardware import GPUS, peak_flops
from clip_jax.runtime.mesh import create_mesh, make_global_batch
from clip_jax.training.config_checks import check_config
from clip_jax.training.loss_scale import LossScaleSpec
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
def compiled_steps(fp32_params, batch, policy_model):
    """Per policy: (the step, its lowering, the executable): one AdamW step at lr 1e-3 on every device (compiled
    with tests/xla_flags.py's `FAST_CODEGEN`: each runs a few times)."""
    mesh = create_mesh()
    results = {}
    for name in POLICIES:
        step = build_step(StepSpec(policy_model("fp32").config, name, optimizer=OptimizerSpec(lr=1e-3)), mesh)
        state = step.state_from_params(cast_params(fp32_params, get_policy(name)))
        lowered = step.update.lower(state, make_global_batch(batch, mesh))
        results[name] = (step, lowered, lowered.compile(compiler_options=FAST_CODEGEN))
    return results


def _run(compiled_steps, name, params, batch):
    """(state after one step of policy `name` from `params` on `batch`, its metrics as floats)."""
    step, _, executable = compiled_steps[name]
    state, metrics = executable(step.state_from_params(cast_params(params, get_policy(name))),
                                make_global_batch(batch, step.mesh))
    return state, {k: float(v) for k, v in metrics.items()}


@pytest.fixture(scope="module")
def steps(compiled_steps, fp32_params, batch):
    """Per policy: (stablehlo of the step, state after one AdamW step, metrics), from the same weights."""
    return {name: (compiled_steps[name][1].as_text(), *_run(compiled_steps, name, fp32_params, batch))
            for name in POLICIES}


def test_switching_policy_keeps_the_parameter_tree(policy_model):
    def abstract_params(name):
        model = policy_model(name)
        return jax.eval_shape(lambda rng: init_params(model, rng), jax.random.key(0))

    trees = {name: abstract_params(name) for name in POLICIES}
    structures = {name: jax.tree.structure(tree) for name, tree in trees.items()}
    assert structures["fp32"] == structures["bf16"] == structures["pure_bf16"] == structures["fp8"]
    assert {leaf.dtype for leaf in jax.tree.leaves(trees["bf16"])} == {jnp.dtype(jnp.float32)}
    assert {leaf.dtype for leaf in jax.tree.leaves(trees["pure_bf16"])} == {jnp.dtype(jnp.bfloat16)}
    # a checkpoint written under one policy loads under another by casting
    cast = jax.eval_shape(lambda t: cast_params(t, get_policy("pure_bf16")), trees["fp32"])
    assert jax.tree.map(lambda a: a.dtype, cast) == jax.tree.map(lambda a: a.dtype, trees["pure_bf16"])


@pytest.mark.slow
def test_fp32_policy_runs_every_matmul_in_fp32(steps):
    precisions = matmul_precisions(steps["fp32"][0])
    assert len(precisions) > 20
    assert {runs_in for runs_in, _ in precisions} == {"f32"}


@pytest.mark.slow
def test_bf16_policy_runs_tower_matmuls_in_bf16_and_only_the_loss_in_fp32(steps):
    fp32_count = len(matmul_precisions(steps["fp32"][0]))
    precisions = matmul_precisions(steps["bf16"][0])
    in_fp32 = [line for runs_in, line in precisions if runs_in == "f32"]
    in_bf16 = [line for runs_in, line in precisions if runs_in == "bf16"]
    # the loss: local x global logits both ways, forward (2) and backward (4), each touching a [2, 16] operand
    assert len(in_fp32) == 6
    assert all("2x16xf32" in line for line in in_fp32)
    assert len(in_bf16) == fp32_count - 6


@pytest.mark.slow
def test_bf16_policy_keeps_fp32_params_and_optimizer_state(steps):
    _, state, _ = steps["bf16"]
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    adam = state.opt_state[1][0]
    assert {leaf.dtype for leaf in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_pure_bf16_policy_keeps_bf16_params(steps):
    _, state, _ = steps["pure_bf16"]
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}


# The loss of one step from the same weights, relative to fp32's: measured 5.2e-4 (bf16) and 1.8e-3 (pure_bf16)
# here, at most 3.4e-3 over four seeds of the weights and batch; 1e-2 leaves 3x.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "pure_bf16"])
def test_bf16_loss_is_close_to_fp32(steps, name):
    fp32_metrics, metrics = steps["fp32"][2], steps[name][2]
    assert metrics["loss"] == pytest.approx(fp32_metrics["loss"], rel=1e-2)
    assert metrics["loss"] != fp32_metrics["loss"]  # it did compute in another precision


@pytest.fixture(scope="module")
def rounded_fp32_step(compiled_steps, fp32_params, batch):
    """(state, metrics) of the fp32 step from the weights and images rounded to bfloat16: the error that no
    bfloat16 step avoids."""
    to_bf16 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    return _run(compiled_steps, "fp32", jax.tree.map(to_bf16, fp32_params),
                {**batch, "images": to_bf16(batch["images"])})


def _gradients_by_tower(state) -> dict[str, dict[str, np.ndarray]]:
    """Adam's first moment after its first step, (1 - b1) times the gradient, leaf by leaf in float64: for the
    image tower (`visual`) and for the rest (the text tower and the logit scale)."""
    towers = {"visual": {}, "text": {}}
    for path, mu in jax.tree_util.tree_flatten_with_path(state.opt_state[1][0].mu)[0]:
        tower = "visual" if path[0].key == "visual" else "text"
        towers[tower][jax.tree_util.keystr(path)] = np.asarray(mu, np.float64)
    return towers


def _distance(a: dict, b: dict) -> float:
    return float(np.sqrt(sum(np.sum((a[k] - b[k]) ** 2) for k in a)))


# The gradient of a bf16 step against fp32's, tower by tower (Frobenius norm of the difference over all its leaves),
# as a multiple of the difference the fp32 step makes from bf16-rounded weights and images. Measured over four seeds
# of the weights and batch (seed 0 is the one here): bf16 is 1.4-4.0% off fp32, pure_bf16 1.5-4.1%, the rounded
# fp32 step 0.8-2.2%; the ratio 1.13-2.03 (1.63-1.76 here), so 3 leaves 1.5x. Each leaf's gradient is at most 7.8%
# off its own norm (4.3% here: an MLP bias of the text tower), so 20% leaves 2.6x. Bugs the loss check above cannot
# see fail it: the attention logits 5% too large in bfloat16 (towers 5.8x the rounding; loss still 0.7% off fp32),
# the LayerNorm scales' gradient dropped in bfloat16 (the image tower 7.8x, the leaves 100% off; the loss
# unchanged). LayerNorm statistics or the features' L2 norm taken in bfloat16 stay within the rounding here (at
# most 1.9x): at these widths they cost what rounding the activations does.
GRADIENT_ERROR = 3.0
LEAF_GRADIENT_ERROR = 0.2
# The lean bf16 step (LayerNorm and GELU through their 16-bit path, gradients summed in float32) against the plain
# one (autodiff's, summed in bf16), each tower's gradient distance from fp32's: lean / plain measured 0.68-0.89 over
# four seeds for the image tower, 0.69-1.13 for the text tower (0.68 and 0.69 at seed 0, here); RESULTS section 19.
LEAN_GRADIENT_ERROR = 1.25


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "pure_bf16"])
def test_bf16_gradients_are_within_a_few_times_the_rounding_of_the_inputs_of_fp32s(steps, rounded_fp32_step, name):
    expected = _gradients_by_tower(steps["fp32"][1])
    got, rounded = _gradients_by_tower(steps[name][1]), _gradients_by_tower(rounded_fp32_step[0])
    for tower in expected:
        error, rounding = _distance(got[tower], expected[tower]), _distance(rounded[tower], expected[tower])
        assert 0 < error <= GRADIENT_ERROR * rounding, (tower, error, rounding)
        for leaf, grad in expected[tower].items():
            leaf_error = np.linalg.norm(got[tower][leaf] - grad)
            assert leaf_error <= LEAF_GRADIENT_ERROR * np.linalg.norm(grad), (leaf, leaf_error, np.linalg.norm(grad))


# fp8 on the CPU (XLA emulates the FP8 products): the loss of one step 1.5-4.3% off fp32's over two seeds (4.3% at
# seed 0, here), each tower's gradient 21-34% (bf16: 1.3-2.3%): e5m2 keeps 2 mantissa bits of each output gradient.
# Whether that trains as bf16 does is for the instability lab and the demo (benchmarks/RESULTS.md section 19).
@pytest.mark.slow
def test_fp8_runs_emulated_on_the_cpu_from_bf16s_state(steps):
    _, state, metrics = steps["fp8"]
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert metrics["loss"] == pytest.approx(steps["fp32"][2]["loss"], rel=0.1)
    assert metrics["loss"] != steps["bf16"][2]["loss"]
    expected, got = _gradients_by_tower(steps["fp32"][1]), _gradients_by_tower(state)
    for tower in expected:
        norm = np.sqrt(sum(np.sum(g**2) for g in expected[tower].values()))
        assert _distance(got[tower], expected[tower]) <= 0.5 * norm, tower


def test_fp8_is_refused_on_a_gpu_without_fp8_matmuls():
    with pytest.raises(ValueError, match=r"precision='fp8' needs FP8 matmuls .*a100-40gb.*--config.precision=bf16"):
        check_fp8("fp8", GPUS["a100-40gb"])
    for ok in ("h100", "h200"):
        check_fp8("fp8", GPUS[ok])
    check_fp8("fp8", None)  # a CPU: emulated
    check_fp8("bf16", GPUS["a100-40gb"])


def test_fp16_is_for_gpus_without_bfloat16_and_runs_elsewhere_with_a_recommendation():
    with pytest.raises(ValueError, match=r"precision='bf16' needs bfloat16 matmuls .*a t4 .*--config.precision=fp16"):
        check_gpu_precision("bf16", GPUS["t4"])
    check_gpu_precision("fp16", GPUS["t4"])
    assert bf16_recommendation("fp16", GPUS["t4"]) is bf16_recommendation("fp16", None) is None
    assert bf16_recommendation("bf16", GPUS["h100"]) is None
    assert "--config.precision=bf16 is recommended" in bf16_recommendation("fp16", GPUS["h100"])
    # MFU under fp16 counts against the float16 tensor-core peak (a V100's 125 TFLOP/s, an H100's bf16 one)
    assert peak_flops("Tesla V100-SXM2-32GB", "fp16") == 125e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp16") == peak_flops("NVIDIA H100 80GB HBM3", "bf16")


def test_unknown_policy_is_named_in_the_error():
    with pytest.raises(ValueError, match="unknown precision policy 'fp12'.*bf16"):
        get_policy("fp12")
    with pytest.raises(ValueError, match="unknown precision policy 'amp'.*fp16.*did you mean 'fp16'"):
        get_policy("amp")  # OpenCLIP's name


def test_fp16_keeps_the_residual_stream_in_float32_unless_told_and_refuses_16_bit_gradient_sums(tiny_model_config):
    def residual(name, **fields):
        return StepSpec.for_model(tiny_model_config, name, **fields).create_model().residual_dtype
    assert residual("fp16") == jnp.float32  # "auto": float16 overflows above 65504 where no loss scale helps
    assert residual("bf16") is residual("fp32") is residual("fp16", residual_dtype="compute") is None
    assert residual("bf16", residual_dtype="float32") == jnp.float32
    c = default_config()
    c.train_data, c.precision, c.grad_reduce_dtype = "/data/{0..1}.tar", "fp16", "bfloat16"
    with pytest.raises(ValueError, match=r"^bad config: grad_reduce_dtype='bfloat16' under a loss-scaled policy .*"
                                         r"keep grad_reduce_dtype='float32'$"):
        check_config(c, num_devices=8)
    c.precision = "bf16"
    check_config(c, num_devices=8)


@pytest.fixture(scope="module")
def plain_bf16_step(fp32_params, batch, policy_model):
    """(state, metrics) of the bf16 step with autodiff's LayerNorm and GELU (their 16-bit path off) and its
    gradients summed in bf16: the step as it was before either."""
    spec = StepSpec(policy_model("fp32").config, "bf16", optimizer=OptimizerSpec(lr=1e-3),
                    grad_reduce_dtype="bfloat16")
    with mock.patch.object(layers, "is_16_bit", lambda dtype: False):
        step = build_step(spec, create_mesh())
        executable = compiled_fast(step.update, step.state_from_params(fp32_params),
                                   make_global_batch(batch, step.mesh))
    return _run({"bf16": (step, None, executable)}, "bf16", fp32_params, batch)


@pytest.mark.slow
def test_lean_bf16_step_is_no_further_from_fp32_than_the_plain_one(steps, plain_bf16_step):
    expected = _gradients_by_tower(steps["fp32"][1])
    lean, plain = _gradients_by_tower(steps["bf16"][1]), _gradients_by_tower(plain_bf16_step[0])
    for tower in expected:
        lean_error, plain_error = _distance(lean[tower], expected[tower]), _distance(plain[tower], expected[tower])
        assert lean_error <= LEAN_GRADIENT_ERROR * plain_error, (tower, lean_error, plain_error)


TRAJECTORY_STEPS = 6


def losses_along(spec: StepSpec, params, batches) -> list[float]:
    """The loss of each of `spec`'s steps from `params` over `batches`, on 8 devices; none may overflow."""
    step = build_step(spec, create_mesh())
    state, losses = step.state_from_params(cast_params(params, get_policy(spec.precision))), []
    batches = [make_global_batch(batch, step.mesh) for batch in batches]
    update = compiled_fast(step.update, state, batches[0])
    for batch in batches:
        state, metrics = update(state, batch)
        losses.append(float(metrics["loss"]))
        assert not metrics.get("overflow", False), f"{spec.precision}: step {len(losses)} overflowed"
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_fp16_losses_are_no_further_from_fp32s_than_bf16s_at_every_step(policy_model, fp32_params, accum_steps):
    rng = np.random.default_rng(1)
    batches = [{"images": rng.normal(size=(GLOBAL_BATCH, 32, 32, 3)).astype(np.float32),
                "tokens": rng.integers(1, 1000, size=(GLOBAL_BATCH, 16)).astype(np.int32)}
               for _ in range(TRAJECTORY_STEPS)]
    # plain SGD: each update is the gradient itself, so its rounding reaches the next loss in proportion (Adam's
    # first steps are about sign(gradient): a tiny gradient's rounding flips a whole step). The loss scale starts
    # where this model's gradients do not overflow (65536 does: its first steps would be skipped, as GradScaler's
    # are, and tests/test_loss_scale.py pins that down), so every step compares float16's numerics with bfloat16's.
    losses = {name: losses_along(StepSpec(policy_model("fp32").config, name, fsdp=True, accum_steps=accum_steps,
                                          optimizer=SGD, loss_scale=LossScaleSpec(init=1024.0)), fp32_params, batches)
              for name in ("fp32", "bf16", "fp16")}
    fp16_off = np.abs(np.subtract(losses["fp16"], losses["fp32"]))
    bf16_off = np.abs(np.subtract(losses["bf16"], losses["fp32"]))
    assert np.all(fp16_off <= bf16_off), (losses, fp16_off, bf16_off)
    assert len(set(losses["fp32"])) == TRAJECTORY_STEPS  # the runs train: every step's loss differs
