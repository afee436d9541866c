"""setup.py: what a source distribution carries and which build settings it refuses (no compiler runs here)."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT_FILES = ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md")
PROJECT_FOLDERS = ("csrc", "ep_comm", "docs")


def _copy_project(destination: Path) -> Path:
    """The files setup.py reads, copied (so that its build and egg-info folders land outside this checkout)."""
    destination.mkdir()
    for name in PROJECT_FILES:
        shutil.copy2(ROOT / name, destination / name)
    for name in PROJECT_FOLDERS:
        shutil.copytree(ROOT / name, destination / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "_C_build_error.txt"))
    return destination


@pytest.mark.cpu
def test_sdist_carries_the_cuda_sources(tmp_path):
    """setup.py compiles csrc/ itself (its Extension lists no sources): an sdist without them built wheels whose
    ep_comm._C linked no object at all and failed at import."""
    project = _copy_project(tmp_path / "project")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path / "dist")], cwd=project,
                   check=True, capture_output=True)
    (archive,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {Path(name).relative_to(Path(name).parts[0]).as_posix() for name in tar.getnames()
                 if len(Path(name).parts) > 1}
    wanted = {f"csrc/{p.name}" for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp")}
    assert wanted and wanted <= names, sorted(wanted - names)


@pytest.mark.cpu
@pytest.mark.parametrize("variable,value,message", [
    ("EP_COMM_CUDA_ARCHS", "90", "use 90a for Hopper"),
    ("EP_COMM_CUDA_ARCHS", "sm_90a", "not an architecture number"),
    ("EP_COMM_CUDA_ARCHS", ";", "names no architecture"),
    ("EP_COMM_NVCC_THREADS", "abc", "EP_COMM_NVCC_THREADS must be a positive integer"),
])
def test_malformed_build_settings_fail_in_auto_mode(tmp_path, variable, value, message):
    """A setting the user got wrong raises even with EP_COMM_BUILD_CUDA=auto, instead of quietly installing the
    pure-Python package (it used to leave only a _C_build_error.txt behind)."""
    project = _copy_project(tmp_path / "project")
    env = dict(os.environ, EP_COMM_BUILD_CUDA="auto", **{variable: value})
    run = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-temp", str(tmp_path / "tmp")], cwd=project,
                         env=env, capture_output=True, text=True)
    assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
