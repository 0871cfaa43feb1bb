"""The PyTorch reference against independent brute-force / float64 implementations."""

import math

import numpy as np
import pytest
import torch

from sparda.config import SelectionConfig
from sparda.kernels import reference as ref


def brute_compressed(k, kernel, stride):
    """Loop over windows: [T, d] -> [C, d] (float64)."""
    k = k.double().numpy()
    out = []
    j = 0
    while j * stride + kernel <= len(k):
        out.append(k[j * stride:j * stride + kernel].mean(0))
        j += 1
    return np.array(out).reshape(-1, k.shape[-1])


def brute_select(q, keys, t, cfg):
    """Independent selection for one query position ``t`` and one KV head.

    q: [G, d] queries of the group; keys: [T, d] post-RoPE keys. Returns a sorted list
    of selected block ids, following design §3 literally with Python loops.
    """
    kernel, stride, bs = cfg.kernel_size, cfg.kernel_stride, cfg.block_size
    ck = brute_compressed(keys, kernel, stride)
    visible = [j for j in range(len(ck)) if j * stride + kernel - 1 <= t]
    group = np.zeros(len(ck))
    qd = q.double().numpy()
    for g in range(qd.shape[0]):
        if not visible:
            break
        logits = np.array([qd[g] @ ck[j] / math.sqrt(qd.shape[1]) for j in visible])
        p = np.exp(logits - logits.max())
        p /= p.sum()
        for j, pj in zip(visible, p):
            group[j] += pj
    cur = t // bs
    n_valid = cur + 1
    if t + 1 < cfg.dense_len or n_valid <= cfg.budget_blocks:
        return list(range(n_valid))
    forced = {b for b in range(n_valid) if b < cfg.init_blocks or b > cur - cfg.local_blocks}
    scores = {}
    for b in range(n_valid):
        over = [j for j in visible if j * stride < (b + 1) * bs and j * stride + kernel > b * bs]
        scores[b] = max(group[j] for j in over) if over else -1e30
    rest = sorted((b for b in range(n_valid) if b not in forced), key=lambda b: (-scores[b], b))
    return sorted(forced | set(rest[:cfg.topk_blocks]))


@pytest.mark.parametrize("T", [31, 32, 77, 200])
def test_compress_keys_matches_loop(T):
    k = torch.randn(2, T, 8)
    got = ref.compress_keys(k, 32, 16)
    for h in range(2):
        want = brute_compressed(k[h], 32, 16)
        assert got.shape[-2] == len(want)
        np.testing.assert_allclose(got[h].double().numpy(), want, atol=1e-6)


@pytest.mark.parametrize("kernel,stride", [(8, 4), (6, 3), (4, 4)])
@pytest.mark.parametrize("ring", [False, True])
def test_update_compressed_keys_tracks_brute_force(kernel, stride, ring):
    """Decode appends one token per step to a ragged batch (a subset of the rows each
    step, in shuffled order); after every step the compressed keys of each row equal the
    float64 window means of its prefix, rows outside the step and windows beyond the
    buffer stay untouched. Keys come from the full cache or a ring of the last ``kernel``."""
    batch, heads, d, total, c_cap = 4, 2, 8, 48, 7  # c_cap < windows of 48 tokens: must not overflow
    keys = torch.randn(batch, heads, total, d)
    length = torch.randint(0, kernel + 2, (batch,))
    junk = torch.randn(batch, heads, c_cap, d)
    ck = junk.clone()
    store = keys.clone() if not ring else torch.zeros(batch, heads, kernel, d)
    for b in range(batch):  # the prompt: its windows and, for the ring, its last `kernel` keys
        n = min(ref.num_compressed(int(length[b]), kernel, stride), c_cap)
        ck[b, :, :n] = ref.compress_keys(keys[b, :, :int(length[b])], kernel, stride)[:, :n]
        if ring:
            for t in range(max(0, int(length[b]) - kernel), int(length[b])):
                store[b, :, t % kernel] = keys[b, :, t]
    for _ in range(30):
        rows = torch.randperm(batch)[:int(torch.randint(1, batch + 1, ()))]
        before = ck.clone()
        pos = length[rows].clone()
        if ring:
            store[rows, :, pos % kernel] = keys[rows, :, pos]
        ref.update_compressed_keys(ck, store, rows, pos, kernel, stride, ring=ring)
        length[rows] += 1
        for b in range(batch):
            want = brute_compressed(keys[b].transpose(0, 1).reshape(int(total), -1)[:int(length[b])],
                                    kernel, stride).reshape(-1, heads, d)[:c_cap]
            n = len(want)
            np.testing.assert_allclose(ck[b, :, :n].double().numpy(), want.transpose(1, 0, 2), atol=1e-6)
            torch.testing.assert_close(ck[b, :, n:], junk[b, :, n:], rtol=0, atol=0)
            if b not in rows.tolist():
                torch.testing.assert_close(ck[b], before[b], rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [SelectionConfig(), SelectionConfig(block_size=32, kernel_size=24, kernel_stride=8),
                                 SelectionConfig(block_size=64, kernel_size=16, kernel_stride=16)])
