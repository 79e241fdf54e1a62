"""The project's error type: every user-facing failure names the problem and the fix."""

from __future__ import annotations


class MMSpecError(ValueError):
    """Bad input or configuration. The message says what is wrong and how to fix it."""


class ArgumentError(MMSpecError):
    """A request's argument out of its limits: ``argument`` names it as the caller spelled it
    (``mmspec serve`` answers it as a 400 whose ``param`` is that name)."""

    def __init__(self, message: str, argument: str):
        super().__init__(message)
        self.argument = argument


def article(word: str) -> str:
    """"an eagle head", "an msd head", "a speculators head": the article for a name said in a message
    (names said letter by letter, msd and mmspec, take "an")."""
    return "an" if word[:1].lower() in "aeiou" or word.lower().startswith(("msd", "mmspec")) else "a"
