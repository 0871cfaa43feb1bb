"""Chunked prefill (``LLM(prefill_chunk_tokens=N)``): the same logits and cache as one chunk.

Tiny random llama, fp32, small blocks (block 16, kernel 8, stride 4, dense_len 40) so that
block-sparse prefill selects at 200 tokens; chunk sizes that are not multiples of the
block size, so chunks start mid-block and mid-window. The reference is the same method
prefilling the whole prompt at once (``prefill_chunk_tokens=0``), whose own correctness
the other test modules establish (dense against transformers, selection against float64).
"""

from __future__ import annotations

import pytest
import torch

from sparda.errors import SpardaError
from test_offload import forecast_file  # noqa: F401 - fixture

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=40, init_blocks=1, local_blocks=2,
             topk_blocks=3)
# method, LLM extras, resident layers of an offloaded method
CASES = [("dense", {}, None), ("sparse", {}, None), ("oracle", {}, None), ("infinigen", {}, None),
         ("sparda", {}, None), ("sparse-offload", {}, ()), ("sparda", {"offload": True}, (0,)),
         ("sparda-no-prefetch", {}, ())]

pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")




def _llm(tiny, method, extra, resident, chunk, forecast_file):
    from sparda.engine.llm import LLM

    if method.startswith("sparda"):
        extra = dict(extra, forecast=forecast_file)
    llm = LLM(str(tiny), method=method, device="cpu", sparse_prefill=True, prefill_chunk_tokens=chunk,
              **SMALL, **extra)
    if resident is not None:
        llm.method.resident_layers = resident
    return llm


@pytest.mark.parametrize("method,extra,resident", CASES,
                         ids=[f"{m}{'-offloaded' if e.get('offload') else ''}" for m, e, _ in CASES])
def test_chunked_prefill_gives_unchunked_logits(tiny, forecast_file, method, extra, resident):
    """Every position's logits, chunks of 37 and 100 tokens (not multiples of 16), against
    the whole prompt at once; block-sparse prefill really drops blocks (logits differ
    from dense)."""
    num_tokens = int(torch.randint(190, 230, ()))
    ids = torch.randint(100, 20000, (num_tokens,)).tolist()
    whole = _llm(tiny, method, extra, resident, 0, forecast_file).logits(ids)
    for chunk in (37, 100):
        out = _llm(tiny, method, extra, resident, chunk, forecast_file).logits(ids)
        assert out.shape == whole.shape
        assert _rel(out, whole) < 2e-5, chunk
        assert torch.equal(out.argmax(-1), whole.argmax(-1))
    if method != "dense":
        dense = _llm(tiny, "dense", {}, None, 0, forecast_file).logits(ids)
        assert _rel(whole[60:], dense[60:]) > 1e-3  # past the dense fallback, selection changes logits


def _cache_state(cache):
    """The offloaded cache's prefill results: host K/V, compressed keys, rings, partial slots."""
    state = {"ck": torch.stack(cache.ck), "ring": torch.stack(cache.ring), "lengths": cache.lengths.clone()}
    for layer in cache.offloaded:
        state[f"host{layer}"] = torch.stack([torch.cat([c.k for c in cache.host.chunks[layer]]),
                                             torch.cat([c.v for c in cache.host.chunks[layer]])])
        state[f"partial{layer}"] = torch.stack([cache.k_slots[layer][:, :, -1], cache.v_slots[layer][:, :, -1]])
        state[f"map{layer}"] = cache.slot_map[layer].clone()
    for layer in cache.resident:
        state[f"full{layer}"] = torch.stack([cache.k_full[layer], cache.v_full[layer]])
    return state


