"""An lm-evaluation-harness model backed by :class:`sparda.LLM`: ``--model sparda``.

Importing this module registers ``sparda`` in lm-eval's model registry. lm-eval does not
discover plugins by itself, so run its CLI through this module's alias (same arguments)::

    python -m sparda.lm_eval_model --model sparda \\
        --model_args pretrained=DIR_OR_ORG/NAME,method=sparda --tasks TASK

(``python -m sparda.integrations.lm_eval`` is the same) or, in Python, ``import
sparda.lm_eval_model`` (or this module) before ``lm_eval.simple_evaluate(model="sparda", ...)``.

How each request type runs (tokenisation, truncation, stop strings and rolling windows
follow lm-eval's ``hf`` model, through lm-eval's own helpers):

* ``loglikelihood``: the context is prefilled with the method (one row per request),
  then the continuation is teacher-forced through batched decode steps, so the scores
  see the method's decode-time selection (design §3-§4) over the context;
  ``batch_size`` requests share one KV cache and decode together.
* ``loglikelihood_rolling``: each rolling window is one prefill with logits at every
  position (as ``sparda eval``'s perplexity).
* ``generate_until``: ``sparda.LLM.generate`` on ``batch_size`` prompts at once, the
  text cut at the first stop string (greedy unless ``do_sample``); like lm-eval's ``hf``, a
  stop string in a special token's text (``<file_sep>`` holds ``e``) ends the generation.

``device`` ``cuda`` without CUDA falls back to the CPU, as lm-eval's ``hf`` does (lm-eval's
CLI passes ``cuda:0`` when ``--device`` is not given). Model args: ``pretrained`` (model directory, ``.gguf``, ``ORG/NAME`` in the local
Hugging Face cache, or empty for the bundled model), ``method``, ``preset``,
``device``, ``dtype``, ``max_length``, ``add_bos_token``, ``batch_size``, and the
:class:`sparda.LLM` options (``topk_blocks``, ``local_blocks``, ``init_blocks``,
``block_size``, ``dense_len``, ``topp_mass``, ``min_blocks``, ``forecast``, ``sparse_prefill`` / ``dense_prefill``, ``offload``).
"""

from __future__ import annotations

import logging
import sys

import torch

from sparda.errors import SpardaError

try:
    import lm_eval.models  # noqa: F401  (fills the registry first: lm-eval only does it when empty)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise SpardaError("lm-eval is not installed; run `pip install sparda[lm-eval]`") from exc


