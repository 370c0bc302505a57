"""Exceptions raised by rtx-serve. Each carries a message meant to be shown to a user as it is."""


class RtxError(Exception):
    """Base class of every error rtx-serve raises on purpose."""


class InvalidRequestError(RtxError, ValueError):
    """A request's prompt or sampling parameters are not acceptable.

    ``param`` names the offending field so servers can report it (OpenAI's error shape has a ``param`` key).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class CapacityError(InvalidRequestError):
    """A request can never fit: longer than the context or larger than the whole KV cache."""


class ModelLoadError(RtxError):
    """A model could not be found, read or understood."""


class PluginError(RtxError):
    """A plugin could not be loaded, registered or resolved."""


class ConfigError(RtxError, ValueError):
    """An engine, cache or scheduler setting is invalid."""


class AdmissionRefused(RtxError):
    """A scheduler will not take a request now (its lane's queue is full, its predicted wait misses the lane's
    target, or brownout sheds its lane); servers answer 429 with ``Retry-After``.

    ``code`` is a short label for metrics (``queue_full``, ``predicted_wait``, ``brownout``).
    """

    def __init__(self, message: str, retry_after_s: float, code: str):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code