def test_offloaded_cache_after_chunked_prefill_and_decode(tiny, forecast_file):
    """Offloaded sparda, two rows of different lengths prefilled in 45-token chunks: host
    store, compressed keys, rings and partial-block slots equal an unchunked prefill's,
    and 24 greedy decode steps give the same tokens."""
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (173, 94)]
    states, outs = [], []
    for chunk in (0, 45):
        llm = _llm(tiny, "sparda", {"offload": True}, (0,), chunk, forecast_file)
        llm.method.reset()
        cache = llm.new_cache(2, 200)
        for row, ids in enumerate(prompts):
            llm.prefill(cache, row, ids)
        assert cache._staging is None and cache._stash[0] == llm.shape.num_layers - 1
        states.append(_cache_state(cache))
        outs.append(llm.generate(None, prompt_token_ids=prompts, max_new_tokens=24, ignore_eos=True))
    for key, value in states[0].items():
        torch.testing.assert_close(states[1][key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    assert states[0]["lengths"].tolist() == [173, 94]


def test_device_cache_compressed_keys_across_chunks(tiny):
    """DeviceKVCache: windows that straddle a chunk boundary are complete after the chunk
    that ends them, equal to the compressed keys of the whole prompt (reference.compress_keys)."""
    from sparda.kernels import reference as ref

    llm = _llm(tiny, "dense", {}, None, 29, None)
    ids = torch.randint(100, 20000, (150,)).tolist()
    cache = llm.new_cache(1, 160)
    llm.prefill(cache, 0, ids)
    for layer in range(llm.shape.num_layers):
        want = ref.compress_keys(cache.k[layer][0, :, :150], 8, 4)
        torch.testing.assert_close(cache.ck[layer][0, :, :want.shape[1]], want, rtol=0, atol=0)
        assert (cache.ck[layer][0, :, want.shape[1]:] == 0).all()


def test_bad_chunk_sizes_are_refused(tiny):
    from click.testing import CliRunner

    from sparda.cli import main
    from sparda.engine.llm import LLM

    for bad in (-1, 2.5, "8k"):
        with pytest.raises(SpardaError, match="prefill_chunk_tokens"):
            LLM(str(tiny), method="dense", device="cpu", prefill_chunk_tokens=bad)
    result = CliRunner().invoke(main, ["generate", "-p", "x", "--prefill-chunk", "-1", "--model", "/nonexistent"])
    assert result.exit_code == 2 and "--prefill-chunk" in result.output and "Traceback" not in result.output


def test_prefill_passes_its_row_as_a_host_int(tiny, forecast_file, monkeypatch):
    """A prefill's steps carry ``row`` (host int) so that the caches' appends read no device
    tensor per layer; a StepInfo built without it derives it from ``rows``."""
    from sparda.model.llama import StepInfo

    llm = _llm(tiny, "sparda", {"offload": True}, (0,), 24, forecast_file)
    cache = llm.new_cache(3, 200)
    seen = []
    real = llm.model_runner._step

    def spy(phase, rows, q_pos, max_kv_len=None, live_len=None, row=None):
        seen.append((phase, row, int(rows[0])))
        return real(phase, rows, q_pos, max_kv_len, live_len, row=row)

    monkeypatch.setattr(llm.model_runner, "_step", spy)
    ids = torch.randint(0, 100, (70,)).tolist()
    llm.prefill(cache, 2, ids)
    assert len(seen) == 3 and all(s == ("prefill", 2, 2) for s in seen)
    step = StepInfo("prefill", torch.tensor([1]), torch.arange(5).view(1, -1), torch.tensor([5]), None, None, 5)
    assert step.row == 1


# the seeds' selectors keep prefill state for decode (h2o's accumulated mass, snapkv's
# observation window, quest's page bounds, shallow's EMA and fixed set); method, options
SEED_CASES = [("h2o", {}), ("snapkv", {}), ("snapkv", {"snapkv_window": 48}), ("quest", {}), ("streaming", {}),
              ("quest", {"sparse_prefill": True}), ("streaming", {"sparse_prefill": True}),
              ("shallow", {"shallow_layers": 1}), ("shallow", {"shallow_layers": 1, "shallow_select_once": True}),
              ("shallow", {"shallow_layers": 1, "offload": True})]


def _decode_logits(llm, ids: list[int], follow: list[int]) -> torch.Tensor:
    """Prefill ``ids`` into row 0 of a fresh cache, then teacher-force ``follow`` through
    decode steps; ``[len(follow), V]`` fp32 logits of the decode steps."""
    llm.method.reset()
    cache = llm.new_cache(1, len(ids) + len(follow))
    with torch.inference_mode():
        llm.prefill(cache, 0, ids)
        rows = torch.zeros(1, dtype=torch.long)
        out = []
        for i, tok in enumerate(follow):
            pos = len(ids) + i
            out.append(llm.model_runner.decode_step(cache, torch.tensor([tok]), torch.tensor([pos]), rows, pos + 1)[0])
    return torch.stack(out)


@pytest.mark.parametrize("method,options", SEED_CASES,
                         ids=[m + "".join(f"-{k}={v}" for k, v in o.items()) for m, o in SEED_CASES])
def test_chunked_prefill_gives_the_seed_selectors_unchunked_decode(tiny, fresh_seed, method, options):
    """The seeds' selectors prefill densely and select in decode from what prefill left them;
    decode logits after 37-token chunks and after chunks whose last one is shorter than the
    observation window (``snapkv``) equal those after the whole prompt at once, and the
    selection drops blocks (decode logits differ from dense's)."""
    from sparda.engine.llm import LLM

    num_tokens = int(torch.randint(190, 230, ()))
    ids = torch.randint(100, 20000, (num_tokens,)).tolist()
    follow = torch.randint(100, 20000, (12,)).tolist()

    def run(name, chunk, opts):
        llm = LLM(str(tiny), method=name, device="cpu", prefill_chunk_tokens=chunk, cuda_graphs=False,
                  dense_heads="none", **SMALL, **opts)
        return _decode_logits(llm, ids, follow)

    whole = run(method, 0, options)
    for chunk in (37, num_tokens - 5):  # the second leaves a 5-token last chunk
        out = run(method, chunk, options)
        assert _rel(out, whole) < 2e-5, (chunk, _rel(out, whole))
    dense = run("dense", 0, {})
    assert _rel(whole, dense) > 1e-3  # decode really selects


@pytest.mark.parametrize("method", ["h2o", "quest", "snapkv", "shallow"])
def test_a_reused_row_starts_from_its_own_prefill(tiny, fresh_seed, method):
    """Prefill a long prompt into row 0, then a shorter one into the same row (a request
    taking a freed row): every per-row state tensor of row 0 equals a fresh cache's after
    the shorter prompt alone (nothing of the first occupant is left), unchunked and chunked."""
    from sparda.engine.llm import LLM

    long_ids = torch.randint(100, 20000, (int(torch.randint(180, 220, ())),)).tolist()
    short_ids = torch.randint(100, 20000, (int(torch.randint(60, 120, ())),)).tolist()
    for chunk in (0, 37):
        llm = LLM(str(tiny), method=method, device="cpu", prefill_chunk_tokens=chunk, cuda_graphs=False,
                  shallow_layers=1 if method == "shallow" else None, **SMALL)
        reused, fresh = llm.new_cache(2, 230), llm.new_cache(2, 230)
        with torch.inference_mode():
            llm.prefill(reused, 0, long_ids)
            llm.prefill(reused, 0, short_ids)
            llm.prefill(fresh, 0, short_ids)
        got, want = llm.method.state.of(reused), llm.method.state.of(fresh)
        for name, tensors in want.items():
            for i, w in enumerate(tensors if isinstance(tensors, list) else [tensors]):
                g = got[name][i] if isinstance(tensors, list) else got[name]
                torch.testing.assert_close(g[0], w[0], rtol=1e-5, atol=1e-5,
                                           msg=f"{method} {name}[{i}] chunk {chunk} seed {fresh_seed}")
