"""bench/profile_quantize_host.py's chunked timer (CPU only, with a stand-in for the per-call timer it chunks)."""
import pytest

import bench_module

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def profile():
    return bench_module.load("profile_quantize_host")


def test_chunks_stay_below_the_launch_queue_and_weigh_each_call_once(profile, monkeypatch):
    chunks = []

    def fake_per_call_us(fn, calls):  # host µs per call = the chunk's size, GPU µs = twice that
        chunks.append(calls)
        return float(calls), 2.0 * calls

    monkeypatch.setattr(profile, "_per_call_us", fake_per_call_us)
    host, gpu = profile._chunked_per_call_us(lambda: None, 2000, 250)
    assert chunks == [250] * 8
    assert (host, gpu) == (250.0, 500.0)
    chunks.clear()
    host, gpu = profile._chunked_per_call_us(lambda: None, 600, 250)
    assert chunks == [250, 250, 100]  # the last chunk short
    assert host == pytest.approx((250 * 250 + 250 * 250 + 100 * 100) / 600)
    assert gpu == pytest.approx(2 * host)


def test_bad_counts_are_refused(profile, monkeypatch, capsys):
    for argv in (["--chunk", "0"], ["--calls", "0"]):
        monkeypatch.setattr("sys.argv", ["profile_quantize_host.py", *argv])
        with pytest.raises(SystemExit) as exc:
            profile.main()
        assert exc.value.code == 2
        assert "must be at least 1" in capsys.readouterr().err
