"""The ``sparda`` command line: one thin subcommand per public entry point.

Every subcommand parses, calls one library function and prints. A :class:`SpardaError`
becomes ``error: <message>`` on stderr and exit code 2, with no traceback.
"""

from __future__ import annotations

import json
import logging
import sys

import click

from sparda import __version__
from sparda.config import DEFAULT_KV_ADMISSION, GPU_SHARE, KV_ADMISSIONS, KV_DTYPES, METHODS, PRESETS, TRANSFERS, spell

#: ``--kv-dtype`` help of the commands that run one method
KV_DTYPE_HELP = ("KV-cache storage: bf16 (the model dtype), int8/int4 quantised per token and head, or mixed "
                 "(offloaded KV cache only: every block in int4 in host memory, plus bf16 copies of the hot blocks, "
                 "those in the local window or selected in the last --kv-hot-steps decode steps, at most "
                 "--kv-hot-blocks; a block that goes cold stays int4; a hot block's fetch moves its bf16 bytes, "
                 "a cold one's int4 bytes; design §6.1, docs/kv_quant.md) [default: bf16].")
from sparda.errors import SpardaError
from sparda.io import os_reason, read_text


# click >= 8.2 raises this for a bare `sparda`; older click prints the help itself
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class Bounded(click.ParamType):
    """An integer (or, ``number``, a float) in ``[lo, hi]``: out of range, one usage error in
    the project's words, ``--max-batch must be an integer >= 1, got 0``."""

    def __init__(self, lo, hi=None, number: bool = False) -> None:
        self.lo, self.hi, self.cast = lo, hi, float if number else int
        self.name = "number" if number else "integer"

    def convert(self, value, param, ctx):
        flag = param.opts[0] if param is not None and param.opts else "the value"
        bound = f">= {self.lo}" if self.hi is None else f"in [{self.lo}, {self.hi}]"
        try:
            out = value if isinstance(value, self.cast) and not isinstance(value, bool) else self.cast(str(value))
        except ValueError:
            out = None
        if out is None or out != out or out < self.lo or (self.hi is not None and out > self.hi):
            raise click.UsageError(f"{flag} must be {'a' if self.cast is float else 'an'} {self.name} {bound}, "
                                   f"got {value}", ctx)
        return out


