"""GPU check of the paged host store (design §6): a paged cache with scattered pages gives the
identity-table cache's logits, bit for bit, through the CUDA path (uva gather and store, the
fused append's host write, CUDA graphs, the scattered-page prefill kernel).

Random tiny model (``sparda.bench.models``, fp32 so both caches compute alike), two prompts
of a few hundred tokens, a third row without pages (decode padding), pages a random
permutation of a pool larger than needed (held pages finite garbage, pages nobody holds NaN). Prints one line per
(method, kv_dtype, growth) and exits non-zero on any difference or a stray write; a second identity
cache is the control (if it differs too, the difference is not the table's). ``grow`` is the
engine's grow-on-demand admission (design §3.11): a row starts with the pages of its prompt
and first decode token, and gets its next page just before the decode step (a CUDA graph
replay) whose token starts that block.

    python3 benchmarks/check_paged_host.py            # CUDA (--device cpu: the script's own smoke run)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.bench import point as pt  # noqa: E402
from sparda.bench.models import build_model, random_forecast, selection_config  # noqa: E402
from sparda.kernels import quant  # noqa: E402

METHODS = ("sparda", "sparse-offload", "sparda-no-prefetch")
KV_DTYPES = ("bf16", "int8", "int4", "mixed")


def _fill_nan(store) -> None:
    for chunks in store.chunks.values():
        for chunk in chunks:
            for t in (chunk.k, chunk.v):
                (t.scale if isinstance(t, quant.QuantizedKV) else t).fill_(float("nan"))


def _garbage(store, pages) -> None:
    """Finite garbage in ``pages`` (what a finished request left in a recycled page)."""
    for chunks in store.chunks.values():
        for chunk in chunks:
            local = [p - chunk.page0 for p in pages if chunk.page0 <= p < chunk.page1]
            for t in (chunk.k, chunk.v):
                for part in ([t.data, t.scale] if isinstance(t, quant.QuantizedKV) else [t]):
                    if part.dtype == torch.uint8:
                        part[:, local] = torch.randint(0, 256, part[:, local].shape, dtype=torch.uint8)
                    else:
                        part[:, local] = torch.randn(part[:, local].shape).to(part.dtype) * 50


def _nan_left(store, pages) -> bool:
    for chunks in store.chunks.values():
        for chunk in chunks:
            local = [p - chunk.page0 for p in pages if chunk.page0 <= p < chunk.page1]
            for t in (chunk.k, chunk.v):
                plane = t.scale if isinstance(t, quant.QuantizedKV) else t
                if not torch.isnan(plane[:, local]).all():
                    return False
    return True


def check(method: str, kv_dtype: str, model, forecast, sel, steps: int | None = None, grow: bool = False) -> bool:
    """One (method, kv_dtype): prefill, ``steps`` decode steps, logits compared each step;
    ``grow``: the paged rows' pages assigned as decode reaches them (``steps`` default: 24, or
    growing ``2 * block_size + 8``, so that a grown block is read back from its page)."""
    llm = pt.make_llm(model, method, sel, forecast if method.startswith("sparda") else None, kv_dtype=kv_dtype)
    runner, bs = llm.model_runner, sel.block_size
    steps = steps or (2 * bs + 8 if grow else 24)
    lengths = [int(torch.randint(300, 700, ())), int(torch.randint(100, 300, ()))]
    capacity = max(lengths) + steps + bs
    prompts = [torch.randint(10, 500, (n,)).tolist() for n in lengths]
    need = [-(-(n + steps) // bs) for n in lengths]
    ident, control = runner.new_cache(3, capacity), runner.new_cache(3, capacity)
    paged = runner.new_cache(3, capacity, host_blocks=sum(need) + 7)
    order = torch.randperm(paged.host_blocks).tolist()
    _fill_nan(paged.host)
    pages = [order[:need[0]], order[need[0]:need[0] + need[1]]]
    held = [-(-(n + 1) // bs) if grow else len(p) for n, p in zip(lengths, pages)]
    for row in (0, 1):
        paged.assign_blocks(row, pages[row][:held[row]])
    free = order[need[0] + need[1]:]
    _garbage(paged.host, order[:need[0] + need[1]])
    outs = []
    for cache in (ident, control, paged):
        llm.method.reset()
        logits = [runner.prefill(cache, row, ids)[-1] for row, ids in enumerate(prompts)]
        tok = torch.stack([x.argmax() for x in logits] + [torch.zeros((), dtype=torch.long, device=logits[0].device)])
        pos = torch.tensor(lengths + [0], device=tok.device)
        seq = [torch.stack(logits)]
        for step in range(steps):
            for row in (0, 1):  # growing: the page of the token this step writes, before the replay
                if cache is paged and -(-(int(pos[row]) + 1) // bs) > held[row]:
                    held[row] += 1
                    paged.assign_blocks(row, pages[row][:held[row]])
            out = runner.decode(cache, tok, pos, max_position=max(lengths) + step)
            seq.append(out[:2])
            tok = torch.cat([out[:2].argmax(-1), tok[2:]])
            pos = pos + torch.tensor([1, 1, 0], device=pos.device)
        outs.append(torch.stack(seq))
    if outs[0].is_cuda:
        torch.cuda.synchronize()
    same = torch.equal(outs[0], outs[2])
    clean = _nan_left(paged.host, free)
    diff = (outs[0] - outs[2]).abs().max().item()
    # a second identity cache: were the two identity runs themselves identical (determinism)?
    print(f"{method:20s} {kv_dtype:5s} {'grow' if grow else 'whole'} engine={paged.engine.name} identical={same} "
          f"max|diff|={diff:.3g} free pages untouched={clean} control identical={torch.equal(outs[0], outs[1])}")
    return same and clean


def main() -> int:
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("check_paged_host needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = build_model("tiny", device, torch.float32, 4096)
    forecast = random_forecast(model)
    sel = selection_config("tiny")
    ok = all([check(m, k, model, forecast, sel, grow=g) for m in METHODS for k in KV_DTYPES for g in (False, True)])
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
