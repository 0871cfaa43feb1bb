"""Dense retrieval heads (design §3.7): decode against a brute force, settings, CLI errors, calibration."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from sparda.attention.dense_heads import CALIBRATION_FILE, parse_dense_heads, stored_heads
from sparda.engine.llm import LLM
from sparda.errors import SpardaError
from sparda.eval.head_calibration import calibrate_heads

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=64, init_blocks=1, local_blocks=2, topk_blocks=3)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama", num_hidden_layers=3)


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int) -> torch.Tensor:
    """float64 softmax attention of one query group ``q [G, d]`` over keys ``0..t`` of ``k, v [T, d]``."""
    q, k, v = q.double(), k[:t + 1].double(), v[:t + 1].double()
    return torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), -1) @ v


@pytest.mark.parametrize("method", ["sparse", "oracle", "sparda-random"])
def test_decode_dense_heads_equal_brute_force(tiny, method, fresh_seed):
    """Listed heads: dense attention over every visible token (float64 by hand); the other
    heads: the plain method's output, run on the same queries and cache."""
    heads = [(0, 1), (2, 0)]
    llm = LLM(str(tiny), method=method, device="cpu", dense_heads=heads, **SMALL)
    plain = LLM(str(tiny), method=method, device="cpu", **SMALL).method
    assert llm.config.dense_heads == tuple(heads) and plain.config.dense_heads == ()
    attend, seen = llm.method.attend, {"decode": 0, "sparse_somewhere": False}
    plain_counters = {"blocks_read": 0.0, "blocks_valid": 0.0}  # the plain method's, apart from the cache's

    def checked(layer, q, h, cache, step):
        nonlocal plain_counters
        out = attend(layer, q, h, cache, step)
        seen["cache"] = cache
        mine, cache.counters = cache.counters, plain_counters
        try:
            want = plain.attend(layer, q, h, cache, step)  # keeps the plain method's per-layer state in step
        finally:
            plain_counters, cache.counters = cache.counters, mine
        if step.phase != "decode":
            return out
        seen["decode"] += 1
        k, v, _ = cache.view(layer, step.rows, step.max_kv_len)
        for b in range(q.shape[0]):
            t = int(step.q_pos[b, -1])
            for head in range(q.shape[1]):
                got = out[b, head, :, -1]
                if (layer, head) in heads:
                    ref = _dense_reference(q[b, head, :, -1], k[b, head], v[b, head], t)
                    assert torch.allclose(got.double(), ref, atol=2e-5), (method, layer, head, t)
                    seen["sparse_somewhere"] |= not torch.allclose(want[b, head, :, -1], got, atol=1e-4)
                else:
                    assert torch.allclose(got, want[b, head, :, -1], atol=1e-6), (method, layer, head, t)
        return out

    llm.method.attend = checked
    gen = torch.Generator().manual_seed(fresh_seed)
    prompts = [torch.randint(10, 3000, (n,), generator=gen).tolist() for n in (230, 171)]
    llm.generate(None, prompt_token_ids=prompts, max_new_tokens=5, ignore_eos=True)
    assert seen["decode"] == 4 * llm.shape.num_layers
    assert seen["sparse_somewhere"], "the dense heads never differed from the sparse selection: no test"
    # blocks read: the dense heads read every visible block of their layer
    dense_read = seen["cache"].read_fraction(0)
    assert dense_read > float(plain_counters["blocks_read"][0]) / float(plain_counters["blocks_valid"][0])


def test_parse_and_resolve(tiny):
    assert parse_dense_heads(None) == () and parse_dense_heads("none") == () and parse_dense_heads("AUTO") == "auto"
    assert parse_dense_heads("18:2, 7:2,7:2") == ((7, 2), (18, 2))
    assert parse_dense_heads([[3, 1]]) == ((3, 1),)
    for bad in ("7-2", "7:", "a:1", "1:2:3", [(1, -1)], [(1, True)], 5):
        with pytest.raises(SpardaError):
            parse_dense_heads(bad)
    with pytest.raises(SpardaError, match="outside the model"):
        LLM(str(tiny), method="sparse", device="cpu", dense_heads="3:0", **SMALL)
    with pytest.raises(SpardaError, match="h2o"):
        LLM(str(tiny), method="h2o", device="cpu", dense_heads="1:0", **SMALL)
    off = LLM(str(tiny), method="sparse", offload=True, device="cpu", dense_heads="1:0", **SMALL)
    assert off.config.dense_heads == ((1, 0),) and 1 in off.new_cache(1, 64).resident  # its layer stays on the device
    assert LLM(str(tiny), method="dense", device="cpu", dense_heads="1:0").config.dense_heads == ()
    assert LLM(str(tiny), method="sparse", device="cpu", dense_heads="auto", **SMALL).config.dense_heads == ()


