"""What every ``mmspec`` command shares: the consoles, the one-line error exit and the small flag
checks (the options commands share: :mod:`mmspec.cli.options`). Nothing outside :mod:`mmspec.cli`
imports this module.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.text import Text

from mmspec.errors import MMSpecError
from mmspec.threads import apply_threads, threads_note

console = Console()
err_console = Console(stderr=True)

def fail(e: Exception) -> None:
    err_console.print(Text.assemble(("error:", "bold red"), " ", str(e)))  # literal: "[/INST]", ":x:" as written
    raise typer.Exit(code=2)


def graphs_flag(text: str):
    """--cuda-graphs auto|on|off -> SpecDecoder's cuda_graphs."""
    flags = {"auto": "auto", "on": True, "off": False}
    if text.lower() not in flags:
        raise MMSpecError(f"--cuda-graphs must be auto, on or off, got {text!r}")
    return flags[text.lower()]


def check_prompt(prompt: str | None) -> None:
    if prompt is not None and not prompt.replace("<image>", "").strip():
        raise MMSpecError(f"--prompt {prompt!r} has no text; say what to ask about the image(s), "
                          "e.g. --prompt \"What is shown?\"")


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_weights(weights: str | None):
    """--weights "1,0.5" -> [1.0, 0.5]; "adaptive" (``adaptive:loglik``, ``adaptive:tabed:0.2``)
    -> an :class:`~mmspec.drafting.adaptive.AdaptiveWeights`; anything else is refused."""
    if not weights:
        return None
    if weights.strip().lower().split(":")[0] == "adaptive":
        from mmspec.drafting.adaptive import AdaptiveWeights

        try:
            return AdaptiveWeights.parse(weights.strip())
        except MMSpecError as e:
            raise MMSpecError(f"--weights {weights!r}: {e}") from None
    try:
        return [float(x) for x in weights.split(",")]
    except ValueError:
        raise MMSpecError(f"--weights {weights!r} is neither a comma-separated list of numbers nor adaptive; "
                          "give one number per view (--views MT --weights 1,0.5), or --weights adaptive "
                          "(adaptive:loglik, adaptive:tabed:0.2)") from None


def set_threads(threads: int | None, say: bool = False) -> int:
    """--threads: torch's CPU threads for this process (one place: :func:`mmspec.threads.apply_threads`);
    ``say``: print how many and why, one dim line (the commands that print a speed-up)."""
    n = apply_threads(threads)
    if say:
        console.print(f"[dim]{threads_note(threads, n)}[/dim]", highlight=False)
    return n
