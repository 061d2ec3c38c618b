"""`python -m clip_jax.plan`: flags in, the report (or its JSON) out; bad input gets one line and exit status 2."""

import sys

import jax

from clip_jax import cli
from clip_jax.errors import InvalidInput
from clip_jax.models import get_model_config
from clip_jax.models.naflex import patch_budget
from clip_jax.plan.cost import PIPELINE_SAMPLES_PER_CORE_S
from clip_jax.plan.planner import DEFAULT_MEMORY_FRACTION, MAX_SIMULATED_DEVICES, plan
from clip_jax.plan.report import format_plan, plan_json
from clip_jax.run_config import default_config
from clip_jax.runtime import entry, xla_gpu
from clip_jax.runtime.hardware import GPUS


def choose_compiler(asked: str) -> str:
    """"gpu" or "cpu" for --compiler=auto|gpu|cpu: auto takes XLA:GPU when jaxlib's CUDA plugin is installed."""
    if asked == "auto":
        return "gpu" if xla_gpu.cuda_plugin_installed() else "cpu"
    if asked == "gpu" and not xla_gpu.cuda_plugin_installed():
        raise xla_gpu.CudaPluginMissing(
            f"--compiler=gpu needs jaxlib's CUDA plugin, which is not installed: {xla_gpu.INSTALL_HINT}")
    if asked not in ("gpu", "cpu"):
        raise InvalidInput(f"--compiler={asked}: choose auto, gpu or cpu")
    return asked


@entry.command(stopped="before the plan was made", run_failed=entry.USAGE_ERROR)  # it runs nothing: bad input
def main(argv) -> None:
    from absl import flags

    FLAGS = flags.FLAGS
    if len(argv) > 1:
        raise InvalidInput(f"unexpected arguments {argv[1:]}")
    if FLAGS.gpu not in GPUS:
        raise InvalidInput(f"unknown GPU {FLAGS.gpu!r}; known: {', '.join(GPUS)}")
    if not 1 <= FLAGS.gpus <= MAX_SIMULATED_DEVICES:
        raise InvalidInput(f"--gpus={FLAGS.gpus}: give 1 to {MAX_SIMULATED_DEVICES}")
    model = get_model_config(FLAGS.config.model)
    patch_budget(model.vision, FLAGS.max_num_patches, model.name)  # needed by a NaFlex tower, refused by any other
    compiler = choose_compiler(FLAGS.compiler)
    if compiler == "gpu":
        xla_gpu.parse_topology(FLAGS.topology, FLAGS.gpus)  # before anything compiles
    elif FLAGS.topology is not None:
        raise InvalidInput("--topology needs the XLA:GPU compiler (--compiler=gpu, with '.[gpu]' installed)")
    jax.config.update("jax_platforms", "cpu")  # XLA:GPU's compile-only devices need no CUDA backend
    jax.config.update("jax_num_cpu_devices", FLAGS.gpus if compiler == "cpu" else 1)
    say = lambda message: print(message, file=sys.stderr, flush=True)
    say(f"memory from XLA:{compiler.upper()}" + (" (jaxlib's CUDA plugin is not installed)"
                                                   if compiler == "cpu" and FLAGS.compiler == "auto" else ""))
    result = plan(FLAGS.config, FLAGS.gpu, FLAGS.gpus, price=FLAGS.price, mfu=FLAGS.mfu,
                  memory_fraction=FLAGS.memory_fraction, pipeline_rate=FLAGS.pipeline_rate, compiler=compiler,
                  topology=FLAGS.topology, search_batch=FLAGS.search_batch, xla_flops=FLAGS.xla_flops,
                  max_num_patches=FLAGS.max_num_patches, progress=say)
    print(plan_json(result) if FLAGS.json else format_plan(result))


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "training config file (configs/*.py)", lock_config=True)
    cli.expect_fields(default_config)
    flags.DEFINE_string("gpu", "a100-40gb", f"GPU kind: {', '.join(GPUS)}")
    flags.DEFINE_integer("gpus", 1, "number of GPUs (one training process each)")
    flags.DEFINE_enum("compiler", "auto", ["auto", "gpu", "cpu"],
                      "who compiles the step: XLA:GPU without a GPU (needs '.[gpu]'), XLA:CPU, or auto (XLA:GPU "
                      "when installed)")
    flags.DEFINE_string("topology", None, "NODESxGPUS_PER_NODE for XLA:GPU, e.g. 96x4 (default: nodes of 8 GPUs)")
    flags.DEFINE_integer("max_num_patches", None, "a NaFlex image tower's patch budget per image, padding included "
                         "(required for a NaFlex model, e.g. 256; refused for any other)")
    flags.DEFINE_float("price", None, "price per GPU-hour, for the cost")
    flags.DEFINE_float("mfu", None, "model FLOPs utilisation to assume (default: measured, else the reference run's)")
    flags.DEFINE_float("memory_fraction", DEFAULT_MEMORY_FRACTION,
                       "fraction of GPU memory JAX may use (XLA_PYTHON_CLIENT_MEM_FRACTION, as launch/env.sh sets it)")
    flags.DEFINE_float("pipeline_rate", PIPELINE_SAMPLES_PER_CORE_S, "input pipeline samples per CPU core-second")
    flags.DEFINE_bool("search_batch", True, "find the largest per-device batch that fits (a few compiles)")
    flags.DEFINE_bool("xla_flops", True, "also count FLOPs on XLA:CPU compiles of the step and its blocks, a check "
                      "of the analytic count (--noxla_flops skips those compiles)")
    flags.DEFINE_bool("json", False, "print the plan as JSON")
    flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
    xla_gpu.prepare()  # before JAX loads its plugins
    _define_flags()
    cli.run(main)
