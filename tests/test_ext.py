"""ep_comm._ext helpers: the raw current CUDA stream handed to every kernel launch, and the device context around it."""
import pytest
import torch

from ep_comm import _ext


@pytest.mark.cpu
def test_current_raw_stream_resolves_the_device_index(monkeypatch):
    """A torch.device or an int selects the device whose stream torch's raw accessor is asked for; a device without
    an index means the current device."""
    asked = []
    monkeypatch.setattr(_ext, "_raw_stream_of_device", lambda index: asked.append(index) or 1000 + index)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert _ext.current_raw_stream(torch.device("cuda", 3)) == 1003
    assert _ext.current_raw_stream(2) == 1002
    assert _ext.current_raw_stream(torch.device("cuda")) == 1005
    assert asked == [3, 2, 5]


@pytest.mark.gpu
def test_current_raw_stream_is_the_current_stream():
    """The same handle as torch.cuda.current_stream(device).cuda_stream: on the default stream, inside a side
    stream's context (what Buffer's comm_stream and CUDA-graph capture rely on), and through the public fallback."""
    device = torch.device("cuda", torch.cuda.current_device())
    assert _ext.current_raw_stream(device) == torch.cuda.current_stream(device).cuda_stream
    side = torch.cuda.Stream(device=device)
    with torch.cuda.stream(side):
        assert _ext.current_raw_stream(device) == side.cuda_stream
        assert _ext.current_raw_stream(device.index) == side.cuda_stream
    saved = _ext._raw_stream_of_device
    try:
        _ext._raw_stream_of_device = None
        with torch.cuda.stream(side):
            assert _ext.current_raw_stream(device) == side.cuda_stream
    finally:
        _ext._raw_stream_of_device = saved


@pytest.mark.gpu
def test_format_kernels_runnable_on_this_gpu():
    """The GPU tier's device is one the extension was built for: formats' impl='auto' takes the kernels there."""
    from ep_comm import formats
    device = torch.device("cuda", torch.cuda.current_device())
    assert _ext._C.formats_kernels_runnable() and _ext._C.formats_kernel_image_error() == ""
    assert formats._kernels_runnable(device) and formats._use_cuda("auto", torch.zeros(1, device=device))


@pytest.mark.gpu
def test_capture_id_tells_captures_apart():
    """0 outside a capture (the default stream included), one positive id for every stream of one capture (a side
    stream joins it through an event wait), another id for the next capture; without the compiled core, one id for
    every capture of the current stream."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream, side = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)
    assert _ext.capture_id(0) == 0 and _ext.capture_id(stream.cuda_stream) == 0
    ids = []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            torch.cuda._sleep(1)
            mine = _ext.capture_id(stream.cuda_stream)
            outside = _ext.capture_id(side.cuda_stream)
            side.wait_stream(stream)
            joined = _ext.capture_id(side.cuda_stream)
            stream.wait_stream(side)
            saved = _ext._C
            try:
                _ext._C = None
                fallback = _ext.capture_id(stream.cuda_stream)
            finally:
                _ext._C = saved
        ids.append(mine)
        assert mine > 0 and outside == 0 and joined == mine and fallback == _ext._SOME_CAPTURE
    assert ids[0] != ids[1]
    assert _ext.capture_id(stream.cuda_stream) == 0


@pytest.mark.cpu
def test_cuda_device_switches_only_when_needed(monkeypatch):
    """cuda_device is a no-op context for the current device (or an index-less device) and torch.cuda.device for any
    other."""
    switched = []

    class FakeDevice:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            switched.append(self.index)

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    for same in (1, torch.device("cuda", 1), torch.device("cuda")):
        with _ext.cuda_device(same):
            pass
    assert switched == []
    with _ext.cuda_device(torch.device("cuda", 0)):
        pass
    with _ext.cuda_device(3):
        pass
    assert switched == [0, 3]


@pytest.mark.multigpu  # (with one GPU there is nothing to switch to: the multigpu tier's machines run it)
def test_cuda_device_makes_the_device_current():
    """On GPUs: inside cuda_device(d) the current device is d, and afterwards the previous one again. With one GPU
    there is no other device to switch to (the switching logic is the CPU test's above)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: no other device to make current")
    before = torch.cuda.current_device()
    for index in range(torch.cuda.device_count()):
        with _ext.cuda_device(torch.device("cuda", index)):
            assert torch.cuda.current_device() == index
        assert torch.cuda.current_device() == before