def test_pool_matches_interval_overlap(cfg):
    C, N = 41, 13
    scores = torch.randn(3, C)
    got = ref.pool_to_blocks(scores, N, cfg)
    for b in range(N):
        over = [j for j in range(C) if j * cfg.kernel_stride < (b + 1) * cfg.block_size
                and j * cfg.kernel_stride + cfg.kernel_size > b * cfg.block_size]
        want = scores[:, over].amax(-1) if over else torch.full((3,), float("-inf"))
        assert torch.equal(got[:, b], want)


def test_paper_geometry_is_pool_5_4_1():
    assert ref.pool_window(SelectionConfig.from_preset("paper")) == (5, 4, 1)


@pytest.mark.parametrize("G", [1, 3, 4])
def test_small_preset_selection_matches_brute_force(G):
    """design §3 selection at the `small` preset, lengths not a multiple of the block size."""
    cfg = SelectionConfig.from_preset("small")
    H, d = 2, 16
    T = cfg.block_size * int(torch.randint(33, 36, ()).item()) + int(torch.randint(1, cfg.block_size, ()).item())
    k = torch.randn(1, H, T, d)
    positions = sorted({T - 1, T - 2, 2047, 2048, 1343, 1344, *torch.randint(1300, T, (6,)).tolist()})
    q = torch.randn(1, H, G, len(positions), d) * 2
    q_pos = torch.tensor([positions])
    ck = ref.compress_keys(k, cfg.kernel_size, cfg.kernel_stride)
    scores = ref.query_group_scores(q, ck, q_pos, cfg.kernel_size, cfg.kernel_stride)
    mask = ref.select_blocks(ref.pool_to_blocks(scores, -(-T // 64), cfg), q_pos, cfg)
    for h in range(H):
        for i, t in enumerate(positions):
            want = brute_select(q[0, h, :, i], k[0, h], t, cfg)
            got = mask[0, h, i].nonzero().flatten().tolist()
            assert got == want, (h, t)
    sel = mask[0, :, -1].sum(-1)
    assert (sel == cfg.budget_blocks).all()


def test_budget_larger_than_context_keeps_every_block():
    cfg = SelectionConfig(topk_blocks=50, dense_len=0)
    T = 700
    scores = torch.randn(1, 2, 1, -(-T // 64))
    mask = ref.select_blocks(scores, torch.tensor([[T - 1]]), cfg)
    assert mask.all()


def test_block_sparse_attention_matches_float64():
    B, H, G, Tq, T, d, bs = 2, 2, 3, 5, 150, 8, 16
    q, k, v = torch.randn(B, H, G, Tq, d), torch.randn(B, H, T, d), torch.randn(B, H, T, d)
    kv_len = torch.tensor([150, 97])
    q_pos = torch.stack([torch.randint(0, int(n), (Tq,)) for n in kv_len])
    N = -(-T // bs)
    mask = torch.rand(B, H, Tq, N) < 0.5
    mask |= (torch.arange(N).view(1, 1, 1, -1) == (q_pos // bs).view(B, 1, Tq, 1))  # own block
    got = ref.block_sparse_attention(q, k, v, mask, q_pos, kv_len, bs)
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                t = int(q_pos[b, i])
                keys = [j for j in range(T) if j <= t and j < kv_len[b] and mask[b, h, i, j // bs]]
                kk, vv = k[b, h, keys].double(), v[b, h, keys].double()
                for g in range(G):
                    w = torch.softmax(kk @ q[b, h, g, i].double() / math.sqrt(d), 0)
                    torch.testing.assert_close(got[b, h, g, i].double(), w @ vv, rtol=1e-5, atol=1e-5)


def test_block_attention_mass_sums_to_group_size():
    q, k = torch.randn(1, 2, 3, 4, 8), torch.randn(1, 2, 100, 8)
    mass = ref.block_attention_mass(q, k, torch.tensor([[10, 50, 64, 99]]), torch.tensor([100]), 16)
    torch.testing.assert_close(mass.sum(-1), torch.full((1, 2, 4), 3.0))
    assert mass[0, :, 0, 1:].sum() == 0  # position 10 sees block 0 only


def test_block_mask_to_indices_round_trip():
    mask = torch.rand(2, 3, 4, 9) < 0.4
    ids = ref.block_mask_to_indices(mask)
    back = torch.zeros_like(mask)
    for idx in np.ndindex(*ids.shape[:-1]):
        row = [i for i in ids[idx].tolist() if i >= 0]
        assert row == sorted(row)
        back[idx][row] = True
    assert torch.equal(back, mask)


def test_no_query_tokens_give_empty_outputs():
    """Tq = 0 returns empty tensors of the right shape (the Triton prefill does the same)."""
    b, h, g, t, d = 2, 3, 2, int(torch.randint(40, 90, ())), 8
    q, k, v = torch.randn(b, h, g, 0, d), torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    q_pos, kv_len = torch.zeros(b, 0, dtype=torch.long), torch.full((b,), t)
    n = -(-t // 16)
    out = ref.block_sparse_attention(q, k, v, torch.ones(b, h, 0, n, dtype=torch.bool), q_pos, kv_len, 16)
    assert out.shape == (b, h, g, 0, d)
    assert ref.block_attention_mass(q, k, q_pos, kv_len, 16).shape == (b, h, 0, n)
