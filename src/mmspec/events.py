"""Event streams: the format event cameras record, a DVS simulator for video, and time binning.

An event camera (DVS) reports per-pixel brightness *changes* instead of frames. This module owns:

- :class:`EventStream`, the format real recordings come in: one row per event, arrays ``t``
  (timestamps, **integer microseconds**), ``x`` (column, 0 = left), ``y`` (row, 0 = top), ``p``
  (polarity, +1 brighter / -1 darker), sorted by ``t``, plus the sensor's ``height`` and
  ``width``. A recording from a real camera is fed as it is through
  :meth:`EventStream.from_arrays` (times in s / ms / us / ns; polarity as +1/-1 or as 1/0 with
  0 = OFF, the convention of Prophesee/Metavision, DSEC, N-MNIST and tonic) or
  :meth:`EventStream.from_structured` (a numpy structured array with fields ``t, x, y, p``, as
  those tools and the ``.npy`` files they write hold them);
- :func:`simulate_dvs`: the standard DVS pixel model (Lichtsteiner, Posch and Delbruck, "A
  128x128 120 dB 15 us latency asynchronous temporal contrast vision sensor", IEEE JSSC 2008),
  simulated from video frames as the ESIM (Rebecq, Gehrig and Scaramuzza, CoRL 2018) and v2e
  (Hu, Liu and Delbruck, CVPR workshops 2021) simulators do. Per pixel, the
  log intensity ``L = log(luma + eps)``; a pixel emits +1 (or -1) each time ``L`` has risen (or
  fallen) by ``threshold`` from the level of its last event, so a change spanning several
  thresholds emits several events in one frame step, and a slow change accumulates over frames
  until it crosses. Timestamps are interpolated inside the frame interval, ``L`` taken as linear
  between frames. Vectorised over pixels with numpy (a loop over frames only), deterministic;
- :func:`bin_events`: the dense tensor a draft-side encoder reads, event counts per time slice
  and polarity, ``[n_bins, 2, H, W]``, from any stream, simulated or recorded;
- :func:`event_stats`: how sparse a stream is, against the dense frames it stands in for.

It knows nothing about the world, tokenizers or models (:mod:`mmspec.substitutes` turns a
stream into a draft's substitute input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmspec.errors import MMSpecError

DEFAULT_THRESHOLD = 0.2  # log-intensity contrast per event (typical DVS pixels: 0.1-0.5)
DEFAULT_EPS = 1e-2  # added to luma in [0, 1] before the log: dark pixels do not fire on noise
DEFAULT_FPS = 8.0  # the embedded world's clip rate (mmspec.world.VIDEO_FPS)
_TIME_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3}  # -> microseconds


@dataclass(frozen=True, eq=False)  # arrays: compare the fields yourself (np.array_equal)
class EventStream:
    """Events as a camera records them, one array entry per event, sorted by ``t``.

    ``t_range`` is the recorded time window ``(start, end)`` in microseconds, ends included;
    ``None`` means from the first event to the last. A simulated stream sets it to the clip's
    span, so binning lines up with the frames even where no event fell near an end.
    """

    t: np.ndarray  # [N] int64, microseconds, non-decreasing
    x: np.ndarray  # [N] int32, column in [0, width)
    y: np.ndarray  # [N] int32, row in [0, height)
    p: np.ndarray  # [N] int8, +1 (brighter) or -1 (darker)
    height: int
    width: int
    t_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        cast = {"t": np.int64, "x": np.int32, "y": np.int32, "p": np.int8}
        arrays = {k: np.asarray(getattr(self, k)) for k in cast}
        for name, a in arrays.items():
            if a.ndim != 1:
                raise MMSpecError(f"EventStream.{name} must be 1-D (one entry per event), got shape "
                                  f"{a.shape}; pass flat arrays, or a structured array to EventStream.from_structured")
            if a.size and not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.bool_)):
                raise MMSpecError(f"EventStream.{name} must hold integers, got {a.dtype}; timestamps "
                                  "in seconds (floats) go through EventStream.from_arrays(..., time_unit='s')")
        n = {len(a) for a in arrays.values()}
        if len(n) != 1:
            raise MMSpecError(f"EventStream arrays differ in length (t {len(arrays['t'])}, x {len(arrays['x'])}, "
                              f"y {len(arrays['y'])}, p {len(arrays['p'])}); pass one entry per event in each")
        if self.height < 1 or self.width < 1:
            raise MMSpecError(f"EventStream sensor size must be >= 1 x 1, got {self.height} x {self.width}")
        t, x, y, p = arrays["t"], arrays["x"], arrays["y"], arrays["p"]
        if t.size:
            if x.min() < 0 or x.max() >= self.width or y.min() < 0 or y.max() >= self.height:
                raise MMSpecError(f"event coordinates fall outside the {self.height} x {self.width} sensor "
                                  f"(x in [{x.min()}, {x.max()}], y in [{y.min()}, {y.max()}]); pass the "
                                  "sensor's real height and width (or crop the events to it)")
            if not np.isin(p, (-1, 1)).all():
                raise MMSpecError(f"EventStream.p must be +1 or -1, got values {np.unique(p)[:5].tolist()}; "
                                  "for 1/0 polarity (0 = OFF) build with EventStream.from_arrays")
            if (np.diff(t) < 0).any():
                raise MMSpecError("EventStream.t must be non-decreasing (events in time order); sort the "
                                  "events, or build with EventStream.from_arrays, which sorts them")
        if self.t_range is not None:
            start, end = (int(v) for v in self.t_range)
            if end < start:
                raise MMSpecError(f"EventStream.t_range {self.t_range} ends before it starts; pass (start, end)")
            object.__setattr__(self, "t_range", (start, end))
        for name, a in arrays.items():
            object.__setattr__(self, name, a.astype(cast[name], copy=False))

    @classmethod
    def from_arrays(
        cls, t: Any, x: Any, y: Any, p: Any, height: int, width: int, time_unit: str = "us",
        t_range: tuple[float, float] | None = None,
    ) -> EventStream:
        """A stream from a recording's arrays: ``t`` in ``time_unit`` ("s", "ms", "us" or "ns"),
        ``p`` as +1/-1 or 1/0 (0 = OFF, darker); sorted by time (stably) if it is not already.
        ``t_range``, if given, is in ``time_unit`` too."""
        if time_unit not in _TIME_UNITS:
            raise MMSpecError(f"unknown time_unit {time_unit!r}; use one of {', '.join(_TIME_UNITS)}")
        scale = _TIME_UNITS[time_unit]
        t_us = np.asarray(t)
        if t_us.size and np.issubdtype(t_us.dtype, np.floating) and not np.isfinite(t_us).all():
            bad = np.flatnonzero(~np.isfinite(t_us))
            raise MMSpecError(f"the timestamps hold {t_us[bad[0]]} at event {int(bad[0])} ({len(bad)} event(s) in all "
                              "with no finite time); drop those events (or fill in their times) before building "
                              "the EventStream")
        if scale != 1.0 or not np.issubdtype(t_us.dtype, np.integer):
            t_us = np.rint(t_us.astype(np.float64) * scale).astype(np.int64)
        p = np.asarray(p)
        if p.size and not np.isin(p, (-1, 0, 1)).all():
            raise MMSpecError(f"polarity must be +1/-1 or 1/0 (0 = OFF), got values {np.unique(p)[:5].tolist()}")
        p = np.where(p > 0, 1, -1).astype(np.int8)
        x, y = np.asarray(x), np.asarray(y)
        if t_us.ndim == 1 and t_us.size and (np.diff(t_us) < 0).any():
            order = np.argsort(t_us, kind="stable")
            t_us, x, y, p = t_us[order], x[order], y[order], p[order]
        window = None if t_range is None else (round(t_range[0] * scale), round(t_range[1] * scale))
        return cls(t_us, x, y, p, height, width, window)

    @classmethod
    def from_structured(cls, events: np.ndarray, height: int, width: int, time_unit: str = "us") -> EventStream:
        """A stream from a numpy structured array with fields ``t``, ``x``, ``y``, ``p`` (any order,
        other fields ignored), as Metavision, tonic and their ``.npy`` files hold events."""
        names = events.dtype.names or ()
        missing = [f for f in ("t", "x", "y", "p") if f not in names]
        if missing:
            raise MMSpecError(f"the structured array lacks field(s) {', '.join(missing)} (it has "
                              f"{', '.join(names) or 'none'}); rename them to t, x, y, p or use "
                              "EventStream.from_arrays")
        return cls.from_arrays(events["t"], events["x"], events["y"], events["p"], height, width, time_unit)

    def __len__(self) -> int:
        return int(self.t.size)

    @property
    def window(self) -> tuple[int, int]:
        """``(start, end)`` in microseconds: ``t_range``, else the first and last event's times."""
        if self.t_range is not None:
            return self.t_range
        return (int(self.t[0]), int(self.t[-1])) if len(self) else (0, 0)


