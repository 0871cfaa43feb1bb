"""What one unit of ``sparda eval`` work measures (design §8): a generation batch, a
``ppl`` window, a ``ppl-decode`` batch or a selection report; returns or yields records.
"""

from __future__ import annotations

import random
import time

import torch

from sparda.errors import SpardaError

#: the pseudo-task that measures perplexity / agreement / KL against dense
PPL = "ppl"
#: the pseudo-task that measures the same against dense in decode, teacher-forced (:func:`ppl_decode_records`)
PPL_DECODE = "ppl-decode"
#: the pseudo-task that reports selection recall through :mod:`sparda.eval.selection`
SELECTION = "selection"


def _budget_fields(llm, length: int) -> dict:
    """``budget_blocks`` and ``context_blocks`` of a ``length``-token context (design §3.4)."""
    sel = llm.config.selection
    return dict(budget_blocks=sel.init_blocks + sel.local_blocks + sel.topk_blocks,
                context_blocks=-(-length // sel.block_size))


def _dense_heads_field(llm) -> str:
    """The dense heads ``llm``'s decode ran with (design §3.7) as ``"L:H,..."``, or ``"none"``."""
    return ",".join(f"{layer}:{head}" for layer, head in llm.config.dense_heads) or "none"


def task_records(models, spec, batch: list, length: int) -> list[dict]:
    """Generate one batch of samples with ``spec`` (one :meth:`sparda.LLM.generate` call, design
    §3.8) and score each.

    Args:
        models: the runner's ``_Models``. spec: a :class:`~sparda.eval.runner.MethodSpec`.
        batch: ``[(index, seed, TaskSample)]`` of one task and length. length: tokens.
    Returns:
        One record per sample: score, completion, token counts, timings, ``kv_read_fraction``,
        ``kv_bytes_read_per_token`` (bytes of K/V read per decoded token: the request's
        ``kv_cache_bytes`` times its ``kv_read_fraction``, whole blocks, every layer and KV
        head), ``topp_mass`` (design §3.12, ``None``: fixed top-k), ``lookahead`` (design §6.2), ``hit_rate`` with ``hit_rate_source`` (``runtime``
        or ``overlap``), ``host_bytes_copied_per_token``, ``early_copies`` (design §6.2), ``dense_heads``.
    """
    from sparda.eval.metrics import exact_match, runtime_hit_rate, score

    llm, tracker, topk = models.get(spec, length)
    samples = [s for _, _, s in batch]
    max_new = max(s.max_new_tokens for s in samples)
    if tracker is not None:
        tracker.reset()
    start = time.perf_counter()
    outs = llm.generate([s.prompt for s in samples], max_new_tokens=max_new, chat=True)
    seconds = time.perf_counter() - start
    for out, s in zip(outs, samples):  # a sample with a smaller budget keeps only its own tokens
        if len(out.token_ids) > s.max_new_tokens:
            out.token_ids = out.token_ids[:s.max_new_tokens]
            out.text = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            out.stats["new_tokens"] = len(out.token_ids)
    spans = [(o.stats["prompt_tokens"], o.stats["prompt_tokens"] + o.stats["new_tokens"] - 2) for o in outs]
    overlap = tracker.take_rows(spans) if tracker is not None else [None] * len(outs)
    offloaded = bool(llm.config.offload) or getattr(llm.method, "offloaded", False)
    records = []
    for (index, seed, sample), out, rate in zip(batch, outs, overlap):
        stats = out.stats
        source = "runtime" if "offload" in stats else "overlap" if tracker is not None and tracker.active else None
        if "offload" in stats:
            rate = runtime_hit_rate(stats["offload"])
        records.append(dict(
            label=spec.label, method=spec.method, budget_pct=spec.budget_pct, topp_mass=spec.topp_mass, lookahead=spec.lookahead, topk_blocks=topk,
            **_budget_fields(llm, length), task=sample.task, length=length, sample=index, depth=sample.depth,
            seed=seed, score=score(sample, out.text), exact=exact_match(sample.answers, out.text),
            answers=list(sample.answers), completion=out.text[:400],
            prompt_tokens=stats["prompt_tokens"], new_tokens=stats["new_tokens"],
            prefill_ms=stats["prefill_ms"], prefill_batch=stats["prefill_batch"], decode_tok_s=stats["decode_tok_s"],
            cache_alloc_ms=stats["cache_alloc_ms"], graph_capture_ms=stats["graph_capture_ms"],
            kv_read_fraction=stats["kv_read_fraction"],
            kv_bytes_read_per_token=stats["kv_cache_bytes"] * stats["kv_read_fraction"],
            host_bytes_copied_per_token=stats["offload"].get("bytes_per_token") if "offload" in stats else None,
            early_copies=stats["offload"].get("early_copies") if "offload" in stats else None,
            hit_rate=rate, hit_rate_source=source if rate is not None else None,
            seconds=round(seconds / len(batch), 3), batch=len(batch),
            prefill="block-sparse" if llm.config.sparse_prefill and spec.method != "dense" else "dense",
            offload=offloaded, dense_heads=_dense_heads_field(llm)))
    return records


def ppl_window(text_ids: list[int], length: int, seed: int) -> list[int]:
    """The ``length + 1`` held-out token ids of window ``seed``. Raises SpardaError if the text is shorter."""
    if len(text_ids) < length + 1:
        raise SpardaError(f"the perplexity text has {len(text_ids)} tokens, fewer than {length + 1}; "
                          "use a longer --text or shorter --lengths")
    offset = random.Random(f"ppl-{seed}-{length}").randint(0, len(text_ids) - length - 1)
    return text_ids[offset:offset + length + 1]


def ppl_records(models, todo: list, text_ids: list[int], length: int, index: int, seed: int):
    """Yield each spec's :func:`~sparda.eval.metrics.compare_logits` against the unquantised dense
    reference on one window, second half scored, block-sparse prefill (``ppl``, design §8)."""
    from sparda.eval.metrics import compare_logits, perplexity

    ids = ppl_window(text_ids, length, seed)
    first = length // 2
    targets = torch.tensor(ids[first + 1:], device=models.base.device)
    reference = models.reference.logits(ids[:-1])[first:]
    for spec in todo:
        llm, _, topk = models.get(spec, length, sparse_prefill=True)
        start = time.perf_counter()
        same = spec.method == "dense" and llm.config.cache.kv_dtype == models.reference.config.cache.kv_dtype
        logits = reference if same else llm.logits(ids[:-1])[first:]
        m = compare_logits(logits, reference, targets)
        n = m["positions"]
        yield dict(label=spec.label, method=spec.method, budget_pct=spec.budget_pct, topp_mass=spec.topp_mass, lookahead=spec.lookahead, topk_blocks=topk,
                   **_budget_fields(llm, length), task=PPL, length=length, sample=index, depth=None, seed=seed,
                   positions=n, ppl=perplexity(m["nll_sum"], n), dense_ppl=perplexity(m["ref_nll_sum"], n),
                   top1_agreement=m["agree_sum"] / n, kl=m["kl_sum"] / n, score=m["agree_sum"] / n,
                   seconds=round(time.perf_counter() - start, 3),
                   prefill="dense" if spec.method == "dense" else "block-sparse")
        del logits


@torch.inference_mode()
def teacher_forced_terms(llm, windows: list[list[int]], prefix: int, reference: torch.Tensor,
                         targets: torch.Tensor) -> dict[str, list[float]]:
    """Teacher-force windows through ``llm``'s decode path and sum each step's logit terms against
    ``reference`` (``ppl-decode``, design §8).

    Args:
        llm: a :class:`sparda.LLM`. windows: ``B`` lists of ``L + 1`` token ids.
        prefix: tokens prefilled, ``1 <= prefix < L``; ``D = L - prefix`` decode steps.
        reference: ``[B, D, V]`` logits at positions ``prefix .. L - 1``. targets: ``[B, D]`` int64.
    Returns:
        ``nll``, ``ref_nll``, ``agree``, ``kl``: ``[B]`` sums over the steps (nats; agree: count).
    """
    from sparda.eval.metrics import logit_terms

    batch, steps = targets.shape
    length = prefix + steps
    feed = torch.tensor([ids[prefix:length] for ids in windows], device=llm.device)  # [B, D]
    cache = llm.new_cache(batch, length)
    llm.method.reset()
    for row, ids in enumerate(windows):
        llm.prefill(cache, row, ids[:prefix])
    run = llm.runner(cache)
    run.load(feed[:, 0], torch.full((batch,), prefix, dtype=torch.long, device=llm.device))
    sums = {name: torch.zeros(batch, dtype=torch.float64, device=llm.device)
            for name in ("nll", "ref_nll", "agree", "kl")}
    for t in range(steps):
        logits = run.step(prefix + t + 1)  # a graph's static output: read before the next step
        for name, term in logit_terms(logits, reference[:, t], targets[:, t]).items():
            sums[name] += term
        if t + 1 < steps:
            run.tokens.copy_(feed[:, t + 1])
            run.positions.add_(1)
    return {name: value.tolist() for name, value in sums.items()}


def ppl_decode_records(models, todo: dict[int, list], text_ids: list[int], length: int, seeds: dict[int, int],
                       decode_tokens: int):
    """Yield the ``ppl-decode`` metrics (design §8) of window ``i`` (:func:`ppl_window` of
    ``seeds[i]``) through each spec of ``todo[i]``: the last ``decode_tokens`` tokens decoded
    one step at a time against one dense unquantised forward.

    Memory: ``B x decode_tokens x V`` fp32 reference logits on the device. Records: ``positions``,
    ``ppl``, ``dense_ppl``, ``top1_agreement`` (= ``score``), ``kl`` (nats per position),
    ``prefix``, ``kv_dtype``, ``seconds`` (per window).
    """
    from sparda.eval.metrics import perplexity

    indices = [i for i in todo if todo[i]]
    windows = {i: ppl_window(text_ids, length, seeds[i]) for i in indices}
    prefix = length - decode_tokens
    device = models.base.device
    reference = None
    for row, i in enumerate(indices):  # one window's full logits at a time
        logits = models.reference.logits(windows[i][:-1])
        if reference is None:
            reference = logits.new_empty(len(indices), decode_tokens, logits.shape[-1])
        reference[row] = logits[prefix:]
        del logits
    specs = list(dict.fromkeys(spec for i in indices for spec in todo[i]))
    for spec in specs:
        rows = [row for row, i in enumerate(indices) if spec in todo[i]]
        wanted = [indices[row] for row in rows]
        llm, _, topk = models.get(spec, length)
        targets = torch.tensor([windows[i][prefix + 1:] for i in wanted], device=device)
        start = time.perf_counter()
        sums = teacher_forced_terms(llm, [windows[i] for i in wanted], prefix, reference[rows], targets)
        seconds = (time.perf_counter() - start) / len(wanted)
        offloaded = bool(llm.config.offload) or getattr(llm.method, "offloaded", False)
        n = decode_tokens
        for b, i in enumerate(wanted):
            yield dict(label=spec.label, method=spec.method, budget_pct=spec.budget_pct, topp_mass=spec.topp_mass, lookahead=spec.lookahead, topk_blocks=topk,
                       **_budget_fields(llm, length), task=PPL_DECODE, length=length, sample=i, depth=None,
                       seed=seeds[i], positions=n, prefix=prefix, ppl=perplexity(sums["nll"][b], n),
                       dense_ppl=perplexity(sums["ref_nll"][b], n), top1_agreement=sums["agree"][b] / n,
                       kl=sums["kl"][b] / n, score=sums["agree"][b] / n, seconds=round(seconds, 3),
                       batch=len(wanted), kv_dtype=llm.config.cache.kv_dtype, offload=offloaded,
                       dense_heads=_dense_heads_field(llm),
                       prefill="block-sparse" if llm.config.sparse_prefill and spec.method != "dense" else "dense")


def selection_records(models, todo: list, length: int, index: int, seed: int) -> list[dict]:
    """Records of :func:`sparda.eval.selection.selection_report` for the methods it knows
    (``score=None`` for the others)."""
    from sparda.eval.selection import KNOWN, selection_report

    names = sorted({s.method for s in todo if s.method in KNOWN})
    rep = selection_report(llm=models.base, text=models.plan.text, methods=names, lengths=(length,),
                           queries=16, preset=models.plan.preset) if names else {}
    records = []
    for spec in todo:
        m = rep.get(spec.method, {}) if spec.budget_pct is None and spec.topp_mass is None else {}
        records.append(dict(label=spec.label, method=spec.method, budget_pct=spec.budget_pct, task=SELECTION,
                            length=length, sample=index, depth=None, seed=seed,
                            recall_vs_sparse=m.get("mean_recall_vs_sparse"),
                            recall_vs_oracle=m.get("mean_recall_vs_oracle"), mass=m.get("mean_mass"),
                            score=m.get("mean_recall_vs_oracle")))
    return records
