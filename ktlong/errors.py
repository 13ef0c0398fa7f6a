"""The one exception type for mistakes a user can fix; the CLI prints it as one line, exit 2."""
from __future__ import annotations


class KtlongError(Exception):
    """A user error: `message` says what is wrong, `hint` how to fix it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"
