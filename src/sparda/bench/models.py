"""Random-weight Llama-family models at named shapes (:data:`MODEL_SPECS`, docs/bench.md):
speed and memory only, never quality; built through our :class:`~sparda.model.llama.CausalLM`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparda.attention.forecast import Forecast
from sparda.cache.host import available_host_bytes
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.model.llama import CausalLM


@dataclass(frozen=True)
class ModelSpec:
    """A model shape (``layers``, ``q_heads``, ``kv_heads``, ``head_dim``, ``hidden``, ``mlp``,
    ``vocab``, ``tie``) plus its budget (``preset``, ``selection`` overrides; design §3.6)."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    mlp: int
    vocab: int
    tie: bool = False
    preset: str = "paper"
    selection: dict = field(default_factory=dict)


MODEL_SPECS: dict[str, ModelSpec] = {
    "llama-8b": ModelSpec(32, 32, 8, 128, 4096, 14336, 128256),
    "minicpm-8b": ModelSpec(32, 32, 2, 128, 4096, 16384, 73448),
    "bundled": ModelSpec(30, 9, 3, 64, 576, 1536, 49152, tie=True),
    # tiny contexts (1-2K tokens) need a tiny budget to leave the dense fallback
    "tiny": ModelSpec(4, 4, 2, 32, 128, 256, 512, preset="small",
                      selection=dict(init_blocks=1, local_blocks=2, topk_blocks=4, dense_len=256)),
}


def model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``name``. Raises SpardaError for an unknown name."""
    if name not in MODEL_SPECS:
        raise SpardaError(f"unknown bench model {name!r}; choose from {', '.join(MODEL_SPECS)}")
    return MODEL_SPECS[name]


def selection_config(name: str) -> SelectionConfig:
    """The selection budget of model ``name`` (design §3.6). Raises SpardaError for an unknown
    name or a rejected preset/override."""
    spec = model_spec(name)
    return SelectionConfig.from_preset(spec.preset, **spec.selection)


def spec_weight_bytes(name: str, dtype: torch.dtype) -> int:
    """Bytes of every weight of ``name`` in ``dtype``, from its :class:`ModelSpec`."""
    s = model_spec(name)
    attn = s.hidden * s.head_dim * (2 * s.q_heads + 2 * s.kv_heads)  # q, o and k, v projections
    layer = attn + 3 * s.hidden * s.mlp + 2 * s.hidden
    params = s.vocab * s.hidden * (1 if s.tie else 2) + s.layers * layer + s.hidden
    return params * torch.empty((), dtype=dtype).element_size()


def available_memory_bytes(device: torch.device) -> int | None:
    """Bytes free for weights: free GPU memory, or ``MemAvailable`` on the CPU; ``None`` if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return available_host_bytes()


def check_models_fit(names, device: torch.device, dtype: torch.dtype, limit_bytes: float | None = None) -> None:
    """Refuse, before allocating, a model whose weights exceed the free memory or ``limit_bytes``.

    Raises:
        SpardaError: naming the model, the bytes needed and available.
    """
    available = available_memory_bytes(device)
    if limit_bytes is not None:
        available = min(available, limit_bytes) if available is not None else limit_bytes
    if available is None:
        return
    for name in names:
        need = spec_weight_bytes(name, dtype)
        if need > 0.9 * available:
            where = "GPU memory free" if device.type == "cuda" else "host memory available"
            raise SpardaError(
                f"bench model {name} needs {need / 2**30:.1f} GiB ({need:,} bytes) for its "
                f"{str(dtype).replace('torch.', '')} weights, but only {available / 2**30:.1f} GiB "
                f"({available:,} bytes) of {where} (weights may use 90 %); pick a smaller --models "
                "(bundled, tiny), --quick, or a machine with more memory")


def build_model(name: str, device: torch.device | str, dtype: torch.dtype,
                max_positions: int = 131072, seed: int = 0) -> CausalLM:
    """A random-weight :class:`CausalLM` of shape ``name``; ``max_positions`` in tokens.

    Raises:
        SpardaError: unknown name, or the weights do not fit.
    """
    from transformers import LlamaConfig

    spec = model_spec(name)
    cfg = LlamaConfig(hidden_size=spec.hidden, intermediate_size=spec.mlp, num_hidden_layers=spec.layers,
                      num_attention_heads=spec.q_heads, num_key_value_heads=spec.kv_heads,
                      head_dim=spec.head_dim, vocab_size=spec.vocab, max_position_embeddings=max_positions,
                      rms_norm_eps=1e-5, tie_word_embeddings=spec.tie)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg)
    except (RuntimeError, MemoryError) as exc:
        raise SpardaError(f"random {name} weights do not fit on {device}: {str(exc).splitlines()[0]}") from exc
    finally:
        torch.set_default_dtype(previous)
    model.rotary.inv_freq.data = model.rotary.inv_freq.float()
    return model.eval().requires_grad_(False)


def random_forecast(model: CausalLM, seed: int = 0, ahead: int = 1) -> Forecast:
    """A random Forecast (``Forecast.for_shape``, ``ahead`` layers ahead) on the model's device and dtype."""
    torch.manual_seed(seed + ahead)
    param = next(model.parameters())
    return Forecast.for_shape(model.shape, ahead=ahead).to(device=param.device, dtype=param.dtype).eval()


def weight_bytes(model: CausalLM) -> int:
    """Bytes of weights a decode step reads: every parameter but the input embedding (unless tied)."""
    seen, total = set(), 0
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def method_extra_bytes(llm) -> int:
    """Bytes of method-owned weights read per step (Forecast, InfiniGen's partial query); else 0."""
    method = llm.method
    tensors = []
    if hasattr(method, "forecast"):
        tensors = list(method.forecast.parameters())
        if getattr(method, "forecast2", None) is not None:  # design §6.2
            tensors += list(method.forecast2.parameters())
    elif hasattr(method, "weights"):
        tensors = list(method.weights)
    return sum(t.numel() * t.element_size() for t in tensors)
