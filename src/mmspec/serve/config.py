"""``mmspec serve``'s settings, :class:`ServeConfig`: each default written once, here (the
command line's flags take theirs from this class and are mapped onto it: :mod:`mmspec.cli.serve`);
the policy and the tool-call parser are checked here only (named by their flags, the words most
users see). Imports nothing heavy (the CLI reads it before any model loads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mmspec.config import SPECULATE
from mmspec.errors import MMSpecError
from mmspec.serve.structured import TOOL_CALL_PARSERS


@dataclass
class ServeConfig:
    """``mmspec serve``'s settings (the CLI maps its flags onto these)."""

    model_name: str = "mmspec"
    max_batch: int = 16  # requests decoded together
    speculate: str = "auto"  # BatchScheduler's policy, one of mmspec.config.SPECULATE (auto: drafting off where it loses)
    max_tokens: int = 512  # a request's max_tokens when it gives none (capped by the room in the context)
    max_images: int | None = None  # images per request; None: as many as the target's context holds
    allowed_media: list[Path] = field(default_factory=list)  # directories local image files may come from
    shutdown_timeout_s: float = 30.0  # after SIGTERM, how long running requests get to finish
    max_request_mb: float = 32.0  # request bodies past this are refused (413) while they arrive
    max_image_pixels: int | None = 4096 * 4096  # per image, read from its header before decoding
    max_request_pixels: int | None = 4 * 4096 * 4096  # all of a request's images together
    api_key: str | None = None  # /v1/ routes need "Authorization: Bearer <api_key>"
    allowed_hosts: list[str] | None = None  # Host header names answered (None: any)
    cors_origins: list[str] = field(default_factory=list)  # origins browsers may call from (none: CORS off)
    metrics: bool = True  # GET /metrics (prometheus-client)
    tool_call_parser: str | None = None  # "hermes": tool_choice "auto" parses <tool_call> tags (None: "auto" refused)

    def __post_init__(self) -> None:
        if self.speculate not in SPECULATE:
            raise MMSpecError(f"--speculate must be one of {', '.join(SPECULATE)}, got {self.speculate!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise MMSpecError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)} (checkpoints that "
                              f"write <tool_call>{{...}}</tool_call> tags), got {self.tool_call_parser!r}")
