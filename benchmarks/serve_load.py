"""``bench_serve.py load``: ``sparda serve`` under open- and closed-loop load (the serving sweep).

One server per configuration (``method`` or ``method:kv_dtype``), started as a child process
on a free loopback port over a random-weight model shape (``sparda.bench.models``; decoded
text through the bundled tokenizer, token ids modulo its vocabulary) or the bundled model
itself, then, against that one server, each load point in turn:

* ``poisson``: requests arrive for ``--duration`` seconds as a Poisson process of each
  ``--rates`` value (requests/s); the point ends when every request has finished or
  ``--drain`` more seconds have passed (what is still open then counts as lost);
* ``closed``: ``--concurrency`` clients, each sending its next request when the last ends,
  for ``--duration`` seconds (then drained likewise);
* ``overload`` (``--overload FACTOR``, last): Poisson arrivals at ``FACTOR`` times the
  saturation rate (the highest ``requests_per_s`` of the configuration's closed points) for
  ``--overload-duration`` (or ``--duration``) seconds; its record adds ``overload_factor``,
  ``saturation_rps``, ``duration_s``,
  ``idle_gpu_mem_gib_before`` / ``idle_host_rss_gib_before`` (the server idle before it),
  ``idle_after`` (idle again within ``--drain`` s), ``idle_gpu_mem_gib_after`` /
  ``idle_host_rss_gib_after`` and ``served_after`` (one more request completes).

Prompts are random token ids whose lengths are drawn log-uniformly from ``--prompt-tokens``
(``lo,hi``); outputs are ``--output-tokens`` (``lo,hi``, uniform) tokens, EOS ignored, greedy.
With ``--replay-trace [PATH]`` (offloaded configurations only; without PATH the shipped trace)
each decoding row of the server fetches and attends a replay of the selection trace instead of
what the random model selects, as ``sparda bench`` replays it (docs/bench.md, Trace replay in the
server benchmark), so that the two carry the same selection traffic; ``--replay-keys order``
makes the ``n``-th request to start decoding replay bench row ``n``, so that ``B`` requests of
one length carry exactly the rows of ``sparda bench`` at batch ``B`` (the engine-overhead point).

Per point, one JSON record (``records`` in ``OUT/serve_load.json``): ``method``, ``kv_dtype``,
``model``, ``mode``, ``rate`` or ``concurrency``, ``selection`` (``model``, or ``trace``
replayed), ``output_tok_s`` (generated tokens over the point's wall time), ``requests_per_s``,
``ttft_p50_ms`` / ``ttft_p99_ms``, ``tpot_p50_ms`` / ``tpot_p99_ms`` (per request: decode time
over its tokens after the first), ``completed``, ``refused`` (a 4xx or 503 answer, by status),
``lost`` (no answer, another status, an error mid-stream, a short output, or still open at the
drain limit), ``peak_running`` / ``peak_waiting`` (``/metrics``, polled every 0.25 s: a shorter
burst can be missed),
``peak_in_flight`` (completed requests open at once by the client's clocks: an upper bound
of running plus waiting), ``gen_tok_s_peak_10s`` (the highest 10-s generation rate
``/metrics`` reported: the decode rate once every row decodes), ``hit_rate`` and
``offload_bytes_per_token`` (offloaded: the engine's cumulative figures at the last scrape),
``hit_rate_peak_10s`` (offloaded: over the 10 s before the highest generation rate,
:func:`window_hit_rate`: the traffic of the decode rate ``gen_tok_s_peak_10s`` reports),
``decode_step_ms_peak_10s`` (the engine's timed decode step over that window,
:func:`window_step_ms`: against the window's wall time per step, time inside the step
against time between steps),
``prefill_tok_s`` / ``generation_tok_s`` (prompt tokens prefilled and tokens generated per
second between the point's first and last scrape), from the engine's step-time counters
between those scrapes (:func:`step_figures`; ``None`` where a counter is absent or a divisor
0): ``prefill_busy_tok_s`` (prefill tokens run, recomputed ones included, per second of prefill
work: the engine's prefill speed while it prefills), ``decode_step_ms`` (decode seconds per
decode step, mean) and ``prefill_share`` (prefill seconds over prefill plus decode seconds),
``preemptions`` (requests preempted by recompute between those scrapes),
``timeline`` (one row a second: seconds since
the point's start, prompt and generated tokens so far, running and waiting requests),
``idle_at_start`` (the previous point's requests had all ended),
``gpu_mem_peak_gib`` / ``host_rss_peak_gib`` (the server process; ``None`` where it cannot be
read), ``device``, ``commit``. Also ``OUT/serve_load.md`` (the table, printed last) and
``OUT/serve_load.png`` (output tok/s and TPOT p99 against offered load, one line per
configuration) when matplotlib is there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values``, nearest rank; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def measured_commit() -> str:
    """The commit a record names: ``$SPARDA_COMMIT`` (a device copy has no ``.git``), else this
    checkout's short ``HEAD``."""
    return os.environ.get("SPARDA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def log_uniform_lengths(count: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    """``count`` integers in ``[lo, hi]`` whose logarithm is uniform."""
    return [min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))) for _ in range(count)]


def rate_between(timeline: list[list[float]], column: int) -> float | None:
    """Tokens per second of a counter ``column`` of ``timeline`` rows ``[t, ...]`` from the
    first scrape to the last; ``None`` for fewer than two scrapes."""
    if len(timeline) < 2 or timeline[-1][0] <= timeline[0][0]:
        return None
    return round((timeline[-1][column] - timeline[0][column]) / (timeline[-1][0] - timeline[0][0]), 1)


#: the ``/metrics`` counters of :func:`step_figures`: prefill seconds, prefill tokens run,
#: decode seconds, decode steps (``decode_steps_total{bucket}`` summed over buckets)
STEP_COUNTERS = ("sparda_prefill_seconds_total", "sparda_prefill_tokens_run_total", "sparda_decode_seconds_total",
                 "sparda_decode_steps_total")


def step_figures(first: dict | None, last: dict | None) -> dict:
    """``prefill_busy_tok_s``, ``decode_step_ms`` and ``prefill_share`` from the
    :data:`STEP_COUNTERS` of two scrapes (``{name: value}``, :meth:`Server.metrics`): their
    differences (:func:`counter_delta`; ``None`` for a server without them). ``None`` too
    where the divisor is 0."""
    pre_s, pre_tok, dec_s, dec_n = (counter_delta(first, last, name) for name in STEP_COUNTERS)
    return {"prefill_busy_tok_s": round(pre_tok / pre_s, 1) if pre_s and pre_tok is not None else None,
            "decode_step_ms": round(dec_s / dec_n * 1e3, 3) if dec_n and dec_s is not None else None,
            "prefill_share": round(pre_s / (pre_s + dec_s), 4)
            if pre_s is not None and dec_s is not None and pre_s + dec_s > 0 else None}


def counter_delta(first: dict | None, last: dict | None, name: str) -> float | None:
    """How much counter ``name`` rose between two scrapes (``{name: value}``); ``None`` where
    ``last`` lacks it, from 0 where ``first`` does (a labelled family has no sample before
    its first event)."""
    if last is None or name not in last:
        return None
    return last[name] - (first or {}).get(name, 0.0)


def window_deltas(samples: list[tuple[float, ...]], end: float | None, span: float = 10.0) -> tuple | None:
    """How much each counter of scrapes ``(s since the point's start, counter, ...)`` in time
    order rose over the ``span`` seconds up to ``end``: the differences between the last scrape
    at or before ``end - span`` (the first scrape if none) and the last at or before ``end``.
    ``None`` without ``end`` or scrapes up to it."""
    if end is None:
        return None
    upto = [x for x in samples if x[0] <= end]
    if not upto:
        return None
    before = [x for x in upto if x[0] <= end - span] or upto[:1]
    return tuple(a - b for a, b in zip(upto[-1][1:], before[-1][1:]))


def window_hit_rate(samples: list[tuple[float, float, float]], end: float | None,
                    span: float = 10.0) -> float | None:
    """The offload hit rate over the ``span`` seconds up to ``end`` from scrapes ``(s, offload
    hits, offload misses)`` (:func:`window_deltas`); ``None`` also without blocks selected."""
    deltas = window_deltas(samples, end, span)
    if deltas is None or deltas[0] + deltas[1] <= 0:
        return None
    return round(deltas[0] / (deltas[0] + deltas[1]), 4)


def window_step_ms(samples: list[tuple[float, float, float]], end: float | None,
                   span: float = 10.0) -> float | None:
    """The engine's mean timed decode step (ms) over the ``span`` seconds up to ``end`` from
    scrapes ``(s, decode seconds, decode steps)`` (:func:`window_deltas`); ``None`` also
    without a step in between. Against the wall time per step of the same window it tells
    time inside the step from time between steps."""
    deltas = window_deltas(samples, end, span)
    if deltas is None or deltas[1] <= 0:
        return None
    return round(deltas[0] / deltas[1] * 1e3, 3)


def poisson_arrivals(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Arrival times (s, in ``[0, duration)``) of a Poisson process of ``rate`` per second."""
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --------------------------------------------------------------------------- server child

class ModuloText:
    """Decodes the ids of a random-weight model through a real tokenizer: id ``i`` reads as
    ``visible[i mod len(visible)]``, ``visible`` the tokenizer's ids that decode alone to text
    with a printed character (no special token, no partial UTF-8). So every generated token
    adds text and the server streams one chunk per token (it skips empty deltas), which the
    TTFT and TPOT of the load generator count on."""

    eos_token_id = None

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self.visible = [i for i in range(len(tokenizer)) if i not in special
                        and (text := tokenizer.decode([i])).strip() and "\ufffd" not in text]

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode([self.visible[int(i) % len(self.visible)] for i in ids],
                                     skip_special_tokens=skip_special_tokens)


def serve_child(argv: list[str]) -> None:
    """The server of one configuration (``bench_serve.py _serve SPEC_JSON``): builds the model
    and the :class:`~sparda.engine.engine.Engine`, prints the banner, serves until SIGINT."""
    import torch
    from transformers import AutoTokenizer

    from sparda import LLM
    from sparda.bench.models import build_model, random_forecast
    from sparda.engine.engine import Engine
    from sparda.model.loader import resolve_model_dir
    from sparda.server.app import bind_socket, serve

    spec = json.loads(argv[0])
    cuda = spec["device"] == "cuda"
    options = {"kv_dtype": spec["kv_dtype"], "prefill_chunk_tokens": spec["prefill_chunk"]}
    if spec["method"] in ("sparda", "sparse") and cuda:
        options["offload"] = spec["method"] == "sparda"
    tokenizer = AutoTokenizer.from_pretrained(spec.get("tokenizer") or resolve_model_dir(None))
    model = build_model(spec["model"], spec["device"], torch.bfloat16 if cuda else torch.float32,
                        max_positions=spec["max_model_len"])
    forecast = random_forecast(model) if spec["method"].startswith("sparda") else None
    llm = LLM.from_model(model, ModuloText(tokenizer), method=spec["method"], preset=spec["preset"],
                         forecast=forecast, **options)
    engine = Engine(llm, max_batch=spec["max_batch"], max_model_len=spec["max_model_len"],
                    max_waiting=spec["max_waiting"], max_prefill_tokens=spec["prefill_chunk"] + spec["max_batch"],
                    gpu_memory_utilization=spec["gpu_memory_utilization"],
                    host_memory_gib=spec["host_memory_gib"])
    if spec.get("replay_trace"):  # each decoding row fetches its request's replay of the trace
        from sparda.bench.traces import RowReplayer

        replayer = RowReplayer.attach(engine, spec["replay_trace"], keys=spec.get("replay_keys", "hash"))
        print(f"replaying {spec['replay_trace']} per row: {replayer.ids.nbytes / 2**20:.1f} MiB of tables "
              f"[{', '.join(map(str, replayer.ids.shape))}] {replayer.ids.dtype}"
              + ("" if replayer.early is None else
                 f"; early copies: {'recorded' if replayer.recorded else 'modelled'} predictions"),
              file=sys.stderr, flush=True)
    parent = os.getppid()

    def watchdog():  # the load generator died (SIGKILL, say): stop rather than serve on as an orphan
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watchdog, daemon=True).start()
    sock = bind_socket("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    serve(engine, spec["name"], sock, drain_timeout_s=5.0,
          banner=f"serving {spec['name']} on http://{host}:{port}/v1 ({engine.memory_plan.line()})")


class Server:
    """A ``_serve`` child process; :attr:`url` once its banner is printed."""

    def __init__(self, spec: dict, log: Path, start_timeout: float) -> None:
        import queue

        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "_serve", json.dumps(spec)]
        self.name, self.url, self.plan = spec["name"], None, ""
        self.log = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_log, daemon=True).start()
        try:
            deadline = time.perf_counter() + start_timeout
            while self.url is None:
                try:
                    line = self.lines.get(timeout=max(0.0, deadline - time.perf_counter()))
                except queue.Empty:
                    raise RuntimeError(f"the server of {self.name} printed no banner in {start_timeout:g} s "
                                       f"(log: {log})") from None
                if line is None:
                    raise RuntimeError(f"the server of {self.name} exited with {self.proc.wait()} (log: {log})")
                found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1 \((.*)\)", line)
                if found:
                    self.url, self.plan = found.group(1), found.group(2)
        except BaseException:
            self.stop()
            self.log.close()
            raise

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.log.write(line)
            self.log.flush()
            if self.url is None:
                self.lines.put(line)
        self.lines.put(None)  # the child's stderr closed: it exited

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{name: value}``, the samples of a name summed over their labels (one
        model: e.g. ``sparda_decode_steps_total`` over buckets); histograms left out."""
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.type in ("gauge", "counter"):
                for sample in family.samples:
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def stop(self) -> None:
        """SIGINT (the server drains for 5 s), then SIGKILL after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def process_memory(pid: int) -> tuple[float | None, float | None]:
    """(GPU GiB used by process ``pid`` as ``nvidia-smi`` reports it, host RSS GiB); ``None``
    where unknown."""
    gpu = host = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        used = [float(b) for a, b in (line.split(",") for line in out.strip().splitlines() if "," in line)
                if int(a) == pid]
        gpu = used[0] / 1024 if used else None
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            host = next(int(line.split()[1]) for line in handle if line.startswith("VmRSS")) / 2**20
    except (OSError, StopIteration, ValueError):
        pass
    return gpu, host


