"""The serving sweep (``benchmarks/bench_serve.py load``): its draws against brute force and
probability bounds, and one small run end to end on the CPU (a server child, HTTP, records)."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_load  # noqa: E402

#: what every record holds (the issue's list, plus the refusals)
RECORD_KEYS = {"method", "kv_dtype", "model", "mode", "rate", "concurrency", "output_tok_s", "requests_per_s",
               "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "completed", "lost", "refused",
               "peak_running", "device", "commit", "selection", "prefill_busy_tok_s", "decode_step_ms", "prefill_share",
               "preemptions"}


def test_percentile_is_nearest_rank(fresh_seed):
    rng = random.Random(fresh_seed)
    values = [rng.random() for _ in range(rng.randint(1, 200))]
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        rank = max(1, math.ceil(q * len(values)))  # nearest-rank definition
        assert serve_load.percentile(values, q) == sorted(values)[rank - 1], fresh_seed
    assert serve_load.percentile([], 0.5) is None


def test_log_uniform_lengths(fresh_seed):
    rng = random.Random(fresh_seed)
    lo, hi, n = 8192, 131072, 4000
    lengths = serve_load.log_uniform_lengths(n, lo, hi, rng)
    assert all(lo <= v <= hi for v in lengths), fresh_seed
    # log-uniform: P(v <= lo * (hi/lo)^f) = f; the count below each quantile within 5 sigma
    for f in (0.25, 0.5, 0.75):
        below = sum(v <= lo * (hi / lo) ** f for v in lengths)
        assert abs(below - f * n) < 5 * math.sqrt(n * f * (1 - f)) + 1, (fresh_seed, f, below)


def test_poisson_arrivals(fresh_seed):
    rng = random.Random(fresh_seed)
    rate, duration = 3.0, 400.0
    times = serve_load.poisson_arrivals(rate, duration, rng)
    assert times == sorted(times) and all(0 <= t < duration for t in times), fresh_seed
    mean = rate * duration  # Poisson count: variance = mean
    assert abs(len(times) - mean) < 5 * math.sqrt(mean), (fresh_seed, len(times))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert abs(sum(gaps) / len(gaps) - 1 / rate) < 5 / rate / math.sqrt(len(gaps)), fresh_seed


def test_rate_between_is_the_counters_slope(fresh_seed):
    rng = random.Random(fresh_seed)
    t, total, rows = 0.0, 0.0, []
    for _ in range(rng.randint(2, 30)):
        rows.append([t, total, 2 * total])
        t += rng.uniform(1.0, 3.0)
        total += rng.randint(0, 500)
    want = (rows[-1][1] - rows[0][1]) / (rows[-1][0] - rows[0][0])
    assert serve_load.rate_between(rows, 1) == pytest.approx(want, abs=0.05)
    assert serve_load.rate_between(rows, 2) == pytest.approx(2 * want, abs=0.05)
    assert serve_load.rate_between(rows[:1], 1) is None


def test_peak_overlap_against_brute_force(fresh_seed):
    rng = random.Random(fresh_seed)
    spans = [(a, a + rng.random()) for a in (rng.random() * 3 for _ in range(rng.randint(1, 30)))]
    instants = sorted({t for span in spans for t in span})
    brute = max(sum(a <= t < b for a, b in spans) for t in instants)  # half-open: [start, end)
    assert serve_load.peak_overlap(spans) == brute, fresh_seed


def test_modulo_text_reads_ids_through_the_tokenizer():
    class Vocab:
        def __len__(self):
            return 10

        def decode(self, ids, skip_special_tokens=True):
            return ",".join(map(str, ids))

    assert serve_load.ModuloText(Vocab()).decode([3, 13, 27]) == "3,3,7"


def test_load_sweep_end_to_end(tmp_path):
    out = tmp_path / "load"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "load", str(out), "--model", "tiny",
           "--device", "cpu", "--configs", "sparse", "--rates", "3", "--concurrency", "2", "--duration", "3",
           "--drain", "60", "--prompt-tokens", "16,256", "--output-tokens", "3,9", "--max-batch", "4",
           "--preset", "small"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((out / "serve_load.json").read_text())
    assert [(r["mode"], r["rate"], r["concurrency"]) for r in result["records"]] == [("poisson", 3.0, None),
                                                                                     ("closed", None, 2)]
    for r in result["records"]:
        assert RECORD_KEYS <= set(r), RECORD_KEYS - set(r)
        assert r["completed"] > 0 and r["lost"] == 0 and not r["refused"], r
        # every completed request generated 3..9 tokens: the throughput lies between those bounds
        assert 3 * r["completed"] / r["wall_s"] * 0.95 <= r["output_tok_s"] <= 9 * r["completed"] / r["wall_s"] * 1.05, r
        assert r["peak_running"] <= 4 and 1 <= r["peak_in_flight"] <= (2 if r["mode"] == "closed" else 99) and r["ttft_p50_ms"] <= r["ttft_p99_ms"], r
        assert r["tpot_p50_ms"] <= r["tpot_p99_ms"], r
        # the timeline's counters never fall, and its generated tokens cover what the point completed
        rows = r["timeline"]
        assert all(b[0] > a[0] and b[1] >= a[1] and b[2] >= a[2] for a, b in zip(rows, rows[1:])), rows
        assert len(rows) < 2 or r["prefill_tok_s"] > 0, r  # prompts were prefilled during the point
        # and the engine's step times saw it prefill and decode
        assert len(rows) < 2 or (r["prefill_busy_tok_s"] > 0 and r["decode_step_ms"] > 0
                                 and 0 < r["prefill_share"] < 1), r
    assert (out / "serve_load.md").read_text().count("| sparse |") == 2
    assert "| config | mode |" in run.stdout


@pytest.mark.parametrize("flag,value,message", [("--prompt-tokens", "9,3", "lo <= hi"),
                                                ("--rates", "0", "> 0"), ("--output-tokens", "x", "lo,hi"),
                                                ("--overload", "0", "--overload needs a factor > 0"),
                                                ("--overload-duration", "-1", "seconds > 0")])
def test_bad_load_options_exit_with_one_line(tmp_path, flag, value, message):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "load", str(tmp_path), "--device", "cpu",
           flag, value]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode != 0 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_common_prefix_against_brute_force(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(100):
        a = [rng.randrange(3) for _ in range(rng.randint(0, 8))]
        b = [rng.randrange(3) for _ in range(rng.randint(0, 8))]
        brute = max(n for n in range(min(len(a), len(b)) + 1) if a[:n] == b[:n])
        assert serve_load.common_prefix(a, b) == brute, (fresh_seed, a, b)


def test_agree_fp32_gives_each_request_its_tokens_alone(tmp_path):
    """The GPU agreement script on the CPU: fp32 greedy tokens under load (rows joining a busy
    batch, chunked prefill, some waiting for a row) equal each request alone, selection engaged."""
    out = tmp_path / "agree"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "agree", str(out), "--model", "tiny",
           "--device", "cpu", "--methods", "dense,sparse-offload", "--requests", "4", "--prompt-tokens", "2100,3000",
           "--max-tokens", "6", "--max-batch", "2", "--prefill-chunk", "512", "--preset", "small",
           "--seed", str(random.randrange(2**31))]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((out / "serve_agree.json").read_text())
    for r in result["records"]:
        assert r["identical"] == r["requests"] == 4 and r["agreement"] == 1.0, (cmd, r)
    assert "| sparse-offload | 4 / 4 | 1.0 |" in run.stdout


class _FakeServer:
    """An OpenAI-shaped completions server on loopback whose answers a test scripts: each
    POST takes the next of ``plan`` (``"ok"``: 3 streamed tokens, ``"429"``, ``"hang"``,
    ``"garbage"``: a broken SSE chunk; the last entry repeats). ``posts`` counts requests.
    ``GET /metrics`` answers ``metrics_text()`` (default: one running request)."""

    def __init__(self, plan, metrics_text=None):
        import http.server
        import threading
        import time as _time

        self.plan, self.posts, self.lock = list(plan), 0, threading.Lock()
        self.metrics_text = metrics_text or (
            lambda: '# TYPE sparda_requests_running gauge\nsparda_requests_running{model="m"} 1.0\n')
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                body = fake.metrics_text().encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with fake.lock:
                    kind = fake.plan[min(fake.posts, len(fake.plan) - 1)]
                    fake.posts += 1
                if kind == "429":
                    body = json.dumps({"error": {"message": "queue full", "type": "rate_limit_exceeded"}}).encode()
                    self.send_response(429)
                    self.send_header("Retry-After", "0")
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                if kind == "hang":
                    _time.sleep(20)
                    return
                if kind == "garbage":
                    self.wfile.write(b"data: {not json\n\n")
                    return
                for i in range(3):
                    chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                             "choices": [{"index": 0, "text": "x", "logprobs": None,
                                          "finish_reason": "length" if i == 2 else None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    _time.sleep(0.01)
                usage = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [],
                         "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url, self.name = f"http://127.0.0.1:{self.httpd.server_address[1]}", "m"
        self.proc = type("P", (), {"pid": os.getpid()})()

    def metrics(self):
        return serve_load.Server.metrics(self)

    def close(self):
        self.httpd.shutdown()


def _args(**kw):
    import argparse

    base = dict(drain=0.5, duration=1.0, prompt_tokens=(4, 8), output_tokens=(3, 3), vocab=100, max_waiting=4,
                max_batch=2)
    return argparse.Namespace(**{**base, **kw})


def test_closed_loop_keeps_a_clients_results_when_its_last_request_hangs():
    fake = _FakeServer(["ok", "ok", "ok", "hang"])
    try:
        point = serve_load.run_point(fake, _args(), "closed", 2, "t")
    finally:
        fake.close()
    assert point["completed"] == 3 and point["open_at_drain"] == 2 and point["lost"] == 2, point
    assert abs(point["output_tok_s"] * point["wall_s"] - 9) < 0.2, point  # 3 requests x 3 tokens
    assert point["peak_running"] == 1 and point["tpot_p50_ms"] is not None, point


def test_refusals_and_broken_streams_are_counted_not_raised():
    fake = _FakeServer(["429", "garbage", "ok"])
    try:
        point = serve_load.run_point(fake, _args(duration=1.5), "poisson", 12, "t")
    finally:
        fake.close()
    assert point["refused"] == {"429": 1} and point["lost"] == 1, point
    assert point["completed"] == fake.posts - 2 and point["completed"] >= 1, (point, fake.posts)


def test_overload_point_offers_a_multiple_of_saturation_and_checks_the_server_after(tmp_path):
    """``--overload 3`` after a closed-loop point: Poisson arrivals at 3x that point's req/s
    into a server of 2 rows and a queue of 1, so requests are refused (429) rather than lost;
    afterwards the server is idle, its memory is read and one more request completes."""
    out = tmp_path / "load"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "load", str(out), "--model", "tiny",
           "--device", "cpu", "--configs", "sparse", "--rates", "", "--concurrency", "2", "--overload", "3",
           "--duration", "4", "--overload-duration", "5", "--drain", "60", "--prompt-tokens", "16,128", "--output-tokens", "8,16",
           "--max-batch", "2", "--max-waiting", "1", "--preset", "small"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    closed, over = json.loads((out / "serve_load.json").read_text())["records"]
    assert (closed["mode"], over["mode"]) == ("closed", "overload"), (closed, over)
    assert over["saturation_rps"] == closed["requests_per_s"] > 0 and over["overload_factor"] == 3.0, over
    assert over["duration_s"] == 5.0 and over["wall_s"] >= 5.0, over
    assert over["rate"] == pytest.approx(3 * closed["requests_per_s"], abs=1e-4), over
    assert over["lost"] == 0 and over["completed"] > 0 and over["refused"], over  # refused, not lost
    assert set(over["refused"]) <= {"429", "503"}, over
    assert over["idle_after"] and over["served_after"] and over["preemptions"] == 0, over  # rows: no pool
    assert over["idle_host_rss_gib_before"] > 0 and over["idle_host_rss_gib_after"] > 0, over
    assert "| sparse | overload |" in run.stdout


def test_load_sweep_replays_the_trace(tmp_path):
    """``--replay-trace --replay-keys order``: the offloaded server replays the shipped trace (its records say
    ``selection: trace`` and carry its hit rate; the replay itself: tests/test_row_replay.py)."""
    out = tmp_path / "load"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "load", str(out), "--model", "tiny",
           "--device", "cpu", "--configs", "sparse-offload", "--rates", "", "--concurrency", "2",
           "--duration", "2", "--drain", "60", "--prompt-tokens", "300,600", "--output-tokens", "3,9",
           "--max-batch", "2", "--preset", "small", "--replay-trace", "--replay-keys", "order"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((out / "serve_load.json").read_text())
    assert result["replay_trace"] == "smollm2-emma.npz" and result["replay_keys"] == "order"
    (r,) = result["records"]
    assert r["selection"] == "trace" and r["completed"] > 0 and r["lost"] == 0, r
    assert 0.0 < r["hit_rate"] <= 1.0, r
    assert r["hit_rate_peak_10s"] is None or 0.0 <= r["hit_rate_peak_10s"] <= 1.0, r
    assert r["decode_step_ms_peak_10s"] is None or r["decode_step_ms_peak_10s"] > 0, r
    assert "replaying" in (out / "server-sparse-offload.log").read_text()


def _scrapes(rng, draw) -> tuple[list[tuple], list[tuple]]:
    """Cumulative scrapes ``(t, a, b)`` a random 0.1-2 s apart and the events ``(t, da, db)``
    behind them, ``draw()`` giving each event's ``(da, db)``."""
    t, a, b, samples, events = 0.0, 0.0, 0.0, [], []
    for _ in range(rng.randint(5, 80)):
        t += rng.uniform(0.1, 2.0)
        da, db = draw()
        a, b = a + da, b + db
        samples.append((t, a, b))
        events.append((t, da, db))
    return samples, events