class _Group(click.Group):
    """A click group that turns SpardaError, unreadable files and usage errors into one-line errors."""

    def main(self, *args, **kwargs):
        """Run the CLI; a usage error (unknown option, bad value) is one line and exit code 2."""
        kwargs.pop("standalone_mode", None)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _NO_ARGS_IS_HELP as exc:  # bare `sparda`: the help text, as click prints it
            click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message())
            sys.exit(0)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else "sparda"
            click.echo(f"error: {exc.format_message()} (see '{where} --help')", err=True)
            sys.exit(2)
        except click.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx):
        logging.getLogger("sparda").addFilter(_cli_spelling)  # notes name flags, as errors do
        try:
            return super().invoke(ctx)
        except SpardaError as exc:  # options named as flags (--kv-dtype), design: sparda.config.spell
            click.echo(f"error: {spell(getattr(exc, 'raw', None) or str(exc), 'cli')}", err=True)
            sys.exit(exc.exit_code)
        except OSError as exc:  # a file the command did not check itself: name it, no [Errno N]
            where = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"error: {where}{os_reason(exc)}", err=True)
            sys.exit(2)
        except UnicodeDecodeError:
            click.echo("error: an input file is not UTF-8 text; convert it, e.g. with iconv -t UTF-8", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        finally:
            logging.getLogger("sparda").removeFilter(_cli_spelling)


def _cli_spelling(record: logging.LogRecord) -> bool:
    """A logging filter: the ``sparda`` logger's notes with options spelt as flags."""
    record.msg = spell(record.getMessage(), "cli")
    record.args = ()
    return True


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sparda")
def main() -> None:
    """sparda: long-context LLM inference with SparDA (Sparse Decoupled Attention)."""


def _dense_heads_option(ctx, param, value):
    """``--dense-heads`` parsed before the model loads (a malformed value is a usage error)."""
    from sparda.attention.dense_heads import parse_dense_heads

    if value is None:
        return None
    try:
        parse_dense_heads(value)
    except SpardaError as exc:
        raise click.BadParameter(str(exc).replace("--dense-heads: ", "")) from None
    return value


def model_options(func):
    """Options shared by every subcommand that loads a model and picks a method."""
    options = [
        click.option("--model", default=None, help="HF model directory, .gguf file or ORG/NAME in the local HF cache [default: bundled SmolLM2-135M-Instruct]."),
        click.option("--method", default=None, metavar="|".join(METHODS),
                     help="Attention method [default: sparda where Forecast weights exist (the bundled "
                          "model, or --forecast), else sparse]."),
        click.option("--preset", default="small", show_default=True, metavar="|".join(PRESETS),
                     help="Selection budget preset (design §3)."),
        click.option("--topk-blocks", type=int, default=None, help="Scored blocks per KV head."),
        click.option("--local-blocks", type=int, default=None, help="Most recent blocks always kept (>= 1)."),
        click.option("--init-blocks", type=int, default=None, help="Attention-sink blocks always kept."),
        click.option("--block-size", type=int, default=None, help="Tokens per KV block."),
        click.option("--dense-len", type=int, default=None, help="Contexts shorter than this use dense attention."),
        click.option("--topp-mass", "topp_mass", type=float, default=None,
                     help="Decode: take scored blocks in score order until the visible blocks' mass reaches this "
                          "share, in (0, 1] (design §3.12; --topk-blocks stays the most) [default: fixed top-k]."),
        click.option("--min-blocks", "min_blocks", type=int, default=None,
                     help="--topp-mass: blocks per KV head at least, forced ones included [default: init + local]."),
        click.option("--device", default=None, help="cpu or cuda[:N] [default: cuda if available]."),
        click.option("--dtype", default=None, help="float32, bfloat16 or float16 [default: bf16 on CUDA, fp32 on CPU]."),
        click.option("--offload/--no-offload", default=None,
                     help="Keep the full KV cache in host memory, selected blocks on the device (design §6; "
                          "methods sparse, sparda and shallow) [default: on for sparda on CUDA, off otherwise; "
                          "sparse-offload and sparda-no-prefetch always offload]."),
        click.option("--forecast", default=None,
                     help="Forecast weights (.safetensors) for method sparda [default: shipped for the bundled model]."),
        click.option("--lookahead", type=int, default=None,
                     help="Offloaded sparda: 2 also copies layer l+2's predicted blocks during layer l, from a "
                          "two-ahead Forecast (design §6.2); the selection stays the one-layer Forecast's [default: 1]."),
        click.option("--forecast2", default=None,
                     help="--lookahead 2: two-ahead Forecast weights (`sparda train-forecast --lookahead 2`) "
                          "[default: shipped for the bundled model]."),
        click.option("--kv-dtype", "kv_dtype", default=None, metavar="|".join(KV_DTYPES),
                     help=KV_DTYPE_HELP),
        click.option("--transfer", default=None, metavar="|".join(TRANSFERS),
                     help="Offloaded cache: the host-to-GPU copy engine (design §6) [default: auto, uva on CUDA]."),
        click.option("--kv-hot-blocks", "kv_hot_blocks", type=int, default=None,
                     help="--kv-dtype mixed: bf16 copies kept per layer, sequence and KV head (the hot pool; at "
                          "least --local-blocks) [default: the budget, init + local + top-k blocks]."),
        click.option("--kv-hot-steps", "kv_hot_steps", type=int, default=None,
                     help="--kv-dtype mixed: decode steps a block stays bf16 after it was last selected or in "
                          "the local window [default: 4]."),
        click.option("--sparse-prefill/--dense-prefill", "sparse_prefill", default=None,
                     help="Block-sparse methods: select blocks in prefill too, or prefill densely and "
                          "select in decode only [default: dense at --preset small, block-sparse at paper]."),
        click.option("--slot-factor", "slot_factor", type=float, default=None,
                     help="Offloaded cache: GPU slots per block of the widest selection (dense-fallback prefix "
                          "included); the spare ones keep blocks that left the selection, so one that returns "
                          "is not copied again (design §6) [default: 1.5]."),
        click.option("--cpu-threads", "cpu_threads", type=int, default=None,
                     help="CPU runs: torch threads [default: the idle cores, from the load average; "
                          "OMP_NUM_THREADS if set]."),
        click.option("--eager", is_flag=True, default=False,
                     help="CUDA: run decode steps eagerly instead of replaying CUDA graphs (docs/cuda_graphs.md)."),
        click.option("--cuda-graph-sizes", "cuda_graph_sizes", default=None, metavar="auto|N,N,...",
                     help="Decode batch buckets (design §3.13): a decode step runs the first N KV rows, N the "
                          "smallest bucket holding every decoding request, one CUDA graph per bucket; auto: 1,2,4 "
                          "and the multiples of 8; a list is capped to and always includes the batch (serve: --max-batch) "
                          "[default: one bucket of all rows, every step runs every row, bit-identical alone or batched; "
                          "auto is faster when few rows decode, design §3.13]."),
        click.option("--dense-heads", "dense_heads", default=None,
                     help="Block-sparse decode: (layer, KV head) pairs that read every visible block "
                          "(design §3.7; offloaded caches keep their layers on the device): auto (the model's "
                          "calibration, `sparda calibrate-heads`; none if it has none), none, or L:H,... "
                          "e.g. 7:2,18:2 [default: auto]."),
        click.option("--shallow-layers", type=int, default=None,
                     help="Method shallow: dense layers N whose attention picks the deeper layers' blocks "
                          "[default: the model's calibration, `sparda calibrate-shallow`, else 3]."),
        click.option("--shallow-select-once", is_flag=True, default=False,
                     help="Method shallow: select once at the end of prefill instead of every step (EMA)."),
        click.option("--quest-page-size", type=int, default=None,
                     help="Method quest: tokens per page of key bounds (divides --block-size) [default: 16]."),
        click.option("--prefill-chunk", type=int, default=None,
                          help="Prompt tokens per prefill chunk (bounds prefill memory; same output) [default: 8192; "
                               "0: the whole prompt at once]."),
        click.option("--snapkv-window", type=int, default=None,
                     help="Method snapkv: prompt queries in the observation window [default: 32]."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def build_llm(model, method, preset, topk_blocks, local_blocks, init_blocks, block_size, dense_len,
              device, dtype, eager=False, **extra):
    """Construct :class:`sparda.LLM` from CLI options, every option checked before the model
    loads (:func:`sparda.config.build_config`); a progress line goes to stderr."""
    from sparda.config import build_config
    from sparda.engine.llm import LLM

    extra["prefill_chunk_tokens"] = extra.pop("prefill_chunk", None)
    options = dict(topk_blocks=topk_blocks, local_blocks=local_blocks, init_blocks=init_blocks, block_size=block_size,
                   dense_len=dense_len, cuda_graphs=False if eager else None, **extra)
    options = {key: value for key, value in options.items() if value is not None}
    build_config(method=method, preset=preset, device=device, dtype=dtype, **options)
    from sparda.model.loader import locate_model

    locate_model(model)  # a missing path or cache entry: one error line, before "loading"
    click.echo(f"loading {model or 'bundled SmolLM2-135M-Instruct'} (method {method or 'default: sparda if Forecast weights exist, else sparse'})...", err=True)
    llm = LLM(model, method=method, preset=preset, device=device, dtype=dtype, **options)
    click.echo(f"method {llm.config.method} on {llm.device} ({str(llm.dtype).replace('torch.', '')}), "
               f"KV cache {'offloaded to host memory' if llm.model_runner.offloaded else 'on the device'}", err=True)
    return llm


def stats_line(stats: dict) -> str:
    """The one-line summary printed after a completion."""
    return (f"[prompt {stats['prompt_tokens']} tok | new {stats['new_tokens']} tok | "
            f"prefill {stats['prefill_ms']:.0f} ms"
            + (f" (batch of {stats['prefill_batch']} prompts)" if stats.get("prefill_batch", 1) > 1 else "")
            + f" | decode {stats['decode_tok_s']:.1f} tok/s | "
            f"KV cache {stats['kv_cache_bytes'] / 2**20:.1f} MiB | "
            f"KV blocks read/step {stats['kv_read_fraction']:.1%}"
            + _offload_part(stats.get("offload")) + "]")


def _offload_part(offload: dict | None) -> str:
    """The offload summary: the hit rate only where blocks were fetched (a dense-fallback or
    one-token request fetches none, and 0 % would read as all misses)."""
    if not offload:
        return ""
    if not offload.get("hits", 0) + offload.get("misses", 0):
        return " | offload: no block fetched (dense fallback or too few decode steps)"
    return (f" | offload hit rate {offload['hit_rate']:.1%}, "
            f"{offload['bytes_per_token'] / 2**20:.2f} MiB copied/token")


def _read_prompts(prompt: tuple[str, ...], prompt_file: tuple[str, ...]) -> list[str]:
    prompts = list(prompt)
    for path in prompt_file:
        prompts.append(read_text(path, "--prompt-file"))
    if not prompts:
        if sys.stdin is None or sys.stdin.isatty():
            raise SpardaError("no prompt given; use --prompt TEXT, --prompt-file FILE or pipe text on stdin")
        prompts.append(sys.stdin.read())
    return prompts


@main.command()
@model_options
@click.option("--prompt", "-p", multiple=True, help="Prompt text (repeatable: prompts batch together).")
@click.option("--prompt-file", "-f", multiple=True, help="File holding one prompt (repeatable).")
@click.option("--max-new-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap prompts in the chat template.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the sampling generator.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt.")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Text output: print tokens as they come (prompts still decode together).")
@click.argument("words", nargs=-1, metavar="[PROMPT]")
def generate(words, prompt, prompt_file, max_new_tokens, temperature, top_p, chat, ignore_eos, seed, as_json,
             stream, **opts):
    """Generate completions for one or more prompts: PROMPT (its words joined by spaces), -p
    and -f (repeatable), else stdin."""
    from sparda.engine.validate import check_prompts, check_sampling

    check_sampling(max_new_tokens, temperature, top_p, seed)  # model-free checks first
    prompts = check_prompts(_read_prompts(((" ".join(words),) if words else ()) + prompt, prompt_file))
    if stream and not as_json:
        params = _cli_sampling_params(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                      ignore_eos=ignore_eos, seed=seed)
        llm = build_llm(**opts)
        _print_stream(llm.generate_stream(prompts, params, chat=chat), len(prompts))
        return
    llm = build_llm(offload_timing=as_json, **opts)
    results = llm.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=top_p, chat=chat, ignore_eos=ignore_eos, seed=seed)
    for result in results:
        if as_json:
            click.echo(json.dumps({"text": result.text, "token_ids": result.token_ids,
                                   "finish_reason": result.finish_reason, "stats": result.stats}))
        else:
            click.echo(result.text)
            click.echo(stats_line(result.stats))


_CLI_NAMES = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p"}


def _cli_sampling_params(**fields):
    """SamplingParams from CLI options; errors name the option (checked before the model loads)."""
    from sparda.engine.sampling_params import SamplingParams

    try:
        return SamplingParams(**fields)
    except SpardaError as exc:
        message = str(exc).replace("SamplingParams.", "")
        name = message.split(" ", 1)[0]
        raise SpardaError(message.replace(name, _CLI_NAMES.get(name, name), 1)) from None


def _print_stream(deltas, count: int) -> None:
    """Print streamed completions in prompt order: the first unfinished one live, the
    others as soon as their turn comes; a stats line after each."""
    pending, done, current = [[] for _ in range(count)], [None] * count, 0
    for index, delta in deltas:
        pending[index].append(delta.text)
        done[index] = delta.output or done[index]
        while current < count:
            text, pending[current] = "".join(pending[current]), []
            if text:
                click.echo(text, nl=False)
            if done[current] is None:
                break
            click.echo()
            click.echo(stats_line(done[current].stats))
            current += 1


def served_name(model: str | None, model_dir) -> str:
    """The name ``sparda serve`` publishes by default: ``ORG/NAME`` as given for a model from
    the Hugging Face cache (not its snapshot's commit hash), else the model's display name
    (:func:`~sparda.attention.forecast.model_name`: the bundled model's, a GGUF's stem, a
    directory's name)."""
    from pathlib import Path

    from sparda.attention.forecast import model_name
    from sparda.model.loader import is_repo_id

    if model is not None and is_repo_id(str(model)) and not Path(model).expanduser().exists():
        return str(model)
    return model_name(model_dir) or (str(model) if model else "sparda")


@main.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, type=Bounded(0, 65535), help="TCP port (0: a free one).")
@click.option("--max-batch", default=8, show_default=True, type=Bounded(1),
              help="KV-cache rows: requests decoding together.")
@click.option("--max-model-len", default=None, type=Bounded(2),
              help="Tokens per row, prompt + new tokens of one request [default: the model's context].")
@click.option("--max-waiting", default=256, show_default=True, type=Bounded(0),
              help="Requests that may queue for a row before 429.")
@click.option("--gpu-memory-utilization", default=GPU_SHARE, show_default=True, type=float,
              help="Share of the GPU's memory for weights, activations and KV pool: fewer than --max-batch rows "
                   "when it holds fewer (design §3.11).")
@click.option("--host-memory-gib", default=None, type=float,
              help="Host memory for the KV pool (the host store of an offloaded cache; on the CPU the whole "
                   "cache) [default: 90% of what is available at start-up].")
@click.option("--kv-admission", default=DEFAULT_KV_ADMISSION, show_default=True, type=click.Choice(KV_ADMISSIONS),
              help="How a paged KV pool (offloaded, host budget below every row whole) gives requests blocks: "
                   "grow on demand and preempt the newest request (recompute) when it runs out, or reserve "
                   "prompt + max_tokens at admission (design §3.11).")
@click.option("--max-num-batched-tokens", default=None, type=Bounded(1),
              help="Tokens per engine step: one per decoding request, the rest prefill chunks of "
                   "--prefill-chunk tokens, at least one chunk (design §3.9) [default: --prefill-chunk + "
                   "--max-batch, a whole chunk beside every decoding request].")
@click.option("--served-model-name", default=None,
              help="Name clients pass as 'model' [default: ORG/NAME as given, else the model's name].")
@click.option("--drain-timeout", default=30.0, show_default=True, type=Bounded(0, number=True),
              help="Seconds running requests get to finish after SIGINT/SIGTERM.")
@click.option("--max-request-bytes", default=16 * 2**20, show_default=True, type=Bounded(1),
              help="Largest request body accepted; larger ones get 413.")
@click.option("--api-key", envvar="SPARDA_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' (401 otherwise) [default: no key].")
@click.option("--protect-health-metrics", is_flag=True, default=False,
              help="With --api-key, /health and /metrics need the key too [default: they are open].")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]), help="uvicorn's log level.")
