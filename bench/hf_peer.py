"""The transformers peer of the decode benchmark, in its fastest set-up: greedy `generate` with a static KV cache,
whose decode steps transformers itself compiles (`CompileConfig`: torch.compile, "reduce-overhead" = CUDA graphs; the
prompt's forward runs eager). A hand-made loop around a compiled forward failed on the GPU (a CUDA
graph's output overwritten by the next replay); generate copies the logits it keeps, so its own path is the one used.

Per-token times come from a streamer that stamps each token as generate emits it, so one generate
call (the same shapes as the warm-up's, hence no recompilation) gives both the time to the first
token and the decode step. Imports only torch and transformers (no JAX).
"""

from __future__ import annotations

import time
from pathlib import Path


def run_hf_compiled(model_dir: Path, prompt: list[int], new: int, device: str = "cuda") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, CompileConfig
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
    ids = torch.tensor([prompt], device=device)
    kw = dict(do_sample=False, cache_implementation="static", max_new_tokens=new, min_new_tokens=new,
              pad_token_id=0, compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, **kw)            # compiles the decode step, records its graphs
        warm_s = time.perf_counter() - t0
        compiled = getattr(model, "_compiled_call", None) is not None   # where generate keeps its compiled forward
        if not compiled:   # eager with a static cache is ~0.6 s a token here (GPU_FACTS.md): do not time it
            raise RuntimeError(f"generate did not compile its decode step (warm-up {warm_s:.0f} s)")
        model.generate(ids, **kw)
        stamps = Stamps()
        t0 = time.perf_counter()
        out = model.generate(ids, streamer=stamps, **kw)
    t = stamps.times[1:]                     # times[0]: the prompt, echoed before any work
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(step_ms=1e3 * (t[-1] - t[0]) / (len(t) - 1), ttft_ms=1e3 * (t[0] - t0),
                tokens=out[0, len(prompt):].tolist(), warmup_s=warm_s,
                setup="generate, static cache, its torch.compile (reduce-overhead)")
