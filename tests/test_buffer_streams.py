"""Buffer's stream ordering (_order_after_last_call's decisions, the entry _run_on_stream leaves for the next call), with
stand-ins for the CUDA stream and event objects (CPU tier): the GPU behaviour (two current streams, the default
stream, comm_stream calls) is tested in dist_cases.comm_stream_worker."""
import contextlib
import types

import pytest
import torch

from ep_comm.buffer import Buffer


class _Log:
    def __init__(self):
        self.calls = []


def _fakes(monkeypatch, log):
    class Event:
        def record(self, stream=None):
            log.calls.append(("record", getattr(stream, "raw", None)))

    class Stream:
        def __init__(self, raw):
            self.raw = raw

        def wait_event(self, event):
            log.calls.append(("wait", self.raw))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    def external(raw, device=None):  # torch: a null stream_ptr means "a stream from the pool" (see _stream_of_raw)
        assert raw != 0, "ExternalStream(0) is a pool stream, not the default stream"
        return Stream(raw)

    monkeypatch.setattr(torch.cuda, "ExternalStream", external)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: Stream(0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("current"))
    return Stream


@pytest.mark.cpu
def test_order_after_last_call(monkeypatch):
    log = _Log()
    Stream = _fakes(monkeypatch, log)
    device = torch.device("cuda", 0)
    me = types.SimpleNamespace(_last_call=None)

    def order(raw, capture=0, stream=None, last=None):
        me._last_call = last
        log.calls.clear()
        Buffer._order_after_last_call(me, device, raw, capture, stream)
        return log.calls

    assert order(7) == []  # no previous call
    assert order(7, last=((7,), None, 0)) == []  # the same stream again: nothing recorded, nothing waited on
    # Another current stream: an event after the previous call's stream, waited on by this call's stream.
    assert order(8, last=((7,), None, 0)) == [("record", 7), ("wait", "current")]
    assert order(8, stream=Stream(8), last=((7,), None, 0)) == [("record", 7), ("wait", 8)]
    # After a comm_stream call its own event is waited on (none recorded again).
    event = torch.cuda.Event()
    assert order(8, last=((7,), event, 0)) == [("wait", "current")]
    assert order(7, last=((7,), event, 0)) == []
    # After a comm_stream dispatch(expand=False) outside a capture: events recorded now on its comm stream (7) and its
    # caller's stream (9), where the result may still be read, except on this call's own stream.
    assert order(8, last=((7, 9), None, 0)) == [("record", 7), ("wait", "current"), ("record", 9),
                                                     ("wait", "current")]
    assert order(9, last=((7, 9), None, 0)) == [("record", 7), ("wait", "current")]
    assert order(7, stream=Stream(7), last=((7, 9), None, 0)) == [("record", 9), ("wait", 7)]
    # The default stream (raw handle 0) is recorded on as itself.
    assert order(8, last=((0,), None, 0)) == [("record", 0), ("wait", "current")]
    assert order(8, last=((7, 0), None, 0)) == [("record", 7), ("wait", "current"), ("record", 0),
                                                     ("wait", "current")]
    # Capture ids (0: outside a capture). Across a capture boundary nothing; between two calls of one capture not lazily
    # (no event), only a recorded event; nothing between two different captures (an event recorded inside one capture
    # cannot be waited on inside another: a capture ending with a comm_stream call, then a new one on another stream).
    assert order(8, capture=3, last=((7,), None, 0)) == []
    assert order(8, capture=0, last=((7,), event, 3)) == []
    assert order(8, capture=3, last=((7,), None, 3)) == []
    assert order(8, capture=3, last=((7,), event, 3)) == [("wait", "current")]
    assert order(8, capture=4, last=((7,), event, 3)) == []
    assert order(8, capture=-1, last=((7,), event, 3)) == []


