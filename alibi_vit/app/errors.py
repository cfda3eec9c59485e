"""The app's one exception: bad input or an impossible request, with the HTTP status it deserves."""

from __future__ import annotations

__all__ = ["SessionError"]


class SessionError(ValueError):
    """Bad input from the page or the command line; ``status`` is the HTTP status it deserves."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
