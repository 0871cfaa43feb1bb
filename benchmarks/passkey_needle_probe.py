"""Where block selection loses a pass key: per decode step, layer and KV head (CPU, fp32).

Rebuilds one ``sparda eval`` passkey prompt (task ``passkey``, its seed and depth, as
``runs/eval-gpu/*/results.jsonl`` record them), generates greedily with ``--method`` and,
at every decode step and every (layer, KV head) whose exact attention puts at least
``--min-mass`` of the query group's mass on a block holding a pass-key token, prints

* ``mass``: that block's share of the group's exact attention (the step's own query over
  every cached key: what dense attention would read there);
* ``rank oracle`` / ``rank ck``: the block's rank among the top-k candidates (neither sink
  nor local) under exact attention mass and under ``sparse``'s compressed-key score
  (group-summed softmax over the mean-pooled keys, max-pooled onto blocks, design §3.2-3.3);
* ``sel``: whether the method's own selection held it.

With ``--check`` (``sparse`` only), every decode selection is also rebuilt from the cached
keys by an independent float64 brute force (window means, softmax, block max over
overlapping windows, sinks + local + top-k with ties to the lower block) and compared
with the runtime's mask. ``--dense-heads L:H,...`` makes those (layer, KV head) pairs read
every block in decode (the causal test: does the answer come back?).

    PYTHONPATH=src python3 benchmarks/passkey_needle_probe.py --seed 1 --depth 0.25 --check
    PYTHONPATH=src python3 benchmarks/passkey_needle_probe.py --seed 1 --depth 0.25 --dense-heads 7:2,18:2

About 45 s per prompt at 7,680 tokens on two CPU cores.
"""

from __future__ import annotations

import argparse
import math
import types

import torch

from sparda.data import heldout_text
from sparda.engine.llm import LLM
from sparda.eval.tasks import make_sample
from sparda.kernels import reference as ref


def key_token_positions(tokenizer, ids: list[int], key: str) -> list[int]:
    """Prompt positions (tokens) of the tokens that spell an occurrence of ``key``."""
    pieces = [tokenizer.decode([t]) for t in ids]
    text = "".join(pieces)
    spans, i = [], text.find(key)
    while i >= 0:
        spans.append((i, i + len(key)))
        i = text.find(key, i + 1)
    out, start = [], 0
    for p, piece in enumerate(pieces):
        end = start + len(piece)
        if any(start < b and end > a for a, b in spans):
            out.append(p)
        start = end
    return out


