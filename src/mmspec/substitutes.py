"""Substitute inputs: what a draft reads in place of the target's video (the target always gets
the real frames and verifies, so drafting from a substitute stays lossless).

Every substitute is one tensor in one layout, ``[S, C, H', W']`` float32 (S time steps of C
channels), so a draft-side encoder is written once per kind and the alignment layer after it
does not care where the input came from:

=========== =============================================== ==================================
kind        tensor                                          made by
=========== =============================================== ==================================
``events``  ``[n_bins, 2, H, W]`` event counts (+1, -1)     :func:`mmspec.events.simulate_dvs`
                                                            then :func:`mmspec.events.bin_events`
``low_fps`` ``[n_frames, C, H, W]`` in [0, 1]: frames       evenly spaced frames, first and last
                                                            kept
``low_res`` ``[T, C, size, size']`` in [0, 1]               area downscaling of every frame
=========== =============================================== ==================================

``C`` is 3 for RGB frames, 1 for grey. :func:`make_substitute` turns a clip's frames into any
kind; a real event camera's recording goes through :meth:`Substitute.from_events` (its
:class:`~mmspec.events.EventStream` binned the same way), so a draft trained on simulated
events reads recorded ones unchanged. A new kind is one function ``frames -> tensor`` added to
:data:`MAKERS`. This module owns only these conversions, not encoders or models.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mmspec.errors import MMSpecError
from mmspec.events import (
    DEFAULT_EPS,
    DEFAULT_FPS,
    DEFAULT_THRESHOLD,
    EventStream,
    bin_events,
    frames_array,
    simulate_dvs,
)

DEFAULT_BINS = 4  # time slices of an events substitute
DEFAULT_LOW_FPS_FRAMES = 2  # frames a low_fps substitute keeps: the first and the last
DEFAULT_LOW_RES_SIZE = 24  # px on the short side of a low_res substitute (96 -> 24: 1/16 the pixels)


@dataclass(frozen=True, eq=False)  # holds a tensor: compare .tensor with torch.equal
class Substitute:
    """A stand-in for a video, ready for a draft-side encoder."""

    kind: str  # a key of MAKERS ("events", "low_fps", "low_res")
    tensor: torch.Tensor  # [S, C, H', W'] float32 (see the module docstring per kind)
    source_shape: tuple[int, ...]  # [T, H, W, C] of the frames it stands in for; () for a recording
    opts: dict[str, Any] = field(default_factory=dict)  # the options it was made with

    @property
    def steps(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def channels(self) -> int:
        return int(self.tensor.shape[1])

    @property
    def size_ratio(self) -> float | None:
        """Values in the tensor per value of the source frames (None for a recording)."""
        return self.tensor.numel() / int(np.prod(self.source_shape)) if self.source_shape else None

    @classmethod
    def from_events(cls, stream: EventStream, n_bins: int = DEFAULT_BINS,
                    t_range: tuple[int, int] | None = None) -> Substitute:
        """The events substitute of a recorded (or simulated) stream: ``bin_events(stream, n_bins)``."""
        return cls("events", bin_events(stream, n_bins, t_range), (), {"n_bins": n_bins})


def _channels_first(video: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(video.transpose(0, 3, 1, 2))).float()  # [T, C, H, W]


def events_tensor(frames: Any, n_bins: int = DEFAULT_BINS, threshold: float = DEFAULT_THRESHOLD,
                  fps: float = DEFAULT_FPS, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """``[n_bins, 2, H, W]``: the clip's simulated DVS events, binned over the clip's span."""
    return bin_events(simulate_dvs(frames, threshold=threshold, fps=fps, eps=eps), n_bins)


def low_fps_tensor(frames: Any, n_frames: int = DEFAULT_LOW_FPS_FRAMES) -> torch.Tensor:
    """``[n_frames, C, H, W]``: ``n_frames`` frames evenly spaced over the clip (the first, and for
    ``n_frames >= 2`` the last, among them), as a camera at a lower frame rate would take them."""
    video = frames_array(frames)  # [T, H, W, C]
    if not 1 <= n_frames <= video.shape[0]:
        raise MMSpecError(f"low_fps n_frames must be in 1..{video.shape[0]} (the clip's frames), got {n_frames}")
    keep = np.rint(np.linspace(0, video.shape[0] - 1, n_frames)).astype(int)  # distinct: spacing >= 1
    return _channels_first(video[keep])


def low_res_tensor(frames: Any, size: int = DEFAULT_LOW_RES_SIZE) -> torch.Tensor:
    """``[T, C, size, size * W // H]``: every frame area-averaged down to ``size`` px high."""
    video = _channels_first(frames_array(frames))  # [T, C, H, W]
    h, w = video.shape[-2:]
    if not 1 <= size <= h:
        raise MMSpecError(f"low_res size must be in 1..{h} (the frames' height), got {size}")
    return F.interpolate(video, size=(size, max(1, round(size * w / h))), mode="area")


# kind -> frames (and options) -> tensor; add a kind here and make_substitute takes it
MAKERS: dict[str, Callable[..., torch.Tensor]] = {
    "events": events_tensor,
    "low_fps": low_fps_tensor,
    "low_res": low_res_tensor,
}


def make_substitute(frames: Any, kind: str, **opts: Any) -> Substitute:
    """The ``kind`` substitute of a clip's ``frames`` (PIL images or an array, as
    :func:`mmspec.events.frames_array` takes them); ``opts`` go to that kind's maker:
    events ``n_bins, threshold, fps, eps``; low_fps ``n_frames``; low_res ``size``."""
    if kind not in MAKERS:
        raise MMSpecError(f"unknown substitute kind {kind!r}; use one of {', '.join(MAKERS)}")
    maker = MAKERS[kind]
    video = frames_array(frames)  # [T, H, W, C], converted once; every maker takes it as is
    try:
        inspect.signature(maker).bind(video, **opts)
    except TypeError:
        known = [p for p in inspect.signature(maker).parameters][1:]
        raise MMSpecError(f"unknown option(s) {', '.join(sorted(opts))} for a {kind} substitute; "
                          f"it takes {', '.join(known) or 'none'}") from None
    return Substitute(kind, maker(video, **opts), tuple(video.shape), dict(opts))


__all__ = ["DEFAULT_BINS", "MAKERS", "Substitute", "events_tensor", "low_fps_tensor", "low_res_tensor",
           "make_substitute"]
