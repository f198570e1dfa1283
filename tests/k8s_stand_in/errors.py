"""TEST-ONLY: the stand-in's refusals, answered as the API server's ``Status`` objects."""


class ApiError(Exception):
    """An API request refused with HTTP ``code`` (answered as a Status object); ``retry_after``: the
    ``Retry-After`` header's seconds, if any."""

    def __init__(self, code: int, reason: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.retry_after = retry_after
