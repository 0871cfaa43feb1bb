"""h2o's prefill block mass on the GPU: the SDPA-backward pass against the materialised softmax.

Usage (from the repository root, on a CUDA machine):

    python3 benchmarks/h2o_prefill_gpu.py [--out FILE.json]

For the bundled model's attention shape (3 KV heads x 3 query heads, d = 64, block 32) at
2,048, 4,096 and 7,680 tokens, bf16 queries and keys (as the model gives them): the mass of
:func:`sparda.attention.h2o.prefill_block_mass` (SDPA forward + backward, fp32) against
:func:`sparda.kernels.reference.block_attention_mass` summed over queries and the group (the
pass it replaced, fp32 softmax materialised in 256 MB query chunks), plus a later prefill
chunk (the last 1,000 queries of the keys). Prints the largest relative error and the time
of each (median of 5 after a warm-up, CUDA-synchronised), in a short table.
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

from sparda.attention import h2o  # noqa: E402
from sparda.kernels import reference as ref  # noqa: E402

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


def old_mass(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The materialised pass (before): reference block mass per query, summed."""
    t, total = q.shape[-2], k.shape[-2]
    q_pos = torch.arange(total - t, total, device=q.device).view(1, -1)
    kv_len = torch.tensor([total], device=q.device)
    chunk = max(1, h2o.MASS_CHUNK_BYTES // (4 * H * G * t))
    return ref.block_attention_mass(q, k, q_pos, kv_len, BLOCK, chunk=chunk).sum(2)


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
        for total, t in ((2048, 2048), (4096, 4096), (7680, 7680), (7680, 1000)):
            q = (torch.randn(1, H, G, t, D, device="cuda", generator=gen) * 1.5).bfloat16()
            k = (torch.randn(1, H, total, D, device="cuda", generator=gen) * 1.5).bfloat16()
            new, old = h2o.prefill_block_mass(q, k, BLOCK), old_mass(q, k)
            err = float(((new - old).abs() / old.abs().clamp(min=1e-3)).max())
            rows.append(dict(keys=total, queries=t, max_rel_err=err, sum_new=float(new.sum()), sum_want=G * H * t,
                             ms_sdpa_backward=_time(lambda: h2o.prefill_block_mass(q, k, BLOCK)),
                             ms_materialised=_time(lambda: old_mass(q, k))))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=dict(H=H, G=G, d=D, block=BLOCK))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta, rows=rows), indent=1))
    print(f"{'keys':>6} {'queries':>7} {'max rel err':>11} {'SDPA bwd ms':>11} {'materialised ms':>15} {'speed-up':>8}")
    for r in rows:
        print(f"{r['keys']:>6} {r['queries']:>7} {r['max_rel_err']:>11.2e} {r['ms_sdpa_backward']:>11.2f} "
              f"{r['ms_materialised']:>15.2f} {r['ms_materialised'] / r['ms_sdpa_backward']:>7.1f}x")
    ok = all(r["max_rel_err"] < 1e-3 for r in rows)
    print("masses agree" if ok else "MASSES DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