def serve(host, port, max_batch, max_model_len, max_waiting, gpu_memory_utilization, host_memory_gib,
          kv_admission, max_num_batched_tokens, served_model_name, drain_timeout, max_request_bytes, api_key, protect_health_metrics,
          log_level, **opts):
    """Serve the model over an OpenAI-compatible HTTP API (docs/serving.md)."""
    from sparda.engine.engine import Engine, check_max_model_len
    from sparda.engine.memory import check_budgets
    from sparda.model.loader import context_length
    from sparda.server.app import bind_socket, exposure_warning, serve as run_server

    if api_key is not None and not api_key.strip():
        raise SpardaError("--api-key is empty; pass a key, or leave it (and SPARDA_API_KEY) unset for none")
    if protect_health_metrics and api_key is None:
        raise SpardaError("--protect-health-metrics needs --api-key (or SPARDA_API_KEY)")
    check_budgets(gpu_memory_utilization, host_memory_gib)
    if max_model_len is not None:  # against the model's config, before any weights load
        check_max_model_len(max_model_len, context_length(opts.get("model")))
    sock = bind_socket(host, port)  # a busy port fails before the model loads
    warning = exposure_warning(sock.getsockname()[0], api_key)
    if warning:
        click.echo(warning, err=True)
    llm = build_llm(**opts)
    engine = Engine(llm, max_batch=max_batch, max_model_len=max_model_len, max_waiting=max_waiting,
                    max_prefill_tokens=max_num_batched_tokens or (llm.config.runtime.prefill_chunk_tokens or 8192)
                    + max_batch,
                    gpu_memory_utilization=gpu_memory_utilization, host_memory_gib=host_memory_gib,
                    kv_admission=kv_admission)
    name = served_model_name or served_name(opts["model"], llm.model_dir)
    bound_host, bound_port = sock.getsockname()[:2]
    pool = engine.memory_plan.line()
    if engine.scheduler.block_pool is not None:  # paged: say how requests take blocks (design §3.11)
        pool += "; blocks grow on demand, preempted by recompute" if engine.scheduler.grows else \
            "; blocks reserved for prompt + max_tokens"
    run_server(engine, name, sock, drain_timeout_s=drain_timeout, log_level=log_level,
               max_request_bytes=max_request_bytes, api_key=api_key, protect_health_metrics=protect_health_metrics,
               banner=f"serving {name} on http://{bound_host}:{bound_port}/v1 ({pool})")


