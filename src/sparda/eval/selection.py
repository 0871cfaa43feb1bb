"""Selection-quality report, ``sparda selection-report`` (design §8).

On a window of real text under dense attention, at ``queries`` positions of its second
half, per layer and method: ``recall_vs_sparse`` and ``recall_vs_oracle`` (shared free top-k
blocks over the reference's; ``recall_vs_sparda`` too when ``sparda`` is reported), ``mass``
(true attention mass the whole selection covers, per query head) and ``reuse`` (free top-k
blocks at ``t + 1`` held by the whole selection at ``t``). ``sparda-lookahead2`` is the
two-ahead prediction of design §6.2 (``F2_{l-2}`` of layer ``l - 2``'s input; layers 0 and 1,
which have none, report the one-layer Forecast's selection). Lookahead selectors follow :func:`sparda.kernels.reference.lookahead_pos`; the seed
selectors are approximated at isolated positions (docs/baselines.md, Selection quality).
"""

from __future__ import annotations

import dataclasses

import torch

from sparda.attention.forecast import Forecast, load_forecast, model_name, q_init, shipped_path
from sparda.model.loader import shipped_name
from sparda.config import SpardaConfig
from sparda.errors import SpardaError
from sparda.io import read_text
from sparda.kernels import reference as ref

KNOWN = ("sparse", "oracle", "sparda", "sparda-random", "sparda-qinit", "infinigen",
         "streaming", "quest", "snapkv", "shallow", "h2o", "sparda-lookahead2", "sparda-lookahead2-qinit")
#: the seeds' selectors, whose masks the report builds itself (:func:`_baseline_mask`)
BASELINES = ("streaming", "quest", "snapkv", "shallow", "h2o")
#: h2o in the report: accumulate the mass of about this many earlier queries per layer
H2O_QUERIES = 256


def _selectors(methods, model, shape, cfg, forecast_path, model_dir, forecast2_path=None):
    """Build ``name -> callable(layer, inputs, q, k, ck, cos, sin, q_idx, q_pos) -> block scores``;
    ``inputs[j]`` is layer ``j``'s attention input ``[1, T, d_model]`` for ``j`` in ``layer - 2 .. layer``."""
    from sparda.attention.baselines.infinigen import InfiniGenAttention

    out = {}
    dev = next(model.parameters()).device
    forecasts: dict[str, list[Forecast]] = {}  # name -> [one-layer, two-ahead (optional)]

    def trained(ahead: int, path) -> Forecast:
        path = path or shipped_path(shipped_name(model_dir), ahead)
        if path is None:
            raise SpardaError(f"no {'two-ahead ' if ahead == 2 else ''}Forecast weights for this model; pass "
                              f"{'--forecast2' if ahead == 2 else '--forecast'} PATH")
        return load_forecast(path, model.config, shape, model_name(model_dir), ahead=ahead)[0]

    def initial(ahead: int) -> Forecast:
        fc = Forecast.for_shape(shape, ahead=ahead)
        q_init(fc, model)
        return fc

    for name in methods:
        if name not in KNOWN:
            raise SpardaError(f"unknown selector {name!r} for the report; choose from {', '.join(KNOWN)}")
        if name == "sparda":
            forecasts[name] = [trained(1, forecast_path)]
        elif name == "sparda-random":
            forecasts[name] = [Forecast.seeded(shape, 0)]
        elif name == "sparda-qinit":
            forecasts[name] = [initial(1)]
        elif name == "sparda-lookahead2":
            forecasts[name] = [trained(1, forecast_path), trained(2, forecast2_path)]
        elif name == "sparda-lookahead2-qinit":
            forecasts[name] = [trained(1, forecast_path), initial(2)]
    for name, fcs in forecasts.items():
        fcs = [fc.to(dev).float().eval() for fc in fcs]

        def score(layer, inputs, q, k, ck, cos, sin, q_idx, q_pos, fcs=fcs):
            fc = fcs[-1] if layer in fcs[-1].targets() else fcs[0]
            src = inputs[fc.source_layer(layer)]
            f = fc.project(layer, src[:, q_idx].float(), cos[:, :, q_idx].float(), sin[:, :, q_idx].float())
            pos = ref.lookahead_pos(q_pos, layer, fc.ahead)
            return ref.forecast_scores(f, ck, pos, cfg.kernel_size, cfg.kernel_stride)
        out[name] = score
    if "infinigen" in methods:
        ig = InfiniGenAttention(SpardaConfig(method="infinigen", selection=cfg), shape, model=model)

        def score_ig(layer, inputs, q, k, ck, cos, sin, q_idx, q_pos):
            src = inputs[max(layer - 1, 0)]
            qp = ig.partial_query(layer, src[:, q_idx], cos[:, :, q_idx], sin[:, :, q_idx])
            return ig.scores(layer, qp, ck, q_pos)
        out["infinigen"] = score_ig
    if "sparse" in methods:
        out["sparse"] = lambda layer, inputs, q, k, ck, cos, sin, q_idx, q_pos: ref.query_group_scores(
            q[..., q_idx, :], ck, q_pos, cfg.kernel_size, cfg.kernel_stride)
    return out


