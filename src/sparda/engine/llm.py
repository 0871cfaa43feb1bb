"""The user-facing API in the style of vLLM: ``LLM(...).generate(prompts)``, ``chat``, streaming.

:class:`LLM` is a facade: :func:`~sparda.config.build_config` checks the options once, the
model loads, a :class:`~sparda.engine.runner.ModelRunner` executes it and every generate
form runs the one loop, :class:`~sparda.engine.engine.Engine`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch

from sparda.attention.dense_heads import resolve_dense_heads
from sparda.attention.forecast import default_forecast_available, model_identity
from sparda.attention.registry import build_method
from sparda.config import SpardaConfig, build_config, check_budget, spell
from sparda.engine.runner import ModelRunner
from sparda.engine.sampling_params import SamplingParams
from sparda.engine.sequence import RequestOutput
from sparda.errors import SpardaError
from sparda.model.loader import load_model

#: the result of one prompt (every generate form returns these)
Completion = RequestOutput


def api_errors(func):
    """Re-raise a :class:`SpardaError` with options spelt as keywords (``kv_dtype``, not
    ``--kv-dtype``); ``raw`` keeps the message for the CLI's spelling."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except SpardaError as exc:
            if getattr(exc, "raw", None) is None:
                exc.raw = str(exc)
                exc.args = (spell(exc.raw, "api"),)
            raise
    return wrapper


class _Run:
    """``LLM.<name>`` is the :class:`ModelRunner`'s method of that name (model execution)."""

    def __set_name__(self, owner, name) -> None:
        self.name = name

    def __get__(self, llm, owner=None):
        return self if llm is None else getattr(llm.model_runner, self.name)