#: smallest demo haystack (tokens) that holds the pass key, its filler and the question
_DEMO_MIN_TOKENS = 128
#: tokens the needle, the question and the chat template add to the haystack, at most
_DEMO_EXTRA_TOKENS = 96


@main.command()
@model_options
@click.option("--context-tokens", default=7000, show_default=True, type=int, help="Haystack length.")
@click.option("--depth", default=0.5, show_default=True, type=float, help="Needle depth, 0 (start) to 1 (end).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--max-new-tokens", default=24, show_default=True, type=int)
def demo(context_tokens, depth, seed, max_new_tokens, **opts):
    """Hide a pass key in ~7K tokens of Jane Austen's Emma and ask the model for it."""
    from sparda.data import heldout_text
    from sparda.engine.validate import check_sampling
    from sparda.eval.tasks.passkey import make_passkey, passkey_correct
    from sparda.model.loader import context_length

    check_sampling(max_new_tokens, 0.0, 1.0, seed)
    if not 0 <= depth <= 1:
        raise SpardaError(f"--depth must lie in [0, 1] (0 is the start of the haystack), got {depth}")
    if context_tokens < _DEMO_MIN_TOKENS:
        raise SpardaError(f"--context-tokens {context_tokens} leaves no room for the haystack; "
                          f"use at least {_DEMO_MIN_TOKENS}")
    limit = context_length(opts.get("model"))
    if limit is not None and context_tokens + max_new_tokens + _DEMO_EXTRA_TOKENS > limit:
        raise SpardaError(f"--context-tokens {context_tokens} does not fit the model's context of {limit} tokens "
                          f"(with the question, the chat template and {max_new_tokens} new tokens); use --context-tokens "
                          f"{limit - max_new_tokens - _DEMO_EXTRA_TOKENS} or less")
    llm = build_llm(**opts)
    sample = make_passkey(llm.tokenizer, heldout_text(), context_tokens, depth, seed)
    click.echo(f"pass key {sample.answer} hidden at depth {depth:.0%} of {context_tokens} tokens of 'Emma'", err=True)
    result = llm.generate([sample.prompt], max_new_tokens=max_new_tokens)[0]
    verdict = "correct" if passkey_correct(sample, result.text) else "WRONG"
    click.echo(f"answer: {result.text.strip()}")
    click.echo(f"expected: {sample.answer} ({verdict})")
    prefill = "block-sparse" if llm.config.sparse_prefill and llm.config.method != "dense" else "dense"
    click.echo(f"method: {llm.config.method} | prefill: {prefill} | decode: {llm.config.method}")
    click.echo(stats_line(result.stats))


