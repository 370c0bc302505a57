"""The built-in ONNX Runtime backend, registered like any third-party backend.

Its module imports nothing from onnxruntime at load time, so the plugin registers (and reports itself unavailable,
with the reason) on an install without it.
"""

from rtxcore.hookspecs import hookimpl


@hookimpl
def register_backends(register) -> None:
    from rtx_plugins.backends.onnxruntime_backend.backend import OnnxRuntimeBackend

    register("onnxruntime", OnnxRuntimeBackend)
