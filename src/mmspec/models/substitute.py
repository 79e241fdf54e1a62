"""The draft's reader of a substitute input (events, low-fps or low-res video): a small encoder
and an alignment layer that maps its output into the draft LM's embedding space.

The target always reads the real video and verifies, so whatever the draft reads, decoding stays
lossless; the point of a substitute is that it is far cheaper to encode than dense frames (an
event stream is sparse: about 2% of a world clip's frame values, :mod:`mmspec.events`).

:class:`SubstituteEncoder`: the substitute tensor ``[S, C, H, W]`` (:mod:`mmspec.substitutes`)
with its S time steps stacked as channels -> two strided convolutions -> adaptive pooling to a
near-square grid of ``n_tokens`` cells -> the alignment layer (a linear map to the draft's
width). It is trained by ``mmspec train align`` to match the draft's own features of the real
video, and saves as a directory (``mmspec_substitute.json`` + ``model.safetensors``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mmspec.errors import MMSpecError

CONFIG_NAME = "mmspec_substitute.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class SubstituteConfig:
    kind: str  # "events", "low_fps", "low_res" (mmspec.substitutes.MAKERS)
    steps: int  # S of the substitute tensor
    channels: int  # C
    height: int  # the encoder's input size (substitutes are resized to it)
    width: int
    n_tokens: int  # tokens per video it gives the draft
    out_size: int  # the draft LM's hidden size
    hidden: int = 64
    opts: dict = field(default_factory=dict)  # make_substitute options (n_bins, threshold, size, ...)
    trained: dict = field(default_factory=dict)  # the recipe that trained it

    @property
    def grid(self) -> tuple[int, int]:
        gh = max(1, int(math.isqrt(self.n_tokens)))
        while self.n_tokens % gh:
            gh -= 1
        return gh, self.n_tokens // gh


class SubstituteEncoder(nn.Module):
    def __init__(self, cfg: SubstituteConfig):
        super().__init__()
        self.config = cfg
        c = cfg.steps * cfg.channels
        self.conv1 = nn.Conv2d(c, cfg.hidden, kernel_size=4, stride=4)
        self.conv2 = nn.Conv2d(cfg.hidden, cfg.hidden, kernel_size=2, stride=2)
        self.align = nn.Linear(cfg.hidden, cfg.out_size)  # the alignment layer: into the draft LM's space

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, C, H, W] (or one substitute [S, C, H, W]) -> tokens [B, n_tokens, out_size]."""
        one = x.dim() == 4
        if one:
            x = x[None]
        B, S, C, H, W = x.shape
        cfg = self.config
        if (S, C) != (cfg.steps, cfg.channels):
            raise MMSpecError(f"this substitute encoder reads {cfg.kind} of {cfg.steps} steps x {cfg.channels} "
                              f"channels, got {S} x {C}; make the substitute with the options it was trained on "
                              f"({cfg.opts})")
        x = x.reshape(B, S * C, H, W).to(self.conv1.weight.dtype)
        if (H, W) != (cfg.height, cfg.width):
            x = F.interpolate(x, size=(cfg.height, cfg.width), mode="area")
        h = F.gelu(self.conv2(F.gelu(self.conv1(x))))  # [B, hidden, h', w']
        h = F.adaptive_avg_pool2d(h, cfg.grid).flatten(2).transpose(1, 2)  # [B, n_tokens, hidden]
        out = self.align(h)
        return out[0] if one else out

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=1))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path / WEIGHTS_NAME))
        return path


def build_substitute_encoder(kind: str, example: torch.Tensor, n_tokens: int, out_size: int, *, hidden: int = 64,
                             opts: dict | None = None, seed: int = 0) -> SubstituteEncoder:
    """An untrained encoder for substitutes shaped like ``example`` [S, C, H, W]."""
    S, C, H, W = example.shape
    cfg = SubstituteConfig(kind=kind, steps=S, channels=C, height=max(8, H), width=max(8, W), n_tokens=n_tokens,
                           out_size=out_size, hidden=hidden, opts=dict(opts or {}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SubstituteEncoder(cfg).eval()


def is_substitute_dir(path) -> bool:
    return isinstance(path, (str, Path)) and (Path(path) / CONFIG_NAME).is_file()


def load_substitute_encoder(path: str | Path) -> SubstituteEncoder:
    from safetensors.torch import load_file

    path = Path(path)
    if not is_substitute_dir(path):
        raise MMSpecError(f"'{path}' is not a substitute encoder directory (no {CONFIG_NAME}); make one with "
                          "mmspec train align")
    enc = SubstituteEncoder(SubstituteConfig(**json.loads((path / CONFIG_NAME).read_text())))
    enc.load_state_dict(load_file(str(path / WEIGHTS_NAME)))
    return enc.eval()
