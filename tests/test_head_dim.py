"""Head dims the Triton kernels do not tile (80, 96: not a power of two) run on the PyTorch
twins (C1): the decode selection against a float64 brute force, and every
block-sparse method end to end against dense (covering budget) and against its on-device
twin (small budget), on a tiny random Llama with head_dim 80."""

from __future__ import annotations

import pytest
import torch

from sparda import kernels
from sparda.config import SelectionConfig
from sparda.kernels import reference as ref
from test_offload import SMALL, _llm, _run_lockstep, forecast_file  # noqa: F401 - fixtures
from test_reference import brute_select

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2,
                      topk_blocks=3, dense_len=0)


@pytest.mark.parametrize("d", [80, 96])
@pytest.mark.parametrize("forecast", [False, True])
def test_decode_selection_any_head_dim_matches_brute_force(d, forecast):
    """The dispatch takes the PyTorch twin for these head dims (it raised before): the blocks
    equal design §3's float64 brute force. A Forecast query scores with raw dot products,
    which rank like the softmax of a one-query group, so the same brute force applies."""
    h, g, n_tok = 2, 1 if forecast else 3, int(torch.randint(150, 220, ()))
    k = torch.randn(1, h, n_tok, d)
    query = torch.randn(1, h, g, d) * 2
    pos = torch.randint(CFG.budget_blocks * CFG.block_size, n_tok, (1,))
    ck = ref.compress_keys(k, CFG.kernel_size, CFG.kernel_stride)
    num_blocks = -(-n_tok // CFG.block_size)
    mask = kernels.select_decode_blocks(query[:, :, 0] if forecast else query, ck, pos, num_blocks, CFG,
                                        return_mask=True)[1]
    for head in range(h):
        want = brute_select(query[0, head], k[0, head], int(pos), CFG)
        assert mask[0, head].nonzero().flatten().tolist() == want, head
        assert len(want) == CFG.budget_blocks  # selection really dropped blocks


@pytest.fixture(scope="module")
def tiny(make_tiny):
    """A tiny random Llama whose head_dim (80) is not a power of two."""
    return make_tiny("llama", head_dim=80)


@pytest.mark.parametrize("method, extra", [("sparse", {}), ("sparse-offload", {}),
                                           ("sparda", {"offload": True}), ("sparda-no-prefetch", {})])
def test_head_dim_80_covering_budget_equals_dense(tiny, forecast_file, method, extra):
    """A budget that covers every block: greedy tokens equal dense attention's."""
    from sparda.engine.llm import LLM

    if method.startswith("sparda"):
        extra = dict(extra, forecast=forecast_file)
    dense = LLM(str(tiny), method="dense", device="cpu")
    llm = LLM(str(tiny), method=method, device="cpu", **{**SMALL, "topk_blocks": 64}, **extra)
    ids = torch.randint(100, 20000, (int(torch.randint(90, 140, ())),)).tolist()
    want = dense.generate([None], prompt_token_ids=[ids], max_new_tokens=12, ignore_eos=True)[0]
    got = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=12, ignore_eos=True)[0]
    assert got.token_ids == want.token_ids


def test_head_dim_80_offloaded_methods_match_on_device(tiny, forecast_file):
    """Small budget (selection drops blocks): offloaded sparse and sparda give the logits of
    their on-device twins, which run the reference selection and attention."""
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (97, 150)]
    for ref_method, method, extra in (("sparse", "sparse-offload", {}),
                                      ("sparda", "sparda", {"offload": True, "forecast": forecast_file})):
        ref = _llm(tiny, ref_method, **{k: v for k, v in extra.items() if k == "forecast"})
        off = _llm(tiny, method, resident=(0,), **extra)
        worst, same, cache = _run_lockstep(ref, off, prompts, 24)
        assert worst <= 1e-5 and same, method
        assert cache.read_fraction() < 0.7, method
