"""The built-in torch backend, registered like any third-party backend."""

from rtxcore.hookspecs import hookimpl


@hookimpl
def register_backends(register) -> None:
    from rtx_plugins.backends.torch_backend.backend import TorchBackend

    register("torch", TorchBackend)
