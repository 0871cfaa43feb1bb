"""`sparse` and `oracle` in the runtime: equivalences that must hold exactly."""

import pytest
import torch

from sparda import LLM

SMALL_BLOCKS = dict(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2,
                    topk_blocks=2, dense_len=0, sparse_prefill=True)  # logits() scores prefill


def test_sparse_with_covering_budget_equals_dense(make_tiny):
    path = make_tiny("llama")
    ids = torch.randint(0, 49152, (int(torch.randint(300, 400, ())),)).tolist()
    dense = LLM(path, method="dense", device="cpu")
    full = LLM(path, method="sparse", device="cpu", **dict(SMALL_BLOCKS, topk_blocks=40))
    torch.testing.assert_close(full.logits(ids), dense.logits(ids), rtol=1e-5, atol=1e-5)
    a = dense.generate([None], prompt_token_ids=[ids], max_new_tokens=24, ignore_eos=True)[0]
    b = full.generate([None], prompt_token_ids=[ids], max_new_tokens=24, ignore_eos=True)[0]
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("method", ["sparse", "oracle"])
def test_small_budget_really_drops_blocks_and_prefill_equals_decode(make_tiny, method):
    """Prefill selects per query token, so the logits of prefill over T tokens equal
    prefill over T-k tokens followed by k decode steps."""
    path = make_tiny("qwen3")
    llm = LLM(path, method=method, device="cpu", **SMALL_BLOCKS)
    dense = LLM(path, method="dense", device="cpu")
    ids = torch.randint(0, 49152, (int(torch.randint(200, 260, ())),)).tolist()
    full = llm.logits(ids)
    assert (full - dense.logits(ids)).abs().max() > 1e-3  # selection changed something
    cache = llm.new_cache(1, len(ids))
    llm.method.reset()
    llm.prefill(cache, 0, ids[:-12])
    steps = [llm.decode(cache, torch.tensor([ids[i]]), torch.tensor([i]))[0] for i in range(len(ids) - 12, len(ids))]
    torch.testing.assert_close(torch.stack(steps), full[-12:], rtol=1e-4, atol=1e-4)
    assert 0 < cache.read_fraction() < 1


def test_sparse_batch_of_different_lengths_matches_single_runs(make_tiny):
    llm = LLM(make_tiny("mistral"), method="sparse", device="cpu", **SMALL_BLOCKS)
    prompts = [torch.randint(0, 49152, (n,)).tolist() for n in (70, 150, 111)]
    batched = llm.generate([None] * 3, prompt_token_ids=prompts, max_new_tokens=30, ignore_eos=True)
    fractions = []
    for ids, res in zip(prompts, batched):
        alone = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=30, ignore_eos=True)[0]
        assert res.token_ids == alone.token_ids
        assert res.stats["kv_read_fraction"] == alone.stats["kv_read_fraction"]  # per sequence
        fractions.append(res.stats["kv_read_fraction"])
    assert fractions[1] < fractions[0] and 0 < fractions[1] < 1  # longer context, smaller share read


def test_method_names_agree_between_config_and_registry():
    """The CLI's --method choices (config.METHODS) are exactly the registered methods."""
    from sparda.attention.registry import METHOD_CLASSES
    from sparda.config import METHODS

    assert list(METHODS) == list(METHOD_CLASSES)
