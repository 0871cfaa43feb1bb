"""Per-request sampling parameters, checked once when they are built (vLLM's shape)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparda.errors import SpardaError

#: most alternatives per token that ``logprobs`` may ask for (the OpenAI API's limit)
MAX_LOGPROBS = 20


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        temperature: 0 is greedy (argmax); otherwise logits are divided by it (> 0).
        top_p: nucleus sampling, the smallest set of tokens whose probability reaches
            ``top_p``, in (0, 1]; 1 keeps every token.
        top_k: keep the ``top_k`` most likely tokens before ``top_p``; 0 or -1 keeps all.
        max_tokens: new tokens at most (>= 1), or ``None``: up to the row's capacity
            (``max_model_len`` minus the prompt, or the model's context).
        stop: strings that end the completion; the text is cut before the first one found
            (the stop string itself is not returned). A string or a list of strings.
        stop_token_ids: token ids that end the completion (kept in ``token_ids``, like EOS).
        seed: seed of this request's own sampling generator: the same seed gives the same
            tokens whatever else runs in the batch; ``None`` draws a fresh seed.
        ignore_eos: keep generating past EOS (until ``max_tokens`` or a stop condition).
        logprobs: ``None``: no log-probabilities; ``k`` (0..20): per generated token its
            natural-log probability under the model (temperature 1, before any filtering)
            and the ``k`` most likely alternatives.
    Raises:
        SpardaError: a field of the wrong type or out of range (one line naming it).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 64
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def fail(name: str, rule: str, value) -> None:
            raise SpardaError(f"SamplingParams.{name} must be {rule}, got {value!r}")

        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            fail("temperature", "a finite number >= 0 (0 is greedy)", self.temperature)
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "a number in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "an integer >= 1, or 0 / -1 for no top-k", self.top_k)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1 (or None: up to the context)", self.max_tokens)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            fail("stop", "a string or a list of strings", self.stop)
        if any(not s for s in stop):
            fail("stop", "non-empty strings", self.stop)
        object.__setattr__(self, "stop", stop)
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            fail("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.seed is not None and not _is_int(self.seed):
            fail("seed", "an integer or None", self.seed)
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "True or False", self.ignore_eos)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"an integer in 0..{MAX_LOGPROBS} or None", self.logprobs)

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (``temperature == 0``)."""
        return self.temperature == 0

    @classmethod
    def from_generate_args(cls, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                           ignore_eos: bool = False, seed: int = 0) -> "SamplingParams":
        """The parameters of ``LLM.generate``'s keyword form (``max_new_tokens`` is
        ``max_tokens``). Raises SpardaError naming the bad argument."""
        from sparda.engine.validate import check_sampling

        check_sampling(max_new_tokens, temperature, top_p, seed)
        return cls(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed, ignore_eos=ignore_eos)
