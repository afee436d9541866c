"""The benchmarks of bench/ refuse bad flags with argparse's message before any rank starts (CPU: their parsers only).
A bad --out used to surface as a traceback after the whole run, losing its figures."""
import argparse

import pytest

from bench_module import load

_BAD_OUT = "/nonexistent-folder-of-ep-comm-tests/figures.json"


@pytest.mark.cpu
@pytest.mark.parametrize("script", ["bench_dispatch_combine", "bench_moe"])
def test_bench_scripts_check_out_before_running(script, tmp_path, capsys):
    module = load(script)
    with pytest.raises(SystemExit):
        module.parse_args(["--out", _BAD_OUT])
    assert "not a writable file path" in capsys.readouterr().err
    good = tmp_path / "figures.json"
    assert module.parse_args(["--out", str(good)]).out == str(good)
    assert not good.exists(), "the check must not leave an empty file behind"


def _training_parser_args(argv):
    """bench_training's parser (built by its main) without running it: main's argparse calls, captured."""
    module = load("bench_training")
    captured = {}

    def check(parser, args, num_gpus):
        captured["parser"], captured["args"] = parser, args
        raise _Stop

    class _Stop(Exception):
        pass

    original = module._check_args
    module._check_args = check
    with pytest.raises(_Stop):
        module.main(argv)
    return original, captured["parser"], captured["args"]


@pytest.mark.cpu
@pytest.mark.parametrize("argv, message", [
    (["--iters", "0"], "--iters must be at least 1"),
    (["--batches", "0"], "--batches must be at least 1"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--experts", "15", "--topk", "2"], "--experts 15 is not a multiple of the 2 ranks"),
    (["--topk", "300"], "--topk 300 exceeds --experts 256"),
    (["--hidden", "100"], "--hidden must be a positive multiple of 32"),
    (["--layer-experts", "3"], "--layer-experts 3 is not a multiple of the 2 ranks"),
    (["--layer-experts", "-2"], "--layer-experts must not be negative"),
    (["--layer-experts", "4"], "--topk 8 exceeds --layer-experts 4"),
    (["--layer-intermediate", "100"], "--layer-intermediate must be a positive multiple of 32"),
    (["--shared-intermediate", "48"], "--shared-intermediate must be a positive multiple of 32"),
    (["--shared-comm-sms", "0"], "--shared-comm-sms must be at least 1"),
    (["--out", _BAD_OUT], "not a writable file path"),
])
def test_bench_training_refuses_bad_flags(argv, message, capsys):
    check, parser, args = _training_parser_args(argv)
    with pytest.raises(SystemExit):
        check(parser, args, 2)  # (as on a machine with 2 GPUs)
    assert message in capsys.readouterr().err


@pytest.mark.cpu
def test_bench_training_accepts_its_defaults_and_needs_gpus(capsys):
    check, parser, args = _training_parser_args([])
    assert check(parser, argparse.Namespace(**vars(args)), 2) == 2
    assert check(parser, argparse.Namespace(**vars(args)), 8) == 2  # (--nproc 2: one rank per GPU up to it)
    with pytest.raises(SystemExit):
        check(parser, args, 0)
    assert "needs CUDA GPUs" in capsys.readouterr().err
