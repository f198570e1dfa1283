"""TEST-ONLY: the stand-in's refusals, answered as the API server's ``Status`` objects."""


class ApiError(Exception):
    """An API request refused with HTTP ``code`` (answered as a Status object)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
