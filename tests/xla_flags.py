"""XLA flags of the test session and the processes its tests start: simulated CPU devices, and LLVM's cheapest code
generation (`--xla_backend_optimization_level=0`). The suite's programs are small and run a few times each, so
compiling them is most of their time: on three step-heavy modules the cheaper code generation took 21% off the wall
time and 32% off the CPU time. It changes how fast the compiled code runs and, at most, float32 rounding (the tests
compare with numpy within tolerances, or two of our own runs under the same flags), not the HLO that memory and FLOP
analyses read. Benchmarks and users' runs keep XLA's defaults.

`FAST_CODEGEN`, per compile, for a program a test compiles to run once or a few times: XLA:CPU's loop emitters in
place of its MLIR fusion emitters, for the same optimised HLO. They compile the tiny models' train steps 3-4x faster
(the SigLIP step of tests/test_siglip_towers.py: 2.4-3.3 s of CPU time instead of 6.5-10.5 per precision policy;
the losses the same to float32 rounding) but make slower code (the trainer tests' step, 49,408 embedding rows
updated on every device, runs 35% longer), so the trainer's runs, a compile and dozens of steps, keep the default."""

FAST_COMPILE = "--xla_backend_optimization_level=0"
FAST_CODEGEN = {"xla_cpu_use_fusion_emitters": False}


def xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


def compiled_fast(jitted, *args):
    """`jitted` (a `jax.jit` function, e.g. a `Step`'s update) compiled for `args` with `FAST_CODEGEN`: the
    executable takes the same arguments (and donates what `jitted` donates)."""
    return jitted.lower(*args).compile(compiler_options=FAST_CODEGEN)


def run_once(jitted, *args):
    """`jitted(*args)` for a program a test runs once, compiled with `FAST_CODEGEN`."""
    return compiled_fast(jitted, *args)(*args)