def test_auto_reads_the_model_calibration(make_tiny, tmp_path, caplog):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(make_tiny("llama", num_hidden_layers=3), model)
    llm = LLM(str(model), method="sparse", device="cpu", **SMALL)
    from sparda.attention.forecast import model_identity

    identity = model_identity(llm.model.config, llm.shape)
    (model / CALIBRATION_FILE).write_text(json.dumps({"format": "sparda-dense-heads-v1", "heads": [[2, 1], [0, 0]],
                                                      "model": identity}))
    assert stored_heads(model, identity)[0] == ((0, 0), (2, 1))
    assert LLM(str(model), method="sparse", device="cpu", dense_heads="auto", **SMALL).config.dense_heads == ((0, 0), (2, 1))
    off = LLM(str(model), method="sparse", offload=True, device="cpu", dense_heads="auto", **SMALL)
    assert off.config.dense_heads == ((0, 0), (2, 1))  # offloaded: applied, the layers kept resident
    (model / CALIBRATION_FILE).write_text(json.dumps({"format": "sparda-dense-heads-v1", "heads": [[2, 1]],
                                                      "model": {**identity, "config_hash": "0" * 16}}))
    with pytest.raises(SpardaError, match="made for model"):
        LLM(str(model), method="sparse", device="cpu", dense_heads="auto", **SMALL)


def _run(*args):
    return subprocess.run([sys.executable, "-m", "sparda.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args, message", [
    (("generate", "--dense-heads", "7-2", "-p", "x"), "LAYER:KV_HEAD"),
    (("generate", "--dense-heads", "1:x", "-p", "x"), "LAYER:KV_HEAD"),
    (("calibrate-heads", "--prompts", "0"), "--prompts must be >= 1"),
    (("calibrate-heads", "--tasks", "vt"), "needle tasks"),
    (("calibrate-heads", "--coverage", "1.5"), "--coverage"),
    (("calibrate-heads", "--lengths", "1,2,3"), "one or two values"),
])
def test_cli_errors_are_one_line(args, message):
    res = _run(*args)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr


def test_cli_refuses_heads_outside_the_model(tiny):
    res = _run("generate", "--model", str(tiny), "--method", "sparse", "--device", "cpu", "--dense-heads", "0:7",
               "-p", "hello", "--max-new-tokens", "2")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: --dense-heads: 0:7 is outside")


def test_calibration_finds_a_planted_retrieval_head(tiny, tmp_path, fresh_seed):
    """In one (layer, KV head) every query points along a unit vector ``u`` and the keys are
    ``s * u``: needle tokens 18, tokens two or more blocks away 12, the rest 0. Exact attention
    then sits on the needle (e^6 per token over the broad tokens), while mean-pooled windows
    (at most 5 needle tokens of 8: mean <= 11.25 < 12) rank the needle's blocks below a
    top-k that the broad blocks fill: the planted head loses nearly all its needle mass."""
    gen = torch.Generator().manual_seed(fresh_seed)
    llm = LLM(str(tiny), method="dense", device="cpu", **SMALL)
    layer, head = int(torch.randint(0, 3, (1,), generator=gen)), int(torch.randint(0, 2, (1,), generator=gen))
    text = " ".join(f"w{int(i)}" for i in torch.randint(0, 5000, (3000,), generator=gen))
    run = llm.model.dense_layers
    bs = SMALL["block_size"]
    planted = {}

    def planting(ids, attention=None):
        from sparda.eval import head_calibration

        needle = planted["needle"]
        for index, h, q, k, cos, sin in run(ids, attention):
            if index == layer:
                d, t = q.shape[-1], k.shape[-2]
                u = torch.nn.functional.normalize(torch.randn(d, generator=gen), dim=0)
                blocks = torch.arange(t) // bs
                near = (blocks.view(-1, 1) - torch.tensor(sorted({p // bs for p in needle})).view(1, -1)).abs().min(1).values
                s = torch.where(near >= 2, 12.0, 0.0)
                s[needle] = 18.0
                q, k = q.clone(), k.clone()
                q[:, head] = u * math.sqrt(d)
                k[:, head] = s.view(-1, 1) * u
            yield index, h, q, k, cos, sin

    from sparda.eval import head_calibration

    build = head_calibration.build_prompt

    def recording(*args, **kwargs):
        ids, needle, start = build(*args, **kwargs)
        planted["needle"] = needle
        return ids, needle, start

    llm.model.dense_layers = planting
    head_calibration.build_prompt = recording
    try:
        out = tmp_path / "heads.json"
        got = calibrate_heads(llm=llm, prompts=3, lengths=(300, 420), tasks=("passkey",), seed=fresh_seed % 1000,
                              out=str(out), texts=[text], coverage=0.6, min_share=0.1)
    finally:
        head_calibration.build_prompt = build
    assert json.loads(out.read_text())["heads"] == [[layer, head]] == got["heads"], got["ranking"][:3]
    top = got["ranking"][0]
    assert (top["layer"], top["head"]) == (layer, head) and top["mass"] > 0.8 and top["lost"] > 0.8 * top["mass"]
    assert got["retrieval_queries"] == 3 * 4  # 5-digit keys: 4 decode steps each
    assert all(p["text"] == "text 0" for p in got["prompts"])
