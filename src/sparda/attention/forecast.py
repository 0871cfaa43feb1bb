"""The Forecast (design §4): layer ``l`` predicts which KV blocks layer ``l+1`` will need.

:class:`Forecast` holds one bias-free projection ``d_model -> H_kv * d`` per layer
``l < L-1`` (``forecast.{l}.weight``, ``F_l``) plus layer 0's current-layer projection
``W^C_0`` (``current.weight``). Its output gets the query RoPE of the current position
and scores a layer's compressed keys with raw dot products, one row per KV head.

:class:`ForecastAttention` is the ``sparda`` method with the KV cache on the device:

* decode: during layer ``l``, :meth:`ForecastAttention.predict_next` scores layer
  ``l+1``'s compressed keys *as they stood before this step's token was appended to
  layer l+1* and stores the block mask; layer ``l+1`` attends over exactly that mask;
* prefill (``Tq = T``): layer ``l+1``'s keys do not exist yet while layer ``l`` runs, so
  ``F_l(h_l)`` is stored and scored when layer ``l+1`` runs, under the same lookahead rule
  (:func:`sparda.kernels.reference.lookahead_pos`): query ``t`` sees the windows complete
  at ``t - 1``, so per query token prefill and decode select the same blocks.

Weights live in safetensors files holding only Forecast tensors plus metadata that
names the base model (:func:`save_forecast`, :func:`load_forecast`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from sparda.attention.base import BlockSparseMethod, dense_attention
from sparda.attention.blocksparse import fused_prefill_selection
from sparda.errors import SpardaError
from sparda.io import atomic_output
from sparda import kernels
from sparda.kernels import reference as ref
from sparda.model.loader import conversion_source, hub_repo_id, shipped_name

FORMAT = "sparda-forecast-v1"
#: Shipped weights (files in sparda/assets/forecast), keyed by the name the model is
#: recognised under by content (:func:`sparda.model.loader.shipped_name`).
SHIPPED = {"SmolLM2-135M-Instruct": "smollm2-135m-instruct.safetensors"}
#: Shipped two-ahead heads (design §6.2), keyed likewise.
SHIPPED_AHEAD2 = {"SmolLM2-135M-Instruct": "smollm2-135m-instruct.lookahead2.safetensors"}
_IDENTITY_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "hidden_size", "intermediate_size", "vocab_size", "head_dim", "rope_theta",
                    "rope_parameters", "max_position_embeddings", "tie_word_embeddings")


def model_identity(config, shape) -> dict[str, str]:
    """Metadata naming a base model: architecture, layer/head counts, hidden size, config hash.

    Args: ``config`` a transformers config; ``shape`` a ``ModelShape``.
    Returns: ``str -> str`` dict (safetensors metadata must be strings).
    """
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    fields = {k: raw.get(k) for k in _IDENTITY_FIELDS}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"architecture": str(raw.get("model_type")), "num_layers": str(shape.num_layers),
            "num_q_heads": str(shape.num_q_heads), "num_kv_heads": str(shape.num_kv_heads),
            "head_dim": str(shape.head_dim), "hidden_size": str(shape.hidden_size),
            "config_hash": digest}


def describe(identity: dict[str, str]) -> str:
    """One-phrase description of a model identity, for error messages."""
    name = identity.get("model_name")
    base = (f"{identity.get('architecture')} {identity.get('num_layers')}L/{identity.get('num_q_heads')}q/"
            f"{identity.get('num_kv_heads')}kv/d{identity.get('head_dim')}/h{identity.get('hidden_size')} "
            f"[{identity.get('config_hash')}]")
    return f"{name} ({base})" if name else base


class Forecast(nn.Module):
    """Forecast projections of one model (design §4, §6.2).

    ``ahead=1``: ``L-1`` lookahead heads plus ``W^C_0``; ``ahead=2``: ``L-2`` two-ahead heads.

    Args:
        num_layers: ``L`` (>= 1, >= 3 for ``ahead=2``). hidden_size: ``d_model``.
        num_kv_heads: ``H_kv``. head_dim: ``d``. ahead: layers between a head's input and
            the layer it scores, 1 or 2.
    Attributes:
        current: ``nn.Linear(d_model, H_kv*d, bias=False)``, ``W^C_0`` (scores layer 0);
            ``None`` for ``ahead=2``.
        forecast: ``L - ahead`` such layers; ``forecast[l]`` reads layer ``l``'s input and
            scores layer ``l + ahead``. Parameters: ``L * d_model * H_kv * d`` (``ahead=1``),
            ``(L - 2) * d_model * H_kv * d`` (``ahead=2``).
    Raises:
        SpardaError: too few layers, or ``ahead`` not 1 or 2.
    """

    def __init__(self, num_layers: int, hidden_size: int, num_kv_heads: int, head_dim: int,
                 ahead: int = 1) -> None:
        super().__init__()
        if ahead not in (1, 2):
            raise SpardaError(f"a Forecast looks 1 or 2 layers ahead, got {ahead}")
        if num_layers < 1 + 2 * (ahead - 1):
            raise SpardaError(f"a Forecast {ahead} layer(s) ahead needs at least {1 + 2 * (ahead - 1)} layers, "
                              f"got {num_layers}")
        out = num_kv_heads * head_dim
        self.num_kv_heads, self.head_dim, self.ahead = num_kv_heads, head_dim, ahead
        self.current = nn.Linear(hidden_size, out, bias=False) if ahead == 1 else None
        self.forecast = nn.ModuleList(nn.Linear(hidden_size, out, bias=False) for _ in range(num_layers - ahead))

    @classmethod
    def for_shape(cls, shape, ahead: int = 1) -> "Forecast":
        """A randomly initialised Forecast (``nn.Linear`` default init) for a ``ModelShape``."""
        return cls(shape.num_layers, shape.hidden_size, shape.num_kv_heads, shape.head_dim, ahead=ahead)

    @classmethod
    def seeded(cls, shape, seed: int, ahead: int = 1) -> "Forecast":
        """:meth:`for_shape` drawn from ``torch.manual_seed(seed)``, leaving the caller's
        CPU random state as it was (the random-Forecast contrast of design §8)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls.for_shape(shape, ahead=ahead)

    def targets(self) -> range:
        """The layers this Forecast scores: ``0 .. L-1`` (``ahead=1``), ``2 .. L-1`` (``ahead=2``)."""
        return range(0 if self.ahead == 1 else 2, len(self.forecast) + self.ahead)

    def scorer(self, target_layer: int) -> nn.Linear:
        """The projection whose output scores ``target_layer``'s compressed keys (``W^C_0`` for
        layer 0, else ``forecast[target - ahead]``, which reads layer ``target - ahead``'s input).
        Raises IndexError for a layer outside :meth:`targets`."""
        if target_layer not in self.targets():
            raise IndexError(f"no Forecast head {self.ahead} layer(s) ahead scores layer {target_layer}")
        return self.current if target_layer == 0 else self.forecast[target_layer - self.ahead]

    def source_layer(self, target_layer: int) -> int:
        """The layer whose attention input the head scoring ``target_layer`` reads."""
        return max(target_layer - self.ahead, 0)

    def project(self, target_layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Forecast queries for ``target_layer``: ``h [B, T, d_model]`` -> ``[B, H_kv, T, d]``.

        ``h`` is the attention input of :meth:`source_layer`; ``cos, sin [B, 1, T, d]`` are the
        query RoPE tables at the tokens' positions. Computed in the projection's dtype.
        """
        lin = self.scorer(target_layer)
        b, t, _ = h.shape
        f = lin(h.to(lin.weight.dtype)).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return ref.apply_rope(f, cos.to(f.dtype), sin.to(f.dtype))


def q_init(forecast: Forecast, model) -> None:
    """Initialise each projection from the query weights of the layer it scores (in place).

    ``F_l = mean_g W_q^{l+a}[group] diag(w_{l+a} / w_l)`` with ``w`` the input RMSNorm
    weights and ``a`` the Forecast's ``ahead`` (the residual stream changes little between
    nearby layers); ``W^C_0 = mean_g W_q^0``. Training then refines it (design §5 does not fix an init).
    """
    s = model.shape
    layers = model.model.layers
    with torch.no_grad():
        for target in forecast.targets():
            wq = layers[target].self_attn.q_proj.weight.float()
            w = wq.view(s.num_kv_heads, s.group_size, s.head_dim, s.hidden_size).mean(1)
            w = w.reshape(-1, s.hidden_size)
            if target > 0:
                num = layers[target].input_layernorm.weight.float()
                den = layers[forecast.source_layer(target)].input_layernorm.weight.float()
                w = w * (num / torch.where(den.abs() < 1e-3, 1e-3, den)).view(1, -1)
            lin = forecast.scorer(target)
            lin.weight.copy_(w.to(lin.weight.dtype))


def save_forecast(forecast: Forecast, path: str | Path, identity: dict[str, str],
                  dtype: torch.dtype = torch.bfloat16, **meta) -> None:
    """Write Forecast tensors (only) and metadata to a safetensors file (atomically, :mod:`sparda.io`).

    The file holds ``current.weight`` and ``forecast.{l}.weight`` (``l < L-1``), or for a
    two-ahead Forecast only ``forecast.{l}.weight`` (``l < L-2``, scoring layer ``l+2``), each
    ``[H_kv * d, d_model]`` in ``dtype``, on CPU; metadata ``lookahead`` is ``forecast.ahead``.

    Args:
        identity: :func:`model_identity` of the base model (plus optional ``model_name``).
        dtype: storage dtype (bf16 keeps SmolLM2's 3.3 M parameters under 7 MB).
        **meta: extra metadata (``preset``, ``step``, ``data``, ...), stringified.
    Raises:
        SpardaError: the file cannot be written (no temporary file is left behind).
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in forecast.state_dict().items()}
    metadata = {"format": FORMAT, "lookahead": str(forecast.ahead), **identity,
                **{k: str(v) for k, v in meta.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as exc:  # an I/O failure inside safetensors (read-only, full disk)
            raise SpardaError(f"cannot write {path}: {str(exc).splitlines()[0]}") from exc
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates 0600 files; give the user's usual mode


def read_forecast(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a Forecast file.

    Returns:
        ``(tensors, metadata)``: ``name -> [H_kv * d, d_model]`` CPU tensors in the stored
        dtype (see :func:`save_forecast`), and the ``str -> str`` metadata.
    Raises:
        SpardaError: the file is missing, unreadable, or not a sparda Forecast file.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise SpardaError(f"Forecast weights not found: {path}; train them with `sparda train-forecast`")
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpardaError(f"cannot read Forecast weights {path}: not a readable safetensors file ({reason}); pass "
                          "the .safetensors file that `sparda train-forecast --out` wrote, or train one") from None
    if meta.get("format") != FORMAT:
        found = f"format {meta['format']!r}" if meta.get("format") else "no sparda format tag"
        raise SpardaError(f"{path} is a safetensors file but not sparda Forecast weights ({found}, expected "
                          f"{FORMAT!r}); pass a file written by `sparda train-forecast`, or train one")
    return tensors, meta


def load_forecast(path: str | Path, config, shape, name: str | None = None,
                  ahead: int = 1) -> tuple[Forecast, dict[str, str]]:
    """Load Forecast weights for a base model, checking identity, lookahead and shapes.

    Args:
        config, shape: the loaded model's transformers config and ``ModelShape``.
        name: the model's display name for messages. ahead: 1 (``--forecast``) or 2
            (``--forecast2``, design §6.2); files without ``lookahead`` metadata are 1.
    Returns: ``(forecast fp32 on CPU, metadata)``.
    Raises:
        SpardaError: one line naming both models if the weights were trained for another,
            or naming the option if they look another number of layers ahead.
    """
    tensors, meta = read_forecast(path)
    have = int(meta.get("lookahead", "1"))
    if have != ahead:
        option = {1: "--forecast", 2: "--forecast2"}
        raise SpardaError(f"Forecast weights {path} look {have} layer(s) ahead, but {option[ahead]} takes "
                          f"{ahead}-ahead weights; pass the file as {option.get(have, '--forecast')}, or train "
                          f"them with `sparda train-forecast --lookahead {ahead}`")
    mine = model_identity(config, shape)
    if name:
        mine["model_name"] = name
    keys = [k for k in mine if k != "model_name"]
    forecast = Forecast.for_shape(shape, ahead=ahead)
    expected = {k: tuple(v.shape) for k, v in forecast.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if any(meta.get(k) != mine[k] for k in keys) or expected != got:
        raise SpardaError(f"Forecast weights {path} were trained for {describe(meta)}, not for the loaded "
                          f"model {describe(mine)}; pass --forecast for this model or train one")
    forecast.load_state_dict({k: v.float() for k, v in tensors.items()})
    return forecast.eval(), meta


def shipped_path(name: str | None, ahead: int = 1) -> Path | None:
    """Path of the shipped Forecast weights filed under ``name`` (for a model directory:
    ``shipped_path(shipped_name(model_dir))``, which recognises the model by content), or None;
    ``ahead=2``: the shipped two-ahead heads (design §6.2)."""
    file = (SHIPPED if ahead == 1 else SHIPPED_AHEAD2).get(name or "")
    if file is None:
        return None
    path = Path(str(resources.files("sparda") / "assets" / "forecast" / file))
    return path if path.is_file() else None


def default_forecast_available(model_dir) -> bool:
    """True if shipped Forecast weights exist for the model in ``model_dir`` (by content)."""
    return shipped_path(shipped_name(model_dir)) is not None


def model_name(model_dir) -> str | None:
    """Display name of a model directory: :data:`~sparda.model.loader.BUNDLED_NAME` for a
    conversion of the bundled GGUF (recognised by content, :func:`~sparda.model.loader.shipped_name`,
    whatever the file was called), the GGUF file's stem for another conversion, else the
    directory's name; None for None."""
    if model_dir is None:
        return None
    source = conversion_source(model_dir)
    if source is None:
        return Path(model_dir).name
    return shipped_name(model_dir) or Path(source[0]).stem


def weights_for(path, model, shape, model_dir, ahead: int = 1) -> tuple[Forecast, dict[str, str]]:
    """The Forecast a method runs: ``path``, or the shipped weights of the model in ``model_dir``
    (``ahead=2``: the two-ahead heads of design §6.2). Returns ``(forecast fp32 on CPU, metadata)``.

    Raises:
        SpardaError: no weights for this model (naming the training command and the option), no
            ``model`` to check them against, or weights trained for another model.
    """
    # a Hugging Face snapshot by its ORG/NAME, not by its directory (the commit hash)
    display = hub_repo_id(model_dir) or model_name(model_dir)
    path = path or shipped_path(shipped_name(model_dir), ahead)
    if path is None:
        repo = hub_repo_id(model_dir) or "..."
        if ahead == 2:
            raise SpardaError(f"no two-ahead Forecast weights (lookahead=2) for {display or 'this model'}; train "
                              f"them with `sparda train-forecast --lookahead 2 --model {repo} --out F2.safetensors` "
                              "and pass --forecast2 F2.safetensors, or drop --lookahead")
        raise SpardaError(f"no Forecast weights for {display or 'this model'}; train them with "
                          f"`sparda train-forecast --model {repo} --out F.safetensors` "
                          "and pass --forecast F.safetensors, or use --method sparse")
    if model is None:
        raise SpardaError("method sparda needs the model to check its Forecast weights")
    return load_forecast(path, model.config, shape, display, ahead=ahead)


def on_model(forecast: Forecast, model) -> Forecast:
    """``forecast`` on ``model``'s device and dtype (as is without a model), frozen, in eval mode."""
    if model is not None:
        param = next(model.parameters())
        forecast = forecast.to(device=param.device, dtype=param.dtype)
    return forecast.eval().requires_grad_(False)


class ForecastAttention(BlockSparseMethod):
    """Method ``sparda`` with the KV cache on the device (design §4).

    Loads ``config.forecast_path`` or, for the bundled model, the shipped weights; a
    ``forecast=`` :class:`Forecast` argument replaces both (used by tests and reports).

    Raises:
        SpardaError: no weights for this model, or weights trained for another model.
    """

    name = "sparda"
    batched_prefill = True  # per-query prefill (design §3.8)

    def __init__(self, config, shape, model=None, model_dir=None, forecast: Forecast | None = None) -> None:
        super().__init__(config, shape, model=model, model_dir=model_dir)
        self.meta: dict[str, str] = {}
        if forecast is None:
            forecast, self.meta = weights_for(config.forecast_path, model, shape, model_dir, ahead=1)
        self.forecast = on_model(forecast, model)
        #: the two-ahead heads of ``lookahead=2`` (design §6.2; the offloaded method loads them)
        self.forecast2: Forecast | None = None
        self._queries: dict[int, torch.Tensor] = {}  # prefill: target layer -> [B, H, T, d]
        self._masks: dict[int, torch.Tensor] = {}    # decode: target layer -> [B, H, 1, N]
        self._next_ids: dict[int, torch.Tensor] = {}  # decode, CUDA: target layer -> [B, H, W] ids

    def reset(self) -> None:
        """Clear the stored Forecast queries and masks (before each prefill)."""
        super().reset()
        self._queries.clear()
        self._masks.clear()
        self._next_ids.clear()

    def forecast_query(self, target_layer: int, h: torch.Tensor, step, ahead: int = 1) -> torch.Tensor:
        """Forecast queries ``[B, H_kv, d]`` of one decode token for ``target_layer`` (``ahead=2``:
        of the two-ahead heads, design §6.2): the fused decode step's precomputed ones
        (``step.projections``, from the stacked QKV(+F) GEMM, design §6, keyed as
        :meth:`stacked_heads`) if present, else :meth:`Forecast.project` of ``h [B, 1, d_model]``."""
        pre = getattr(step, "projections", None)
        key = target_layer if ahead == 1 else (target_layer, ahead)
        if pre and key in pre:
            return pre[key]
        forecast = self.forecast if ahead == 1 else self.forecast2
        return forecast.project(target_layer, h, step.cos, step.sin)[:, :, -1]

    def stacked_heads(self, layer: int) -> list[tuple[int | tuple[int, int], torch.nn.Linear]]:
        """Extra heads the fused decode step stacks into layer ``layer``'s QKV GEMM
        (:class:`sparda.model.fused.FusedDecoder`): ``[(key, projection), ...]``, ``W^C_0`` at
        layer 0 (key 0), ``F_layer`` (key ``layer+1``) below the last layer and, with
        :attr:`forecast2`, ``F2_layer`` (key ``(layer+2, 2)``, design §6.2)."""
        heads = [(0, self.forecast.current)] if layer == 0 else []
        if layer + 1 < self.shape.num_layers:
            heads.append((layer + 1, self.forecast.forecast[layer]))
        if self.forecast2 is not None and layer + 2 < self.shape.num_layers:
            heads.append(((layer + 2, 2), self.forecast2.forecast[layer]))
        return heads

    def predict_next(self, layer: int, h: torch.Tensor, cache, step, ahead: int = 1) -> torch.Tensor:
        """Layer ``layer+ahead``'s block mask, computed during layer ``layer`` (decode).

        ``F_layer(h)`` (``ahead=2``: ``F2_layer``, design §6.2) scores layer ``layer+ahead``'s
        compressed keys as they stood before this step's token was appended there (a window
        completing at the current token is not scored; the current block is forced local
        anyway), then §3.4 selects.

        Args: ``h [B, Tq, d_model]``; ``cache`` a cache with ``view``; ``step`` a StepInfo.
        Returns: ``[B, H_kv, Tq, N]`` bool, ``N = ceil(max kv_len / block_size)``.
        """
        cfg, target = self.selection, layer + ahead
        num_tokens = step.max_kv_len
        _, _, ck = cache.view(target, step.cache_rows, max(num_tokens - 1, 0))
        num_blocks = -(-num_tokens // cfg.block_size)
        if h.is_cuda and h.shape[-2] == 1:
            # Triton: fused scoring + pooling + rule; ck_len cuts each row to the keys
            # complete before this step's token (no host sync).
            f = self.forecast_query(target, h, step, ahead)
            pos = step.q_pos[:, -1]
            ck_len = torch.where(pos >= cfg.kernel_size, (pos - cfg.kernel_size) // cfg.kernel_stride + 1, 0)
            ids, mask = kernels.select_decode_blocks(f, ck, pos, num_blocks, cfg,
                                                     ck_len=ck_len, return_mask=True)
            if ahead == 1:
                self._next_ids[target] = ids
            return mask.unsqueeze(2)
        f = self.forecast_query(target, h, step, ahead).unsqueeze(2) if h.shape[-2] == 1 else \
            (self.forecast if ahead == 1 else self.forecast2).project(target, h, step.cos, step.sin)
        scores = ref.forecast_scores(f, ck, step.q_pos - 1, cfg.kernel_size, cfg.kernel_stride)
        blocks = ref.pool_to_blocks(scores, num_blocks, cfg)
        return ref.select_blocks(blocks, step.q_pos, cfg, adaptive=step.phase == "decode",
                                 logit_scale=self.mass_logit_scale)

    @property
    def mass_logit_scale(self) -> float:
        """Forecast block scores are logits at ``1 / sqrt(d)`` for the top-p mass (design §3.12, §5)."""
        return 1.0 / math.sqrt(self.shape.head_dim)

    def _prefill_dense(self, step) -> bool:
        return step.phase == "prefill" and not self.config.sparse_prefill

    def before_layer(self, layer, q, h, cache, step):
        """Run the Forecast for the next layer (design §4), from ``h [B, Tq, d_model]``.

        Prefill: store ``F_layer(h)`` (and ``W^C_0(h)`` at layer 0) as ``[B, H_kv, Tq, d]``
        queries for the target layer. Decode: store layer ``layer+1``'s block mask
        ``[B, H_kv, 1, N]`` bool from :meth:`predict_next`. Nothing under the dense
        fallback or with dense prefill. Raises SpardaError only through ``cache.view``.
        """
        if not self.needs_selection(step) or self._prefill_dense(step):
            return
        if step.phase == "prefill":
            if layer == 0:
                self._queries[0] = self.forecast.project(0, h, step.cos, step.sin)
            if layer + 1 < self.shape.num_layers:
                self._queries[layer + 1] = self.forecast.project(layer + 1, h, step.cos, step.sin)
            return
        if layer == 0:
            self._queries[0] = self.forecast_query(0, h, step).unsqueeze(2)
        if layer + 1 < self.shape.num_layers:
            self._masks[layer + 1] = self.predict_next(layer, h, cache, step)

    def block_scores(self, layer, q, h, cache, step, k, ck, chunk):
        """Forecast block scores ``[B, H_kv, Tq_chunk, N]`` fp32 (design §3.3, §4).

        Raw dot products of the stored Forecast queries ``[B, H_kv, Tq, d]`` with
        ``ck [B, H_kv, C, d]`` (``-inf`` where invisible under the lookahead rule,
        :func:`~sparda.kernels.reference.lookahead_pos`: layers >= 1 see the windows complete
        before the query's token, as in decode), max-pooled onto ``N = ceil(T / block_size)``
        blocks of ``k [B, H_kv, T, d]``; ``q`` is unused.
        Raises KeyError if :meth:`before_layer` stored no queries for ``layer``.
        """
        cfg = self.selection
        f = self._queries[layer][..., chunk, :]
        scores = ref.forecast_scores(f, ck, ref.lookahead_pos(step.q_pos[:, chunk], layer),
                                     cfg.kernel_size, cfg.kernel_stride)
        return ref.pool_to_blocks(scores, -(-k.shape[-2] // cfg.block_size), cfg)

    def select(self, layer, q, h, cache, step, first=0):
        """Block mask ``[B, H_kv, Tq - first, N]`` bool: in decode, the mask predicted by the
        previous layer (popped, not repaired: design §4); otherwise scored from the stored
        Forecast queries, which are then dropped (they live for one prefill chunk). CUDA
        prefill: the fused per-token kernel (:func:`sparda.kernels.select_prefill_blocks`)
        under the lookahead rule (layers >= 1 score the windows complete before the token)."""
        if step.phase == "decode" and layer in self._masks:
            if layer in self._next_ids:
                self.decode_ids[layer] = self._next_ids.pop(layer)
            return self._masks.pop(layer)
        if step.phase == "prefill" and fused_prefill_selection(q):
            f = self._queries.pop(layer)[..., first:, :]
            ck = cache.compressed_keys(layer, step.cache_rows, step.max_kv_len)
            num_blocks = -(-step.max_kv_len // self.selection.block_size)
            return kernels.select_prefill_blocks(f, ck, step.q_pos[:, first:], num_blocks, self.selection,
                                                 lookahead=layer > 0)
        mask = super().select(layer, q, h, cache, step, first)
        self._queries.pop(layer, None)
        return mask

    def attend(self, layer, q, h, cache, step):
        """``q [B, H_kv, G, Tq, d]`` -> same shape, ``q``'s dtype: dense in prefill unless
        ``config.sparse_prefill``, else :meth:`BlockSparseMethod.attend` with the Forecast's
        blocks. Raises SpardaError only through ``cache.view``."""
        if self._prefill_dense(step):
            num_tokens = step.max_kv_len
            k, v, _ = cache.view(layer, step.cache_rows, num_tokens)
            return dense_attention(q, k, v, step)
        return super().attend(layer, q, h, cache, step)


class RandomForecastAttention(ForecastAttention):
    """Method ``sparda-random``: ``sparda`` with a seeded random-init Forecast (``nn.Linear``
    default init, seed 0), the untrained contrast row of design §8's measurements."""

    name = "sparda-random"

    def __init__(self, config, shape, model=None, model_dir=None) -> None:
        super().__init__(config, shape, model=model, model_dir=model_dir, forecast=Forecast.seeded(shape, 0))
