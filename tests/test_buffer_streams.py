"""Buffer._order_after_last_call's decisions, with stand-ins for the CUDA stream and event objects (CPU tier): the
GPU behaviour (two current streams, comm_stream calls) is tested in dist_cases.comm_stream_worker."""
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

    def order(raw, capturing=False, stream=None, last=None):
        me._last_call = last
        log.calls.clear()
        Buffer._order_after_last_call(me, device, raw, capturing, stream)
        return log.calls

    assert order(7) == []  # no previous call
    assert order(7, last=((7,), None, False)) == []  # the same stream again: nothing recorded, nothing waited on
    # Another current stream: an event after the previous call's stream, waited on by this call's stream.
    assert order(8, last=((7,), None, False)) == [("record", 7), ("wait", "current")]
    assert order(8, stream=Stream(8), last=((7,), None, False)) == [("record", 7), ("wait", 8)]
    # After a comm_stream call its own event is waited on (none recorded again).
    event = torch.cuda.Event()
    assert order(8, last=((7,), event, False)) == [("wait", "current")]
    assert order(7, last=((7,), event, False)) == []
    # After a comm_stream dispatch(expand=False) outside a capture: events recorded now on its comm stream (7) and its
    # caller's stream (9), where the result may still be read, except on this call's own stream.
    assert order(8, last=((7, 9), None, False)) == [("record", 7), ("wait", "current"), ("record", 9),
                                                     ("wait", "current")]
    assert order(9, last=((7, 9), None, False)) == [("record", 7), ("wait", "current")]
    assert order(7, stream=Stream(7), last=((7, 9), None, False)) == [("record", 9), ("wait", 7)]
    # The default stream (raw handle 0) is recorded on as itself.
    assert order(8, last=((0,), None, False)) == [("record", 0), ("wait", "current")]
    assert order(8, last=((7, 0), None, False)) == [("record", 7), ("wait", "current"), ("record", 0),
                                                     ("wait", "current")]
    # Across a capture boundary nothing; between two captured calls not lazily (no event), only a recorded one.
    assert order(8, capturing=True, last=((7,), None, False)) == []
    assert order(8, capturing=False, last=((7,), event, True)) == []
    assert order(8, capturing=True, last=((7,), None, True)) == []
    assert order(8, capturing=True, last=((7,), event, True)) == [("wait", "current")]
