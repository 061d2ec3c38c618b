"""The benchmarks' scripts loaded as modules (benchmarks/ is no package), for the tests that read their specs and
their fits without running them."""

import importlib.util
import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    """benchmarks/NAME.py as a module, its top level run once per call."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
