"""XLA flags of the test session and the processes its tests start: simulated CPU devices, and LLVM's cheapest code
generation (`--xla_backend_optimization_level=0`). The suite's programs are small and run a few times each, so
compiling them is most of their time: on three step-heavy modules the cheaper code generation took 21% off the wall
time and 32% off the CPU time. It changes how fast the compiled code runs and, at most, float32 rounding (the tests
compare with numpy within tolerances, or two of our own runs under the same flags), not the HLO that memory and FLOP
analyses read. Benchmarks and users' runs keep XLA's defaults."""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"

