"""Batched prefill (design §3.8): prompts of different lengths right-padded through one forward.

Tiny random llama, fp32, small blocks (block 16, kernel 8, stride 4, dense_len 40) so that
block-sparse prefill selects at these lengths. The reference of each row is the same
method prefilling that prompt alone in a fresh cache (:meth:`sparda.LLM.prefill`), whose
own correctness the other test modules establish (dense against transformers, selection
against float64, chunked against unchunked). Lengths are drawn fresh (seed printed on
failure), from below the dense fallback to past several compressed-key windows, so the
padding of the shorter rows covers windows and blocks that the longest row completes.
"""

from __future__ import annotations

import pytest
import torch

from sparda import SamplingParams
from sparda.errors import SpardaError
from near_tie import agree_up_to_a_tie
from test_offload import forecast_file  # noqa: F401 - fixture

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=40, init_blocks=1, local_blocks=2,
             topk_blocks=3)
# method, LLM options, resident layers of an offloaded method (None: on the device)
BATCHED = [("dense", {}, None), ("sparse", {}, None), ("oracle", {}, None), ("infinigen", {}, None),
           ("streaming", {}, None), ("sparda", {}, None), ("sparda-random", {}, None),
           ("sparse", {"sparse_prefill": False}, None), ("sparda", {"sparse_prefill": False}, None),
           ("sparse", {"kv_dtype": "int8"}, None), ("sparse-offload", {}, ()),
           ("sparda", {"offload": True}, (0,)), ("sparda", {"offload": True, "kv_dtype": "int4"}, (0,)),
           ("sparda-no-prefetch", {}, ()),
           # the seeds' selectors keep per-row state from their prompt (design §3.8: each row's own)
           ("h2o", {}, None), ("snapkv", {}, None), ("snapkv", {"snapkv_window": 48}, None), ("quest", {}, None),
           ("quest", {"sparse_prefill": False}, None), ("shallow", {"shallow_layers": 1}, None),
           ("shallow", {"shallow_layers": 1, "shallow_select_once": True}, None),
           ("shallow", {"shallow_layers": 1, "offload": True}, None)]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


def _id(method, options):
    return method + "".join(f"-{k}={v}" for k, v in options.items())


def _llm(tiny, method, options, resident, forecast_file, **extra):
    from sparda.engine.llm import LLM

    options = dict(options)
    options.setdefault("sparse_prefill", True)
    if method.startswith("sparda") and method != "sparda-random":
        options["forecast"] = forecast_file
    llm = LLM(str(tiny), method=method, device="cpu", cuda_graphs=False, dense_heads="none",
              **SMALL, **options, **extra)
    if resident is not None:
        llm.method.resident_layers = resident
    return llm


