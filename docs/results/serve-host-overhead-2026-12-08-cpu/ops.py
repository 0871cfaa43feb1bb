"""Device ops of one decode step, counted on the CPU as CUDA would launch them (sparda.bench.op_count): the
server engine's step (RowReplayer, order keys) against bench's (Replayer), tiny model, 4 rows decoding.

    PYTHONPATH=src python docs/results/serve-host-overhead-2026-12-08-cpu/ops.py
"""
import torch
from sparda.bench import point as pt
from sparda.bench.models import build_model, random_forecast, selection_config
from sparda.bench.op_count import OpCounter, force_fused, twin_engine, count_decode_step
from sparda.bench.traces import RowReplayer, Replayer, replay_masks, load_traces, SHIPPED_TRACE, trace_for
from sparda.engine.engine import Engine
from sparda import SamplingParams

torch.manual_seed(0)
B, P = 4, 400
model = build_model("tiny", "cpu", torch.float32, 4096)
forecast, sel = random_forecast(model), selection_config("tiny")
llm = pt.make_llm(model, "sparda", sel, forecast, cuda_graphs=False)
force_fused(llm.model_runner)
trace = trace_for(load_traces(SHIPPED_TRACE), "sparda")
prompts = [torch.randint(10, 500, (P,)).tolist() for _ in range(B)]

# server engine
from sparda.model.loader import load_model
llm.tokenizer = load_model(None, torch.device("cpu"), torch.float32)[1]
engine = Engine(llm, max_batch=B, max_model_len=1024)
twin_engine(engine.cache)
RowReplayer.attach(engine, trace, keys="order")
seqs = [engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in prompts]
for _ in range(6):
    engine.step()
assert all(s.prefilled for s in seqs)
c = OpCounter()
with torch.inference_mode(), c.watch(engine.cache, llm.model), c:
    engine.step()
server = c

# bench step
runner = llm.model_runner
runner.method.reset()
cache = runner.new_cache(B, 1024); twin_engine(cache)
with torch.inference_mode():
    logits = torch.stack([runner.prefill(cache, r, ids)[-1] for r, ids in enumerate(prompts)])
rp = Replayer(replay_masks(trace, 4, model.config.num_key_value_heads, llm.config.selection, [P] * B, 8, cache.num_blocks))
rp.install(cache)
tokens, positions = logits.argmax(-1), torch.full((B,), P)
for i in range(3):
    with torch.inference_mode():
        out = runner.decode_step(cache, tokens, positions, torch.arange(B), int(positions.max()) + 1)
    tokens, positions = out.argmax(-1), positions + 1
bench = count_decode_step(runner, cache, tokens, positions)
print("server", server.total, server.per_layer())
print("bench ", bench.total, bench.per_layer())
for layer in [1, 2]:
    s, b = server.breakdown(layer), bench.breakdown(layer)
    diff = {k: s.get(k, 0) - b.get(k, 0) for k in set(s) | set(b) if s.get(k, 0) != b.get(k, 0)}
    print("layer", layer, "server - bench:", diff)
for k in ("pre", "head"):
    s, b = server.breakdown(k), bench.breakdown(k)
    print(k, "server - bench:", {n: s.get(n, 0) - b.get(n, 0) for n in set(s) | set(b) if s.get(n, 0) != b.get(n, 0)})
