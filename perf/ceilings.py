"""The machine and its two ceilings, first thing in a GPU pass (`perf/gpu_pass.sh`'s env step):
``nvidia-smi``, the versions that matter (python, torch, CUDA, transformers, the project's commit),
the device's copy bandwidth (bytes read + written per second, a large device-to-device copy:
the memory floor every decode is measured against) and its dense matrix-product rate (a
bfloat16 N x N x N product, FLOP/s). Writes ``env.json`` beside a printed summary.

Each figure is the median of ``--repeats`` timings of ``INNER`` back-to-back calls
(:func:`mmspec.timing.median_time`: synced, warm-up first). On a CPU (``--device cpu``, dry runs)
the same code runs with small sizes; its figures mean nothing.

    python perf/ceilings.py --out runs/env.json
    python perf/ceilings.py --device cpu --copy-mib 8 --matmul 128 --repeats 2 --out /tmp/env.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from mmspec.provenance import now
from mmspec.timing import median_time

INNER = 5  # calls per timing: the sync around them is shared


def nvidia_smi() -> str:
    """``nvidia-smi``'s table, or why there is none."""
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"no nvidia-smi: {type(e).__name__}: {e}"


def versions() -> dict:
    import transformers

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None  # a copy of the tree without its .git
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "commit": commit}


def copy_rate(device: torch.device, mib: int, repeats: int) -> float:
    """Bytes read + written per second by a ``mib`` MiB device-to-device copy."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return INNER * 2 * src.numel() / median_time(lambda: [dst.copy_(src) for _ in range(INNER)], device, repeats, 1)


def matmul_rate(device: torch.device, n: int, repeats: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of an ``n`` x ``n`` x ``n`` product in ``dtype``."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    return INNER * 2 * n**3 / median_time(lambda: [a @ b for _ in range(INNER)], device, repeats, 1)


def measure(device: torch.device, copy_mib: int, matmul_n: int, repeats: int) -> dict:
    res = {"date": now(), **versions(), "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        res |= {"gpu": p.name, "sms": p.multi_processor_count, "memory_GiB": round(p.total_memory / 2**30, 1)}
    res |= {"copy_MiB": copy_mib, "copy_GBps_read_plus_write": copy_rate(device, copy_mib, repeats) / 1e9,
            "matmul_n": matmul_n, "bf16_matmul_TFLOPs": matmul_rate(device, matmul_n, repeats) / 1e12}
    return res


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the copied buffer")
    ap.add_argument("--matmul", type=int, default=8192, help="N of the bf16 N x N x N product")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="runs/env.json")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    print(nvidia_smi().rstrip(), flush=True)
    res = measure(torch.device(a.device), a.copy_mib, a.matmul, a.repeats)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"python {res['python']}, torch {res['torch']} (CUDA {res['cuda']}), transformers {res['transformers']}, "
          f"commit {res['commit']}; {res.get('gpu', res['device'])}")
    print(f"copy {res['copy_GBps_read_plus_write']:.0f} GB/s (read + write, {a.copy_mib} MiB); "
          f"bf16 {a.matmul}^3 matmul {res['bf16_matmul_TFLOPs']:.1f} TFLOP/s; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
