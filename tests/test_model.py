"""Our forward against transformers' own models on the same weights (fp32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparda import LLM, SpardaError

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _assert_greedy_match(hf, ids, ours, ref):
    """``ours`` == ``ref`` (transformers' greedy tokens after ``ids``) up to a near-tie: at the
    first token that differs, our choice scores within 1e-4 (relative to the largest logit)
    of transformers' best on that prefix (fp32 sums in another order flip exact ties)."""
    if ours == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
    with torch.no_grad():
        step = hf(torch.tensor([ids + ref[:i]])).logits[0, -1].float()
    gap = float(step.max() - step[ours[i]])
    assert gap <= 1e-4 * float(step.abs().max()), (i, ours[i], ref[i], gap)


def _check_parity(llm, hf, ids):
    ours = llm.logits(ids)[-1]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0, -1].float()
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= 1e-4 * scale, float((ours - theirs).abs().max() / scale)
    out = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=64, ignore_eos=True)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, min_new_tokens=64,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    _assert_greedy_match(hf, ids, out.token_ids, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_match_transformers(arch, make_tiny):
    path = make_tiny(arch)
    llm = LLM(path, method="dense", device="cpu")
    ids = torch.randint(0, 49152, (int(torch.randint(40, 90, ())),)).tolist()
    _check_parity(llm, _hf(path), ids)


def test_bundled_model_matches_transformers(bundled_dir):
    llm = LLM(None, method="dense", device="cpu")
    text = "The quick brown fox jumps over the lazy dog while the cat watches from the window. " * 3
    ids = llm.encode(text)
    _check_parity(llm, _hf(bundled_dir), ids)


def test_unsupported_architecture_is_refused(tmp_path, make_tiny):
    import json
    import shutil

    src = make_tiny("llama")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpardaError, match="unsupported architecture 'gpt2'.*llama, mistral, qwen2, qwen3"):
        LLM(tmp_path, device="cpu")


def test_missing_model_and_too_long_prompt(make_tiny):
    with pytest.raises(SpardaError, match="not found"):
        LLM("/no/such/model", device="cpu")
    llm = LLM(make_tiny("llama"), device="cpu")
    with pytest.raises(SpardaError, match="4090 tokens plus 10 new tokens exceeds the model's context of 4096"):
        llm.generate([None], prompt_token_ids=[[5] * 4090], max_new_tokens=10)


def test_batch_of_different_lengths_matches_single_runs(make_tiny):
    llm = LLM(make_tiny("qwen2"), method="dense", device="cpu")
    prompts = [torch.randint(0, 49152, (n,)).tolist() for n in (17, 60, 33)]
    batched = llm.generate([None] * 3, prompt_token_ids=prompts, max_new_tokens=20, ignore_eos=True)
    for ids, res in zip(prompts, batched):
        alone = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=20, ignore_eos=True)[0]
        assert res.token_ids == alone.token_ids


