"""Build and install ep_comm.

The C++/CUDA core `ep_comm._C` is a torch-free pybind11 module compiled with nvcc directly (no
torch.utils.cpp_extension: a CPU-only torch wheel cannot build CUDA extensions, and keeping torch headers
out keeps builds fast and independent of one torch ABI).

Environment:
  EP_COMM_BUILD_CUDA   auto (default): build `_C` when nvcc is found, else install pure Python;
                       0: never build; 1: build or fail loudly. A malformed EP_COMM_CUDA_ARCHS or
                       EP_COMM_NVCC_THREADS raises (auto and 1).
  EP_COMM_CUDA_ARCHS   semicolon list of targets, default "90a" (H100/H200). "90a;100a" also compiles the
                       Blackwell-native paths (sm_100a), which CI does as a compile check.
  EP_COMM_NVCC_THREADS parallel compile jobs (default: number of CPUs).
  CUDA_HOME            CUDA install (default: the directory above `nvcc` on PATH, or /usr/local/cuda).
"""
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _is_cuda_toolkit(home: Path) -> bool:
    return (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime.h").exists()


def find_cuda_home():
    """(toolkit, why not): CUDA_HOME if set -- and then only it: a CUDA_HOME without the toolkit is reported, not
    silently replaced by another CUDA --; else the toolkit of the `nvcc` on PATH, or /usr/local/cuda. A candidate counts
    only with both bin/nvcc and include/cuda_runtime.h (an `nvcc` on PATH may be a wrapper script outside the
    toolkit)."""
    if os.environ.get("CUDA_HOME"):
        home = Path(os.environ["CUDA_HOME"])
        if _is_cuda_toolkit(home):
            return home, ""
        return None, f"CUDA_HOME={home} has no bin/nvcc and include/cuda_runtime.h (fix or unset it)"
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for home in candidates:
        if _is_cuda_toolkit(home):
            return home, ""
    return None, ("no CUDA toolkit found (looked at the nvcc on PATH and /usr/local/cuda; set CUDA_HOME to the "
                  "toolkit)")


def gencode_flags(archs):
    # The -gencode form: `-arch=sm_90a` would also run a plain sm_90 pass that rejects wgmma.
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in archs]


def build_options() -> dict:
    """EP_COMM_CUDA_ARCHS and EP_COMM_NVCC_THREADS, checked (ValueError naming the variable)."""
    archs = [a.strip() for a in os.environ.get("EP_COMM_CUDA_ARCHS", "90a").replace(",", ";").split(";") if a.strip()]
    if not archs:
        raise ValueError("EP_COMM_CUDA_ARCHS names no architecture (e.g. 90a, or 90a;100a)")
    if "90" in archs:
        # Hopper's wgmma (the NVFP4 grouped GEMM) exists only in the arch-specific target: a plain sm_90 build
        # would compile that kernel to a trap.
        raise ValueError("EP_COMM_CUDA_ARCHS: use 90a for Hopper (plain 90 has no wgmma)")
    for arch in archs:
        if not (arch[:-1] if arch.endswith(("a", "f")) else arch).isdigit():
            raise ValueError(f"EP_COMM_CUDA_ARCHS: {arch!r} is not an architecture number like 90a or 100a")
    threads = os.environ.get("EP_COMM_NVCC_THREADS", str(os.cpu_count() or 1))
    if not threads.strip().isdigit() or int(threads) < 1:
        raise ValueError(f"EP_COMM_NVCC_THREADS must be a positive integer, got {threads!r}")
    return {"archs": archs, "threads": int(threads)}


