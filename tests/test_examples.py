"""The example MoE forward runs end to end and stays within the NVFP4/S2F6 error of the unquantized layer."""
import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import moe_forward  # noqa: E402
from harness import run_ranks  # noqa: E402


@pytest.mark.cpu
def test_moe_forward_example_on_gloo():
    args = argparse.Namespace(tokens=64, hidden=256, intermediate=128, experts=8, topk=2, gpu=False)
    errors = run_ranks(moe_forward.worker, 2, args, backend="gloo")
    # NVFP4 activations (~9% relative error per token) through a SwiGLU MLP, then S2F6 (~1%).
    assert all(0.0 < e < 0.16 for e in errors), errors  # 0.125 / 0.130 measured


@pytest.mark.cpu
def test_moe_layer_example_on_gloo():
    import moe_layer
    args = argparse.Namespace(tokens=32, hidden=128, intermediate=64, experts=4, topk=2, gpu=False)
    for result in run_ranks(moe_layer.worker, 2, args, backend="gloo"):
        # On CPU the layer itself uses the reference experts (no second layer to compare with); against the
        # unquantized FP32 layer: NVFP4 activations and weights plus S2F6 (0.22 measured at the example's defaults).
        assert result["experts"] == "reference" and result["vs_reference_experts"] is None, result
        assert 0.05 < result["vs_unquantized"] < 0.35, result


@pytest.mark.cpu
@pytest.mark.parametrize("argv,message", [(["--hidden", "100"], "--hidden must be a multiple of 32"),
                                          (["--intermediate", "24"], "--intermediate must be a multiple of 16"),
                                          (["--topk", "20"], "exceeds --experts"),
                                          (["--tokens", "0"], "--tokens must be at least 1")])
def test_examples_refuse_bad_sizes_before_starting_ranks(argv, message, capsys):
    from example_args import parse_moe_args
    with pytest.raises(SystemExit):
        parse_moe_args(argv, hidden=512, intermediate=256)
    assert message in capsys.readouterr().err


@pytest.mark.cpu
def test_example_args_reach_the_ranks():
    """What parse_moe_args returns goes to spawned ranks: it must pickle (a parser kept on it broke every example)."""
    import pickle
    from example_args import parse_moe_args
    args, world = parse_moe_args([], hidden=512, intermediate=256, check=lambda parser, a: None)
    assert pickle.loads(pickle.dumps(args)).hidden == 512 and world >= 1


@pytest.mark.cpu
@pytest.mark.parametrize("argv,message", [(["--steps", "0"], "--steps must be at least 1"),
                                          (["--lr", "nan"], "--lr must be a finite positive number"),
                                          (["--intermediate", "48"], "--intermediate must be a multiple of 32"),
                                          (["--expert-parallel", "3"], "--expert-parallel must divide the rank count"),
                                          (["--grad-format", "nvfp4"], "argument --grad-format: invalid choice")])
def test_training_example_refuses_bad_flags_before_starting_ranks(argv, message, monkeypatch, capsys):
    """Its own flags too (checked after the ranks ran, or by every rank's ExpertMLP, before), and --help lists them."""
    import moe_training
    monkeypatch.setattr(sys, "argv", ["moe_training.py", *argv])
    monkeypatch.setattr(moe_training, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(SystemExit):
        moe_training.main()
    assert message in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["moe_training.py", "--help"])
    with pytest.raises(SystemExit):
        moe_training.main()
    shown = capsys.readouterr().out
    assert all(flag in shown for flag in ("--steps", "--lr", "--expert-mlp", "--expert-parallel", "--intermediate",
                                          "--grad-format")), \
        shown


@pytest.mark.cpu
@pytest.mark.parametrize("expert_mlp, expert_parallel, grad_format",
                         [("ep_comm", 0, "bf16"), ("torch", 0, "bf16"), ("ep_comm", 1, "bf16"), ("ep_comm", 0, "mxfp8")])
