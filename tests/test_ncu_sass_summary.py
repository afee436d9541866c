"""bench/ncu_sass_summary.py: the stall samples of an ncu per-SASS-line CSV grouped by execution count (CPU only)."""
import pytest

import bench_module

pytestmark = pytest.mark.cpu  # a tier marker like every other test (unmarked, `-m cpu` deselected these)


@pytest.fixture(scope="module")
def summary():
    return bench_module.load("ncu_sass_summary")


def _write_csv(path):
    header = ['"Address"', '"Source"', '"Warp Stall Sampling (All Samples)"', '"Instructions Executed"',
              '"stall_barrier"', '"stall_wait"', '"stall_barrier (Not Issued)"']
    rows = [("0x10", "HGMMA.64x128x16.F32", 60, 400, 0, 50, 0),
            ("0x20", "LOP3.LUT R1", 20, 400, 0, 20, 0),
            ("0x30", "BAR.SYNC 0x0", 15, 25, 15, 0, 15),
            ("0x40", "EXIT", 5, 1, 0, 5, 0)]
    with open(path, "w") as f:
        f.write("==PROF== Connected to process 1\n")
        f.write('"Kernel Name","kernel",\n')
        f.write(",".join(header) + "\n")
        for row in rows:
            f.write(",".join(f'"{v}"' for v in row) + "\n")
        f.write('"truncated"\n')  # a short line is skipped


def test_reads_rows_and_reasons(summary, tmp_path):
    path = tmp_path / "sass.csv"
    _write_csv(path)
    rows = summary.read_rows(str(path))
    assert [r[0] for r in rows] == ["0x10", "0x20", "0x30", "0x40"]
    assert rows[2][2:4] == (15, 25)
    assert rows[2][4] == {"barrier": 15, "wait": 0}  # the "(Not Issued)" columns are left out


def _summary_of(summary, tmp_path, capsys, *options):
    """What main prints for the CSV of _write_csv with these options."""
    path = tmp_path / "sass.csv"
    _write_csv(path)
    assert summary.main([str(path), *options]) == 0
    return capsys.readouterr().out


def test_groups_samples_by_execution_count(summary, tmp_path, capsys):
    out = _summary_of(summary, tmp_path, capsys, "--top", "2")
    assert "4 SASS lines, 100 stall samples" in out
    levels = [line for line in out.splitlines() if line.strip().startswith("executed")]
    assert levels[0].split(":")[0].split()[-1] == "400" and "2 lines,  80.0% of samples" in levels[0]
    assert "barrier 15.0%" in levels[1]
    assert "HGMMA" in out.split("lines with the most samples:")[1].splitlines()[1]


def test_refuses_a_file_that_is_not_a_source_report(summary, tmp_path):
    path = tmp_path / "failed.csv"
    path.write_text("==ERROR== the profiled process failed\n")
    with pytest.raises(ValueError, match="not an ncu"):
        summary.read_rows(str(path))


def test_opcode_drops_predicate_and_modifiers(summary):
    assert summary.opcode("@!P0  LDG.E.128.CONSTANT R4, desc[UR8][R2.64]") == "LDG"
    assert summary.opcode("FFMA R3, R9, -R0, R9") == "FFMA"
    assert summary.opcode("") == ""


def test_instructions_per_element(summary, tmp_path, capsys):
    # 826 warp instructions of 32 lanes over 3304 elements: 8.00 per element; HGMMA 400 * 32 / 3304 = 3.87
    out = _summary_of(summary, tmp_path, capsys, "--elements", "3304")
    assert "thread instructions per element: 8.00 (826 warp instructions, 3304 elements)" in out
    assert "HGMMA 3.87, LOP3 3.87, BAR 0.24" in out  # EXIT (0.01) is below the 0.1 shown
    assert "EXIT" not in out.split("by opcode")[1].splitlines()[1]


def test_refuses_a_negative_element_count(summary, tmp_path):
    with pytest.raises(SystemExit):  # argparse's error exit, before the file is read
        summary.main([str(tmp_path / "absent.csv"), "--elements", "-3"])