def _window_sums(samples, events, end) -> tuple[float, float] | None:
    """Brute force: the events' own sums over the 10 s window that ends at the last scrape at
    or before ``end`` and starts at the last scrape at or before ``end - 10`` (the first if none)."""
    upto = [x for x in samples if x[0] <= end]
    if not upto:
        return None
    start = max([x[0] for x in upto if x[0] <= end - 10.0], default=upto[0][0])
    inside = [e for e in events if start < e[0] <= upto[-1][0]]
    return sum(e[1] for e in inside), sum(e[2] for e in inside)


def test_window_hit_rate_against_a_brute_force(fresh_seed):
    """The hit rate over the 10 s up to a time, from cumulative scrapes, equals the blocks'
    own hits and misses summed over that window."""
    rng = random.Random(fresh_seed)
    samples, events = _scrapes(rng, lambda: (rng.randint(0, 500), rng.randint(0, 50)))
    end = rng.uniform(0.0, samples[-1][0] + 1)
    got, sums = serve_load.window_hit_rate(samples, end), _window_sums(samples, events, end)
    want = None if sums is None or not sum(sums) else round(sums[0] / sum(sums), 4)
    assert got == want, (fresh_seed, end)
    assert serve_load.window_hit_rate(samples, None) is None and serve_load.window_hit_rate([], end) is None


