"""Compile-only checks of the Blackwell-native conversions in csrc/qm_element_formats.cuh (CUTLASS's compile-only tier:
they cannot run on our sm_90 GPUs). The extension's build compiles the default native form for sm_100a (e2m1x2); the
opt-in forms (EP_COMM_NATIVE_UE8M0: ue8m0x2, EP_COMM_NATIVE_S2F6: s2f6x2, PTX ISA 9.1 = CUDA >= 13.1) are compiled
by no build, so this test compiles a small kernel with them on and checks that nvcc and ptxas accept them and that the
native instructions, and only there, replace the software forms. Needs the CUDA toolkit setup.py finds
(CUDA_HOME, the PATH or /usr/local/cuda); no GPU."""
import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"

KERNEL = r"""
#include "quant_math.cuh"
using namespace ep_comm::qm;
__global__ void native_forms(const float* in, unsigned int* out) {
  const int i = threadIdx.x;
  out[4 * i] = e2m1x2_encode(in[2 * i], in[2 * i + 1]);
  out[4 * i + 1] = ue8m0_mxfp8_scale(in[2 * i]);
  out[4 * i + 2] = s2f6x2_encode(in[2 * i], in[2 * i + 1], 130, 0.125f);
  out[4 * i + 3] = e2m1_encode(in[2 * i]);
}
"""

E2M1 = "cvt.rn.satfinite.e2m1x2.f32"
UE8M0 = "cvt.rp.satfinite.ue8m0x2.f32"
S2F6 = "s2f6x2.f32"


def _nvcc():
    """The nvcc of the toolkit setup.py builds with (its find_cuda_home, taken from setup.py's source: importing
    setup.py would run setup()), or None."""
    setup_py = CSRC.parent / "setup.py"
    tree = ast.parse(setup_py.read_text())
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef)
              and node.name in ("_is_cuda_toolkit", "find_cuda_home")]
    namespace = {"os": os, "shutil": shutil, "Path": Path}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(setup_py), "exec"), namespace)
    home, _ = namespace["find_cuda_home"]()
    return None if home is None else home / "bin" / "nvcc"


def _version(nvcc):
    text = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    major, minor = re.search(r"release (\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def _compile(nvcc, tmp_path, arch, defines, what):
    """PTX text of KERNEL for `arch` with the -D `defines`, after ptxas accepted it (a cubin build)."""
    source = tmp_path / "native_forms.cu"
    source.write_text(KERNEL)
    flags = ["-std=c++17", "--expt-relaxed-constexpr", f"-I{CSRC}", f"-arch=sm_{arch}",
             *(f"-D{name}" for name in defines)]
    for kind in ("-ptx", "-cubin"):
        out = tmp_path / f"{what}{'.ptx' if kind == '-ptx' else '.cubin'}"
        run = subprocess.run([str(nvcc), *flags, kind, str(source), "-o", str(out)], capture_output=True, text=True)
        assert run.returncode == 0, f"nvcc {kind} for sm_{arch} {defines} failed:\n{run.stderr[-3000:]}"
    return (tmp_path / f"{what}.ptx").read_text()


@pytest.mark.cpu
def test_opt_in_native_conversions_compile_for_sm100a(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc: the compile-only check needs a CUDA toolkit")
    version = _version(nvcc)
    hopper = _compile(nvcc, tmp_path, "90a", ("EP_COMM_NATIVE_UE8M0", "EP_COMM_NATIVE_S2F6"), "sm90a")
    assert not any(op in hopper for op in (E2M1, UE8M0, S2F6)), "sm_90a must take the software forms"
    default = _compile(nvcc, tmp_path, "100a", (), "sm100a_default")
    assert E2M1 in default, "sm_100a: e2m1x2 is native by default"
    assert UE8M0 not in default and S2F6 not in default, "ue8m0x2 / s2f6x2 are opt-in"
    opt_in = _compile(nvcc, tmp_path, "100a", ("EP_COMM_NATIVE_UE8M0", "EP_COMM_NATIVE_S2F6"), "sm100a_opt_in")
    assert E2M1 in opt_in and UE8M0 in opt_in, "EP_COMM_NATIVE_UE8M0 on sm_100a: the native ue8m0x2"
    # s2f6x2 needs PTX ISA 9.1 (CUDA 13.1): older toolkits keep the software form under the opt-in (the guard in
    # qm_arith.cuh), newer ones must emit it.
    assert (S2F6 in opt_in) == (version >= (13, 1)), (version, "s2f6x2 present" if S2F6 in opt_in else "absent")
    forced_soft = _compile(nvcc, tmp_path, "100a", ("EP_COMM_NATIVE_UE8M0", "EP_COMM_NATIVE_S2F6",
                                                   "EP_COMM_NO_NATIVE_CVT"), "sm100a_forced_soft")
    assert not any(op in forced_soft for op in (E2M1, UE8M0, S2F6)), "EP_COMM_NO_NATIVE_CVT: software forms only"
