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
    shutil.copytree(ROOT / "tests", project / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path / "dist")], cwd=project,
                   check=True, capture_output=True)
    (archive,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {Path(name).relative_to(Path(name).parts[0]).as_posix() for name in tar.getnames()
                 if len(Path(name).parts) > 1}
    wanted = {f"csrc/{p.name}" for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp")}
    assert wanted and wanted <= names, sorted(wanted - names)
    # and no tests: they run from a checkout (setuptools' default list put tests/test_*.py alone in, without their
    # helpers: 17 collection errors)
    assert not [name for name in names if name.startswith("tests/")], sorted(names)


@pytest.mark.cpu
def test_builds_outside_the_source_tree_leave_its_module_alone(tmp_path):
    """A build that is not in-place (a wheel, `pip install .`) and makes no ep_comm._C (here EP_COMM_BUILD_CUDA=0)
    leaves the checkout's ep_comm/ as it was: it used to delete the _C of an editable install in the same checkout.
    An in-place build (editable installs build so) still removes that stale module and says why there is none."""
    project = _copy_project(tmp_path / "project")
    module = project / "ep_comm" / "_C.cpython-0-fake.so"
    module.write_bytes(b"an editable install's module")
    env = dict(os.environ, EP_COMM_BUILD_CUDA="0")
    build = [sys.executable, "setup.py", "build_ext", "--build-temp", str(tmp_path / "tmp")]
    run = subprocess.run(build + ["--build-lib", str(tmp_path / "lib")], cwd=project, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert module.exists() and not (project / "ep_comm" / "_C_build_error.txt").exists()
    assert "EP_COMM_BUILD_CUDA=0" in (tmp_path / "lib" / "ep_comm" / "_C_build_error.txt").read_text()
    run = subprocess.run(build + ["--inplace"], cwd=project, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not module.exists()
    assert "EP_COMM_BUILD_CUDA=0" in (project / "ep_comm" / "_C_build_error.txt").read_text()


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