# ----------------------------------------------------------------------------- frames


def frames_array(frames: Any) -> np.ndarray:
    """Video frames as ``[T, H, W, C]`` float64 in [0, 1] (C = 3, or 1 for grey input).

    Takes a sequence of PIL images (any mode; converted to RGB unless greyscale), or a numpy
    array / torch tensor ``[T, H, W]`` (intensity) or ``[T, H, W, 3]`` (RGB, channels last, as
    video decoders give them); uint8 is scaled by 1/255, floats are taken as intensities in [0, 1].
    """
    if isinstance(frames, (list, tuple)) and frames and isinstance(frames[0], Image.Image):
        sizes = {im.size for im in frames}
        if len(sizes) != 1:
            raise MMSpecError(f"the frames differ in size ({', '.join(f'{w}x{h}' for w, h in sorted(sizes))}); "
                              "resize them to one size first (all frames of a clip come from one sensor)")
        grey = all(im.mode in ("L", "I", "F", "1") for im in frames)
        arr = np.stack([np.asarray(im.convert("L" if grey else "RGB"), dtype=np.float64) for im in frames]) / 255.0
        return arr[..., None] if grey else arr
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise MMSpecError("no frames given; pass at least one frame")
        try:
            frames = np.stack([np.asarray(f) for f in frames])
        except ValueError:
            raise MMSpecError("the frames differ in size; resize them to one size first") from None
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu().numpy()
    arr = np.asarray(frames)
    if arr.ndim == 3:
        arr = arr[..., None]
    if arr.ndim != 4 or arr.shape[-1] not in (1, 3) or arr.shape[0] < 1:
        raise MMSpecError(f"frames of shape {tuple(np.shape(frames))} are not a video; pass a list of PIL "
                          "images, or an array [T, H, W] (grey) or [T, H, W, 3] (RGB, channels last)")
    if arr.dtype == np.uint8:
        return arr.astype(np.float64) / 255.0
    arr = arr.astype(np.float64)
    if (arr < 0).any() or not np.isfinite(arr).all():
        raise MMSpecError("frame intensities must be finite and >= 0; pass uint8 frames or floats in [0, 1]")
    return arr