@pytest.mark.cpu
def test_run_on_stream_records_what_the_next_call_waits_for(monkeypatch):
    """The _last_call entry each kind of call leaves (what _order_after_last_call then waits for)."""
    import ep_comm.buffer as buffer_module

    log = _Log()
    Stream = _fakes(monkeypatch, log)

    class CommStream(Stream):
        device = torch.device("cuda", 0)

        @property
        def cuda_stream(self):
            return self.raw

        def wait_stream(self, other):
            log.calls.append(("wait_stream", self.raw, other.raw))

    state = {"current": 5, "capture": 0}  # the capture id every stream reports
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: CommStream(state["current"]))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(buffer_module, "current_raw_stream", lambda device: state["current"])
    monkeypatch.setattr(buffer_module, "capture_id", lambda raw_stream: state["capture"])
    me = types.SimpleNamespace(_last_call=None, _backend=types.SimpleNamespace(holds=lambda tensor: 0))
    me._order_after_last_call = lambda *args, **kwargs: Buffer._order_after_last_call(me, *args, **kwargs)
    cuda = torch.device("cuda", 0)

    def call(comm=None, result_in_buffer=False, device=cuda):
        log.calls.clear()
        Buffer._run_on_stream(me, device, None if comm is None else CommStream(comm), None, (), lambda: None,
                              result_in_buffer=result_in_buffer)
        return me._last_call

    # On the current stream: that stream, no event.
    assert call() == ((5,), None, 0)
    # On a comm stream: the comm stream and the event recorded after the call on it.
    streams, event, capture = call(comm=7)
    assert (streams, capture) == ((7,), 0) and event is not None and ("record", 7) in log.calls
    # A result in the Buffer's memory (dispatch(expand=False)) outside a capture: no event; the comm stream and the
    # caller's stream, recorded on when the next call is made.
    assert call(comm=7, result_in_buffer=True) == ((7, 5), None, 0)
    assert ("record", 7) not in log.calls
    # The same with comm_stream = the current stream: listed once.
    state["current"] = 7
    assert call(comm=7, result_in_buffer=True) == ((7,), None, 0)
    state["current"] = 5
    # Inside a capture: the event, as for any comm_stream call, and the capture's id.
    state["capture"] = 3
    streams, event, capture = call(comm=7, result_in_buffer=True)
    assert (streams, capture) == ((7,), 3) and event is not None
    assert call() == ((5,), None, 3)
    # The next capture's first call, on another stream, does not wait on the previous capture's event.
    call(comm=7)
    state["capture"] = 4
    assert call() == ((5,), None, 4) and not any(entry[0] == "wait" for entry in log.calls)
    state["capture"] = 0
    # A CPU call leaves the entry of the last CUDA call.
    before = call()
    assert call(device=torch.device("cpu")) == before


@pytest.mark.cpu
def test_tensors_in_finds_every_tensor_of_a_result_once_in_order():
    """_tensors_in (what a comm_stream call marks in use on the other stream): the tensors of nested dataclasses,
    lists and tuples, in field order, and nothing from other values (a dataclass type, strings, dtypes, None)."""
    import dataclasses

    from ep_comm.buffer import _tensors_in

    @dataclasses.dataclass(frozen=True)
    class Inner:
        a: torch.Tensor
        nested: object = None

    @dataclasses.dataclass
    class Outer:
        x: torch.Tensor
        count: int
        name: str
        dtype: torch.dtype
        inner: Inner
        items: list
        kind: type = Inner

    t = [torch.zeros(i + 1) for i in range(6)]
    outer = Outer(t[0], 3, "s", torch.float32, Inner(t[1], Inner(t[2])), [t[3], (t[4], Inner(t[5])), 7, None])
    for _ in range(2):  # (the second walk uses the cached field names)
        assert [id(x) for x in _tensors_in(outer)] == [id(x) for x in t]
    assert _tensors_in(Outer) == [] and _tensors_in(None) == [] and _tensors_in("x") == []
    assert [id(x) for x in _tensors_in((t[0], [t[1]]))] == [id(t[0]), id(t[1])]

    @dataclasses.dataclass(frozen=True)
    class Pair(tuple):  # a dataclass that is also a tuple: walked by its fields (what the dataclass says it holds)
        first: torch.Tensor

    pair = Pair((t[2], t[3]))
    object.__setattr__(pair, "first", t[1])
    assert [id(x) for x in _tensors_in(pair)] == [id(t[1])]