@register_model("sparda")
class SpardaLM(TemplateLM):
    """lm-eval ``LM`` over :class:`sparda.LLM` (see the module docstring).

    Raises:
        SpardaError: bad model args (through :class:`sparda.LLM`) or a ``batch_size`` that
            is not a positive integer.
    """

    def __init__(self, pretrained: str | None = None, method: str | None = None, preset: str = "small",
                 device: str | None = None, dtype: str | None = None, batch_size: int | str = 1,
                 max_batch_size: int | None = None, max_length: int | None = None,
                 add_bos_token: bool | None = None, **options) -> None:
        super().__init__()
        from sparda import LLM

        try:
            self.batch_size = int(batch_size)
        except (TypeError, ValueError):
            raise SpardaError(f"batch_size must be a positive integer for sparda, got {batch_size!r}") from None
        if self.batch_size < 1:
            raise SpardaError(f"batch_size must be a positive integer for sparda, got {batch_size!r}")
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI passes cuda:0 when --device is not given; its hf model then runs on
            # the CPU, and so does this one
            logging.getLogger(__name__).warning("CUDA is not available; running sparda on the CPU")
            device = "cpu"
        self.llm = LLM(pretrained or None, method=method, preset=preset, device=device, dtype=dtype, **options)
        self.tokenizer = self.llm.tokenizer
        self._max_length = int(max_length) if max_length else self.llm.shape.max_positions
        self.add_bos_token = add_bos_token

    # ------------------------------------------------------------ tokenizer
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """BOS if the tokenizer has one, else EOS (as lm-eval's ``hf``)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Tokens per scored sequence (default: the model's context)."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "sparda").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None,
                   **kwargs) -> list[int]:
        """Token ids of ``string`` with lm-eval ``hf``'s special-token rule."""
        if add_special_tokens is not None:
            special = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        else:
            special = {}
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template applied to ``chat_history`` (text, not ids)."""
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------- scoring
    def _split(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Left-truncate to ``max_length + 1`` tokens as lm-eval's ``hf``: (prompt, scored)."""
        whole = (context + continuation)[-(self.max_length + 1):]
        scored = continuation[-(len(whole) - 1):]
        return whole[: len(whole) - len(scored)], scored

    @torch.inference_mode()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Prefill each prompt into its own cache row, then teacher-force the scored tokens
        through batched decode steps. Returns ``(sum log p, all greedy)`` per pair (fp32)."""
        llm = self.llm
        cache = llm.new_cache(len(pairs), max(len(p) for p, _ in pairs) + max(len(c) for _, c in pairs))
        llm.method.reset()
        logp = [0.0] * len(pairs)
        greedy = [True] * len(pairs)

        def take(row: int, logits: torch.Tensor, token: int) -> None:
            logp[row] += float(torch.log_softmax(logits.float(), -1)[token])
            greedy[row] = greedy[row] and int(logits.argmax()) == token

        for row, (prompt, scored) in enumerate(pairs):
            take(row, llm.prefill(cache, row, prompt)[-1], scored[0])
        positions = torch.tensor([len(p) for p, _ in pairs], device=llm.device)
        max_position = int(positions.max())
        for j in range(1, max(len(c) for _, c in pairs)):
            # rows already done feed their last token again (their output is not read)
            tokens = torch.tensor([c[min(j, len(c)) - 1] for _, c in pairs], device=llm.device)
            logits = llm.decode(cache, tokens, positions, max_position)
            for row, (_, scored) in enumerate(pairs):
                if j < len(scored):
                    take(row, logits[row], scored[j])
            positions = positions + 1
            max_position += 1
        return list(zip(logp, greedy))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per ``(key, context_ids, continuation_ids)``."""
        pairs = [self._split(list(ctx), list(cont)) for _, ctx, cont in requests]
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            for i, result in zip(chunk, self._score_batch([pairs[i] for i in chunk])):
                out[i] = result
                self.cache_hook.add_partial("loglikelihood", requests[i][0], result)
        return out

    @torch.inference_mode()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text over lm-eval's rolling windows of ``max_length``."""
        from lm_eval import utils

        results = []
        for (text,) in [req.args for req in requests]:
            total = 0.0
            windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            for context, scored in windows:
                ids = (list(context) + list(scored))[:-1]
                logits = self.llm.logits(ids)[-len(scored):].float()
                total += float(torch.log_softmax(logits, -1).gather(
                    -1, torch.tensor(scored, device=logits.device).view(-1, 1)).sum())
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return results

    def _stop_length(self, ids: list[int], until: list[str]) -> int:
        """Tokens of ``ids`` up to the first whose text so far, special tokens included, holds a
        stop string: where lm-eval's own ``hf`` model stops generating (its stop criterion
        decodes without skipping special tokens; the text it returns skips them). One decode
        when no stop string occurs (the common case); else one per token up to the stop."""
        if not any(stop in self.tok_decode(ids, skip_special_tokens=False) for stop in until):
            return len(ids)
        for n in range(1, len(ids) + 1):
            if any(stop in self.tok_decode(ids[:n], skip_special_tokens=False) for stop in until):
                return n
        return len(ids)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with ``do_sample``) completions cut at the first stop string,
        ``batch_size`` prompts per :meth:`sparda.LLM.generate` call, grouped by gen_kwargs."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        args = [req.args for req in requests]
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(repr(sorted(gen_kwargs.items())), []).append(i)
        out: list[str | None] = [None] * len(args)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(args[members[0]][1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if max_gen_toks >= self.max_length:
                raise SpardaError(f"max_gen_toks {max_gen_toks} must be below max_length {self.max_length}")
            temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
            top_p = float(kwargs.get("top_p") or 1.0)
            for start in range(0, len(members), self.batch_size):
                chunk = members[start:start + self.batch_size]
                prompts = [self.tok_encode(args[i][0], left_truncate_len=self.max_length - max_gen_toks)
                           for i in chunk]
                done = self.llm.generate([None] * len(chunk), prompt_token_ids=prompts, max_new_tokens=max_gen_toks,
                                         temperature=temperature, top_p=top_p)
                for i, completion in zip(chunk, done):
                    ids = completion.token_ids[:self._stop_length(completion.token_ids, until)]
                    text = postprocess_generated_text(self.tok_decode(ids), until, None)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", args[i], text)
        return out


def main() -> None:
    """lm-eval's CLI with ``--model sparda`` registered (``python -m sparda.lm_eval_model``)."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except SpardaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