@torch.no_grad()
def eval_window(ids_all: list[int], length: int, queries: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``length`` tokens from a third into ``ids_all`` (``[1, length]`` int64) and at most ``queries``
    positions spread over its second half (``[Q]`` int64)."""
    start = (len(ids_all) - length) // 3
    ids = torch.tensor([ids_all[start:start + length]], device=device)
    q_idx = torch.linspace(length // 2, length - 1, queries, device=device).long().unique()
    return ids, q_idx


def selection_report(model=None, text: str | None = None, methods=KNOWN, lengths=(4096, 8192), *,
                     queries: int = 64, preset: str = "small", forecast: str | None = None,
                     device=None, llm=None, forecast2: str | None = None) -> dict:
    """The report of the module doc, per method.

    Args:
        model: directory / .gguf / ``None`` (bundled); ignored if ``llm`` is given.
        text: UTF-8 file, or ``None`` for the held-out Emma. methods: :data:`KNOWN` names.
        lengths: tokens. queries: positions per length. forecast, forecast2: weight files
            (``None``: the shipped ones) of the one-layer and the two-ahead Forecast.
    Returns:
        ``{method: {"per_layer": [{"layer", "recall_vs_sparse", "recall_vs_oracle", "mass",
        "reuse"}], "mean_*", "setup"}}``, plus ``recall_vs_sparda`` (per layer and mean) when
        ``sparda`` is among ``methods``; ``reuse`` ``None`` where no pair selected a free block.
    Raises:
        SpardaError: unknown method, ``queries < 1``, a length outside ``[dense_len, context]``,
            text too short or unreadable.
    """
    from sparda.engine.llm import LLM

    if queries < 1:
        raise SpardaError(f"--queries must be >= 1, got {queries}")
    if not lengths:
        raise SpardaError("no --lengths given; pass e.g. --lengths 4096,8192")

    llm = llm or LLM(model, method="dense", preset=preset, device=device, dtype="float32" if device in (None, "cpu") else None)
    net, cfg, shape = llm.model, llm.config.selection, llm.shape
    for length in lengths:
        if not cfg.dense_len <= length <= shape.max_positions:
            raise SpardaError(f"length {length} is outside [{cfg.dense_len}, {shape.max_positions}]: shorter "
                              "contexts use dense attention (recall 1), longer ones exceed the model's context")
    if text is None:
        from sparda.data import heldout_text

        body, source = heldout_text(), "held-out Emma"
    else:
        body, source = read_text(text, "--text"), text
    ids_all = llm.tokenizer.encode(body, add_special_tokens=False)
    selectors = _selectors(list(methods), net, shape, cfg, forecast, llm.model_dir, forecast2)
    vs_sparda = "sparda" in methods
    # hs, ts, ho, to, mass, rh, rt, hits and total vs sparda's free top-k
    stats = {m: [[0.0] * 9 for _ in range(shape.num_layers)] for m in methods}
    counts = [0] * shape.num_layers
    for length in lengths:
        if len(ids_all) < length:
            raise SpardaError(f"the text has {len(ids_all)} tokens, fewer than the length {length}")
        ids, q_idx = eval_window(ids_all, length, queries, llm.device)
        pair = q_idx + 1 < length  # positions with a next step inside the window
        num_blocks = -(-length // cfg.block_size)
        kv_len = torch.tensor([length], device=ids.device)
        inputs: dict[int, torch.Tensor] = {}  # layer -> attention input, the last three layers
        states: tuple[dict, dict] = ({}, {})  # the seeds' selectors' state at q_idx, at q_idx + 1
        for layer, h, q, k, cos, sin in net.dense_layers(ids):
            inputs[layer] = h
            inputs.pop(layer - 3, None)
            ck = ref.compress_keys(k, cfg.kernel_size, cfg.kernel_stride).float()

            def masks(idx, state):
                """Every method's selection and free top-k at ``idx``, the oracle's mass, the forced blocks."""
                pos = idx.view(1, -1)
                forced = ref.forced_blocks(pos, num_blocks, cfg)
                mass = ref.block_attention_mass(q[..., idx, :], k, pos, kv_len, cfg.block_size)
                out = {}
                for name in methods:
                    if name in BASELINES:
                        sel = _baseline_mask(name, layer, q, k, idx, pos, mass, state, llm, cfg)
                    elif name == "oracle":
                        sel = ref.select_blocks(mass, pos, cfg)
                    else:
                        sc = selectors[name](layer, inputs, q, k, ck, cos, sin, idx, pos)
                        sel = ref.select_blocks(ref.pool_to_blocks(sc, num_blocks, cfg), pos, cfg)
                    out[name] = (sel, sel & ~forced)
                return out, mass, forced

            now, mass, forced = masks(q_idx, states[0])
            q_pos = q_idx.view(1, -1)
            sparse_free = ref.select_blocks(ref.pool_to_blocks(ref.query_group_scores(
                q[..., q_idx, :], ck, q_pos, cfg.kernel_size, cfg.kernel_stride), num_blocks, cfg), q_pos, cfg) & ~forced
            oracle_free = ref.select_blocks(mass, q_pos, cfg) & ~forced
            nxt = masks(q_idx[pair] + 1, states[1])[0] if bool(pair.any()) else {}  # selections only
            counts[layer] += 1
            for name in methods:
                sel, free = now[name]
                acc = stats[name][layer]
                acc[0] += (free & sparse_free).sum().item()
                acc[1] += sparse_free.sum().item()
                acc[2] += (free & oracle_free).sum().item()
                acc[3] += oracle_free.sum().item()
                acc[4] += ((mass * sel).sum(-1) / shape.group_size).mean().item()
                if name in nxt:
                    later = nxt[name][1]
                    acc[5] += (sel[:, :, pair] & later).sum().item()  # resident after step t
                    acc[6] += later.sum().item()
                if vs_sparda:
                    acc[7] += (free & now["sparda"][1]).sum().item()
                    acc[8] += now["sparda"][1].sum().item()
    report = {}
    keys = ("recall_vs_sparse", "recall_vs_oracle", "mass") + (("recall_vs_sparda",) if vs_sparda else ())
    for name in methods:
        rows = []
        for layer, (hs, ts, ho, to, ms, rh, rt, hd, td) in enumerate(stats[name]):
            rows.append({"layer": layer, "recall_vs_sparse": round(hs / ts, 4) if ts else 1.0,
                         "recall_vs_oracle": round(ho / to, 4) if to else 1.0,
                         "mass": round(ms / max(counts[layer], 1), 4),
                         "reuse": round(rh / rt, 4) if rt else None})
            if vs_sparda:
                rows[-1]["recall_vs_sparda"] = round(hd / td, 4) if td else 1.0
        report[name] = {"per_layer": rows, **{f"mean_{key}": round(sum(r[key] for r in rows) / len(rows), 4)
                                              for key in keys}}
        reuse = [r["reuse"] for r in rows if r["reuse"] is not None]
        report[name]["mean_reuse"] = round(sum(reuse) / len(reuse), 4) if reuse else None
    setup = {"text": source, "lengths": list(lengths), "queries": queries, "budget_blocks": cfg.budget_blocks}
    for name in methods:
        report[name]["setup"] = setup
    return report


def _baseline_mask(name, layer, q, k, q_idx, q_pos, mass, state, llm, cfg) -> torch.Tensor:
    """``[1, H, Q, N]`` bool mask of one of :data:`BASELINES` at the report's queries; ``q [1, H,
    G, T, d]``, ``k [1, H, T, d]`` of ``layer``, ``mass`` the oracle's."""
    from sparda.attention.baselines.quest import page_bounds, page_scores, pages_to_blocks
    from sparda.attention.baselines.shallow import ShallowAttention
    from sparda.attention.baselines.snapkv import window_votes

    length, num_blocks = k.shape[-2], mass.shape[-1]
    blocks = torch.arange(num_blocks, device=k.device)
    qs = q[..., q_idx, :]
    if name == "streaming":
        return ref.select_blocks(blocks.float().expand_as(mass), q_pos, cfg)
    if name == "quest":
        page = llm.config.quest_page_size
        lo, hi = page_bounds(k, page)
        return ref.select_blocks(pages_to_blocks(page_scores(qs, lo, hi, q_pos, page), num_blocks,
                                                 cfg.block_size // page), q_pos, cfg)
    if name == "snapkv":
        window, rows = llm.config.snapkv_window, []
        for t in q_idx.tolist():
            votes = window_votes(q[..., :t, :], k[:, :, :t], window, cfg.block_size)
            chosen = ref.select_blocks(votes.unsqueeze(2), q_pos.new_tensor([[t - 1]]), cfg)[:, :, 0]
            start = max(min((t - 1) // cfg.block_size - cfg.local_blocks + 1,
                            (t - min(window, t)) // cfg.block_size), 0)
            fixed = torch.zeros(*chosen.shape[:2], num_blocks, dtype=torch.bool, device=k.device)
            fixed[..., :chosen.shape[-1]] = chosen & (blocks[:chosen.shape[-1]] < start)
            rows.append((fixed | (blocks >= start)) & (blocks <= t // cfg.block_size))
        return torch.stack(rows, dim=2)
    if name == "shallow":
        if "shallow_layers" not in state:
            method = ShallowAttention(dataclasses.replace(llm.config, method="shallow"), llm.shape,
                                      model_dir=llm.model_dir)
            state["shallow_layers"], state["shallow_sum"] = method.num_shallow, 0
        if layer < state["shallow_layers"]:
            state["shallow_sum"] = state["shallow_sum"] + mass / q.shape[2]
            return ref.select_blocks(mass, q_pos, dataclasses.replace(cfg, dense_len=1 << 40))
        return ref.select_blocks(state["shallow_sum"] / state["shallow_layers"], q_pos, cfg)
    if name == "h2o":
        stride = max(1, length // H2O_QUERIES)
        seen = torch.arange(0, length, stride, device=k.device)
        kv_len = torch.tensor([length], device=k.device)
        acc = ref.block_attention_mass(q[..., seen, :], k, seen.view(1, -1), kv_len, cfg.block_size).cumsum(2)
        last = torch.searchsorted(seen, q_idx, right=True) - 1  # the sampled queries at or before t
        return ref.select_blocks(acc[:, :, last], q_pos, cfg)
    raise SpardaError(f"unknown baseline {name!r}")


def format_report(report: dict) -> str:
    """Plain-text table: one row per layer, columns ``method: recall_sparse/recall_oracle/mass``."""
    methods = list(report)
    setup = report[methods[0]]["setup"]
    lines = [f"selection report ({setup['text']}, lengths {setup['lengths']}, "
             f"{setup['queries']} queries/length); cells: recall vs sparse / vs oracle / mass / step-to-step reuse",
             "layer " + " ".join(f"{m:>28}" for m in methods)]
    num_layers = len(report[methods[0]]["per_layer"])
    for layer in range(num_layers):
        cells = [report[m]["per_layer"][layer] for m in methods]
        lines.append(f"{layer:>5} " + " ".join(
            f"{c['recall_vs_sparse']:>8.3f}/{c['recall_vs_oracle']:.3f}/{c['mass']:.3f}/{_num(c['reuse'])}"
            for c in cells))
    lines.append(" mean " + " ".join(
        f"{report[m]['mean_recall_vs_sparse']:>8.3f}/{report[m]['mean_recall_vs_oracle']:.3f}/{report[m]['mean_mass']:.3f}"
        f"/{_num(report[m]['mean_reuse'])}" for m in methods))
    return "\n".join(lines)


def _num(x) -> str:
    return "  -  " if x is None else f"{x:.3f}"
