"""The seeds' selectors end to end on a tiny random Llama: a budget that covers the context
gives dense attention's greedy tokens (nothing dropped), a selecting budget reads fewer
blocks and still runs a batch of different lengths, and bad method options fail early."""

from __future__ import annotations

import pytest
import torch

from sparda.engine.llm import LLM
from sparda.errors import SpardaError

NEW = ["streaming", "h2o", "quest", "snapkv", "shallow"]
SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=64, init_blocks=1, local_blocks=2,
             topk_blocks=2, quest_page_size=4)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


def _options(method):
    return {"shallow_layers": 2} if method == "shallow" else {}


@pytest.mark.parametrize("method", NEW)
def test_covering_budget_gives_dense_tokens(tiny, method):
    """A top-k of every block of the request (prompt + new tokens), under the model's whole
    context: the same greedy tokens as dense, every block read."""
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (150, 77)]
    covering = -(-(max(map(len, prompts)) + 12) // SMALL["block_size"])  # 11 blocks of 16 of the 4096-token context
    dense = LLM(str(tiny), method="dense", device="cpu", **SMALL)
    want = dense.generate(None, prompt_token_ids=prompts, max_new_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny), method=method, device="cpu", **{**SMALL, "topk_blocks": covering}, **_options(method))
    got = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.stats["kv_read_fraction"] == 1.0 for o in got)


@pytest.mark.parametrize("method", NEW)
def test_selecting_budget_reads_less(tiny, method):
    """A selecting budget on a batch of two lengths: the long row reads a fraction of its
    blocks, the short one (under dense_len throughout) reads all of them."""
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (230, 30)]
    llm = LLM(str(tiny), method=method, device="cpu", **SMALL, **_options(method))
    out = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=10, ignore_eos=True)
    assert out[0].stats["kv_read_fraction"] < 0.9
    assert out[1].stats["kv_read_fraction"] == 1.0
    assert len(out[0].token_ids) == len(out[1].token_ids) == 10


def test_bad_method_options_fail_before_the_model_loads(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(SpardaError, match="quest_page_size 5 must be a positive divisor of block_size 64"):
        LLM(missing, method="quest", quest_page_size=5)
    with pytest.raises(SpardaError, match="snapkv_window"):
        LLM(missing, method="snapkv", snapkv_window=0)
    with pytest.raises(SpardaError, match="shallow_layers"):
        LLM(missing, method="shallow", shallow_layers=0)
