"""The main job (`python -m ep_comm.bench`) on 2 CPU ranks over gloo: its table's figures are the measured ones."""
import json

import pytest

from ep_comm import bench


@pytest.mark.cpu
def test_main_job_on_cpu_ranks(tmp_path, capsys):
    out = tmp_path / "result.json"
    bench.main(["--cpu", "--tokens", "24", "--hidden", "256", "--experts", "8", "--topk", "2", "--iters", "1",
                "--formats", "nvfp4/s2f6,bf16/bf16", "--out", str(out)])
    rows = {(r["rank"], r["dispatch_format"]): r for r in json.loads(out.read_text())["results"]}
    assert len(rows) == 4
    for (rank, fmt), r in rows.items():
        # The combine's own error, against a BF16 combine of the same expert rows: S2F6 within DESIGN's 1.5%; a BF16
        # combine is that reference itself, so the job reports exactly 0 for it (not measured).
        assert 0.0 < r["combine_rel_l2_error"] < 0.015 if fmt == "nvfp4" else r["combine_rel_l2_error"] == 0.0
        # End to end: NVFP4 dispatch error dominates.
        assert (0.02 < r["rel_l2_error"] < 0.2) if fmt == "nvfp4" else r["rel_l2_error"] < 0.01
        assert r["dispatch_us"] > 0 and r["combine_us"] > 0 and 0 < r["combine_row_pairs"] <= 24
    table = capsys.readouterr().out
    assert "comb L2" in table and "0.00" not in table.split("\n")[3].split()[5:9], table  # rates keep their digits
    for fmt in ("nvfp4/s2f6", "bf16/bf16"):  # each pair's slowest rank, from the rows the JSON has
        d, c = (max(rows[(rank, fmt.split("/")[0])][key] for rank in (0, 1)) for key in ("dispatch_us", "combine_us"))
        slow = [line for line in table.splitlines() if line.startswith(fmt) and "slowest rank" in line]
        assert len(slow) == 1 and f"dispatch {d:.1f} us" in slow[0] and f"combine {c:.1f} us" in slow[0], table


@pytest.mark.cpu
@pytest.mark.parametrize("argv,message", [(["--iters", "0"], "--iters must be at least 1"),
                                          (["--topk", "40", "--experts", "32"], "exceeds --experts"),
                                          (["--experts", "30", "--ranks", "4"], "not a multiple"),
                                          (["--hidden", "100"], "--hidden must be a positive multiple of 32"),
                                          (["--hidden", "0"], "--hidden must be a positive multiple of 32"),
                                          (["--formats", "fp8/s2f6"], "dispatch is one of nvfp4/mxfp8/bf16"),
                                          (["--formats", "nvfp4/fp8"], "combine one of s2f6/mxfp8/bf16"),
                                          (["--formats", ","], "names no dispatch/combine pair"),
                                          (["--backend", "nvlink"], "--backend nvlink needs GPUs"),
                                          (["--out", "/nonexistent_dir/x.json"], "not a writable file path"),
                                          (["--out", "/"], "not a writable file path"),
                                          (["--out", "/proc/ep_comm_x.json"], "cannot be written"),
                                          (["--timeout", "0"], "--timeout must be a positive number"),
                                          (["--timeout", "inf"], "--timeout must be a positive number"),
                                          (["--timeout", "nan"], "--timeout must be a positive number")])
def test_main_job_refuses_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--cpu", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.cpu
def test_main_job_json_is_strict_when_exact(tmp_path, capsys):
    """One rank, one expert, BF16 both ways: the end-to-end error is exactly 0, so the SQNR is infinite. Strict JSON
    has no Infinity: the file says "inf"."""
    out = tmp_path / "one.json"
    bench.main(["--cpu", "--ranks", "1", "--experts", "1", "--topk", "1", "--tokens", "8", "--hidden", "64",
                "--iters", "1", "--formats", "bf16/bf16", "--out", str(out)])
    text = out.read_text()
    result = json.loads(text)
    assert "Infinity" not in text and result["results"][0]["sqnr_db"] == "inf"
    # One rank: nothing crosses to another rank, so no wire rate (None / "n/a", not a 0 that reads as a measurement).
    assert result["results"][0]["dispatch_wire_gbps"] is None and result["results"][0]["combine_bf16_equiv_gbps"] is None
    assert "--experts 1" in result["config"]["command"] and result["config"]["host"]
    printed = capsys.readouterr().out
    assert "inf" in printed and "n/a" in printed


@pytest.mark.cpu
def test_default_ranks_divide_the_experts(monkeypatch):
    """Every visible GPU by default, unless the experts do not split over them: 256 experts on 6 GPUs run on 4 ranks
    (refusing the README's one-line command there would leave such a machine without its main job)."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 6)
    assert bench.parse_args([]).ranks == 4
    assert bench.parse_args(["--experts", "12"]).ranks == 6
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 8)
    assert bench.parse_args([]).ranks == 8


@pytest.mark.cpu
def test_git_commit_is_only_this_checkouts(tmp_path, monkeypatch):
    """A package copied into another git repository (an install into a .venv inside the user's project) records no
    commit rather than that project's HEAD."""
    import shutil
    import subprocess
    monkeypatch.delenv("EP_COMM_SOURCE_COMMIT", raising=False)
    other = tmp_path / "their_project"
    package = other / ".venv" / "site-packages" / "ep_comm"
    shutil.copytree(bench.os.path.dirname(bench.__file__), package)
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    subprocess.run(["git", "-C", str(other), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "theirs"], check=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import ep_comm.bench as b; print(repr(b._git_commit()))")
    printed = subprocess.run([bench.sys.executable, "-c", code, str(package.parent)], capture_output=True, text=True,
                             check=True).stdout.strip()
    assert printed == "None", printed


@pytest.mark.cpu
def test_git_commit_is_this_checkouts_head():
    """The positive case of the test above: run from a git checkout of this project, the JSON records its HEAD."""
    import subprocess
    root = bench.os.path.dirname(bench.os.path.dirname(bench.os.path.abspath(bench.__file__)))
    head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0 or not bench.os.path.isdir(bench.os.path.join(root, ".git")):
        pytest.skip("not run from a git checkout of this project (an installed copy or an sdist)")
    saved = bench.os.environ.pop("EP_COMM_SOURCE_COMMIT", None)
    try:
        assert (bench._git_commit() or "").startswith(head.stdout.strip())
    finally:
        if saved is not None:
            bench.os.environ["EP_COMM_SOURCE_COMMIT"] = saved
