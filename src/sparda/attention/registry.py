"""Name -> attention method. A new baseline is one file plus one line here."""

from __future__ import annotations

from sparda.attention.base import AttentionMethod
from sparda.attention.blocksparse import OracleAttention, SparseAttention
from sparda.attention.dense import DenseAttention
from sparda.attention.forecast import ForecastAttention, RandomForecastAttention
from sparda.attention.baselines.infinigen import InfiniGenAttention
from sparda.attention.baselines.h2o import H2OAttention
from sparda.attention.baselines.quest import QuestAttention
from sparda.attention.baselines.shallow import ShallowAttention
from sparda.attention.baselines.snapkv import SnapKVAttention
from sparda.attention.baselines.streaming import StreamingAttention
from sparda.attention.offload import OFFLOADED, SparseOffloadAttention, SpardaNoPrefetchAttention
from sparda.config import ALWAYS_OFFLOADED, FORECAST_METHODS, SpardaConfig  # noqa: F401 - re-exported
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


def build_method(config: SpardaConfig, shape, **kwargs) -> AttentionMethod:
    """Instantiate ``config.method`` for a model of ``shape``.

    ``config`` was checked by :func:`~sparda.config.build_config`. Raises SpardaError if the
    method is not available in this build or the model has sliding-window layers.
    """
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