def test_window_step_ms_against_a_brute_force(fresh_seed):
    """The mean decode step over the 10 s up to a time, from cumulative scrapes of decode
    seconds and steps, equals the steps' own seconds over their count in that window."""
    rng = random.Random(fresh_seed)

    def draw():
        n = rng.randint(0, 60)
        return sum(rng.uniform(0.005, 0.05) for _ in range(n)), n

    samples, events = _scrapes(rng, draw)
    end = rng.uniform(0.0, samples[-1][0] + 1)
    got, sums = serve_load.window_step_ms(samples, end), _window_sums(samples, events, end)
    if sums is None or not sums[1]:
        assert got is None, (fresh_seed, end, got)
    else:
        assert got == pytest.approx(sums[0] / sums[1] * 1e3, abs=2e-3), (fresh_seed, end, got, sums)
    assert serve_load.window_step_ms(samples, None) is None and serve_load.window_step_ms([], end) is None


def test_step_figures_from_two_scrapes(fresh_seed):
    """``prefill_busy_tok_s``, ``decode_step_ms``, ``prefill_share`` are the counters'
    differences' ratios; a counter missing from the last scrape gives None, one missing
    from the first counts from 0; a zero divisor gives None."""
    rng = random.Random(fresh_seed)
    names = serve_load.STEP_COUNTERS
    first = {name: rng.uniform(0, 100) for name in names}
    grow = [rng.uniform(0.5, 50), rng.randint(1, 10**6), rng.uniform(0.5, 50), rng.randint(1, 10**5)]
    last = {name: first[name] + d for name, d in zip(names, grow)}
    got = serve_load.step_figures(first, last)
    assert got["prefill_busy_tok_s"] == pytest.approx(grow[1] / grow[0], abs=0.05), fresh_seed
    assert got["decode_step_ms"] == pytest.approx(grow[2] / grow[3] * 1e3, abs=5e-4), fresh_seed
    assert got["prefill_share"] == pytest.approx(grow[0] / (grow[0] + grow[2]), abs=5e-5), fresh_seed
    steps = names[3]
    no_steps_yet = serve_load.step_figures({k: v for k, v in first.items() if k != steps}, last)
    assert no_steps_yet["decode_step_ms"] == pytest.approx(grow[2] / last[steps] * 1e3, abs=5e-4), fresh_seed
    assert set(serve_load.step_figures(first, {})) == set(got) and not any(serve_load.step_figures(first, {}).values())
    assert not any(serve_load.step_figures(None, None).values())
    assert serve_load.step_figures(first, first) == dict.fromkeys(got)  # nothing ran: every divisor 0