def luma(video: np.ndarray) -> np.ndarray:
    """``[T, H, W, C]`` in [0, 1] -> ``[T, H, W]`` intensity: ITU-R BT.601 luma for RGB (a DVS
    pixel is monochrome), the channel itself for grey."""
    if video.shape[-1] == 1:
        return video[..., 0]
    return video @ np.array([0.299, 0.587, 0.114])


# ----------------------------------------------------------------------------- DVS model


def simulate_dvs(
    frames: Any, threshold: float = DEFAULT_THRESHOLD, fps: float = DEFAULT_FPS, eps: float = DEFAULT_EPS
) -> EventStream:
    """The events a DVS pixel array would emit watching ``frames`` (see the module docstring).

    Frame ``k`` is at ``k / fps`` seconds; the stream's ``t_range`` is ``(0, (T-1) / fps)`` in
    microseconds and the first frame sets every pixel's reference level (it emits nothing).
    Events within one frame step are ordered by time, then row, then column.
    """
    if not threshold > 0 or not fps > 0 or not eps > 0:
        raise MMSpecError(f"threshold, fps and eps must be > 0, got threshold={threshold}, fps={fps}, eps={eps}")
    level = np.log(luma(frames_array(frames)) + eps)  # [T, H, W] log intensity
    n_frames, height, width = level.shape
    dt_us = 1e6 / fps
    ref = level[0].ravel().copy()  # [H*W] each pixel's level at its last event
    chunks: list[tuple[np.ndarray, ...]] = []
    for k in range(1, n_frames):
        prev, cur = level[k - 1].ravel(), level[k].ravel()  # [H*W]
        diff = cur - ref
        count = np.floor(np.abs(diff) / threshold).astype(np.int64)  # [H*W] crossings this step
        pix = np.flatnonzero(count)  # [M] pixels that fire
        if pix.size == 0:
            continue
        cnt, sign = count[pix], np.sign(diff[pix])  # [M]
        ev_pix = np.repeat(pix, cnt)  # [E] one entry per event
        nth = np.arange(ev_pix.size) - np.repeat(np.cumsum(cnt) - cnt, cnt) + 1  # [E] 1..cnt per pixel
        ev_sign = np.repeat(sign, cnt)  # [E]
        crossed = ref[ev_pix] + ev_sign * nth * threshold  # [E] the level each event marks
        p0, p1 = prev[ev_pix], cur[ev_pix]
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.where(p1 != p0, (crossed - p0) / (p1 - p0), 1.0)  # where in the step L crossed it
        t_us = np.rint((k - 1 + np.clip(frac, 0.0, 1.0)) * dt_us).astype(np.int64)
        order = np.lexsort((ev_pix, t_us))  # by time, then pixel (row-major): deterministic
        chunks.append((t_us[order], ev_pix[order], ev_sign[order]))
        ref[pix] += sign * cnt * threshold  # the reference moves to the last event's level
    if chunks:
        t, pix, sign = (np.concatenate(c) for c in zip(*chunks))
    else:
        t, pix, sign = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    y, x = np.divmod(pix, width)
    return EventStream(t, x, y, sign.astype(np.int8), height, width, (0, round((n_frames - 1) * dt_us)))


