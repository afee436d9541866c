"""The device-only forms of the format primitives (the `__CUDA_ARCH__` branches of csrc/qm_*.cuh: PTX conversions,
round-toward-zero intrinsics, the MUFU reciprocal sequence, prmt), checked exhaustively on the GPU against the forms
the host emulation runs (which tests/test_formats_host.py proves against the torch reference). The host tests cannot
reach these branches, and the kernel tests (tests/test_formats_cuda.py) reach them only through random and edge rows.
The program is tests/device_checks/device_forms.cu, built with the extension's nvcc flags (setup.py: no FMA contraction,
no fast math). Tiers: `cpu` builds it (a compile-only check, CUTLASS-style; needs the CUDA toolkit), `gpu` runs it."""
import subprocess

import pytest
import torch

from test_native_compile import CSRC, _nvcc

SOURCE = CSRC.parent / "tests" / "device_checks" / "device_forms.cu"
# setup.py's cu_flags that shape the numerics (no FMA contraction; -O3 as the extension).
FLAGS = ["-O3", "-std=c++17", "--fmad=false", "--expt-relaxed-constexpr", f"-I{CSRC}"]

# How many cases each check must have seen (exact where the domain is fixed; a floor where a filter decides).
EXPECTED_CHECKED = {
    "rcp_fast": 0x71000000 - 0x0D000000 + 1 + 1,  # every d in [2^-101, 2^99], and d = 0
    "e4m3x2_decode": 0x10000,
    "add_offset_rz": 2 * 0x3C800000,  # every a in [0, 2^-6), two offsets
    "max_abs_nan": 1 << 32,
    "byte_perm": 1 << 26,
    "scaled_codes_decode_equal": 127 * 127 * 64 * 17,  # scale pairs x code pairs x (16 positions + uniform)
}
AT_LEAST_CHECKED = {
    "e4m3x2_encode": 2 * 4_000_000_000,  # both positions of (nearly) every non-NaN pattern
    "mul_rz_pow2": 7 * 2_000_000_000,  # 7 multipliers, every pattern with a finite product
    "sr_e4m3_fast": 9 * 4 * 1_000_000_000,  # 9 scale bytes x 4 random words, |x p| <= 448
}


def _build(tmp_path, arch):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc: building the device checks needs a CUDA toolkit")
    binary = tmp_path / "device_forms"
    run = subprocess.run([str(nvcc), *FLAGS, f"-arch=sm_{arch}", str(SOURCE), "-o", str(binary)],
                         capture_output=True, text=True)
    assert run.returncode == 0, f"nvcc for sm_{arch} failed:\n{run.stderr[-3000:]}"
    return binary


@pytest.mark.cpu
def test_device_checks_build_for_hopper(tmp_path):
    _build(tmp_path, "90a")


@pytest.mark.gpu
def test_device_only_forms_match_the_host_forms_exhaustively(tmp_path):
    major, minor = torch.cuda.get_device_capability()
    binary = _build(tmp_path, "90a" if (major, minor) == (9, 0) else f"{major}{minor}")
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"device checks failed to run:\n{run.stdout}\n{run.stderr}"
    results = {}
    for line in run.stdout.splitlines():
        name, mismatches, checked = line.split()
        results[name] = (int(mismatches), int(checked))
    assert set(results) == set(EXPECTED_CHECKED) | set(AT_LEAST_CHECKED), run.stdout
    for name, (mismatches, checked) in results.items():
        assert mismatches == 0, f"{name}: {mismatches} of {checked} differ from the host form"
        if name in EXPECTED_CHECKED:
            assert checked == EXPECTED_CHECKED[name], f"{name}: checked {checked}, expected {EXPECTED_CHECKED[name]}"
        else:
            assert checked >= AT_LEAST_CHECKED[name], f"{name}: only {checked} cases checked"
