"""The hot-block rule of ``kv_dtype`` ``mixed`` (design §6.1, docs/kv_quant.md).

An offloaded cache with ``kv_dtype="mixed"`` stores every block in int4 in the host store
(as ``int4`` does) and keeps, per offloaded layer, (row, KV head), a bf16 copy of its *hot*
blocks in a pool of ``P`` blocks on the host. Block ``n`` has pool slot ``n mod P``.

The rule, per layer, row and KV head, at the decode step of the token at position ``p``
(current block ``c = p // block_size``; ``L = local_blocks``, ``R = hot_steps``):

* a block is born hot: its tokens are written to the int4 store *and* to its pool slot as
  they arrive, and the current block is always hot;
* every block of the local window ``[c - L + 1, c]`` and every block of the step's
  selection gets ``last[n] = p``;
* a hot block stays hot while ``p - last[n] < R`` (selected or in the local window in one of
  the last ``R`` decode steps of this layer, this one included) **and** ``n > c - P`` (its
  pool slot is not yet the current block's); otherwise it is *demoted*: its pool copy is
  given up (the int4 copy was always there) and a GPU slot that holds its bf16 copy is
  emptied, so attention always reads a hot block exact and a cold one int4;
* a cold block never becomes hot again (no promotion).

After a prompt's prefill the blocks of the local window at its end are hot (with
``last = end - 1``), the others cold. ``P >= L`` keeps the local window hot.
"""

from __future__ import annotations

import torch

from sparda.config import SelectionConfig
from sparda.kernels.twins import HotSplit, hot_rule_update, hot_split

#: ``last`` of a block never selected
NEVER = -(2**40)


def default_hot_blocks(selection: SelectionConfig) -> int:
    """Default pool size ``P``: the budget, ``init + local + topk`` blocks."""
    return selection.budget_blocks


class HotBlocks:
    """Which blocks of each offloaded layer are hot (module doc), on the device.

    Args:
        layers: the offloaded layers. batch, num_kv_heads, num_blocks: ``B, H, N``.
        selection: block size and local window. hot_blocks, hot_steps: ``P``, ``R``.
    Attributes:
        hot: per layer ``[B, H, N]`` bool. last: per layer ``[B, H, N]`` int64, the last
            position at which a block was selected or in the local window (:data:`NEVER`).
    """

    def __init__(self, layers, batch: int, num_kv_heads: int, num_blocks: int, selection: SelectionConfig,
                 hot_blocks: int, hot_steps: int, device: torch.device) -> None:
        self.block_size, self.local = selection.block_size, selection.local_blocks
        self.pool_blocks, self.steps, self.num_blocks = hot_blocks, hot_steps, num_blocks
        shape = (batch, num_kv_heads, num_blocks)
        self.hot = {l: torch.zeros(shape, dtype=torch.bool, device=device) for l in layers}
        self.last = {l: torch.full(shape, NEVER, dtype=torch.long, device=device) for l in layers}
        self._blocks = torch.arange(num_blocks, device=device).view(1, 1, -1)

    def prefill(self, layer: int, row: int, end: int) -> None:
        """Row ``row`` holds tokens ``< end`` of a new prompt: the local window at ``end - 1`` hot."""
        cur = (end - 1) // self.block_size
        window = (self._blocks[0, 0] > cur - self.local) & (self._blocks[0, 0] <= cur)
        self.hot[layer][row] = window
        self.last[layer][row] = torch.where(window, end - 1, NEVER)

    def update(self, layer: int, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One decode step of ``layer``'s first ``b`` rows (design §3.13): ``ids [b, H, W]``
        selected (``-1`` padded), ``pos [b]`` the step's positions. Returns the demoted blocks
        ``[b, H, N]`` bool (static shapes, no host sync;
        :func:`~sparda.kernels.twins.hot_rule_update`); rows ``b ..`` are not touched. A fetch
        runs it inside its slot diff (:meth:`split_operands`)."""
        b = ids.shape[0]
        return hot_rule_update(self.hot[layer][:b], self.last[layer][:b], ids, pos, self.block_size, self.local,
                               self.pool_blocks, self.steps)

    def split(self, layer: int, load: torch.Tensor,
              pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``load [b, H, S]`` of the first ``b`` rows (block to copy into slot ``s``, ``-1`` none)
        split into ``(pool, cold)``: the pool slot of each hot block, the block id of each cold
        one (``-1`` elsewhere). ``pos [b]``: an early copy at the step of these positions, before
        its :meth:`update` (design §6.2): a hot block whose pool slot the step's current block
        takes (``n <= c - P``) counts as cold (:func:`~sparda.kernels.twins.hot_split`)."""
        return hot_split(self.hot[layer][:load.shape[0]], load, self.pool_blocks, self.block_size, pos)

    def split_operands(self, layer: int, load: torch.Tensor, pool_misses: torch.Tensor,
                       update: bool) -> HotSplit:
        """The operands of :func:`sparda.kernels.slot_diff` that run :meth:`update` (``update``:
        a fetch; not for an early diff) and :meth:`split` of its loads inside the slot diff, for
        the first ``b`` rows of ``load [b, H, S]`` (design §3.13): the hot state and the counter
        ``pool_misses [B]`` of the hot loads cut to ``[:b]`` (views), fresh ``pool_load,
        cold_load`` outputs shaped like ``load``."""
        b = load.shape[0]
        return HotSplit(self.hot[layer][:b], self.last[layer][:b], torch.empty_like(load), torch.empty_like(load),
                        pool_misses[:b], self.pool_blocks, self.steps, self.local, update)
