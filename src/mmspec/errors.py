"""The project's error type: every user-facing failure names the problem and the fix."""

from __future__ import annotations


class MMSpecError(ValueError):
    """Bad input or configuration. The message says what is wrong and how to fix it."""
