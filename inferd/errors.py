"""Errors the engine raises for bad requests; the server maps them to HTTP 400 with an OpenAI error body."""


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked.

    Attributes:
        param: the request field at fault (OpenAI's ``error.param``), or None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; requests cannot be served."""


class EngineOverloadedError(RuntimeError):
    """The model already has as many waiting requests as it may queue (load shedding): retry later.

    Attributes:
        retry_after: seconds the client should wait before retrying.
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after