# --------------------------------------------------------------------------- load generator

def one_request(client, model: str, ids: list[int], max_tokens: int, start: float | None = None) -> dict:
    """One streamed completion; its timings and outcome (``completed``, ``refused``: a 4xx or
    503 answer, with ``retry_after`` s; ``lost``: anything else). ``start``
    (``time.perf_counter()``): when the request arrived, if before now (TTFT counts from it)."""
    import openai

    start = time.perf_counter() if start is None else start
    stamps, tokens, finish = [], 0, None
    try:
        for chunk in client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            if chunk.choices:
                stamps.append(time.perf_counter())
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
    except openai.APIStatusError as exc:
        if 400 <= exc.status_code < 500 or exc.status_code == 503:
            try:
                retry = float(exc.response.headers.get("retry-after", 1.0))
            except (TypeError, ValueError):
                retry = 1.0
            return {"outcome": "refused", "status": exc.status_code, "retry_after": retry}
        return {"outcome": "lost", "error": f"HTTP {exc.status_code}"}
    except Exception as exc:  # noqa: BLE001 - a broken stream of any kind is one lost request, never the sweep
        return {"outcome": "lost", "error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    end = time.perf_counter()
    if finish != "length" or tokens != max_tokens or not stamps:
        return {"outcome": "lost", "error": f"finish {finish}, {tokens} of {max_tokens} tokens"}
    ttft = stamps[0] - start
    return {"outcome": "completed", "tokens": tokens, "ttft_s": ttft, "span": (start, end),
            "tpot_s": (end - stamps[0]) / (tokens - 1) if tokens > 1 else None}


def peak_overlap(spans: list[tuple[float, float]]) -> int:
    """The most intervals ``(start, end)`` open at one instant (an end before a start at a tie)."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def run_point(server, args, mode: str, level: float, seed: str) -> dict:
    """One load point against ``server`` (``url``, ``name``, ``metrics()``, ``proc.pid``):
    ``mode`` ``poisson`` (``level`` requests/s) or ``closed`` (``level`` clients, each with its
    own draws from ``seed``; a refused client waits the answer's ``Retry-After``). Returns the
    point's figures (no identity fields); a request still open at the drain limit is lost."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=args.drain + 600)
    lo, hi = args.prompt_tokens
    olo, ohi = args.output_tokens

    def draw(rng):
        n = log_uniform_lengths(1, lo, hi, rng)[0]
        return [rng.randrange(10, args.vocab) for _ in range(n)], rng.randint(olo, ohi)

    results, lock = [], threading.Lock()
    peaks, stop = {"running": 0, "waiting": 0, "gpu": None, "host": None, "metrics_errors": 0, "gen_rate": 0.0,
                   "gen_at": None, "hit_rate": None, "bytes_per_token": None}, threading.Event()
    timeline: list[list[float]] = []  # [s since start, prompt tokens, generated tokens, running, waiting]
    scrapes: dict[str, dict | None] = {"first": None, "last": None}  # the STEP_COUNTERS of each
    offload: list[tuple[float, float, float]] = []  # (s since start, offload hits, misses) per scrape
    steps: list[tuple[float, float, float]] = []  # (s since start, decode seconds, decode steps) per scrape

    def poll():
        while not stop.is_set():
            try:
                m = server.metrics()
                now = time.perf_counter() - start
                counters = {k: float(m[k]) for k in STEP_COUNTERS + ("sparda_preemptions_total",) if k in m}
                scrapes["first"] = counters if scrapes["first"] is None else scrapes["first"]
                scrapes["last"] = counters
                if not timeline or now - timeline[-1][0] >= 1.0:
                    timeline.append([round(now, 2)] + [float(m.get(f"sparda_{k}", 0.0)) for k in (
                        "prompt_tokens_total", "generation_tokens_total", "requests_running", "requests_waiting")])
                peaks["running"] = max(peaks["running"], int(m.get("sparda_requests_running", 0)))
                peaks["waiting"] = max(peaks["waiting"], int(m.get("sparda_requests_waiting", 0)))
                rate = float(m.get("sparda_generation_tokens_per_second", 0.0))
                if rate > peaks["gen_rate"]:
                    peaks["gen_rate"], peaks["gen_at"] = rate, now
                if "sparda_decode_seconds_total" in counters:
                    steps.append((now, counters["sparda_decode_seconds_total"],
                                  counters.get("sparda_decode_steps_total", 0.0)))
                if "sparda_offload_hits_total" in m:
                    offload.append((now, float(m["sparda_offload_hits_total"]), float(m["sparda_offload_misses_total"])))
                if "sparda_offload_hit_rate" in m:  # engine-wide, cumulative: the last scrape's
                    peaks["hit_rate"] = round(float(m["sparda_offload_hit_rate"]), 4)
                    peaks["bytes_per_token"] = float(m.get("sparda_offload_bytes_per_token", 0.0))
            except Exception:  # noqa: BLE001 - a failed scrape is counted, the poller goes on
                peaks["metrics_errors"] += 1
            gpu, host = process_memory(server.proc.pid)
            for key, value in (("gpu", gpu), ("host", host)):
                if value is not None:
                    peaks[key] = max(peaks[key] or 0.0, value)
            stop.wait(0.25)

    def record(result):
        with lock:
            results.append(result)

    start = time.perf_counter()
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    deadline = start + args.duration
    if mode == "poisson":  # room for every request the server can hold, and more (refusals need them sent)
        pool = concurrent.futures.ThreadPoolExecutor(args.max_waiting + args.max_batch + 64)
        rng = random.Random(seed)
        futures = []
        for at in poisson_arrivals(level, args.duration, rng):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            ids, n = draw(rng)
            futures.append(pool.submit(lambda *a: record(one_request(*a)), client, server.name, ids, n, start + at))
    else:
        pool = concurrent.futures.ThreadPoolExecutor(int(level))

        def client_loop(index: int):
            rng = random.Random(f"{seed}:{index}")
            while time.perf_counter() < deadline:
                ids, n = draw(rng)
                result = one_request(client, server.name, ids, n)
                record(result)
                if result["outcome"] == "refused":
                    time.sleep(min(result["retry_after"], max(0.0, deadline - time.perf_counter())))
        futures = [pool.submit(client_loop, i) for i in range(int(level))]
    _, open_ = concurrent.futures.wait(futures, timeout=max(0.0, deadline + args.drain - time.perf_counter()))
    wall = max(time.perf_counter() - start, args.duration)
    with lock:
        done = list(results)
    for future in open_:
        future.cancel()
    pool.shutdown(wait=False, cancel_futures=True)
    stop.set()
    poller.join()
    # open at the drain limit: a Poisson request not finished, or a client in the middle of one
    open_at_drain = len(open_)
    ok = [r for r in done if r["outcome"] == "completed"]
    refused: dict[str, int] = {}
    for r in done:
        if r["outcome"] == "refused":
            refused[str(r["status"])] = refused.get(str(r["status"]), 0) + 1
    ms = lambda v: None if v is None else round(v * 1e3, 1)  # noqa: E731
    preempted = counter_delta(scrapes["first"], scrapes["last"], "sparda_preemptions_total")
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    return {"output_tok_s": round(sum(r["tokens"] for r in ok) / wall, 2),
            "requests_per_s": round(len(ok) / wall, 4), "wall_s": round(wall, 1),
            "ttft_p50_ms": ms(percentile(ttft, 0.5)), "ttft_p99_ms": ms(percentile(ttft, 0.99)),
            "tpot_p50_ms": ms(percentile(tpot, 0.5)), "tpot_p99_ms": ms(percentile(tpot, 0.99)),
            "completed": len(ok), "refused": refused,
            "lost": sum(r["outcome"] == "lost" for r in done) + open_at_drain,
            "open_at_drain": open_at_drain, "peak_running": peaks["running"],
            "peak_in_flight": peak_overlap([r["span"] for r in ok]), "peak_waiting": peaks["waiting"],
            "metrics_errors": peaks["metrics_errors"], "gen_tok_s_peak_10s": round(peaks["gen_rate"], 1),
            "hit_rate": peaks["hit_rate"], "hit_rate_peak_10s": window_hit_rate(offload, peaks["gen_at"]),
            "decode_step_ms_peak_10s": window_step_ms(steps, peaks["gen_at"]),
            "offload_bytes_per_token": peaks["bytes_per_token"],
            "prefill_tok_s": rate_between(timeline, 1), "generation_tok_s": rate_between(timeline, 2),
            **step_figures(scrapes["first"], scrapes["last"]), "preemptions": None if preempted is None else int(preempted),
            "timeline": timeline,
            "gpu_mem_peak_gib": None if peaks["gpu"] is None else round(peaks["gpu"], 2),
            "host_rss_peak_gib": None if peaks["host"] is None else round(peaks["host"], 2)}


def wait_idle(server, timeout: float) -> bool:
    """Until the server holds no request (the previous point's stragglers), at most ``timeout``
    s; False if it still held some then (or ``/metrics`` kept failing)."""
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        try:
            m = server.metrics()
            if not m.get("sparda_requests_running") and not m.get("sparda_requests_waiting"):
                return True
        except Exception:  # noqa: BLE001 - retried until the timeout
            pass
        time.sleep(0.5)
    return False


def idle_memory(server, when: str) -> dict:
    """``idle_gpu_mem_gib_{when}`` / ``idle_host_rss_gib_{when}``: the server process's memory
    now (:func:`process_memory`, ``None`` where unreadable), rounded to 0.01 GiB."""
    gpu, host = process_memory(server.proc.pid)
    return {f"idle_gpu_mem_gib_{when}": None if gpu is None else round(gpu, 2),
            f"idle_host_rss_gib_{when}": None if host is None else round(host, 2)}


def after_overload(server, args) -> dict:
    """After an overload point: ``idle_after`` (the server held no request within ``--drain``
    s), its idle memory (:func:`idle_memory` ``after``) and ``served_after`` (one more request
    of the shortest prompt and output completes)."""
    import openai

    idle = wait_idle(server, args.drain)
    memory = idle_memory(server, "after")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=args.drain + 600)
    probe = one_request(client, server.name, list(range(10, 10 + args.prompt_tokens[0])), args.output_tokens[0])
    return {"idle_after": idle, **memory, "served_after": probe["outcome"] == "completed"}


def device_name(device: str) -> str:
    if device != "cuda":
        return f"cpu ({os.cpu_count()} CPUs)"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "cuda"


def plot(records: list[dict], path: Path) -> bool:
    """Output tok/s and TPOT p99 against offered load (Poisson rate; closed-loop concurrency
    on a second row), one line per configuration. False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = [m for m in ("poisson", "closed") if any(r["mode"] == m for r in records)]
    fig, axes = plt.subplots(len(modes), 2, figsize=(10, 3.6 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes):
        key = "rate" if mode == "poisson" else "concurrency"
        for config in dict.fromkeys(r["config"] for r in records):
            pts = sorted((r[key], r["output_tok_s"], r["tpot_p99_ms"]) for r in records
                         if r["config"] == config and r["mode"] == mode)
            row[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=config)
            row[1].plot([p[0] for p in pts if p[2] is not None], [p[2] for p in pts if p[2] is not None],
                        marker="o", label=config)
        row[0].set(xlabel="requests/s offered" if mode == "poisson" else "clients", ylabel="output tok/s")
        row[1].set(xlabel=row[0].get_xlabel(), ylabel="TPOT p99 (ms)")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def pair(text: str, name: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"{name} takes lo,hi (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise SystemExit(f"{name} needs 1 <= lo <= hi, got {text!r}")
    return lo, hi


def numbers(text: str, kind, name: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()] if text else []
    except ValueError:
        raise SystemExit(f"{name} takes a comma list of numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise SystemExit(f"{name} values must be > 0, got {text!r}")
    return values


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agree(argv: list[str]) -> None:
    """Greedy tokens under load against each request alone (``bench_serve.py agree OUT``), in
    the server's engine (in process): ``--requests`` prompts (lengths log-uniform in
    ``--prompt-tokens``) join a running batch one every ``--every`` steps, chunked prefill on;
    then each runs alone in a fresh engine. Per method: requests whose tokens are identical,
    and the agreement rate (mean common-prefix length over the generated length: after a first
    different token the rest differs too). fp32 on the CPU is expected to give 1.0 (the CPU
    test asserts it); bf16 on the GPU measures how often batching changes a greedy choice.
    Writes ``OUT/serve_agree.json``; prints a Markdown table last."""
    import torch

    from sparda import LLM
    from sparda.bench.harness import NoText
    from sparda.bench.models import build_model, random_forecast
    from sparda.engine.engine import Engine
    from sparda.engine.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(prog="bench_serve.py agree", description=agree.__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="minicpm-8b", help="bench model shape, random weights [minicpm-8b]")
    parser.add_argument("--methods", default="sparda,sparse-offload,sparse,dense", help="[%(default)s]")
    parser.add_argument("--requests", type=int, default=8, help="[8]")
    parser.add_argument("--prompt-tokens", default="2048,32768", help="lo,hi, log-uniform [%(default)s]")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request [64]")
    parser.add_argument("--every", type=int, default=3, help="decode steps between arrivals [3]")
    parser.add_argument("--max-batch", type=int, default=4, help="[4]: fewer rows than requests, so some wait")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="[2048]")
    parser.add_argument("--preset", default="paper", help="[paper]")
    parser.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (fp32) [cuda]")
    parser.add_argument("--seed", type=int, default=0, help="[0]")
    args = parser.parse_args(argv)
    lo, hi = pair(args.prompt_tokens, "--prompt-tokens")
    methods = [m for m in args.methods.split(",") if m]
    cuda = args.device == "cuda"
    rng = random.Random(args.seed)
    from sparda.bench.models import model_spec

    vocab = min(model_spec(args.model).vocab, 60000)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)]
               for n in log_uniform_lengths(args.requests, lo, hi, rng)]
    max_len = hi + args.max_tokens
    model = build_model(args.model, args.device, torch.bfloat16 if cuda else torch.float32, max_positions=max_len)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    records = []
    for method in methods:
        extra = {"forecast": random_forecast(model)} if method.startswith("sparda") else {}
        if cuda and method in ("sparda", "sparse"):
            extra["offload"] = method == "sparda"
        llm = LLM.from_model(model, NoText(), method=method, preset=args.preset,
                             prefill_chunk_tokens=args.prefill_chunk, **extra)

        def engine(rows):
            return Engine(llm, max_batch=rows, max_model_len=max_len,
                          max_prefill_tokens=args.prefill_chunk + rows, chunked_prefill=True)

        busy = engine(args.max_batch)
        seqs, steps = [], 0
        while len(seqs) < len(prompts) or busy.has_work():
            if len(seqs) < len(prompts) and steps % args.every == 0:
                seqs.append(busy.add_request(prompts[len(seqs)], params))
            busy.step()
            steps += 1
        under_load = [list(s.output_ids) for s in seqs]
        del busy
        alone = []
        for ids in prompts:
            solo = engine(1)
            seq = solo.add_request(ids, params)
            while solo.has_work():
                solo.step()
            alone.append(list(seq.output_ids))
            del solo
        prefix = [common_prefix(a, b) / max(len(b), 1) for a, b in zip(under_load, alone)]
        rec = {"method": method, "requests": len(prompts), "identical": sum(a == b for a, b in zip(under_load, alone)),
               "agreement": round(sum(prefix) / len(prefix), 4), "steps": steps,
               "prompt_tokens": [len(p) for p in prompts]}
        records.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
        del llm
        if cuda:
            torch.cuda.empty_cache()
    device = device_name(args.device)
    commit = measured_commit()
    meta = {"device": device, "date": datetime.date.today().isoformat(), "commit": commit, "model": args.model,
            "dtype": "bf16" if cuda else "fp32", "max_tokens": args.max_tokens, "every": args.every,
            "max_batch": args.max_batch, "prefill_chunk": args.prefill_chunk, "preset": args.preset}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_agree.json").write_text(json.dumps({**meta, "records": records}, indent=1))
    print(f"{device}, {args.model} (random weights, {meta['dtype']}), {args.requests} requests of {lo}-{hi} tokens, "
          f"{args.max_tokens} greedy tokens, one joins every {args.every} steps, {args.max_batch} rows, commit {commit}\n")
    print("| method | identical / requests | agreement (common prefix) |")
    print("|---|---|---|")
    for r in records:
        print(f"| {r['method']} | {r['identical']} / {r['requests']} | {r['agreement']} |")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_serve.py load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="minicpm-8b", help="bench model shape, random weights [minicpm-8b]")
    parser.add_argument("--configs", default="sparda,sparda:int8,sparse-offload,sparse,dense",
                        help="method[:kv_dtype],... one server each [%(default)s]; on CUDA sparda is offloaded, "
                             "sparse and dense on the GPU")
    parser.add_argument("--rates", default="0.05,0.1,0.2,0.4", help="Poisson arrival rates, requests/s [%(default)s]")
    parser.add_argument("--concurrency", default="4,16", help="closed-loop clients [%(default)s]")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per point [120]")
    parser.add_argument("--drain", type=float, default=120.0, help="seconds a point waits for its last requests [120]")
    parser.add_argument("--prompt-tokens", default="8192,131072", help="lo,hi, log-uniform [%(default)s]")
    parser.add_argument("--output-tokens", default="256,1024", help="lo,hi, uniform [%(default)s]")
    parser.add_argument("--max-batch", type=int, default=32, help="server --max-batch [32]")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="server --max-model-len [the prompt hi + the output hi]")
    parser.add_argument("--max-waiting", type=int, default=256, help="server --max-waiting [256]")
    parser.add_argument("--prefill-chunk", type=int, default=8192, help="server --prefill-chunk [8192]")
    parser.add_argument("--preset", default="paper", help="selection preset [paper]")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="[0.9]")
    parser.add_argument("--host-memory-gib", type=float, default=None, help="[90%% of what is available]")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run [cuda]")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer folder for the decoded text [the bundled model's]")
    parser.add_argument("--seed", type=int, default=0, help="seed of lengths, ids and arrivals [0]")
    parser.add_argument("--replay-trace", nargs="?", const="shipped", default=None, metavar="PATH",
                        help="offloaded configs: each decoding row fetches a replay of this selection trace "
                             "(sparda.bench.traces.RowReplayer, as `sparda bench` replays it) instead of the "
                             "model's selection [off; without PATH the shipped trace]")
    parser.add_argument("--replay-keys", choices=("hash", "order"), default="hash",
                        help="which bench row a request replays: a hash of its id (the same alone or batched), "
                             "or the order requests start decoding (B requests = the bench's B rows) [hash]")
    parser.add_argument("--overload", type=float, default=None, metavar="FACTOR",
                        help="after the other points, Poisson arrivals at FACTOR x the saturation rate (the "
                             "highest req/s of this configuration's closed-loop points) for --overload-duration, "
                             "then the server idle again: its memory and one more request [off]")
    parser.add_argument("--overload-duration", type=float, default=None, metavar="S",
                        help="seconds of arrivals of the --overload point [--duration]")
    parser.add_argument("--start-timeout", type=float, default=1800.0,
                        help="seconds a server may take to print its banner [1800]")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop the server child
    args.prompt_tokens = pair(args.prompt_tokens, "--prompt-tokens")
    args.output_tokens = pair(args.output_tokens, "--output-tokens")
    rates = numbers(args.rates, float, "--rates")
    clients = numbers(args.concurrency, int, "--concurrency")
    if not rates and not clients:
        raise SystemExit("no load point: give --rates and/or --concurrency")
    if args.overload_duration is not None and not (math.isfinite(args.overload_duration) and args.overload_duration > 0):
        raise SystemExit("--overload-duration takes seconds > 0")
    if args.overload is not None and (not clients or not math.isfinite(args.overload) or args.overload <= 0):
        raise SystemExit("--overload needs a factor > 0 and --concurrency (its closed-loop points give the "
                         "saturation rate)")
    max_model_len = args.max_model_len or args.prompt_tokens[1] + args.output_tokens[1]
    if max_model_len < args.prompt_tokens[1] + args.output_tokens[1]:
        raise SystemExit(f"--max-model-len {max_model_len} is below the longest prompt + output "
                         f"({args.prompt_tokens[1] + args.output_tokens[1]})")
    from sparda.bench.models import model_spec
    from sparda.bench.traces import SHIPPED_TRACE

    args.vocab = min(model_spec(args.model).vocab, 60000)
    trace = str(SHIPPED_TRACE) if args.replay_trace == "shipped" else args.replay_trace
    if trace is not None and not Path(trace).is_file():
        raise SystemExit(f"--replay-trace: no trace file {trace}")
    configs = []
    for item in (c.strip() for c in args.configs.split(",")):
        parts = item.split(":") if item else []
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise SystemExit(f"--configs takes method[:kv_dtype],..., got {args.configs!r}")
        configs.append((parts[0], parts[1] if len(parts) == 2 else "bf16"))
    args.out.mkdir(parents=True, exist_ok=True)
    device = device_name(args.device)
    commit = measured_commit()
    meta = {"device": device, "date": datetime.date.today().isoformat(), "commit": commit, "model": args.model,
            "prompt_tokens": list(args.prompt_tokens), "output_tokens": list(args.output_tokens),
            "duration_s": args.duration, "drain_s": args.drain, "max_batch": args.max_batch,
            "max_model_len": max_model_len, "prefill_chunk": args.prefill_chunk, "preset": args.preset,
            "replay_trace": None if trace is None else Path(trace).name,
            "replay_keys": None if trace is None else args.replay_keys}
    records = []
    for method, kv_dtype in configs:
        name = method if kv_dtype == "bf16" else f"{method}:{kv_dtype}"
        spec = {"name": name, "model": args.model, "method": method, "kv_dtype": kv_dtype, "device": args.device,
                "preset": args.preset, "max_batch": args.max_batch, "max_model_len": max_model_len,
                "max_waiting": args.max_waiting, "prefill_chunk": args.prefill_chunk, "tokenizer": args.tokenizer,
                "gpu_memory_utilization": args.gpu_memory_utilization, "host_memory_gib": args.host_memory_gib,
                "replay_trace": trace, "replay_keys": args.replay_keys}
        server = None
        try:
            server = Server(spec, args.out / f"server-{name.replace(':', '-')}.log", args.start_timeout)
            points = [(mode, level) for mode, levels in (("poisson", rates), ("closed", clients)) for level in levels]
            overload_args = argparse.Namespace(**{**vars(args), "duration": args.overload_duration or args.duration})
            if args.overload is not None:
                points.append(("overload", args.overload))
            for mode, level in points:
                idle = wait_idle(server, args.drain)
                extra = {}
                if mode == "overload":
                    saturation = max((r["requests_per_s"] for r in records if r["config"] == name
                                      and r["mode"] == "closed"), default=0.0)
                    if not saturation:
                        print(f"{name}: no closed-loop point completed a request: no overload point", file=sys.stderr)
                        continue
                    extra = {"overload_factor": level, "saturation_rps": saturation,
                             "duration_s": overload_args.duration, **idle_memory(server, "before")}
                    level = round(level * saturation, 4)
                point = run_point(server, overload_args if mode == "overload" else args, "closed" if mode == "closed" else "poisson", level,
                                  f"{args.seed}:{name}:{mode}:{level}")
                if mode == "overload":
                    extra.update(after_overload(server, args))
                rec = {"config": name, "method": method, "kv_dtype": kv_dtype, "model": args.model, "mode": mode,
                       "rate": level if mode != "closed" else None,
                       "concurrency": int(level) if mode == "closed" else None,
                       "selection": "model" if trace is None else "trace", **point, **extra, "idle_at_start": idle,
                       "memory_plan": server.plan, "device": device, "commit": commit}
                records.append(rec)
                print(json.dumps(rec), file=sys.stderr, flush=True)
                (args.out / "serve_load.json").write_text(json.dumps({**meta, "records": records}, indent=1))
        except RuntimeError as exc:  # the server did not start: the next configuration
            print(f"{name}: {exc}", file=sys.stderr, flush=True)
        finally:
            if server is not None:
                server.stop()
                server.log.close()
    (args.out / "serve_load.json").write_text(json.dumps({**meta, "records": records}, indent=1))
    lines = [f"{device}, {args.model} (random weights), prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} "
             f"tokens (log-uniform), outputs {args.output_tokens[0]}-{args.output_tokens[1]}, {args.duration:g} s per "
             f"point, commit {commit}, {meta['date']}", "",
             "| config | mode | rate / clients | output tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
             "completed | refused | lost | peak running | GPU / host GiB |",
             "|---|---|---:|---:|---:|---|---|---:|---|---:|---:|---|"]
    for r in records:
        level = r["concurrency"] if r["mode"] == "closed" else r["rate"]
        lines.append(f"| {r['config']} | {r['mode']} | {level} | {r['output_tok_s']} | {r['requests_per_s']} | "
                     f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} | "
                     f"{r['completed']} | {r['refused'] or 0} | {r['lost']} | {r['peak_running']} | "
                     f"{r['gpu_mem_peak_gib']} / {r['host_rss_peak_gib']} |")
    (args.out / "serve_load.md").write_text("\n".join(lines) + "\n")
    if records:
        plot(records, args.out / "serve_load.png")
    print("\n".join(lines))