def _lengths() -> list[int]:
    """Four prompt lengths, shuffled: one under the dense fallback (40), one past 9 blocks
    (so that a budget of 6 blocks drops some), two anywhere up to 230."""
    lengths = [int(torch.randint(20, 40, ())), int(torch.randint(150, 231, ())), *torch.randint(41, 231, (2,)).tolist()]
    return [lengths[i] for i in torch.randperm(4).tolist()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _row_state(cache, row: int, num_tokens: int) -> dict[str, torch.Tensor]:
    """What a prefill leaves in ``row`` for its first ``num_tokens`` tokens: K/V (device
    cache, resident layers, host store, partial slot), the complete compressed keys, the
    ring of the last keys and the length."""
    from sparda.kernels import quant

    num_ck = cache.num_compressed(num_tokens)
    state = {"length": cache.lengths[row].clone(),
             "ck": torch.stack([ck[row, :, :num_ck] for ck in cache.ck])}
    if not cache.offload:  # DeviceKVCache
        for layer in range(len(cache.k)):
            k, v, _ = cache.view(layer, torch.tensor([row]), num_tokens)
            state[f"kv{layer}"] = torch.stack([k[0], v[0]])
        return state
    state["ring"] = torch.stack([ring[row] for ring in cache.ring])
    for layer in cache.resident:
        state[f"full{layer}"] = torch.stack([quant.as_float(cache.k_full[layer][row, :, :num_tokens], torch.float32),
                                             quant.as_float(cache.v_full[layer][row, :, :num_tokens], torch.float32)])
    for layer in cache.offloaded:
        hk, hv = cache.host.read_tokens(layer, row, num_tokens)
        state[f"host{layer}"] = torch.stack([quant.as_float(hk, torch.float32), quant.as_float(hv, torch.float32)])
        first = (num_tokens - 1) // cache.selection.block_size * cache.selection.block_size
        slot = [quant.as_float(s[row, :, cache.slots, :num_tokens - first], torch.float32)
                for s in (cache.k_slots[layer], cache.v_slots[layer])]
        state[f"partial{layer}"] = torch.stack(slot)
        state[f"map{layer}"] = cache.slot_map[layer][row].clone()
    return state


def _method_state(method, cache, row: int) -> dict[str, torch.Tensor]:
    """The per-row state a stateful selector keeps from its prompt (h2o's mass, quest's page
    bounds, snapkv's and shallow's fixed sets, shallow's EMA) for ``row``; none for others."""
    state = getattr(method, "state", None)
    if state is None:
        return {}
    out = {}
    for name, value in state.of(cache).items():
        value = torch.stack([v[row] for v in value]) if isinstance(value, list) else value[row]
        out[f"method.{name}"] = value.float() if value.dtype != torch.bool else value
    return out


@pytest.mark.parametrize("method,options,resident", BATCHED, ids=[_id(m, o) for m, o, _ in BATCHED])
def test_batched_prefill_gives_each_prompt_its_own_prefill(tiny, forecast_file, method, options, resident):
    """Four prompts of different lengths in one forward: each row's last logits and cache
    state equal that prompt's prefill alone (fp32, 2e-5 relative); the method does select
    (logits differ from dense past the fallback) where prefill is block-sparse."""
    llm = _llm(tiny, method, options, resident, forecast_file)
    lengths = _lengths()
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in lengths]
    capacity = max(lengths) + 8
    # a quantised cache rounds keys that differ by float summation order (1e-7) to codes a
    # level apart now and then, and a code a level apart in one layer moves every later
    # layer's K/V a little: a looser relative bound (1e-3) on logits and on the state
    quantised = "kv_dtype" in options
    tol = 1e-3 if quantised else 2e-5
    assert llm.prefill_groups(llm.new_cache(4, capacity), prompts) == [[0, 1, 2, 3]]
    llm.method.reset()
    cache = llm.new_cache(4, capacity)
    rows = [2, 0, 3, 1]  # not in order: rows are cache rows, not batch positions
    batched = llm.prefill_batch(cache, rows, prompts)
    assert batched.shape == (4, llm.model.config.vocab_size)
    for i, (row, ids) in enumerate(zip(rows, prompts)):
        llm.method.reset()
        alone_cache = llm.new_cache(1, capacity)
        alone = llm.prefill(alone_cache, 0, ids)[-1]
        assert _rel(batched[i], alone) < tol, (lengths[i], _rel(batched[i], alone))
        got, want = _row_state(cache, row, len(ids)), _row_state(alone_cache, 0, len(ids))
        got.update(_method_state(llm.method, cache, row))
        want.update(_method_state(llm.method, alone_cache, 0))
        assert got.keys() == want.keys()
        for key in want:
            if quantised:
                assert got[key].shape == want[key].shape, (i, key)
                if not torch.equal(got[key], want[key]):
                    assert _rel(got[key], want[key]) < tol, (i, key, _rel(got[key], want[key]))
            else:
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=f"row {i} {key}")
    if llm.config.sparse_prefill and method not in ("dense", "h2o", "snapkv", "shallow"):  # these prefill densely
        dense = _llm(tiny, "dense", {}, None, forecast_file)
        longest = max(range(4), key=lambda i: lengths[i])
        assert _rel(batched[longest], dense.prefill(dense.new_cache(1, capacity), 0, prompts[longest])[-1]) > 1e-4


@pytest.mark.parametrize("method,options,resident", BATCHED, ids=[_id(m, o) for m, o, _ in BATCHED])
def test_generate_gives_each_prompt_its_tokens_alone(tiny, forecast_file, method, options, resident):
    """``generate`` over four prompts, prefilled in one forward, gives each prompt the
    greedy tokens and KV read fraction it gets alone (decode after the batched prefill
    reads what it wrote, including the seeds' selectors' per-row state)."""
    llm = _llm(tiny, method, options, resident, forecast_file)
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in _lengths()]
    groups = llm.prefill_groups(llm.new_cache(4, 300), prompts)
    assert groups == [[0, 1, 2, 3]]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    outs = llm.generate(None, params, prompt_token_ids=prompts)
    for ids, out in zip(prompts, outs):
        alone = llm.generate(None, params, prompt_token_ids=[ids])[0]
        # padded GEMMs round otherwise: an int8 / int4 code may flip, and with it a near tie
        if agree_up_to_a_tie(out, alone, 1e-3, len(ids)):
            assert out.stats["kv_read_fraction"] == pytest.approx(alone.stats["kv_read_fraction"], abs=1e-4)


