"""The Forecast's decode lookahead through the selection kernel (`ck_len` cut) equals the
reference composition used on CPU: score layer l+1's compressed keys as they stood before
this step's token (visibility at ``q_pos - 1``), then select at ``q_pos`` (design §4)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.config import SelectionConfig  # noqa: E402
from sparda.kernels import reference, select_decode_blocks  # noqa: E402
from sparda.kernels.selection import select_decode_blocks_triton  # noqa: E402

CFG = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1,
                      local_blocks=2, topk_blocks=3, dense_len=0)


def test_lookahead_cut_matches_reference():
    bsz, heads, d = 3, 2, 32
    num_tokens = int(torch.randint(150, 260, ()))
    pos = torch.tensor([num_tokens - 1, num_tokens // 2 + 3, 8 * CFG.kernel_stride + CFG.kernel_size - 1])
    ck = torch.randn(bsz, heads, reference.num_compressed(num_tokens, CFG.kernel_size, CFG.kernel_stride), d)
    f = torch.randn(bsz, heads, d) * 2
    num_blocks = -(-num_tokens // CFG.block_size)
    scores = reference.forecast_scores(f.unsqueeze(2), ck, pos.view(-1, 1) - 1, CFG.kernel_size, CFG.kernel_stride)
    want = reference.select_blocks(reference.pool_to_blocks(scores, num_blocks, CFG), pos.view(-1, 1), CFG)[:, :, 0]
    ck_len = torch.where(pos >= CFG.kernel_size, (pos - CFG.kernel_size) // CFG.kernel_stride + 1, 0)
    for fn in (select_decode_blocks, select_decode_blocks_triton):
        _, mask = fn(f, ck, pos, num_blocks, CFG, ck_len=ck_len, return_mask=True)
        assert torch.equal(mask, want)