class LLM:
    """Load a Llama-family model and generate with an attention method.

    Args:
        model: a Hugging Face model directory, ``ORG/NAME`` in the local Hugging Face cache
            (offline), a ``.gguf`` file, or ``None`` for the bundled SmolLM2-135M-Instruct.
        method: ``dense``, ``sparse``, ``sparda``, ... (:data:`sparda.config.METHODS`); ``None``:
            ``sparda`` where Forecast weights are given or shipped for the model, else ``sparse``.
        preset, device, dtype, **options: every option of :func:`sparda.config.build_config`
            (selection budget, ``forecast``, ``offload``, ``kv_dtype``, ``cuda_graphs``, ...;
            README "Python API" lists them).
    Raises:
        SpardaError: a bad option (checked before the model loads), path or architecture.
    """

    new_cache, prefill, prefill_batch, prefill_groups = _Run(), _Run(), _Run(), _Run()
    decode, runner, logits, kv_bytes_per_token, cache_capacity = _Run(), _Run(), _Run(), _Run(), _Run()

    @api_errors
    def __init__(self, model: str | os.PathLike | None = None, *, method: str | None = None,
                 preset: str = "small", device=None, dtype=None, **options) -> None:
        self.options = dict(method=method, preset=preset, device=device, dtype=dtype, **options)
        config = build_config(**self.options)
        self.device, self.dtype = torch.device(config.runtime.device), getattr(torch, config.runtime.dtype)
        if config.runtime.cpu_threads is not None:  # on the CPU: threads on idle cores only (config.cpu_threads)
            torch.set_num_threads(config.runtime.cpu_threads)
        self.model, self.tokenizer, self.model_dir = load_model(model, self.device, self.dtype)
        if method is None and config.forecast_path is None and not default_forecast_available(self.model_dir):
            config = build_config(**{**self.options, "method": "sparse"})  # no Forecast for this model
        check_budget(config, self.model.shape.max_positions)
        self._setup(config, model_identity(self.model.config, self.model.shape))
        if self.device.type == "cpu" and self.model_runner.offloaded:
            logging.getLogger("sparda").warning(
                "note: an offloaded KV cache on the CPU copies its blocks synchronously (no side stream to hide "
                "them behind), so it measures nothing of the prefetch; offload is meant for CUDA (design §6)")

    def _setup(self, config: SpardaConfig, identity: dict | None, **method_kwargs) -> None:
        """Build the method and runner for ``config``, resolving ``dense_heads`` (design §3.7)."""
        self.shape = self.model.shape
        self.method = build_method(config, self.shape, model=self.model, model_dir=self.model_dir, **method_kwargs)
        heads = resolve_dense_heads(config.dense_heads, method=self.method, shape=self.shape,
                                    model_dir=self.model_dir, identity=identity)
        self.config = self.method.config = dataclasses.replace(config, dense_heads=heads)
        self.model_runner = ModelRunner(self.model, self.method, self.config)

    @classmethod
    @api_errors
    def from_model(cls, model, tokenizer=None, *, method: str = "sparse", preset: str = "small",
                   forecast=None, forecast2=None, **options) -> "LLM":
        """An LLM around an in-memory :class:`~sparda.model.llama.CausalLM` (benchmarks, tests):
        device and dtype are the model's; ``forecast`` (``forecast2``: the two-ahead heads of
        ``lookahead=2``) is a :class:`Forecast` module; offload off, block-sparse prefill on and no
        dense heads unless asked."""
        param = next(model.parameters())
        llm = cls.__new__(cls)
        llm.options = dict(method=method, preset=preset, device=str(param.device), dtype=str(param.dtype),
                           defaults="bench", cuda_available=param.device.type == "cuda", **options)
        config = build_config(**llm.options)
        llm.device, llm.dtype = param.device, param.dtype
        llm.model, llm.tokenizer, llm.model_dir = model.eval(), tokenizer, None
        extra = {"forecast": forecast} if method.startswith("sparda") and forecast is not None else {}
        if config.lookahead == 2 and forecast2 is not None:
            extra["forecast2"] = forecast2
        llm._setup(config, None, **extra)
        return llm

    @api_errors
    def derive(self, **options) -> "LLM":
        """An LLM over the same weights and tokenizer with ``options`` changed (one method per
        copy: the eval's methods and budgets). Raises SpardaError as :class:`LLM`."""
        other = object.__new__(type(self))
        other.__dict__.update({k: self.__dict__[k] for k in ("device", "dtype", "model", "tokenizer", "model_dir")})
        other.options = {**self.options, **options}
        config = build_config(**other.options)
        identity = None if self.model_dir is None else model_identity(self.model.config, self.model.shape)
        extra = {}
        if self.model_dir is None and config.method.startswith("sparda"):  # in-memory Forecasts go along
            for key, wanted in (("forecast", True), ("forecast2", config.lookahead == 2)):
                if wanted and getattr(self.method, key, None) is not None:
                    extra[key] = getattr(self.method, key)
        other._setup(config, identity, **extra)
        return other

    # ----------------------------------------------------------------- prompts
    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of ``prompt``, wrapped in the tokenizer's chat template if ``chat``."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def eos_ids(self) -> set[int]:
        """End-of-sequence token ids of the model and tokenizer."""
        ids = set()
        for source in (self.model.config, getattr(self.tokenizer, "generation_config", None)):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update([value] if isinstance(value, int) else value or ())
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---------------------------------------------------------------- generate
    @api_errors
    def generate(self, prompts=None, sampling_params=None, *, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, chat: bool = True, ignore_eos: bool = False, seed: int = 0,
                 prompt_token_ids: list[list[int]] | None = None, max_batch: int | None = None) -> list[RequestOutput]:
        """Generate a completion for each prompt (one :class:`RequestOutput` each, in order).

        Args:
            prompts: a string or a list (the chat template applied if ``chat``);
                ``prompt_token_ids`` replaces them if given.
            sampling_params: one :class:`SamplingParams` for all prompts or a list of one per
                prompt; without it ``max_new_tokens``, ``temperature``, ``top_p``,
                ``ignore_eos`` and ``seed`` make one.
            max_batch: requests decoding together (default: all).
        Raises:
            SpardaError: empty or non-string prompts, token ids outside the vocabulary, bad
                sampling parameters, a prompt plus its new tokens over the model's context.
        """
        outputs = {}
        for index, delta in self.generate_stream(prompts, sampling_params, chat=chat, max_batch=max_batch,
                                                 prompt_token_ids=prompt_token_ids, max_new_tokens=max_new_tokens,
                                                 temperature=temperature, top_p=top_p, ignore_eos=ignore_eos,
                                                 seed=seed):
            if delta.output is not None:
                outputs[index] = delta.output
        return [outputs[i] for i in range(len(outputs))]

    @api_errors
    def generate_stream(self, prompts=None, sampling_params=None, *, chat: bool = True,
                        prompt_token_ids: list[list[int]] | None = None, max_batch: int | None = None,
                        **sampling):
        """As :meth:`generate`, but an iterator of ``(index, Delta)`` as tokens come; a
        request's deltas' texts concatenate to its final text. Arguments are checked before
        the first token (SpardaError)."""
        from sparda.engine.offline import offline_engine

        if sampling_params is None:
            sampling_params = SamplingParams.from_generate_args(**sampling)
        return offline_engine(self, prompts, sampling_params, chat, prompt_token_ids, max_batch)

    @api_errors
    def chat(self, messages, sampling_params=None, *, max_batch: int | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or a list of them
        through the tokenizer's chat template. Raises SpardaError: malformed messages, no template."""
        from sparda.engine.chat import chat_token_ids

        single = not isinstance(messages, (list, tuple)) or not messages or isinstance(messages[0], dict)
        ids = [chat_token_ids(self.tokenizer, conv) for conv in ([messages] if single else messages)]
        return self.generate(None, sampling_params or SamplingParams(), prompt_token_ids=ids, max_batch=max_batch)