def _csv(kind):
    def parse(ctx, param, value):
        try:
            return tuple(kind(v) for v in value.split(",") if v.strip()) if value else None
        except ValueError as exc:
            raise click.BadParameter(f"expected comma-separated {kind.__name__} values") from exc
    return parse


@main.command("eval")
@click.option("--tasks", callback=_csv(str), help="Comma-separated tasks (passkey, passkey-synth, niah-single, "
              "niah-single-synth, niah-multikey, niah-multivalue, niah-multiquery, vt, cwe, fwe, ppl, ppl-decode, selection).")
@click.option("--methods", callback=_csv(str), help="Comma-separated registered methods [default: all; --quick: dense,sparse,oracle,sparda].")
@click.option("--lengths", callback=_csv(int), help="Comma-separated prompt lengths in tokens.")
@click.option("--samples", type=int, default=None, help="Samples per task and length.")
@click.option("--budgets", callback=_csv(float), help="KV budgets in % of the context for non-dense methods.")
@click.option("--topp-mass", "topp_mass", callback=_csv(float),
              help="Comma-separated top-p masses in (0, 1]: the methods with a mass-adaptive decode budget "
                   "(sparse, oracle, sparda...) also run at each, labelled METHOD@pP (design §3.12).")
@click.option("--min-blocks", "min_blocks", type=int, default=None,
              help="--topp-mass: blocks per KV head at least, forced ones included [default: init + local].")
@click.option("--lookahead", callback=_csv(int),
              help="Comma-separated lookaheads (1, 2): method sparda also runs offloaded at each, labelled "
                   "sparda@laN and paired with sparda@la1 (design §6.2).")
@click.option("--forecast", default=None,
              help="Forecast weights (.safetensors) of the sparda methods [default: shipped for the bundled model].")
@click.option("--forecast2", default=None,
              help="--lookahead 2: two-ahead Forecast weights [default: shipped for the bundled model].")
@click.option("--depths", callback=_csv(float), help="Needle depths 0-1, cycled over samples.")
@click.option("--ppl-windows", type=int, default=None, help="Held-out text windows per length for ppl and ppl-decode.")
@click.option("--decode-tokens", type=int, default=None,
              help="Last tokens of each ppl-decode window fed one decode step at a time, against dense "
                   "[default: 256].")
