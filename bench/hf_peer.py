"""The transformers peer of the decode benchmark, in its fastest set-up: a static KV cache and the
model's forward under torch.compile ("reduce-overhead": CUDA graphs), greedy `generate`.

Per-token times come from a streamer that stamps each token as generate emits it, so one generate
call (the same shapes as the warm-up's, hence no recompilation) gives both the time to the first
token and the decode step. Imports only torch and transformers (no JAX).
"""

from __future__ import annotations

import time
from pathlib import Path


def run_hf_compiled(model_dir: Path, prompt: list[int], new: int, device: str = "cuda") -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):   # the prompt first, then one call per generated token
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.tensor([prompt], device=device)
    kw = dict(do_sample=False, cache_implementation="static", max_new_tokens=new, min_new_tokens=new,
              pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **kw)            # compiles (prefill and decode shapes), records graphs
        model.generate(ids, **kw)
        stamps = Stamps()
        t0 = time.perf_counter()
        out = model.generate(ids, streamer=stamps, **kw)
    t = stamps.times[1:]                     # times[0]: the prompt, echoed before any work
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(step_ms=1e3 * (t[-1] - t[0]) / (len(t) - 1), ttft_ms=1e3 * (t[0] - t0),
                tokens=out[0, len(prompt):].tolist(), setup="static cache, torch.compile reduce-overhead")
