"""Dense retrieval heads (design §3.7): a few (layer, KV head) pairs that read every block in decode.

Mean-pooled compressed keys cannot see a one-token attention spike (design §3.7):
a retrieval head whose query puts nearly all its mass on one or two earlier tokens ranks
their block far below the top-k. Keeping such heads dense in decode -- the idea of
DuoAttention and RazorAttention -- restores what the sparse selection loses, at the cost
of those heads' full KV reads. The heads are calibrated per model
(:mod:`sparda.eval.head_calibration`, ``sparda calibrate-heads``) and stored as JSON next to
the model (:data:`CALIBRATION_FILE`) or shipped for the bundled model
(``sparda/assets/dense_heads``).

The rule: in a decode step a listed (layer, KV head) attends to every causally visible
block of its row (blocks ``0 .. t // block_size`` at position ``t``), every other head to
its method's selection, unchanged. Prefill is untouched (dense at the ``small`` preset).
``dense_heads`` is ``none`` (the default), ``auto`` (the stored calibration for the model,
if any) or an explicit ``L:H,...`` list.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from sparda.config import parse_dense_heads  # noqa: F401 - re-exported
from sparda.errors import SpardaError
from sparda.model.loader import shipped_name

#: calibration file name inside a model directory
CALIBRATION_FILE = "sparda_dense_heads.json"
#: shipped calibrations (sparda/assets/dense_heads), keyed by the name the model is recognised
#: under by content (:func:`sparda.model.loader.shipped_name`)
SHIPPED = {"SmolLM2-135M-Instruct": "smollm2-135m-instruct.json"}
FORMAT = "sparda-dense-heads-v1"

Heads = tuple[tuple[int, int], ...]


def check_heads(heads: Heads, shape, source: str = "dense_heads") -> Heads:
    """``heads`` if every pair lies in the model (``layer < L``, ``kv_head < H_kv``).

    Raises:
        SpardaError: naming the first pair outside the model and the model's sizes.
    """
    for layer, head in heads:
        if layer >= shape.num_layers or head >= shape.num_kv_heads:
            raise SpardaError(f"{source}: {layer}:{head} is outside the model ({shape.num_layers} layers, "
                              f"{shape.num_kv_heads} KV heads: layers 0..{shape.num_layers - 1}, "
                              f"heads 0..{shape.num_kv_heads - 1})")
    return heads


def calibration_sources(model_dir) -> list[Path]:
    """Where a stored head calibration for the model in ``model_dir`` is looked up, in order:
    ``sparda_dense_heads.json`` in the model directory, then the shipped asset."""
    paths = [Path(model_dir) / CALIBRATION_FILE] if model_dir is not None else []
    shipped = SHIPPED.get(shipped_name(model_dir) or "")
    if shipped:
        paths.append(Path(str(resources.files("sparda") / "assets" / "dense_heads" / shipped)))
    return paths


def read_calibration(path: str | Path) -> dict:
    """The JSON of a head calibration file (``format`` :data:`FORMAT`).

    Raises:
        SpardaError: unreadable, not JSON, or not a sparda dense-heads file.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpardaError(f"cannot read the dense-heads calibration {path}: {exc}".splitlines()[0]) from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("heads"), list):
        raise SpardaError(f"{path} is not a sparda dense-heads calibration (format {FORMAT})")
    return data


def stored_heads(model_dir, identity: dict | None = None) -> tuple[Heads, str | None]:
    """The heads of the first existing calibration of :func:`calibration_sources`.

    Args:
        identity: :func:`sparda.attention.forecast.model_identity` of the loaded model; if
            given, a calibration made for another model (``config_hash``) is refused.
    Returns:
        ``(heads, path)``, or ``((), None)`` if no calibration exists.
    Raises:
        SpardaError: a calibration exists but is unreadable or belongs to another model.
    """
    for path in calibration_sources(model_dir):
        if not path.is_file():
            continue
        data = read_calibration(path)
        made_for = data.get("model", {}).get("config_hash")
        if identity is not None and made_for and made_for != identity.get("config_hash"):
            raise SpardaError(f"the dense-heads calibration {path} was made for model {made_for}, not the loaded "
                              f"{identity.get('config_hash')}; rerun `sparda calibrate-heads` or pass --dense-heads none")
        return parse_dense_heads([tuple(h[:2]) for h in data["heads"]], str(path)), str(path)
    return (), None


def resolve_dense_heads(value, *, method, shape, model_dir=None, identity: dict | None = None,
                        option: str = "--dense-heads") -> Heads:
    """The (layer, KV head) pairs a method keeps dense in decode.

    Args:
        value: the setting (:func:`parse_dense_heads`).
        method: the built :class:`~sparda.attention.base.AttentionMethod` (its
            ``supports_dense_heads`` flag and name decide what is allowed; the offloaded
            methods support them by keeping those heads' layers resident, design §3.7).
        shape: the model's ``ModelShape``. model_dir, identity: where ``auto`` looks and
            which model it must match.
    Returns:
        Sorted unique pairs (empty: none). ``auto`` resolves to the stored calibration for
        a method that supports dense heads, else to none.
    Raises:
        SpardaError: a malformed value, a pair outside the model, or an explicit list for a
            method that does not support it (one line naming the fix).
    """
    heads = parse_dense_heads(value, option)
    name = getattr(method, "name", "?")
    if name == "dense":
        return ()  # every head is dense already
    supported = getattr(method, "supports_dense_heads", False)
    if heads == "auto":
        if not supported:
            return ()
        found, path = stored_heads(model_dir, identity)
        return check_heads(found, shape, path or option)
    if not heads:
        return ()
    if not supported:
        raise SpardaError(f"{option} applies to the block-sparse decode of sparse, oracle, sparda, sparda-random, "
                          f"quest, infinigen, streaming and the offloaded methods, not {name!r}; drop {option} "
                          "or pick one of them")
    return check_heads(heads, shape, option)


def dense_head_mask(heads: Heads, layer: int, num_kv_heads: int, device) -> torch.Tensor | None:
    """``[H_kv]`` bool, True for the KV heads of ``layer`` listed in ``heads``; ``None`` if none are."""
    listed = [h for lay, h in heads if lay == layer]
    if not listed:
        return None
    out = torch.zeros(num_kv_heads, dtype=torch.bool, device=device)
    out[listed] = True
    return out


def widen_to_dense(mask: torch.Tensor, dense: torch.Tensor, q_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """A decode block mask in which the ``dense`` KV heads read every causally visible block.

    Args:
        mask: ``[B, H_kv, Tq, N]`` bool, the method's selection.
        dense: ``[H_kv]`` bool, the heads to widen.
        q_pos: ``[B, Tq]`` int64 query positions (tokens); block ``n`` is visible to the
            query at ``t`` iff ``n <= t // block_size``.
        block_size: tokens per block.
    Returns:
        A new ``[B, H_kv, Tq, N]`` bool mask (no host sync; static shapes).
    """
    blocks = torch.arange(mask.shape[-1], device=mask.device)
    visible = blocks.view(1, 1, 1, -1) <= (q_pos // block_size).view(q_pos.shape[0], 1, -1, 1)
    return torch.where(dense.view(1, -1, 1, 1), visible, mask)
