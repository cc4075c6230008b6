"""`import mscclpp_torchcomms` registers the TorchComms backend "mscclpp" (mscclpp-rs under
torchcomms' Python backend protocol), so `torchcomms.new_comm("mscclpp", device, name=...)` finds
it. torchcomms also finds it without this import, through the `torchcomms.backends` entry point
the mscclpp-rs wheel declares (and torch.comms through `torch.comms.backends`). See mscclpp.torchcomms_backend and docs/torchcomms.md."""

try:
    import torchcomms
except ImportError as missing:
    # PyTorch's in-tree copy (torch.comms, which reads the `torch.comms.backends` entry points).
    try:
        import torch.comms as torchcomms
    except ImportError:
        raise ImportError(
            "mscclpp_torchcomms registers a backend with torchcomms (>= 0.3) or torch.comms, "
            f"neither of which is importable here: {missing}"
        ) from missing

from mscclpp.torchcomms_backend import (
    BACKEND_NAME,
    TORCHCOMMS_PROTOCOL_VERSION,
    MscclppBackendMethods,
    backend_class,
)

MscclppBackend = backend_class(torchcomms.TorchCommBackend)


def _register():
    registered = getattr(torchcomms, "_is_backend_registered", None)
    if registered is None or not registered(BACKEND_NAME):
        torchcomms.register_backend(BACKEND_NAME, MscclppBackend)


_register()

__all__ = ["BACKEND_NAME", "TORCHCOMMS_PROTOCOL_VERSION", "MscclppBackend", "MscclppBackendMethods"]