def test_prefill_groups_respect_the_token_budget(tiny, forecast_file):
    """Groups are consecutive prompts covering all of them in order; a group of several
    keeps size x longest within ``prefill_batch_tokens``; a prompt over one prefill chunk
    runs alone; ``prefill_batch_tokens=0`` gives one prompt per forward; greedily, a group
    stops only where the next prompt would overflow it (brute force over random lengths)."""
    llm = _llm(tiny, "sparse", {}, None, forecast_file, prefill_chunk_tokens=100)
    cache = llm.new_cache(1, 8)
    for _ in range(50):
        budget = int(torch.randint(50, 400, ()))
        llm = llm.derive(prefill_batch_tokens=budget)
        lengths = torch.randint(1, 130, (int(torch.randint(1, 12, ())),)).tolist()
        groups = llm.prefill_groups(cache, [[1] * n for n in lengths])
        assert [i for g in groups for i in g] == list(range(len(lengths)))
        for g, nxt in zip(groups, groups[1:] + [None]):
            longest = max(lengths[i] for i in g)
            if len(g) > 1:
                assert len(g) * longest <= budget and longest <= 100
            if nxt is not None and longest <= 100 and lengths[nxt[0]] <= 100:
                assert (len(g) + 1) * max(longest, lengths[nxt[0]]) > budget, (lengths, budget, groups)
    llm = llm.derive(prefill_batch_tokens=0)
    assert llm.prefill_groups(cache, [[1] * 5] * 3) == [[0], [1], [2]]


def test_prefill_batch_refuses_what_it_cannot_batch(tiny, forecast_file):
    """A method without batched prefill, a prompt longer than one prefill chunk, rows that
    are not one distinct row per prompt and an empty prompt are refused with one line
    naming the problem (``generate`` prefills the first two kinds one at a time); bad
    ``prefill_batch_tokens`` values too."""
    from sparda.engine.llm import LLM

    plain = _llm(tiny, "sparse", {}, None, forecast_file)
    plain.method.batched_prefill = False  # a method that has not shown a batched prefill
    with pytest.raises(SpardaError, match="one at a time"):
        plain.prefill_batch(plain.new_cache(2, 64), [0, 1], [[5] * 30, [6] * 20])
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (30, 50)]
    assert plain.prefill_groups(plain.new_cache(2, 64), prompts) == [[0], [1]]
    outs = plain.generate(None, prompt_token_ids=prompts, max_new_tokens=4, ignore_eos=True)
    assert [o.stats["prefill_batch"] for o in outs] == [1, 1]
    sparse = _llm(tiny, "sparse", {}, None, forecast_file, prefill_chunk_tokens=25)
    with pytest.raises(SpardaError, match="prefill it alone"):
        sparse.prefill_batch(sparse.new_cache(2, 64), [0, 1], [[5] * 30, [6] * 20])
    with pytest.raises(SpardaError, match="distinct cache row"):  # two prompts into one row
        sparse.prefill_batch(sparse.new_cache(2, 64), [0, 0], [[5] * 10, [6] * 20])
    with pytest.raises(SpardaError, match="distinct cache row"):
        sparse.prefill_batch(sparse.new_cache(2, 64), [0], [[5] * 10, [6] * 20])
    with pytest.raises(SpardaError, match="empty prompt"):
        sparse.prefill_batch(sparse.new_cache(2, 64), [0, 1], [[5] * 10, []])
    for bad in (-1, 2.5, "64k", True):
        with pytest.raises(SpardaError, match="prefill_batch_tokens"):
            LLM(str(tiny), method="dense", device="cpu", prefill_batch_tokens=bad)


def test_batched_selection_scores_as_few_queries_as_one_prompt(tiny, forecast_file, monkeypatch):
    """A block-sparse prefill scores ``chunk_tokens / B`` queries of each row at a time
    (``oracle`` holds ``[B, H, G, chunk, T]`` fp32 scores), so a batch holds what one prompt
    would; the masks, hence the logits, are those of unchunked scoring."""
    from sparda.attention import blocksparse
    from sparda.attention.base import BlockSparseMethod

    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in _lengths()]
    llm = _llm(tiny, "oracle", {}, None, forecast_file)
    whole = llm.prefill_batch(llm.new_cache(4, 240), [0, 1, 2, 3], prompts)  # 1,024 queries a chunk
    scored = []
    real = blocksparse.OracleAttention.block_scores

    def spy(self, layer, q, h, cache, step, k, ck, chunk):
        scored.append(q.shape[0] * len(range(*chunk.indices(q.shape[-2]))))
        return real(self, layer, q, h, cache, step, k, ck, chunk)

    monkeypatch.setattr(blocksparse.OracleAttention, "block_scores", spy)
    monkeypatch.setattr(BlockSparseMethod, "chunk_tokens", 24)
    llm.method.reset()
    chunked = llm.prefill_batch(llm.new_cache(4, 240), [0, 1, 2, 3], prompts)
    assert scored and max(scored) <= 24 and len(scored) > llm.model.config.num_hidden_layers
    assert _rel(chunked, whole) < 1e-6
