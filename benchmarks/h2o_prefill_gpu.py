"""h2o's prefill block mass on the GPU: the Triton kernel against the SDPA-backward twin.

Usage (from the repository root, on a CUDA machine):

    python3 benchmarks/h2o_prefill_gpu.py [--out FILE.json]

For the bundled model's attention shape (3 KV heads x 3 query heads, d = 64, block 32) at
2,048, 4,096 and 7,680 tokens, bf16 queries and keys (as the model gives them), plus a
later prefill chunk (the last 1,000 queries of 7,680 keys) and one fp32 case:
:func:`sparda.kernels.prefill_block_mass` (on CUDA the two Triton passes of
:mod:`sparda.kernels.attention_mass`: bf16 ``tl.dot`` with fp32 accumulation, IEEE fp32
dots for fp32 inputs) against :func:`sparda.kernels.twins.token_attention_mass_reference`
summed onto blocks (SDPA forward + backward in fp32, the path it replaced on CUDA) and
against float64 (a materialised softmax, query chunks). Prints the largest relative errors
and the time of each path (median of 5 after a warm-up, CUDA-synchronised), in a short
table; exits 1 if the Triton mass is off by more than 1e-3 relative to float64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda import kernels  # noqa: E402
from sparda.kernels import twins  # noqa: E402

H, G, D, BLOCK = 3, 3, 64, 32


def _time(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def twin_mass(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The SDPA-backward path (fp32), summed onto blocks."""
    mass = twins.token_attention_mass_reference(q, k)
    total = k.shape[-2]
    mass = torch.nn.functional.pad(mass, (0, -total % BLOCK))
    return mass.view(*mass.shape[:-1], -1, BLOCK).sum(-1)


def fp64_mass(q: torch.Tensor, k: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """float64 softmax, materialised ``chunk`` queries at a time, summed onto blocks."""
    t, total = q.shape[-2], k.shape[-2]
    kd = k.double()
    keys = torch.arange(total, device=q.device)
    mass = torch.zeros(k.shape[0], H, total, dtype=torch.float64, device=q.device)
    for s in range(0, t, chunk):
        qd = q[..., s:s + chunk, :].double()
        pos = torch.arange(total - t + s, total - t + s + qd.shape[-2], device=q.device)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qd, kd) / D ** 0.5
        logits = logits.masked_fill(keys.view(1, -1) > pos.view(-1, 1), float("-inf"))
        mass += torch.softmax(logits, -1).sum((2, 3))
    mass = torch.nn.functional.pad(mass, (0, -total % BLOCK))
    return mass.view(*mass.shape[:-1], -1, BLOCK).sum(-1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b).abs() / b.abs().clamp(min=1e-3)).max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs CUDA", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.inference_mode():
        for total, t, dtype in ((2048, 2048, torch.bfloat16), (4096, 4096, torch.bfloat16),
                                (7680, 7680, torch.bfloat16), (7680, 1000, torch.bfloat16),
                                (4096, 4096, torch.float32)):
            q = (torch.randn(1, H, G, t, D, device="cuda", generator=gen) * 1.5).to(dtype)
            k = (torch.randn(1, H, total, D, device="cuda", generator=gen) * 1.5).to(dtype)
            new, old, want = kernels.prefill_block_mass(q, k, BLOCK), twin_mass(q, k), fp64_mass(q, k)
            rows.append(dict(keys=total, queries=t, dtype=str(dtype).split(".")[-1],
                             rel_err_triton=_rel(new, want), rel_err_sdpa=_rel(old, want),
                             sum_triton=float(new.sum()), sum_want=G * H * t,
                             ms_triton=_time(lambda: kernels.prefill_block_mass(q, k, BLOCK)),
                             ms_sdpa_backward=_time(lambda: twin_mass(q, k))))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=dict(H=H, G=G, d=D, block=BLOCK))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta, rows=rows), indent=1))
    print(f"{'keys':>6} {'queries':>7} {'dtype':>8} {'err triton':>10} {'err sdpa':>9} {'triton ms':>9} "
          f"{'SDPA bwd ms':>11} {'speed-up':>8}")
    for r in rows:
        print(f"{r['keys']:>6} {r['queries']:>7} {r['dtype']:>8} {r['rel_err_triton']:>10.2e} {r['rel_err_sdpa']:>9.2e} "
              f"{r['ms_triton']:>9.2f} {r['ms_sdpa_backward']:>11.2f} {r['ms_sdpa_backward'] / r['ms_triton']:>7.1f}x")
    ok = all(r["rel_err_triton"] < 1e-3 for r in rows)
    print("masses agree" if ok else "MASSES DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