def test_run_point_records_the_step_times_between_its_first_and_last_scrape(fresh_seed):
    """Against a fake server whose step counters advance with each scrape (decode steps in
    two buckets, summed; one bucket has no sample at the first scrape), the record's figures
    are those of the first and last scrape."""
    rng = random.Random(fresh_seed)
    served = []

    def metrics_text():
        prev = served[-1] if served else [rng.uniform(0, 9), rng.randint(0, 99), rng.uniform(0, 9), 0, 0,
                                          rng.randint(0, 9)]
        now = [prev[0] + rng.uniform(0.01, 1), prev[1] + rng.randint(1, 5000), prev[2] + rng.uniform(0.01, 1),
               prev[3] + rng.randint(1, 50), prev[4] + rng.randint(1, 50) if served else 0,
               prev[5] + rng.randint(0, 3)]
        served.append(now)
        lines = [f'sparda_{name}_total{{model="m"}} {value}' for name, value in
                 zip(("prefill_seconds", "prefill_tokens_run", "decode_seconds"), now)]
        families = [f"# TYPE sparda_{name}_total counter\n{line}" for name, line in
                    zip(("prefill_seconds", "prefill_tokens_run", "decode_seconds"), lines)]
        families.append("# TYPE sparda_decode_steps_total counter\n"
                        + "".join(f'sparda_decode_steps_total{{model="m",bucket="{b}"}} {v}\n'
                                  for b, v in ((4, now[3]), (8, now[4])) if v))  # bucket 8: none at first
        families.append(f'# TYPE sparda_preemptions_total counter\nsparda_preemptions_total{{model="m"}} {now[5]}')
        return "\n".join(families) + "\n"

    fake = _FakeServer(["ok"], metrics_text)
    try:
        point = serve_load.run_point(fake, _args(duration=1.0), "closed", 1, "t")
    finally:
        fake.close()
    a, b = served[0], served[-1]
    assert len(served) >= 3, served
    assert point["prefill_busy_tok_s"] == pytest.approx((b[1] - a[1]) / (b[0] - a[0]), abs=0.05), served
    steps = b[3] + b[4] - a[3] - a[4]
    assert point["decode_step_ms"] == pytest.approx((b[2] - a[2]) / steps * 1e3, abs=5e-4), served
    assert point["prefill_share"] == pytest.approx((b[0] - a[0]) / (b[0] - a[0] + b[2] - a[2]), abs=5e-5), served
    assert point["preemptions"] == b[5] - a[5], served