class CudaBuild(build_ext):
    """Compiles csrc/*.cu with nvcc and csrc/*.cpp with the host compiler, links one shared module."""

    _into_source_tree = False  # set by run()

    def run(self):
        # Whether the module goes into the source tree (build_ext --inplace, editable installs): only those builds may
        # touch the checkout's ep_comm/ (a stale _C there, the build-error note). A wheel or `pip install .` built in a
        # checkout with an editable install must leave that install's _C alone. (Read here: setuptools clears
        # self.inplace while it builds the extensions and copies them into the source tree afterwards.)
        self._into_source_tree = bool(self.inplace)
        super().run()

    def build_extension(self, ext):
        mode = os.environ.get("EP_COMM_BUILD_CUDA", "auto").lower()
        if mode not in ("auto", "0", "1"):
            raise RuntimeError(f"EP_COMM_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
        if mode == "0":
            print("ep_comm: EP_COMM_BUILD_CUDA=0; installing the pure-Python package without ep_comm._C")
            self._record_failure(ext, "not built: EP_COMM_BUILD_CUDA=0 at install time")
            return
        # Settings are read before anything is built: a malformed one (EP_COMM_CUDA_ARCHS=90, EP_COMM_NVCC_THREADS=abc)
        # is the user's mistake and raises in every mode, rather than installing the pure-Python package in auto.
        options = build_options()
        cuda_home, why_not = find_cuda_home()
        if cuda_home is None:
            if mode == "1":
                raise RuntimeError(f"EP_COMM_BUILD_CUDA=1 but {why_not}")
            print(f"ep_comm: {why_not}; installing the pure-Python package without ep_comm._C", file=sys.stderr)
            self._record_failure(ext, f"not built at install time: {why_not}")
            return
        nvcc = cuda_home / "bin" / "nvcc"
        try:
            self._build(ext, cuda_home, nvcc, options)
            for path in self._error_files(ext):
                path.unlink(missing_ok=True)
        except Exception as error:
            if mode == "1":
                raise
            self._record_failure(ext, f"building ep_comm._C failed: {type(error).__name__}: {error}")
            print(f"ep_comm: building ep_comm._C FAILED ({error}); installing the pure-Python package "
                  "(EP_COMM_BUILD_CUDA=auto). `import ep_comm` reports why the CUDA path is unavailable; "
                  "EP_COMM_BUILD_CUDA=1 makes this an error.", file=sys.stderr)

    def _error_files(self, ext):
        # Next to the package: in the build tree (wheels), and in the source tree for builds that put the module there
        # (in-place and editable).
        files = [Path(self.get_ext_fullpath(ext.name)).parent / "_C_build_error.txt"]
        if self._into_source_tree:
            files.append(ROOT / "ep_comm" / "_C_build_error.txt")
        return files

    def _record_failure(self, ext, reason: str) -> None:
        """Leave the reason where `import ep_comm` finds it, and remove stale modules (in the source tree only for the
        builds that put the module there), so an old build is never imported in place of the one that was not made."""
        Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
        if self._into_source_tree:
            for stale in (ROOT / "ep_comm").glob("_C.*"):
                stale.unlink()
        for path in self._error_files(ext):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(reason + "\n")

    def copy_extensions_to_source(self):
        # In-place builds copy the module into the source tree; skip it when the build failed (auto mode).
        built = [e for e in self.extensions
                 if (Path(self.build_lib) / self.get_ext_filename(self.get_ext_fullname(e.name))).exists()]
        self.extensions, everything = built, self.extensions
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = everything

    def _build(self, ext, cuda_home, nvcc, options):
        import pybind11

        cu_sources = sorted((ROOT / "csrc").glob("*.cu"))
        cpp_sources = sorted((ROOT / "csrc").glob("*.cpp"))
        if not cu_sources or not cpp_sources:  # else an empty module links and imports as a broken ep_comm._C
            raise RuntimeError(f"no CUDA/C++ sources in {ROOT / 'csrc'} (an sdist made without MANIFEST.in?)")
        includes = [f"-I{ROOT / 'csrc'}", f"-I{cuda_home / 'include'}", f"-I{pybind11.get_include()}",
                    f"-I{sysconfig.get_paths()['include']}"]
        cxx = os.environ.get("CXX", "c++")
        # No --use_fast_math and no FMA contraction: the format kernels must be bit-identical to the
        # reference (docs/NUMERICS.md); kernels that want FMAs write them explicitly.
        cu_flags = ["-O3", "-std=c++17", "--fmad=false", "-Xcompiler", "-fPIC", "-lineinfo",
                    "--expt-relaxed-constexpr", *gencode_flags(options["archs"]), *includes]
        # -ffp-contract=off: GCC's C++ default contracts a*b+c into an FMA on targets that have one (aarch64; x86-64
        # with -march flags a wrapper may add), which would change the host emulation's bits (formats_host.cpp).
        cpp_flags = ["-O2", "-std=c++17", "-ffp-contract=off", "-fPIC", "-fvisibility=hidden", *includes]
        # Objects are reused only when everything that shapes them is the same: the compilers (path and version),
        # their flags (arch list, includes: pybind11 and Python) -- a new toolkit or CXX gets its own folder.
        versions = [subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
                    for tool in (str(nvcc), cxx)]
        # (pybind11 by its version: its include path is a fresh temporary folder in every isolated pip build)
        stable_flags = [flag for flag in cu_flags + cpp_flags if flag != f"-I{pybind11.get_include()}"]
        key = repr([str(nvcc), cxx, versions, stable_flags, pybind11.__version__])
        build_dir = Path(self.build_temp) / ("ep_comm_C_" + hashlib.sha1(key.encode()).hexdigest()[:10])
        build_dir.mkdir(parents=True, exist_ok=True)
        jobs = []
        for src in cu_sources:
            obj = build_dir / (src.stem + ".cu.o")
            jobs.append((src, obj, [str(nvcc), "-c", str(src), "-o", str(obj), *cu_flags]))
        for src in cpp_sources:
            obj = build_dir / (src.stem + ".cpp.o")
            jobs.append((src, obj, [cxx, "-c", str(src), "-o", str(obj), *cpp_flags]))

        def run(job):
            src, obj, cmd = job
            if obj.exists() and obj.stat().st_mtime > max(
                    [src.stat().st_mtime] + [h.stat().st_mtime for h in (ROOT / "csrc").glob("*.h*")]
                    + [h.stat().st_mtime for h in (ROOT / "csrc").glob("*.cuh")]):
                return obj
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            return obj

        with ThreadPoolExecutor(max_workers=options["threads"]) as pool:
            objects = list(pool.map(run, jobs))
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        lib_dir = cuda_home / "lib64"
        if not lib_dir.exists():
            lib_dir = cuda_home / "lib"
        # The CUDA runtime is linked statically: the module then needs only the driver (libcuda) at run time.
        link = [cxx, "-shared", "-o", str(out), *map(str, objects), f"-L{lib_dir}", "-lcudart_static",
                "-ldl", "-lrt", "-lpthread"]
        print(" ".join(link), flush=True)
        subprocess.run(link, check=True)


setup(
    name="ep_comm",
    version="0.1.0",
    description="Quantized expert-parallel dispatch/combine (NVFP4 dispatch, RHT+S2F6 combine) for MoE",
    packages=find_packages(include=["ep_comm", "ep_comm.*"]),
    python_requires=">=3.10",
    # torch.float8_e8m0fnu (MXFP8 / S2F6 scales, 2.7), torch._grouped_mm on CPU and CUDA (ExpertMLP, 2.9): README
    install_requires=["torch>=2.9", "numpy"],
    extras_require={
        "test": ["pytest>=7"],
        "nvlink": ["nvshmem4py-cu13", "cuda-python"],
    },
    ext_modules=[Extension("ep_comm._C", sources=[])],
    cmdclass={"build_ext": CudaBuild},
    zip_safe=False,
)