def test_moe_training_example_learns_on_gloo(expert_mlp, expert_parallel, grad_format):
    """Gradients through dispatch, combine and the routing weights (ep_comm.training), and through the experts
    (training.ExpertMLP's NVFP4 / MXFP8 experts, or plain torch ones) train the student layer: SGD lowers its loss
    against the teacher on every rank. expert_parallel 1: two data-parallel replicas, each an EP group of one rank
    with every expert; the worker checks that the replicas' parameters end equal. grad_format mxfp8: both backward
    exchanges in MXFP8."""
    import moe_training
    args = argparse.Namespace(tokens=64, hidden=128, intermediate=64, experts=8, topk=2, gpu=False, steps=12, lr=5.0,
                              expert_mlp=expert_mlp, expert_parallel=expert_parallel, grad_format=grad_format)
    for losses in run_ranks(moe_training.worker, 2, args, backend="gloo"):
        assert len(losses) == 12 and all(0.0 < loss < 1.0 for loss in losses), losses
        assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.cpu
def test_moe_training_example_stops_every_rank_with_the_reason_when_it_diverges():
    """A learning rate too large for the sizes (here 8 tokens per rank at lr 20; lr 10 diverges too, 5 did before the
    experts' gradients were divided by the rank count): every rank stops at the same step with a message that names
    the cause, instead of a routing error from a forward on NaN router weights."""
    import moe_training
    args = argparse.Namespace(tokens=8, hidden=256, intermediate=128, experts=8, topk=2, gpu=False, steps=30, lr=20.0,
                              expert_mlp="ep_comm", expert_parallel=0, grad_format="bf16")
    with pytest.raises(AssertionError, match="the training diverged at step") as failure:
        run_ranks(moe_training.worker, 2, args, backend="gloo")
    assert "lower --lr" in str(failure.value) and "InvalidRoutingError" not in str(failure.value)


@pytest.mark.cpu
@pytest.mark.parametrize("argv,message", [(["--micro-batches", "3"], "--micro-batches must be a positive divisor"),
                                          (["--expert-parallel", "3"], "--expert-parallel must divide the rank count"),
                                          (["--steps", "0"], "--steps must be at least 1"),
                                          (["--max-grad-norm", "-1"], "--max-grad-norm must be a finite number >= 0")])
def test_fsdp2_example_refuses_bad_flags_before_starting_ranks(argv, message, monkeypatch, capsys):
    import moe_fsdp2
    monkeypatch.setattr(sys, "argv", ["moe_fsdp2.py", *argv])
    monkeypatch.setattr(moe_fsdp2, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(SystemExit):
        moe_fsdp2.main()
    assert message in capsys.readouterr().err


@pytest.mark.cpu
@pytest.mark.parametrize("expert_parallel, micro_batches, bf16, max_grad_norm",
                         [(0, 1, False, 0.0), (1, 2, True, 0.0), (0, 1, False, 0.05)])
def test_moe_fsdp2_example_learns_on_gloo(expert_parallel, micro_batches, bf16, max_grad_norm):
    """The FSDP2 layout (experts sharded over "dp", the router over every rank) trains the student: SGD lowers its
    loss on every rank, with EP over both ranks, with two replicas of one rank each, accumulating two micro-batches
    in BF16 parameters, and with the gradients clipped (training.clip_grad_norm_: the first steps' norms above the
    bound, the same on both ranks). (That these steps are the hand-averaged ones bit for bit, and the clipping's
    norm the whole layer's: tests/test_trainer_wrappers.py.)"""
    import moe_fsdp2
    args = argparse.Namespace(tokens=64, hidden=128, intermediate=64, experts=8, topk=2, gpu=False, steps=12, lr=5.0,
                              expert_parallel=expert_parallel, micro_batches=micro_batches, bf16=bf16,
                              max_grad_norm=max_grad_norm)
    logs = run_ranks(moe_fsdp2.worker, 2, args, backend="gloo")
    for log in logs:
        losses = log.losses
        assert len(losses) == 12 and all(0.0 < loss < 1.0 for loss in losses), losses
        assert losses[-1] < 0.8 * losses[0], losses
        assert len(log.grad_norms) == (12 if max_grad_norm else 0), log.grad_norms
    if max_grad_norm:
        assert logs[0].grad_norms == logs[1].grad_norms and logs[0].grad_norms[0] > max_grad_norm, logs
