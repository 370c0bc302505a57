"""The built-in TensorRT backend, registered like any third-party backend.

Nothing here imports tensorrt: without it the plugin still registers and reports itself unavailable, with the
import error, in ``rtx plugins list``.
"""

from rtxcore.hookspecs import hookimpl


@hookimpl
def register_backends(register) -> None:
    from rtx_plugins.backends.tensorrt_backend.backend import TensorRTBackend

    register("tensorrt", TensorRTBackend)
