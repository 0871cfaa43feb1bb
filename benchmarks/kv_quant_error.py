"""KV quantisation error on the bundled model's real K/V (and Gaussian data): the numbers
behind the scheme chosen in docs/kv_quant.md. CPU, about a minute.

Compares, at int8 and int4, three ways to choose the scales:

* ``sym``: per token and head, ``step = max|x| / (2**(b-1) - 1)``, signed levels;
* ``asym``: per token and head, ``step = (max - min) / (2**b - 1)``, offset ``min``
  (:mod:`sparda.kernels.quant`, what sparda stores);
* ``chan``: KIVI-style per channel over groups of 64 tokens (one KV block), asymmetric.

Prints the relative Frobenius error of K and V (mean over layers) and of one decode
attention output per layer (the mean of the last 64 keys as the query; V asym).

    PYTHONPATH=src python3 benchmarks/kv_quant_error.py
"""

from __future__ import annotations

import math

import torch

from sparda.data import heldout_text
from sparda.engine.llm import LLM
from sparda.kernels import quant


def sym(x: torch.Tensor, bits: int) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / qmax
    return (x / s).round().clamp(-qmax, qmax) * s


def asym(x: torch.Tensor, bits: int) -> torch.Tensor:
    kv = "int8" if bits == 8 else "int4"
    return quant.QuantizedKV.quantize(x, kv).dequantize(x.dtype)


def chan(x: torch.Tensor, bits: int, group: int = 64) -> torch.Tensor:
    b, h, t, d = x.shape
    t2 = t // group * group
    g = x[:, :, :t2].reshape(b, h, t2 // group, group, d).transpose(-1, -2)
    return torch.cat([asym(g, bits).transpose(-1, -2).reshape(b, h, t2, d), x[:, :, t2:]], 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def attention(q, k, v):
    p = (torch.einsum("bhgd,bhtd->bhgt", q, k) / math.sqrt(k.shape[-1])).softmax(-1)
    return torch.einsum("bhgt,bhtd->bhgd", p, v)


def main() -> None:
    schemes = {"sym": sym, "asym": asym, "chan": chan}
    torch.manual_seed(0)
    x = torch.randn(1, 4, 2048, 64, dtype=torch.float64)
    for bits in (8, 4):
        print(f"gaussian int{bits}:", {n: round(rel(f(x, bits), x), 4) for n, f in schemes.items()})
    llm = LLM(method="dense", device="cpu")
    ids = llm.tokenizer.encode(heldout_text()[20000:60000])[:2048]
    cache = llm.new_cache(1, len(ids))
    llm.prefill(cache, 0, ids)
    for bits in (8, 4):
        for name, store in (("K", cache.k), ("V", cache.v)):
            errs = {n: sum(rel(f(t.double(), bits), t.double()) for t in store) / len(store)
                    for n, f in schemes.items()}
            print(f"bundled {name} int{bits}:", {n: round(e, 4) for n, e in errs.items()})
        for name, f in schemes.items():
            errs = []
            for k, v in zip(cache.k, cache.v):
                k, v = k.double(), v.double()
                q = k[:, :, -64:].mean(2, keepdim=True)
                errs.append(rel(attention(q, f(k, bits), asym(v, bits)), attention(q, k, v)))
            print(f"bundled attention output int{bits}, K {name}:", round(sum(errs) / len(errs), 4))


if __name__ == "__main__":
    main()
