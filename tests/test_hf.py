"""transformers' own generate() with sparda attention (sparda.hf) against sparda.LLM."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import sparda.integrations.hf as hf
from sparda import LLM, SpardaError

# A budget that selects at a few hundred tokens: 16-token blocks, 3 + 2 + 1 of them.
BUDGET = dict(block_size=16, kernel_size=16, kernel_stride=8, topk_blocks=3, local_blocks=2, init_blocks=1,
              dense_len=64, sparse_prefill=True)  # prefill logits selected too


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy(model, ids, n):
    prompt = torch.tensor([ids])  # an explicit mask: generate() would mask prompt tokens equal to pad_token_id
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("method", ["sparse", "sparda-random"])
def test_generate_with_sparda_attention_equals_llm(method, make_tiny, monkeypatch):
    monkeypatch.setattr(hf, "GROW_TOKENS", int(torch.randint(3, 12, ())))  # the cache grows in decode
    path = make_tiny("llama")
    ids = torch.randint(0, 49152, (int(torch.randint(150, 260, ())),)).tolist()  # 10-16 blocks
    llm = LLM(path, method=method, device="cpu", **BUDGET)
    expected = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=16, ignore_eos=True)[0]
    model = hf.enable(_hf(path), method=method, **BUDGET)
    assert _greedy(model, ids, 16) == expected.token_ids
    assert hf.cache_of(model).read_fraction() == pytest.approx(expected.stats["kv_read_fraction"], abs=1e-4)
    # a second call starts a fresh sequence
    short = ids[: int(torch.randint(70, 140, ()))]
    again = llm.generate([None], prompt_token_ids=[short], max_new_tokens=8, ignore_eos=True)[0].token_ids
    assert _greedy(model, short, 8) == again
    with torch.no_grad():  # a plain forward: all positions' logits, as LLM.logits
        logits = model(torch.tensor([ids])).logits[0]
    assert torch.allclose(logits, llm.logits(ids), rtol=0, atol=1e-4 * float(logits.abs().max()))
    hf.disable(model)  # selection is really on: the logits differ from transformers' own attention
    with torch.no_grad():
        plain = model(torch.tensor([ids])).logits[0]
    assert (plain - logits).abs().max() > 1e-2 * plain.abs().max()


def test_sliding_window_model_through_hf_dense(make_tiny):
    path = make_tiny("mistral", sliding_window=24)
    ids = torch.randint(0, 49152, (int(torch.randint(60, 120, ())),)).tolist()
    plain = _greedy(_hf(path), ids, 30)
    assert _greedy(hf.enable(_hf(path), method="dense"), ids, 30) == plain
    with pytest.raises(SpardaError, match="does not implement sliding-window attention.*use --method dense"):
        hf.enable(_hf(path), method="sparse")


def test_refusals(make_tiny):
    model = hf.enable(_hf(make_tiny("qwen3")), method="sparse", **BUDGET)
    with pytest.raises(SpardaError, match="one sequence per call, got a batch of 2"):
        model.generate(torch.ones(2, 5, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(SpardaError, match="batch of 2 .beam search"):
        model.generate(torch.ones(1, 5, dtype=torch.long), max_new_tokens=2, num_beams=2, do_sample=False)
    ids = torch.randint(1, 49152, (1, int(torch.randint(20, 60, ()))))
    where = int(torch.randint(0, ids.shape[1], ()))
    mask = torch.ones_like(ids)
    mask[0, where] = 0
    with pytest.raises(SpardaError, match=f"attention_mask masks 1 of {ids.shape[1]} .*one at a time"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    ids[0, where] = 7  # generate() builds that mask itself from a prompt token equal to pad_token_id
    with pytest.raises(SpardaError, match=f"attention_mask masks 1 of {ids.shape[1]}"):
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=7, eos_token_id=None)
    mask[0, where] = 1  # the same prompt unmasked decodes
    assert model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False).shape[1] == ids.shape[1] + 2
    with pytest.raises(SpardaError, match="on-device methods; 'sparse-offload' offloads"):
        hf.enable(model, method="sparse-offload")
    for stateful in ("h2o", "quest", "snapkv", "shallow"):  # their per-row state is not carried by sparda.hf
        with pytest.raises(SpardaError, match=f"{stateful}' keeps state across decode steps: use sparda.LLM"):
            hf.enable(model, method=stateful)


@pytest.mark.slow
def test_bundled_model_generate_with_sparda_equals_llm(bundled_dir):
    from sparda.data import heldout_text

    budget = dict(topk_blocks=4, local_blocks=2, dense_len=512)  # 7 of 15 blocks
    llm = LLM(None, method="sparda", device="cpu", **budget)
    ids = llm.encode(heldout_text()[:6000], chat=False)[:900]
    expected = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=16, ignore_eos=True)[0]
    model = hf.enable(_hf(bundled_dir), method="sparda", **budget)
    assert _greedy(model, ids, 16) == expected.token_ids
    assert hf.cache_of(model).read_fraction() == pytest.approx(expected.stats["kv_read_fraction"], abs=1e-4)
    assert expected.stats["kv_read_fraction"] < 0.6


def test_enable_takes_llms_options_and_gives_llms_tokens_by_default(make_tiny, tmp_path):
    """Defaults as sparda.LLM: the method, and dense_heads="auto", which reads the model's stored
    calibration (here every KV head of layers 1 and 2: their decode reads every block)."""
    import json
    import shutil

    from sparda.attention.dense_heads import CALIBRATION_FILE

    path = tmp_path / "tiny"
    shutil.copytree(make_tiny("llama"), path)  # its own copy: the calibration must not reach other tests
    heads = ((1, 0), (1, 1), (2, 0), (2, 1))
    (path / CALIBRATION_FILE).write_text(json.dumps({"format": "sparda-dense-heads-v1", "heads": list(heads)}))
    ids = torch.randint(0, 49152, (int(torch.randint(150, 260, ())),)).tolist()
    llm = LLM(path, device="cpu", **BUDGET)  # method and dense heads left to their defaults
    assert llm.config.method == "sparse" and llm.config.dense_heads == heads
    expected = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=16, ignore_eos=True)[0]
    model = hf.enable(_hf(path), cuda_graphs=False, fused_decode=True, device="cpu", dtype="float32", **BUDGET)
    assert hf.method_of(model).config.method == "sparse" and hf.method_of(model).config.dense_heads == heads
    assert _greedy(model, ids, 16) == expected.token_ids
    read = expected.stats["kv_read_fraction"]
    assert hf.cache_of(model).read_fraction() == pytest.approx(read, abs=1e-4)
    none = LLM(path, device="cpu", dense_heads="none", **BUDGET)
    plain = none.generate([None], prompt_token_ids=[ids], max_new_tokens=16, ignore_eos=True)[0]
    assert plain.stats["kv_read_fraction"] < read  # the heads really read more
    model = hf.enable(_hf(path), dense_heads="none", **BUDGET)
    assert hf.method_of(model).config.dense_heads == ()
    assert _greedy(model, ids, 16) == none.generate([None], prompt_token_ids=[ids], max_new_tokens=16,
                                                    ignore_eos=True)[0].token_ids
    assert hf.method_of(hf.enable(_hf(path), method="sparse", dense_heads="0:1", **BUDGET)).config.dense_heads == \
        ((0, 1),)
    with pytest.raises(SpardaError, match="dense_heads: 'x' is not LAYER:KV_HEAD"):
        hf.enable(_hf(path), dense_heads="x")
    with pytest.raises(SpardaError, match="kv_dtype 'int8' needs sparda.LLM"):
        hf.enable(_hf(path), kv_dtype="int8")
    with pytest.raises(SpardaError, match="runs in the model's dtype"):
        hf.enable(_hf(path), dtype="bfloat16")
