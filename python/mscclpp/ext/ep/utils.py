"""Events of the communication stream: `EventHandle` (one CUDA event) and `EventOverlap`, DeepEP's
wrapper that `async_finish` calls return and `with` blocks wait on."""

import torch


class EventHandle:
    """A CUDA event recorded on `stream` (default: the current stream) when made."""

    def __init__(self, stream=None):
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream() if stream is None else stream)

    def current_stream_wait(self):
        """The current stream waits for the event (the host does not)."""
        torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """An optional `EventHandle` and the tensors it keeps alive (`extra_tensors`: DeepEP's way of
    recording a stream use that stays valid under CUDA graphs). `with event_overlap:` runs its
    body on the current stream, which then waits for the event."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is None:
            raise ValueError("EventOverlap.current_stream_wait: there is no event (the call that "
                             "returned it was not made with async_finish=True)")
        self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.event is not None:
            self.event.current_stream_wait()