# ----------------------------------------------------------------------------- binning and statistics


def bin_events(stream: EventStream, n_bins: int, t_range: tuple[int, int] | None = None) -> torch.Tensor:
    """Event counts per time slice and polarity: ``[n_bins, 2, H, W]`` float32, channel 0 the
    positive (+1) events, channel 1 the negative ones.

    The window ``t_range`` (microseconds, ends included; default ``stream.window``) is cut into
    ``n_bins`` equal slices; an event at the window's end counts in the last slice, and events
    outside the window are left out.
    """
    if n_bins < 1:
        raise MMSpecError(f"n_bins must be >= 1, got {n_bins}")
    start, end = stream.window if t_range is None else (int(t_range[0]), int(t_range[1]))
    if end < start:
        raise MMSpecError(f"t_range {t_range} ends before it starts; pass (start, end) in microseconds")
    h, w = stream.height, stream.width
    inside = (stream.t >= start) & (stream.t <= end)
    t, x, y, p = stream.t[inside], stream.x[inside], stream.y[inside], stream.p[inside]
    span = max(end - start, 1)
    b = np.minimum((t - start) * n_bins // span, n_bins - 1)  # [N] slice of each event (exact integers)
    flat = ((b * 2 + (p < 0)) * h + y.astype(np.int64)) * w + x  # [N] index into [n_bins, 2, H, W]
    counts = np.bincount(flat, minlength=n_bins * 2 * h * w)
    return torch.from_numpy(counts.reshape(n_bins, 2, h, w).astype(np.float32))


@dataclass(frozen=True)
class EventStats:
    """How much a stream holds, and against the dense frames it stands in for."""

    n_events: int
    n_positive: int
    n_negative: int
    duration_s: float  # the window's length
    events_per_second: float  # n_events / duration_s (0 for a zero-length window)
    events_per_pixel: float  # n_events / (height * width) over the whole window
    active_pixels: float  # share of sensor pixels with at least one event
    events_per_frame_value: float | None  # n_events / (n_frames * H * W * channels), with n_frames given


def event_stats(stream: EventStream, n_frames: int | None = None, channels: int = 3) -> EventStats:
    """Counts and sparsity of ``stream``; with ``n_frames`` also the events per value of the
    ``[n_frames, H, W, channels]`` frames it replaces (an event is 4 numbers, a frame value 1
    byte: below ~0.25 the raw stream is the smaller input, far below it on a still scene)."""
    n, pixels = len(stream), stream.height * stream.width
    start, end = stream.window
    duration = (end - start) / 1e6
    active = np.unique(stream.y.astype(np.int64) * stream.width + stream.x).size
    return EventStats(
        n_events=n,
        n_positive=int((stream.p > 0).sum()),
        n_negative=int((stream.p < 0).sum()),
        duration_s=duration,
        events_per_second=n / duration if duration > 0 else 0.0,
        events_per_pixel=n / pixels,
        active_pixels=active / pixels,
        events_per_frame_value=None if n_frames is None else n / (n_frames * pixels * channels),
    )


__all__ = [
    "DEFAULT_EPS", "DEFAULT_FPS", "DEFAULT_THRESHOLD", "EventStats", "EventStream",
    "bin_events", "event_stats", "frames_array", "luma", "simulate_dvs",
]  # fmt: skip
