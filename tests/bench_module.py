"""Loads a script of bench/ as a module, for the CPU tests of its pure parts (bench/ is no package)."""
import importlib.util
import os

_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")


def load(name: str):
    """bench/<name>.py as a fresh module object."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(_BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