@click.option("--out", required=True, help="Output directory (rerun with the same one to resume).")
@click.option("--quick", is_flag=True, help="CPU-sized subset (2.5K tokens, 2 samples, < 10 min on 2 cores).")
@click.option("--text", default=None, help="UTF-8 text file for haystacks and ppl [default: held-out Emma].")
@click.option("--model", default=None, help="HF model directory, .gguf file or ORG/NAME in the local HF cache [default: bundled model].")
@click.option("--preset", default="small", show_default=True, type=click.Choice(list(PRESETS)))
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default=None)
@click.option("--kv-dtype", "kv_dtype", default=None, type=click.Choice(KV_DTYPES),
              help="KV-cache storage of every method: bf16 (the model dtype), int8 or int4 (docs/kv_quant.md), "
                   "or mixed (offloaded methods only, so pass --methods of those, e.g. "
                   "sparse-offload,sparda-no-prefetch; design §6.1) [default: bf16].")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--dense-heads", "dense_heads", default=None, callback=_dense_heads_option,
              help="Retrieval heads kept dense in decode by every block-sparse method (design §3.7): auto "
                   "(the model's calibration), none, or L:H,... [default: auto].")
@click.option("--sparse-prefill/--dense-prefill", "sparse_prefill", default=None,
              help="Block-sparse methods in the generation tasks: select in prefill too, or prefill densely "
                   "and select in decode only [default: dense at --preset small, block-sparse at paper]; "
                   "ppl always scores block-sparse prefill logits.")
@click.option("--batch-size", type=int, default=None,
              help="Samples of one task and length per generate call [default: 16 on CUDA, 4 on the CPU]; "
                   "changes no result.")
@click.option("--time-budget-s", type=float, default=None,
              help="Start no new batch after this many seconds (model load included); rerun to resume.")
def eval_cmd(time_budget_s=None, **opts):
    """Accuracy, perplexity/agreement and KV reads of every method (resumable; design §8)."""
    from sparda.eval.runner import plan_from_options, run_eval

    plan = plan_from_options(**opts)
    summary = run_eval(plan, time_budget_s=time_budget_s)
    click.echo(json.dumps(summary, indent=1))
    progress = _read_json(f"{plan.out}/progress.json")
    if progress and not progress.get("complete"):
        click.echo(f"stopped ({progress.get('stopped')}) after {progress['done']} of {progress['planned']} records; "
                   "rerun the same command to resume", err=True)
    click.echo(f"wrote {plan.out}/report.md, summary.json, results.jsonl and plots", err=True)


