"""``GET /metrics``: the server's Prometheus metrics, through ``prometheus_client``.

Everything is labelled with the served model (``model="..."``) and prefixed ``sparda_``.

* From :meth:`Engine.metrics` at each scrape (a custom collector): ``requests_running``,
  ``requests_prefilling``, ``requests_waiting``, ``kv_tokens_in_use``, ``kv_tokens_total``,
  ``kv_rows_in_use``, ``kv_rows_free``, ``kv_rows_total``,
  ``max_model_len_tokens``, with a paged cache ``kv_blocks_used``, ``kv_blocks_free`` and
  ``kv_blocks_total`` (host KV blocks, design §3.11), ``prompt_tokens_total``,
  ``generation_tokens_total``, ``generation_tokens_per_second`` (last 10 s),
  ``requests_finished_total{reason}``, ``preemptions_total`` (requests preempted by recompute
  when a paged pool that grows on demand ran out of blocks, design §3.11; 0 otherwise),
  ``decode_bucket_rows`` (rows the last decode step ran), ``decode_steps_total{bucket}``
  (design §3.13), ``cuda_graph_capture_seconds_total``, the engine's step times
  (:mod:`sparda.engine.step_timer`; on CUDA from events, behind by the step or two the device
  has not finished): ``prefill_seconds_total`` (in the steps' prefill work, first tokens'
  sampling included), ``prefill_tokens_run_total`` (the tokens that work ran, recomputed ones
  of preempted requests included, which ``prompt_tokens_total`` leaves out),
  ``decode_seconds_total`` (in decode steps, sampling included; per step: over
  ``decode_steps_total{bucket}`` summed over buckets) and ``decode_rows_total`` (requests
  those steps decoded, one token each) and, on an offloaded cache, ``offload_hit_rate``,
  ``offload_bytes_per_token``, ``offload_hits_total`` and ``offload_misses_total`` (a hit rate
  over any window: their differences; all four refreshed at most once a second).
* Observed as each engine step's time is resolved: the histogram
  ``engine_step_seconds{kind}``, the whole step's wall time, ``kind`` ``decode`` (decode only)
  or ``mixed`` (prefill work, with or without decode; its ``_count`` is the steps with prefill
  work).
* Observed when each HTTP request's engine request finishes (its
  :attr:`RequestOutput.stats`): the histograms ``time_to_first_token_seconds``,
  ``time_per_output_token_seconds`` (decode time over the tokens after the first) and
  ``request_latency_seconds`` (arrival to finish).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sparda.engine.sequence import RequestOutput
from sparda.engine.step_timer import STEP_KINDS

#: the ``Content-Type`` of :meth:`ServerMetrics.render`
CONTENT_TYPE = CONTENT_TYPE_LATEST
#: histogram buckets, seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class EngineCollector:
    """A ``prometheus_client`` collector reading :meth:`Engine.metrics` at each scrape."""

    def __init__(self, engine, model: str) -> None:
        self.engine, self.model = engine, model

    def describe(self):
        return []  # families depend on the engine (offload); collected at scrape time only

    def collect(self):
        m = self.engine.metrics()
        model = self.model

        def gauge(name: str, doc: str, value) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"sparda_{name}", doc, labels=["model"])
            family.add_metric([model], float(value))
            return family

        def counter(name: str, doc: str, value) -> CounterMetricFamily:
            family = CounterMetricFamily(f"sparda_{name}", doc, labels=["model"])
            family.add_metric([model], float(value))
            return family

        yield gauge("requests_running", "Requests holding a KV-cache row.", m["requests_running"])
        yield gauge("requests_prefilling", "Running requests whose prompt is not yet all prefilled.",
                    m["requests_prefilling"])
        yield gauge("requests_waiting", "Requests queued for a row.", m["requests_waiting"])
        yield gauge("kv_tokens_in_use", "Tokens held in the KV cache.", m["kv_tokens_in_use"])
        yield gauge("kv_tokens_total",
                    "Tokens the KV cache holds at most (rows x --max-model-len; paged: at most blocks x block size).",
                    m["kv_tokens_total"])
        yield gauge("kv_rows_in_use", "KV-cache rows in use.", m["kv_rows_in_use"])
        yield gauge("kv_rows_free", "KV-cache rows free.", m["kv_rows_total"] - m["kv_rows_in_use"])
        yield gauge("kv_rows_total", "KV-cache rows (--max-batch).", m["kv_rows_total"])
        yield gauge("max_model_len_tokens", "Tokens per row (--max-model-len).", m["max_model_len"])
        if "kv_blocks_total" in m:  # a paged cache (design §3.11)
            yield gauge("kv_blocks_used", "Host KV blocks held by requests.", m["kv_blocks_used"])
            yield gauge("kv_blocks_free", "Host KV blocks free.", m["kv_blocks_total"] - m["kv_blocks_used"])
            yield gauge("kv_blocks_total", "Host KV blocks in the pool.", m["kv_blocks_total"])
        yield counter("prompt_tokens", "Prompt tokens prefilled.", m["prompt_tokens_total"])
        yield counter("generation_tokens", "Tokens generated.", m["generation_tokens_total"])
        yield gauge("generation_tokens_per_second", "Tokens generated per second over the last 10 s.",
                    m["generation_tokens_per_s"])
        finished = CounterMetricFamily("sparda_requests_finished", "Requests finished, by finish reason.",
                                       labels=["model", "reason"])
        for reason, count in sorted(m["requests_finished"].items()):
            finished.add_metric([model, reason], float(count))
        yield finished
        yield counter("preemptions", "Requests preempted by recompute (a paged KV pool out of blocks).",
                      m["preemptions"])
        yield gauge("decode_bucket_rows", "KV rows the last decode step ran: its decode batch bucket (design §3.13).",
                    m["decode_bucket"])
        steps = CounterMetricFamily("sparda_decode_steps", "Decode steps, by decode batch bucket (rows run).",
                                    labels=["model", "bucket"])
        for bucket, count in m["decode_steps_by_bucket"].items():
            steps.add_metric([model, str(bucket)], float(count))
        yield steps
        yield counter("cuda_graph_capture_seconds", "Wall time spent capturing CUDA graphs of decode steps.",
                      m["graph_capture_ms"] / 1e3)
        yield counter("prefill_seconds", "Seconds of the engine steps' prefill work (chunks, whole prompts).",
                      m["prefill_seconds_total"])
        yield counter("prefill_tokens_run", "Tokens the steps' prefill work ran, recomputed ones of preempted "
                      "requests included.", m["prefill_tokens_run_total"])
        yield counter("decode_seconds", "Seconds of the engine's decode steps (sampling included).",
                      m["decode_seconds_total"])
        yield counter("decode_rows", "Requests the timed decode steps decoded, one token each.",
                      m["decode_rows_total"])
        if "offload" in m:
            yield gauge("offload_hit_rate", "Fraction of selected KV blocks already on the device.",
                        m["offload"].get("hit_rate", 0.0))
            yield gauge("offload_bytes_per_token", "K+V bytes copied host-to-device per decoded token.",
                        m["offload"].get("bytes_per_token", 0.0))
            yield counter("offload_hits", "Selected KV blocks found on the device (summed over layers, heads, rows).",
                          m["offload"].get("hits", 0))
            yield counter("offload_misses", "Selected KV blocks copied from host memory.",
                          m["offload"].get("misses", 0))


class ServerMetrics:
    """The server's registry: the engine's figures, its step times and per-request latency histograms.

    Args:
        engine: the :class:`~sparda.engine.engine.Engine` served.
        model: the served model name (the ``model`` label).
    """

    def __init__(self, engine, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model))
        self.ttft = Histogram("sparda_time_to_first_token_seconds", "Arrival to first token, per request.",
                              ["model"], buckets=TTFT_BUCKETS, registry=self.registry).labels(model)
        self.tpot = Histogram("sparda_time_per_output_token_seconds",
                              "Decode time per token after the first, per request.", ["model"],
                              buckets=TPOT_BUCKETS, registry=self.registry).labels(model)
        self.latency = Histogram("sparda_request_latency_seconds", "Arrival to finish, per request.", ["model"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry).labels(model)
        steps = Histogram("sparda_engine_step_seconds", "Wall time of an engine step, by kind: decode (decode only) "
                          "or mixed (prefill work in it).", ["model", "kind"], buckets=STEP_BUCKETS,
                          registry=self.registry)
        self.step_seconds = {kind: steps.labels(model, kind) for kind in STEP_KINDS}
        engine.step_timer.observers.append(self.observe_step)

    def observe_step(self, kind: str, seconds: float) -> None:
        """Record one engine step's wall time (``kind``: ``decode`` or ``mixed``, seconds); the
        engine's :class:`~sparda.engine.step_timer.StepTimer` calls it."""
        self.step_seconds[kind].observe(seconds)

    def observe(self, output: RequestOutput) -> None:
        """Record a finished request's TTFT, time per output token and latency (from its
        stats; a request that never got a token adds its latency only)."""
        stats = output.stats or {}
        ttft = stats.get("ttft_ms")
        if ttft is not None:
            self.ttft.observe(ttft / 1e3)
            after_first = stats.get("new_tokens", 0) - 1
            latency = stats.get("latency_ms")
            if after_first > 0 and latency is not None:
                self.tpot.observe(max(latency - ttft, 0.0) / 1e3 / after_first)
        if stats.get("latency_ms") is not None:
            self.latency.observe(stats["latency_ms"] / 1e3)

    def render(self) -> bytes:
        """The exposition text (``Content-Type``: :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
