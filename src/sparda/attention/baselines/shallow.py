"""``shallow``: the seed blog's shallow-layer shared mask (design §7).

Layers ``0..N-1`` attend densely. In decode, each of them also measures its query's
attention mass per KV block (softmax over every key, summed over the block's tokens,
averaged over the ``G`` query heads of the KV head); the mean over those ``N`` layers,
smoothed across decode steps by an EMA (``0.7`` current, ``0.3`` previous; the prefill's
last query starts it), is scored by the §3.4 rule (sinks + local window + top-k, dense
fallback: design §3.4, §3.6) into one block mask per KV head, which every layer ``>= N``
attends over. With ``shallow_select_once`` (``--shallow-select-once``) the mask is
chosen once, from the last prompt query at the end of prefill, and decode reads those
blocks plus every block from the prompt's local window on (the blocks written since
included). Prefill itself is dense.

``N`` is ``config.shallow_layers`` if given, else the calibration stored for the model
(``sparda calibrate-shallow``, :mod:`sparda.eval.shallow_calibration`): a
``sparda_shallow.json`` in the model directory, or the result shipped for the bundled
model; else :data:`DEFAULT_LAYERS`. It is capped at ``L - 1``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from sparda.attention.base import BlockSparseMethod, dense_attention, prefill_rows
from sparda.attention.row_state import RowState, block_ids, decode_attention_any, fixed_set_mask, prime_fixed_set
from sparda.kernels import reference as ref
from sparda.model.loader import shipped_name

#: dense layers when no calibration is stored for the model
DEFAULT_LAYERS = 3
#: EMA weight of the current step's shallow scores (the previous smoothed scores get 1 - this)
EMA_CURRENT = 0.7
#: calibration file name inside a model directory
CALIBRATION_FILE = "sparda_shallow.json"
#: shipped calibrations (sparda/assets/shallow), keyed by the name the model is recognised
#: under by content (:func:`sparda.model.loader.shipped_name`)
SHIPPED = {"SmolLM2-135M-Instruct": "smollm2-135m-instruct.json"}


def calibration_sources(model_dir) -> list[Path]:
    """Where a stored calibration for the model in ``model_dir`` is looked up, in order."""
    paths = [Path(model_dir) / CALIBRATION_FILE] if model_dir is not None else []
    shipped = SHIPPED.get(shipped_name(model_dir) or "")
    if shipped:
        paths.append(Path(str(resources.files("sparda") / "assets" / "shallow" / shipped)))
    return paths


def calibrated_layers(model_dir) -> int | None:
    """``shallow_layers`` of the first readable calibration of :func:`calibration_sources`, or None."""
    for path in calibration_sources(model_dir):
        try:
            return int(json.loads(path.read_text())["shallow_layers"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def shallow_block_mass(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    """Attention mass per block of the last query, averaged over the group: ``[B, H, N]`` fp32.

    ``q [B, H, G, Tq, d]`` (only the last token is used), ``k [B, H, T, d]``,
    ``q_pos [B, Tq]``, ``kv_len [B]`` int64; ``N = ceil(T / block_size)``; rows sum to 1.
    """
    mass = ref.block_attention_mass(q[..., -1:, :], k, q_pos[:, -1:], kv_len, block_size)
    return mass[:, :, 0] / q.shape[2]


class ShallowAttention(BlockSparseMethod):
    """Method ``shallow``: dense layers ``< N`` fuse their attention into the deep layers' mask."""

    name = "shallow"
    batched_prefill = True  # each row's mask from its own last query (design §3.8)
    prefill_across_steps = False  # RowState: prefilled whole in one engine step
    #: decode does not go through BlockSparseMethod.attend's mask: no dense heads (design §3.7)
    supports_dense_heads = False

    def __init__(self, config, shape, model=None, model_dir=None) -> None:
        super().__init__(config, shape, model=model, model_dir=model_dir)
        wanted = config.shallow_layers or calibrated_layers(model_dir) or DEFAULT_LAYERS
        #: dense layers ``N`` (at least one deep layer remains)
        self.num_shallow = max(1, min(wanted, shape.num_layers - 1))
        self.select_once = bool(config.shallow_select_once)
        self._sum = None  # this step: shallow masses summed so far ([B, H, N]; prefill: a list per row)
        self._mask: torch.Tensor | None = None  # this step: the deep layers' mask [B, H, 1, N]

        def make(rows, capacity, device):
            dims = (rows, shape.num_kv_heads, -(-capacity // config.selection.block_size))
            return {"ema": torch.zeros(dims, device=device),
                    "fixed": torch.zeros(dims, dtype=torch.bool, device=device),
                    "start": torch.zeros(rows, dtype=torch.long, device=device)}
        self.state = RowState(make)

    def reset(self) -> None:
        """Clear this step's partial sums (before each prefill)."""
        super().reset()
        self._sum = self._mask = None

    def state_from_cache(self, cache, context: int) -> None:
        """Benchmarks: a cache filled without a prefill starts from a zero EMA and, for
        ``shallow_select_once``, a budget-sized fixed set (:func:`prime_fixed_set`)."""
        st = self.state.of(cache)
        st["ema"].zero_()
        prime_fixed_set(st["fixed"], st["start"], context, self.selection)

    def _shallow(self, layer, q, k, cache, step) -> None:
        """Add layer ``layer``'s block mass; after the last shallow layer, make the deep mask."""
        cfg = self.selection
        if step.phase == "decode" and self.select_once:
            if layer == self.num_shallow - 1:
                st = self.state.of(cache)
                num_blocks = -(-k.shape[-2] // cfg.block_size)
                self._mask = fixed_set_mask(st["fixed"][step.rows][..., :num_blocks], st["start"][step.rows],
                                            step.q_pos, cfg.block_size)
            return
        if step.phase == "prefill":  # per row: a batched prefill's rows each from their own prompt
            rows = list(prefill_rows(step, q, k))
            masses = [shallow_block_mass(q_row, k_row, sub.q_pos, sub.kv_len, cfg.block_size)
                      for sub, q_row, k_row in rows]
            self._sum = masses if layer == 0 else [a + b for a, b in zip(self._sum, masses)]
            if layer == self.num_shallow - 1:
                st = self.state.of(cache)
                for (sub, _, k_row), total in zip(rows, self._sum):
                    self._prefill_state(st, total / self.num_shallow, k_row.shape[-2], sub)
                self._sum = None
            return
        mass = shallow_block_mass(q, k, step.q_pos, step.kv_len, cfg.block_size)
        self._sum = mass if layer == 0 else self._sum + mass
        if layer != self.num_shallow - 1:
            return
        st = self.state.of(cache)
        current = self._sum / self.num_shallow
        self._sum = None
        n = current.shape[-1]
        score = EMA_CURRENT * current + (1.0 - EMA_CURRENT) * st["ema"][step.rows][..., :n]
        st["ema"][step.rows, :, :n] = score
        self._mask = ref.select_blocks(score.unsqueeze(2), step.q_pos, cfg)

    def _prefill_state(self, st: dict, current: torch.Tensor, t: int, step) -> None:
        """A one-row prefill's state (row ``step.rows[:1]``, ``t`` tokens): the EMA starts at
        ``current [1, H, N]`` (the shallow layers' mean block mass of the last query) and
        the fixed set is its §3.4 choice before the local window."""
        cfg = self.selection
        row, n = step.rows[:1], current.shape[-1]
        st["ema"][row] = 0.0
        st["ema"][row, :, :n] = current
        chosen = ref.select_blocks(current.unsqueeze(2), step.q_pos[:, -1:], cfg)[:, :, 0]
        start = max((t - 1) // cfg.block_size - cfg.local_blocks + 1, 0)
        st["fixed"][row] = False
        st["fixed"][row, :, :n] = chosen & (block_ids(n, current.device)[:, :, 0] < start)
        st["start"][row] = start

    def attend(self, layer, q, h, cache, step):
        """``q [B, H_kv, G, Tq, d]`` -> same shape. Prefill and layers ``< N``: dense (they feed
        the mask). Decode layers ``>= N``: exact attention over this step's shared mask, or
        dense where the whole batch is under the dense fallback."""
        k, v, _ = cache.view(layer, step.cache_rows, step.max_kv_len)
        if layer < self.num_shallow:
            self._shallow(layer, q, k, cache, step)
            self._count_dense(cache, step)
            return dense_attention(q, k, v, step)
        if step.phase == "prefill" or (not self.select_once and not self.needs_selection(step)):
            self._count_dense(cache, step)
            return dense_attention(q, k, v, step)
        mask = self._mask
        self._count(cache, step, mask[..., -1, :])
        return decode_attention_any(q, k, v, mask, step, self.selection.block_size)
