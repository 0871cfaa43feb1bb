"""Name -> attention method. A new baseline is one file plus one line here."""

from __future__ import annotations

from sparda.attention.base import AttentionMethod
from sparda.attention.blocksparse import OracleAttention, SparseAttention
from sparda.attention.dense import DenseAttention
from sparda.attention.forecast import ForecastAttention, RandomForecastAttention
from sparda.attention.infinigen import InfiniGenAttention
from sparda.attention.h2o import H2OAttention
from sparda.attention.quest import QuestAttention
from sparda.attention.shallow import ShallowAttention
from sparda.attention.snapkv import SnapKVAttention
from sparda.attention.streaming import StreamingAttention
from sparda.attention.offload import OFFLOADED, SparseOffloadAttention, SpardaNoPrefetchAttention
from sparda.config import MIXED_ON_DEVICE, SpardaConfig
from sparda.errors import SpardaError

METHOD_CLASSES: dict[str, type[AttentionMethod]] = {
    "dense": DenseAttention,
    "sparse": SparseAttention,
    "oracle": OracleAttention,
    "sparda": ForecastAttention,
    "sparda-random": RandomForecastAttention,
    "infinigen": InfiniGenAttention,
    "sparse-offload": SparseOffloadAttention,
    "sparda-no-prefetch": SpardaNoPrefetchAttention,
    "streaming": StreamingAttention,
    "h2o": H2OAttention,
    "quest": QuestAttention,
    "snapkv": SnapKVAttention,
    "shallow": ShallowAttention,
}


#: methods whose KV cache always lives in host memory (design §6); ``--no-offload`` is refused
ALWAYS_OFFLOADED = ("sparse-offload", "sparda-no-prefetch")
#: methods that read trained Forecast weights (``--forecast``)
FORECAST_METHODS = ("sparda", "sparda-no-prefetch")


def register(name: str, cls: type[AttentionMethod]) -> None:
    """Add (or replace) a method under ``name``."""
    METHOD_CLASSES[name] = cls


def check_offload(method: str, offload: bool | None, shallow_select_once: bool = False) -> None:
    """Refuse ``--offload`` for a method without an offloaded variant (no model needed).

    Also refuses ``shallow --offload --shallow-select-once``: that variant reads every block
    from the prompt's local window on, a set that grows with decode past any fixed number
    of GPU slots.

    Raises SpardaError naming the methods that do offload, or the flag to drop.
    """
    if offload and method not in OFFLOADED and method not in ALWAYS_OFFLOADED:
        raise SpardaError(
            f"--offload is not supported for method {method!r}; use it with sparse, sparda or shallow, "
            "or the always-offloaded sparse-offload / sparda-no-prefetch")
    if offload and method == "shallow" and shallow_select_once:
        raise SpardaError("--shallow-select-once does not run offloaded: it reads every block written since the "
                          "prompt's local window, more than the offloaded cache's GPU slots hold as decode goes "
                          "on; drop --offload or --shallow-select-once")


def check_kv_dtype_cache(kv_dtype: str | None, method: str, offload: bool | None, cuda: bool) -> None:
    """Refuse ``kv_dtype`` ``mixed`` for a method whose KV cache stays on the device (no model
    needed): ``mixed`` lives in an offloaded cache's host store (design §6.1). ``offload`` as
    given (``None``: the default, on for ``sparda`` where ``cuda``).

    Raises SpardaError naming the fix.
    """
    if kv_dtype != "mixed":
        return
    offloaded = method in ALWAYS_OFFLOADED or (method in OFFLOADED and (
        offload if offload is not None else (method == "sparda" and cuda)))
    if not offloaded:
        raise SpardaError(MIXED_ON_DEVICE.format(what=f"method {method}" + (
            " without --offload" if method in OFFLOADED else "")))


def build_method(config: SpardaConfig, shape, **kwargs) -> AttentionMethod:
    """Instantiate ``config.method`` for a model of ``shape``.

    Raises SpardaError if the method is not available in this build or cannot offload.
    """
    check_offload(config.method, config.offload, config.shallow_select_once)
    cls = METHOD_CLASSES.get(config.method)
    if config.offload and config.method in OFFLOADED:  # --offload: the offloaded variant (design §6)
        cls = OFFLOADED[config.method]
    if cls is None:
        raise SpardaError(
            f"method {config.method!r} is not available; available: {', '.join(METHOD_CLASSES)}")
    check_windows(config.method, cls, shape)
    return cls(config, shape, **kwargs)


def check_windows(name: str, cls: type[AttentionMethod], shape) -> None:
    """Refuse a block-sparse method on a model with sliding-window layers.

    Only ``dense`` applies the window; the block-sparse methods do not cap their
    selection at it yet, so a window shorter than the context would compute wrongly.
    Raises SpardaError naming the config field and ``--method dense``.
    """
    layers = shape.windowed_layers() if hasattr(shape, "windowed_layers") else []
    if layers and not issubclass(cls, DenseAttention):
        window = shape.window(layers[0])
        raise SpardaError(
            f"method {name!r} does not implement sliding-window attention (config sliding_window={window} on "
            f"{len(layers)} of {shape.num_layers} layers, shorter than the context of {shape.max_positions} "
            "tokens); use --method dense")