def brute_force_selection(q: torch.Tensor, k: torch.Tensor, t: int, cfg) -> set[int]:
    """``sparse``'s decode selection for one KV head, in float64 from the cached keys.

    Args:
        q: ``[G, d]`` the step's queries of the group (post-RoPE); k: ``[T, d]`` post-RoPE
            keys, ``T >= t + 1``; t: the query's position (tokens); cfg: SelectionConfig.
    Returns:
        The selected block ids.
    """
    q, k = q.double(), k[:t + 1].double()
    bs, ker, st = cfg.block_size, cfg.kernel_size, cfg.kernel_stride
    windows = list(range((t + 1 - ker) // st + 1)) if t + 1 >= ker else []
    ck = torch.stack([k[j * st:j * st + ker].mean(0) for j in windows]) if windows else k[:0]
    p = torch.softmax(q @ ck.T / math.sqrt(q.shape[-1]), -1).sum(0) if windows else k.new_zeros(0)
    cur = t // bs
    score = []
    for b in range(cur + 1):
        hits = [float(p[j]) for j in windows if j * st < (b + 1) * bs and j * st + ker > b * bs]
        score.append(max(hits) if hits else -math.inf)
    forced = {b for b in range(cur + 1) if b < cfg.init_blocks or b > cur - cfg.local_blocks}
    free = sorted((b for b in range(cur + 1) if b not in forced), key=lambda b: (-score[b], b))
    return forced | set(free[:cfg.topk_blocks])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--depth", type=float, required=True)
    ap.add_argument("--length", type=int, default=7680)
    ap.add_argument("--method", default="sparse", choices=("sparse", "oracle"))
    ap.add_argument("--min-mass", type=float, default=0.02)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--check", action="store_true", help="float64 brute force of every decode selection")
    ap.add_argument("--dense-heads", default="", help="L:H,... pairs that read every block in decode")
    args = ap.parse_args()
    llm = LLM(method=args.method, device="cpu", dtype="float32", dense_heads="none")  # the probe forces its own
    cfg = llm.method.selection
    sample = make_sample("passkey", llm.tokenizer, heldout_text(), args.length, args.depth, args.seed)
    ids = llm.encode(sample.prompt, True)
    key = sample.answers[0]
    positions = key_token_positions(llm.tokenizer, ids, key)
    needle = sorted({p // cfg.block_size for p in positions})
    dense_heads = [tuple(map(int, p.split(":"))) for p in args.dense_heads.split(",") if p]
    print(f"seed {args.seed} depth {args.depth}: {len(ids)} prompt tokens, key {key} at tokens {positions} "
          f"(blocks {needle}); {cfg.init_blocks} sink + {cfg.local_blocks} local + {cfg.topk_blocks} top-k "
          f"blocks of {cfg.block_size}, compressed keys {cfg.kernel_size}/{cfg.kernel_stride}")
    rows, state = [], {"step": -1, "checked": 0, "differ": 0}
    select = llm.method.select

    def probed_select(self, layer, q, h, cache, step, first=0):
        mask = select(layer, q, h, cache, step, first)
        if step.phase != "decode":
            return mask
        state["step"] += layer == 0
        for lay, head in dense_heads:
            if lay == layer:
                mask[:, head] = True  # the attention applies causality and kv_len
        t = int(step.q_pos[0, -1])
        k, _, ck = cache.view(layer, step.rows, step.max_kv_len)
        k, qq = k[:, :, :t + 1], q[..., -1:, :]
        ck = ck[:, :, :ref.num_compressed(t + 1, cfg.kernel_size, cfg.kernel_stride)]
        nb = t // cfg.block_size + 1
        mass = ref.block_attention_mass(qq, k, step.q_pos[:, -1:], step.kv_len[:1], cfg.block_size)[0, :, 0]
        cs = ref.pool_to_blocks(ref.query_group_scores(qq, ck, step.q_pos[:, -1:], cfg.kernel_size,
                                                       cfg.kernel_stride), nb, cfg)[0, :, 0]
        free = torch.arange(cfg.init_blocks, nb - cfg.local_blocks)
        group = q.shape[2]
        for head in range(k.shape[1]):
            if args.check and args.method == "sparse" and (layer, head) not in dense_heads:
                want = brute_force_selection(q[0, head, :, -1], k[0, head], t, cfg)
                got = set(torch.nonzero(mask[0, head, -1, :nb]).flatten().tolist())
                state["checked"] += 1
                state["differ"] += want != got
            for b in needle:
                share = float(mass[head, b]) / group
                if share >= args.min_mass and b in free:
                    rank_o = int((mass[head, free] > mass[head, b]).sum()) + 1
                    rank_c = int((cs[head, free] > cs[head, b]).sum()) + 1
                    rows.append((state["step"], layer, head, b, share, rank_o, rank_c, bool(mask[0, head, -1, b])))
        return mask

    llm.method.select = types.MethodType(probed_select, llm.method)
    out = llm.generate([sample.prompt], max_new_tokens=args.max_new_tokens, chat=True)[0]
    print(f"{args.method} answers {out.text!r}: {'right' if key in out.text else 'WRONG'}")
    print("step layer head block   mass  rank oracle  rank ck  sel")
    for st, layer, head, b, share, rank_o, rank_c, sel in rows:
        print(f"{st:4d}  L{layer:<3d}  h{head}  {b:5d}  {100 * share:5.1f}%  {rank_o:11d}  {rank_c:7d}  "
              f"{'yes' if sel else 'MISSED'}")
    missed: dict[tuple[int, int], list[float]] = {}
    for _, layer, head, _, share, _, _, sel in rows:
        if not sel:
            missed.setdefault((layer, head), []).append(share)
    print("missed (layer, KV head): steps, largest mass -- "
          + ", ".join(f"L{lay}h{head}: {len(v)}, {100 * max(v):.1f}%" for (lay, head), v in sorted(missed.items())))
    if args.check and args.method == "sparse":
        print(f"float64 brute force: {state['differ']} of {state['checked']} decode selections differ")


if __name__ == "__main__":
    main()
