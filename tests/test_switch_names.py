"""Every EP_COMM_* environment switch the tests name is one the library reads. Several GPU tests set a switch to run
a second code path (EP_COMM_NVLINK_STREAM_RECV=0, EP_COMM_GEMM_WIDE_TILE=0, EP_COMM_DIRECT_SELF_MIN_TOKENS, ...) and
compare with a reference that does not depend on the path; if the library stopped reading that name (a rename), such a
test would rerun the default path and still pass. This catches the rename on any machine."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Switches only the tests read (their own tiers and sizes), not the library.
TEST_ONLY = {"EP_COMM_TEST_SHARED_GPU", "EP_COMM_TEST_SHARED_WORLD", "EP_COMM_EXHAUSTIVE"}
NAME = re.compile(r"\bEP_COMM_[A-Z0-9_]*[A-Z0-9]\b")


def _library_sources():
    """The library's own sources: the package, the CUDA/C++ core, the build script and the benchmark scripts (not
    their recorded results)."""
    files = [ROOT / "setup.py", *(ROOT / "ep_comm").rglob("*.py"), *(ROOT / "csrc").iterdir(),
             *(ROOT / "bench").glob("*.py"), *(ROOT / "bench").glob("*.sh")]
    return [path for path in files if path.is_file() and path.suffix in (".py", ".sh", ".cu", ".cuh", ".h", ".cpp")]


def _names_read(text: str) -> set:
    """Names the text reads: a quoted string (os.environ / getenv / env_choice) or a preprocessor test (-D switch)."""
    quoted = set(re.findall(r"[\"'](EP_COMM_[A-Z0-9_]*[A-Z0-9])[\"']", text))
    defined = set(re.findall(r"(?:defined\s*\(\s*|#\s*ifn?def\s+)(EP_COMM_[A-Z0-9_]*[A-Z0-9])", text))
    return quoted | defined


@pytest.mark.cpu
def test_every_switch_the_tests_set_is_read_by_the_library():
    library = set()
    for path in _library_sources():
        library |= _names_read(path.read_text(errors="replace"))
    named_by_tests = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        for name in NAME.findall(path.read_text()):
            named_by_tests.setdefault(name, path.name)
    assert len(named_by_tests) >= 10, sorted(named_by_tests)  # (the scan found the tests' switches at all)
    unread = {name: where for name, where in named_by_tests.items() if name not in library and name not in TEST_ONLY}
    assert not unread, f"switches named in the tests that the library does not read (renamed?): {unread}"