def _read_json(path: str):
    """A JSON file's content, or ``None`` if it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


@main.command("train-forecast")
@click.option("--model", default=None, help="HF model directory, .gguf file or ORG/NAME in the local HF cache [default: bundled SmolLM2-135M-Instruct].")
@click.option("--data", multiple=True, help="Text, jsonl or parquet file, directory of them, or a Hugging Face "
              "datasets directory (save_to_disk) (repeatable) [default: bundled training split].")
@click.option("--text-column", default="text", show_default=True,
              help="Text field of jsonl, parquet and datasets inputs.")
@click.option("--seq-len", default=4096, show_default=True, type=int, help="Tokens per training sequence.")
@click.option("--steps", default=200, show_default=True, type=int,
              help="Total optimiser steps (--resume continues up to it).")
@click.option("--batch-size", default=1, show_default=True, type=int,
              help="Sequences per step (one at a time, gradients accumulated).")
@click.option("--lr", default=5e-4, show_default=True, type=float, help="AdamW learning rate (constant).")
@click.option("--queries", default=256, show_default=True, type=int,
              help="Loss query tokens per sequence (seeded, past max(dense_len, budget)).")
@click.option("--frozen-attention", default="dense", show_default=True, type=click.Choice(["dense", "sparse"]),
              help="Attention of the frozen model: dense, or block-sparse over the blocks each layer's own "
                   "queries select (design §5).")
@click.option("--init", default="q", show_default=True, type=click.Choice(["q", "random"]), help="Initial weights.")
@click.option("--lookahead", default=1, show_default=True, type=Bounded(1, 2),
              help="1: the Forecast (layer l scores layer l+1); 2: the two-ahead heads of --lookahead 2 "
                   "(layer l scores layer l+2, design §6.2), a weight file for --forecast2.")
@click.option("--preset", default="small", show_default=True, type=click.Choice(list(PRESETS)))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out", required=True, help="Output .safetensors file.")
@click.option("--resume", is_flag=True, help="Continue from OUT.state.pt (same settings; bit-exact).")
@click.option("--device", default=None, help="cpu or cuda[:N] [default: cuda if available].")
@click.option("--save-every", default=50, show_default=True, type=int,
              help="Checkpoint period in steps (also at the end and on Ctrl-C).")
@click.option("--nproc", default=1, show_default=True, type=Bounded(1),
              help="Data-parallel processes (GPUs): starts torchrun; --batch-size is the global batch.")
def train_forecast_cmd(model, data, out, nproc, **opts):
    """Train Forecast weights with the base model frozen (design §5; recipe: docs/forecast.md)."""
    from sparda.training.distributed import Distributed
    from sparda.training.trainer import train_forecast

    if nproc > 1:
        sys.exit(_launch_torchrun(click.get_current_context(), nproc, model, data, out, opts))
    dist = Distributed.from_env(opts.get("device"))
    try:
        result = train_forecast(model, list(data) or None, out=out, dist=dist, **opts)
    finally:
        if dist is not None:
            dist.close()
    if dist is None or dist.rank == 0:
        click.echo(json.dumps({"out": out, **result, **({"ranks": dist.world_size} if dist else {})}))


def _launch_torchrun(ctx, nproc: int, model, data, out: str, opts: dict) -> int:
    """Rerun this train-forecast command under ``torchrun --standalone --nproc-per-node N``
    (issue #17) once every model-free check passed here. Returns the exit code."""
    import subprocess

    from sparda.training.trainer import preflight

    keys = ("seq_len", "steps", "batch_size", "queries", "save_every", "lr", "init", "frozen_attention",
            "preset", "resume", "text_column")
    preflight(model, list(data) or None, out=out, selection=None, ranks=nproc, **{k: opts[k] for k in keys})
    args = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name == "nproc" or value is None or value == () or not isinstance(param, click.Option):
            continue
        flag = param.opts[0]
        if param.is_flag:
            args += [flag] if value else []
        else:
            args += [item for v in (value if param.multiple else (value,)) for item in (flag, str(v))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "sparda.cli", "train-forecast", *args]
    code = subprocess.call(cmd)
    if code:
        click.echo(f"error: a training process failed (exit code {code}); its error is printed above", err=True)
        return 2 if code != 130 else 130
    return 0


@main.command("selection-report")
@click.option("--model", default=None, help="HF model directory, .gguf file or ORG/NAME in the local HF cache [default: bundled].")
@click.option("--text", default=None, help="UTF-8 text file [default: the held-out Emma].")
@click.option("--methods", default="sparse,oracle,sparda,sparda-random,infinigen", show_default=True,
              help="Comma-separated selectors.")
@click.option("--lengths", default="4096,8192", show_default=True, callback=_csv(int),
              help="Comma-separated context lengths (tokens).")
@click.option("--queries", default=64, show_default=True, type=int, help="Query tokens scored per length.")
@click.option("--preset", default="small", show_default=True, type=click.Choice(list(PRESETS)))
@click.option("--forecast", default=None, help="Forecast weights [default: shipped for the bundled model].")
@click.option("--forecast2", default=None,
              help="Two-ahead Forecast weights of selector sparda-lookahead2 (design §6.2) [default: shipped].")
@click.option("--device", default=None, help="cpu or cuda[:N].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object keyed by method.")
def selection_report_cmd(model, text, methods, lengths, queries, preset, forecast, forecast2, device, as_json):
    """Per-layer selection recall of each method vs the query-based and oracle top-k (design §8)."""
    from sparda.eval.selection import format_report, selection_report

    report = selection_report(model, text, [m.strip() for m in methods.split(",") if m.strip()],
                              list(lengths), queries=queries,
                              preset=preset, forecast=forecast, device=device, forecast2=forecast2)
    click.echo(json.dumps(report, indent=1) if as_json else format_report(report))


@main.command("calibrate-shallow")
@click.option("--model", default=None, help="HF model directory, .gguf file or ORG/NAME in the local HF cache [default: bundled].")
@click.option("--text", default=None, help="UTF-8 text file [default: the held-out Emma].")
@click.option("--length", default=4096, show_default=True, type=int, help="Context tokens of the window.")
@click.option("--queries", default=64, show_default=True, type=int, help="Query tokens scored.")
@click.option("--candidates", default="2,3,4", show_default=True, callback=_csv(int),
              help="Numbers of dense shallow layers to choose from.")
@click.option("--preset", default="small", show_default=True, type=click.Choice(list(PRESETS)))
@click.option("--out", default=None, help="Output JSON [default: sparda_shallow.json in the model directory, used by --method shallow].")
@click.option("--device", default=None, help="cpu or cuda[:N].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def calibrate_shallow_cmd(model, text, length, queries, candidates, preset, out, device, as_json):
    """Pick method shallow's dense layers N by the IoU of their top-k with the deep layers' (design §7)."""
    from sparda.eval.shallow_calibration import calibrate_shallow, format_calibration

    result = calibrate_shallow(model, text, length=length, queries=queries, candidates=list(candidates),
                               preset=preset, device=device, out=out)
    click.echo(json.dumps(result, indent=1) if as_json else format_calibration(result))


@main.command("calibrate-heads")
@click.option("--model", default=None, help="HF model directory, .gguf file or ORG/NAME in the local HF cache [default: bundled].")
@click.option("--prompts", default=12, show_default=True, type=int, help="Needle prompts (training split of the bundled text).")
@click.option("--lengths", default="4096,6144", show_default=True, callback=_csv(int),
              help="Shortest,longest prompt tokens (spread over the prompts).")
@click.option("--tasks", default="passkey,niah-single", show_default=True, callback=_csv(str),
              help="Comma-separated needle tasks (passkey, passkey-synth, niah-*).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the prompts and depths.")
@click.option("--coverage", default=0.9, show_default=True, type=float,
              help="Share of the summed lost needle mass the chosen heads must hold.")
@click.option("--max-heads", default=None, type=int, help="At most this many heads [default: ceil(3 % of the KV heads)].")
@click.option("--min-share", default=0.03, show_default=True, type=float,
              help="Skip heads losing less than this share of the top head's loss.")
@click.option("--preset", default="small", show_default=True, type=click.Choice(list(PRESETS)))
@click.option("--out", default=None, help="Output JSON [default: sparda_dense_heads.json in the model directory, used by --dense-heads auto].")
@click.option("--device", default=None, help="cpu or cuda[:N].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def calibrate_heads_cmd(model, prompts, lengths, tasks, seed, coverage, max_heads, min_share, preset, out, device,
                        as_json):
    """Pick the retrieval heads that the sparse selection blinds, to keep dense in decode (design §3.7)."""
    from sparda.eval.head_calibration import calibrate_heads, format_calibration

    result = calibrate_heads(model, prompts=prompts, lengths=list(lengths), tasks=list(tasks), seed=seed,
                             coverage=coverage, max_heads=max_heads, min_share=min_share, preset=preset,
                             device=device, out=out)
    click.echo(json.dumps(result, indent=1) if as_json else format_calibration(result))


@main.command("bench")
@click.option("--models", default=None, help="Comma list of llama-8b, minicpm-8b, bundled, tiny [default: llama-8b].")
@click.option("--methods", default=None, help="Comma list [default: dense,sparse,sparse-offload,infinigen,sparda-no-prefetch,sparda; "
              "also streaming,h2o,quest,snapkv,shallow].")
@click.option("--contexts", default=None, help="Comma list of context lengths in tokens [default: 32768].")
@click.option("--batches", default=None, help="Comma list of batch sizes [default: 1,4,8,16,32,64].")
@click.option("--decode-steps", type=int, default=None, help="Timed decode steps per repeat [default: 16].")
@click.option("--repeats", type=int, default=None, help="Timed repeats; the median is reported [default: 3].")
@click.option("--prefill-tokens", type=int, default=None, help="Prefill is timed on min(context, this) tokens [default: 16384].")
@click.option("--out", default=None, help="Output directory: results.json, report.md, plots [default: bench-out].")
@click.option("--device", default=None, help="cpu or cuda[:N] [default: cuda if available].")
@click.option("--gpu-mem-gb", type=float, default=None, help="Cap this process's GPU memory (GiB).")
@click.option("--host-mem-gb", type=float, default=None, help="Cap the host KV cache (GiB) [default: 90% of free memory].")
@click.option("--trace", default=None, help="Selection trace (.npz) replayed by offloaded methods; 'none': native selection [default: shipped].")
@click.option("--time-budget-s", type=float, default=None, help="Points after this many seconds are recorded as skipped.")
@click.option("--hit-rate", "hit_rates", default=None, help="Comma list in [0,1]: offloaded methods also run a synthetic selection keeping this fraction of the previous step's top-k blocks (records carry target_hit_rate).")
@click.option("--eager", is_flag=True, default=None, help="CUDA: eager decode steps instead of CUDA-graph replay.")
@click.option("--kv-dtype", "kv_dtype", default=None, type=click.Choice(KV_DTYPES),
              help="KV-cache storage of every point: bf16 (the model dtype), int8/int4 quantised per token and "
                   "head (docs/kv_quant.md), or mixed (int4 host store plus bf16 hot blocks, design §6.1: offloaded "
                   "methods only, the others' points are recorded skipped); records carry kv_dtype, memory checks "
                   "count its bytes [default: bf16].")
@click.option("--slot-factor", "slot_factor", type=float, default=None,
              help="Offloaded methods: GPU slots per block of the widest selection (design §6); records carry "
                   "slot_factor [default: 1.5].")
@click.option("--lookahead", "lookaheads", default=None,
              help="Comma list of 1, 2: offloaded sparda runs once per value; 2 also copies layer l+2's predicted "
                   "blocks during layer l (design §6.2) [default: 1].")
@click.option("--lookahead-recall", type=float, default=None,
              help="--lookahead 2 on a replayed selection: model the two-ahead predictions, holding this share of "
                   "its free top-k blocks, the rest random (docs/bench.md) [default: a trace's recorded predictions; "
                   "0.79, measured on the bundled model, for a synthetic selection or a trace without them].")
@click.option("--quick", is_flag=True, help="CPU smoke run: tiny model, contexts 1K/2K, batches 1-2, few steps.")
@click.option("--record-trace", default=None, help="Record a selection trace of the bundled model on Emma to this file and exit.")
def bench_cmd(quick, record_trace, **opts):
    """Decode/prefill throughput of every method with a per-component breakdown (docs/bench.md)."""
    from sparda.bench import sweep, traces
    from sparda.io import check_output_file

    if record_trace:
        check_output_file(record_trace, "--record-trace", "trace.npz")  # before the minutes of recording
        recorded = traces.record_traces(device=opts.get("device") or "cpu")
        traces.save_traces(record_trace, recorded)
        click.echo(json.dumps({"trace": record_trace, **{k: traces.reuse_stats(v) for k, v in recorded.items()}}))
        return
    cfg = sweep.config_from_options(quick=quick, **opts)
    records = sweep.run_sweep(cfg, log=lambda line: click.echo(line, err=True))
    ok = sum(r["status"] == "ok" for r in records)
    click.echo(json.dumps({"out": cfg.out, "points": len(records), "ok": ok,
                           "oom": sum(r["status"] == "oom" for r in records)}))


if __name__ == "__main__":  # pragma: no cover
    main()
