"""Model resolution: ORG/NAME from the local Hugging Face cache, .bin weights, GGUF cache key."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparda import LLM, SpardaError
from sparda.model import loader


def _hub_cache(root: Path, repo_id: str, src: Path, revision: str = "0123456789abcdef0123456789abcdef01234567"):
    """Lay ``src``'s files out as huggingface_hub's cache does: blobs, snapshots/<rev>, refs/main."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snap


def test_model_by_name_from_the_local_hub_cache(tmp_path, make_tiny, monkeypatch):
    from huggingface_hub import constants

    src = make_tiny("qwen2")
    snap = _hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen2", src)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert loader.resolve_model_dir("tiny-org/tiny-qwen2") == snap
    ids = torch.randint(0, 49152, (int(torch.randint(10, 40, ())),)).tolist()
    by_name = LLM("tiny-org/tiny-qwen2", method="dense", device="cpu").logits(ids)
    by_path = LLM(src, method="dense", device="cpu").logits(ids)
    assert torch.equal(by_name, by_path)
    with pytest.raises(SpardaError, match=r"model tiny-org/absent is not in the local Hugging Face cache "
                                          r"\(.*hub\); on a machine with network run `hf download tiny-org/absent`"):
        LLM("tiny-org/absent", device="cpu")


def test_cli_by_name_with_hf_home_offline(tmp_path, make_tiny):
    """`python -m sparda generate --model ORG/NAME` as a user runs it: HF_HOME, offline."""
    _hub_cache(tmp_path / "hf" / "hub", "tiny-org/tiny-llama", make_tiny("llama"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, "-m", "sparda", "generate", "--model", "tiny-org/tiny-llama", "--method", "dense",
           "--device", "cpu", "--no-chat", "-p", "hello", "--max-new-tokens", "3", "--json"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["stats"]["new_tokens"] == 3
    cmd[5] = "tiny-org/missing"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: model tiny-org/missing is not in the local "
                                                           "Hugging Face cache")


def test_pytorch_bin_weights_load_like_safetensors(tmp_path, make_tiny):
    from safetensors.torch import load_file

    src = make_tiny("mistral")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    torch.save(load_file(src / "model.safetensors"), tmp_path / "pytorch_model.bin")
    assert [f.name for f in loader.weight_files(tmp_path)] == ["pytorch_model.bin"]
    AutoModelForCausalLM.from_pretrained(tmp_path)  # transformers reads it too
    ids = torch.randint(0, 49152, (int(torch.randint(10, 40, ())),)).tolist()
    ours = LLM(tmp_path, method="dense", device="cpu").logits(ids)
    assert torch.equal(ours, LLM(src, method="dense", device="cpu").logits(ids))


def test_weight_files_follow_the_index_and_skip_consolidated(tmp_path):
    (tmp_path / "consolidated.safetensors").write_bytes(b"x")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x")
    assert [f.name for f in loader.weight_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                               "model-00002-of-00002.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00002-of-00002.safetensors"}}))
    assert [f.name for f in loader.weight_files(tmp_path)] == ["model-00002-of-00002.safetensors"]


def test_gguf_conversion_cache_is_keyed_by_content(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setattr(loader, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(loader, "_DIGEST_CHUNK_BYTES", 1000)  # several chunks
    data = os.urandom(int(torch.randint(3000, 9000, ())))
    first, moved = tmp_path / "a" / "m.gguf", tmp_path / "b" / "other-name.gguf"
    for path in (first, moved):
        path.parent.mkdir()
        path.write_bytes(data)
    digest = loader.file_digest(first)
    assert digest == hashlib.sha256(data).hexdigest()[:16] == loader.file_digest(moved)
    converted = []

    def fake_convert(gguf, out):
        converted.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    out = loader.resolve_model_dir(first)
    assert out == tmp_path / "cache" / f"m-{digest}"
    assert loader.resolve_model_dir(moved) == out and converted == [first]  # a copy elsewhere: reused
    os.utime(first, ns=(1, 1))  # a new mtime, same content: the same conversion
    assert loader.resolve_model_dir(first) == out and len(converted) == 1
    first.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit changed: converted anew
    assert loader.resolve_model_dir(first) != out and len(converted) == 2