def test_sampling_is_seeded_and_top_p_restricts(make_tiny):
    llm = LLM(make_tiny("llama"), device="cpu")
    ids = [[3, 4, 5, 6, 7]]
    a = llm.generate([None], prompt_token_ids=ids, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    b = llm.generate([None], prompt_token_ids=ids, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    assert a[0].token_ids == b[0].token_ids
    greedy = llm.generate([None], prompt_token_ids=ids, max_new_tokens=12, ignore_eos=True)
    tiny_p = llm.generate([None], prompt_token_ids=ids, max_new_tokens=12, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)
    assert tiny_p[0].token_ids == greedy[0].token_ids  # top_p -> 0 keeps only the argmax


# Sliding windows as transformers 5 reads them: mistral on every layer; qwen2 from layer
# max_window_layers on; qwen3 per layer_types.
WINDOWED = {
    "mistral": dict(sliding_window=24),
    "qwen2": dict(use_sliding_window=True, sliding_window=24, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=19,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_sliding_window_models_match_transformers(arch, make_tiny, monkeypatch):
    import sparda.attention.base as base

    monkeypatch.setattr(base, "WINDOW_CHUNK_TOKENS", int(torch.randint(5, 40, ())))  # chunk edges
    path = make_tiny(arch, **WINDOWED[arch])
    llm = LLM(path, method="dense", device="cpu")
    assert llm.shape.windowed_layers(), "the config must ask for a window"
    hf = _hf(path)
    ids = torch.randint(0, 49152, (int(torch.randint(60, 120, ())),)).tolist()  # 2.5-6x the window
    ours = llm.logits(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= 1e-4 * scale, float((ours - theirs).abs().max() / scale)
    # greedy choice at every position, up to a near-tie: where the argmaxes differ, ours must
    # score within 1e-4 (relative to the largest logit) of transformers' best (fp32 sums in
    # another order, ~5e-7 apart, flip a top-2 gap that small in ~1 of 3,000 runs)
    pick = ours.argmax(-1)
    gap = theirs.max(-1).values - theirs.gather(-1, pick.view(-1, 1)).squeeze(-1)
    assert (gap <= 1e-4 * scale).all(), (gap.max(), (pick != theirs.argmax(-1)).nonzero().flatten())
    # decode past the window: the decode mask, against transformers' sliding-window cache
    out = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=40, ignore_eos=True)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, min_new_tokens=40,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    _assert_greedy_match(hf, ids, out.token_ids, ref)


def test_window_as_long_as_the_context_changes_nothing(make_tiny):
    """A window >= the context is full attention: block-sparse methods run (Mistral's default)."""
    llm = LLM(make_tiny("mistral", sliding_window=4096), method="sparse", device="cpu")
    assert llm.shape.windowed_layers() == []


@pytest.mark.parametrize("method", ["sparse", "oracle", "sparda-random", "infinigen", "sparse-offload"])
def test_block_sparse_methods_refuse_a_sliding_window(method, make_tiny):
    path = make_tiny("qwen2", **WINDOWED["qwen2"])
    with pytest.raises(SpardaError, match=r"does not implement sliding-window attention \(config "
                                          r"sliding_window=24 on 2 of 3 layers.*use method=dense$"):
        LLM(path, method=method, device="cpu")


def _with_config(tmp_path, src, **changes):
    import json
    import shutil

    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("arch, field, value", [
    ("llama", "attn_logit_softcapping", 50.0),
    ("llama", "attention_chunk_size", 8192),
    ("qwen3", "no_rope_layers", [1, 0, 1]),
    ("mistral", "partial_rotary_factor", 0.5),
    ("llama", "sliding_window", 64),
    ("qwen2", "layer_types", ["chunked_attention"] * 3),
])
def test_unimplemented_attention_fields_are_refused(tmp_path, make_tiny, arch, field, value):
    path = _with_config(tmp_path, make_tiny(arch), **{field: value})
    with pytest.raises(SpardaError, match=f"config field ([a-z_]+\\.)?{field}=.* is not supported"):
        LLM(path, method="dense", device="cpu")


def test_biases_and_activation_follow_the_config(make_tiny):
    """llama's attention_bias (q/k/v/o), mlp_bias and a non-SiLU hidden_act, against transformers."""
    path = make_tiny("llama", attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh")
    llm = LLM(path, method="dense", device="cpu")
    ids = torch.randint(0, 49152, (int(torch.randint(20, 60, ())),)).tolist()
    _check_parity(llm, _hf(path), ids)


def test_dense_layers_apply_the_window(make_tiny):
    """The dense pass of Forecast training and the selection report, on a windowed model."""
    path = make_tiny("qwen2", **WINDOWED["qwen2"])
    llm, hf = LLM(path, method="dense", device="cpu"), _hf(path)
    ids = torch.randint(0, 49152, (1, int(torch.randint(60, 120, ())))).long()
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
        for layer, h, *_ in llm.model.dense_layers(ids):
            ref = hf.model.layers[layer].input_layernorm(states[layer])
            assert (h - ref).abs().max() <= 1e-4 * ref.abs().max(), layer
