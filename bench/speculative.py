"""Speculative decoding on the GPU: what a verify step costs, the speed the engine reaches when every draft is
accepted, and batched throughput with adaptive speculation on and off.

    PYTHONPATH=. python3 bench/speculative.py [--shape qwen3-4b] [--prompt 1024] [--new 128] [--out DIR]

Random bf16 weights at a real shape (bench.random_model), loaded through our loader; one engine at a time.
1. Cost of one verify step (Q = k + 1 rows of one sequence, the "verify" attention layout) against one decode
   step (a 16-step decode dispatch's time per step), at contexts 1k and 8k, Q = 4, 8, 16: each a jitted step
   on the engine's own weights and cache, timed over repeated calls.
2. The bound: random weights accept nothing real, so an oracle proposer replays the target's own greedy tokens
   (recorded in a first run without speculation) at no drafting cost; every draft is accepted. Batch 1, decode
   tok/s as a user sees it (first token to last), k = 7 and 15, against plain decode in the same run.
3. A DFlash drafter's own cost at the shape of the published Qwen3-4B drafter (random weights), and the tok/s it
   projects at the published accepted lengths (a verify step, the drafter, the host's time a step), next to the
   measured bound.
4. Batched: 64 concurrent requests, output tok/s with adaptive n-gram speculation on and off, on random prompts and on
   prompts repeating one block (proposals the random target rejects).
5. `--sections real` (the CPU): real acceptance on stories260k's weights: n-gram, the draft model llama2xs-260k
   and a trained DFlash drafter (--dflash-drafter, tools/train_dflash.py) on a copy-heavy prompt and open text.
Prints one table; writes speculative.json.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import hbm_read_ceiling
from bench.random_model import bench_model
from jaxinfer.engine.engine import Engine
from jaxinfer.model.kv_cache import slots_for
from jaxinfer.runner.batch import StepBatch, VerifyBatch
from jaxinfer.runner.steps import verify_step
from jaxinfer.runner.transfer import to_device_packed
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.sample import SamplingArrays

GREEDY = dict(temperature=0, ignore_eos=True)


class OracleProposer:
    """Drafts the tokens a first run without speculation produced: every draft is accepted."""

    name = "oracle"
    host_only = True   # its drafts need only the host's tokens: verify steps may be chained

    def __init__(self, outputs: list[int]):
        self.outputs = outputs

    def propose(self, seqs, k: int) -> list[list[int]]:
        return [self.outputs[len(s.output_ids): len(s.output_ids) + k] for s in seqs]


def _engine(model_dir: Path, context: int, new: int, batch: int = 1, **kw) -> Engine:
    chunk = min(context, 2048)
    return Engine(model_dir, dtype="bfloat16", max_num_seqs=batch, compile_all_at_start=True,
                  max_model_len=context + new + 32, max_num_batched_tokens=chunk, token_buckets=[chunk],
                  progress=False, skip_tokenizer_init=True, max_logprobs=0,
                  cache_dir="/tmp/jaxinfer-bench-cache", **kw)


def _timed_request(engine: Engine, prompt: list[int], new: int) -> tuple[list[int], float]:
    """(tokens, ms a token from the first to the last), the second of two runs."""
    params = SamplingParams(max_tokens=new, **GREEDY)
    for _ in range(2):
        rid = engine.add_request(prompt, params)
        first = done = None
        while engine.has_unfinished():
            for d in engine.step():
                if d.request_id == rid and d.token_ids and first is None:
                    first = time.perf_counter()
                if d.request_id == rid and d.finished:
                    done = time.perf_counter()
        out = engine.take_finished(rid).outputs[0].token_ids
    return out, 1e3 * (done - first) / (len(out) - 1)


def _time(fn, calls: int = 20) -> float:
    """ms a call (after two warm-up calls)."""
    for _ in range(2):
        jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / calls


def verify_cost(model_dir: Path, contexts: list[int], widths: list[int]) -> list[dict]:
    """Section 1: a verify step of Q rows against a decode step, per context."""
    rows = []
    for ctx in contexts:
        engine = _engine(model_dir, ctx, 64, decode_steps=16)
        r = engine.runner
        prompt = np.random.default_rng(0).integers(100, engine.cfg.vocab_size - 100, ctx).tolist()
        _, decode_ms = _timed_request(engine, prompt, 64)
        pages = engine.pages.allocate(-(-(ctx + 16) // r.page_size))
        for width in widths:
            step = jax.jit(functools.partial(verify_step, engine.cfg, r.ops, 0, greedy=True, attention="verify"),
                           donate_argnums=(1, 2))
            a = r.empty_verify(width, 1, width)
            s = a["step"]
            start = ctx - 1
            s["tokens"][:] = 1000
            s["positions"][:] = np.arange(start, start + width)
            s["slot_mapping"][:] = slots_for(pages, start, start + width, r.page_size)
            s["page_table"][0, :len(pages)] = pages
            s["emits"][0], s["state_row"][0] = True, 0
            a["score_rows"][0] = np.arange(width)
            a["num_drafts"][0] = width - 1
            batch = to_device_packed(VerifyBatch(step=StepBatch(**s, sampling=SamplingArrays.from_params([], [], 1)),
                                                 **{k: a[k] for k in ("score_rows", "drafts", "num_drafts")}))

            def call():
                r.kv, r.state, *out = step(r.params, r.kv, r.state, batch)
                return out
            ms = _time(call)
            rows.append(dict(context=ctx, Q=width, verify_ms=ms, decode_ms=decode_ms, ratio=ms / decode_ms))
            print(f"# verify ctx {ctx} Q {width}: {ms:.3f} ms, decode step {decode_ms:.3f} ms, x{ms / decode_ms:.2f}",
                  flush=True)
        del engine, r
        gc.collect()
    return rows


def oracle_bound(model_dir: Path, context: int, new: int, ks: list[int]) -> list[dict]:
    """Section 2: plain decode, then the oracle proposer at each k."""
    engine = _engine(model_dir, context, new, decode_steps=16)
    prompt = np.random.default_rng(1).integers(100, engine.cfg.vocab_size - 100, context).tolist()
    tokens, plain_ms = _timed_request(engine, prompt, new)
    del engine
    gc.collect()
    rows = [dict(case="decode", k=0, step_ms=plain_ms, tok_s=1e3 / plain_ms, speedup=1.0, equal=True)]
    print(f"# plain decode: {1e3 / plain_ms:.0f} tok/s", flush=True)
    for k, chain in ((k, chain) for k in ks for chain in (False, True)):   # verify steps chained or not (A/B)
        engine = _engine(model_dir, context, new, decode_steps=16, speculative="ngram", num_speculative_tokens=k,
                         chain_verify=chain)
        engine.speculator.adaptive = False
        # A verify step's logits round differently from a decode step's (other kernels), so on random weights
        # (near-ties everywhere) its greedy text can part from plain decode's: replay its own text until fixed.
        record = tokens
        for _ in range(4):
            engine.speculator.proposer = OracleProposer(record)
            engine.speculator.stats = type(engine.speculator.stats)()
            out, ms = _timed_request(engine, prompt, new)
            if out == record:
                break
            record = out
        st = engine.speculator.stats
        rows.append(dict(case=f"oracle k={k}" + (" chained" if chain else ""), k=k, chain=chain, step_ms=ms,
                         tok_s=1e3 / ms, speedup=plain_ms / ms, equal=out == tokens,
                         mean_accepted_length=round(st.mean_accepted_length, 2), verify_steps=st.verify_steps,
                         chained_steps=st.chained_steps, chained_rows_dropped=st.chained_rows_dropped))
        print(f"# oracle k={k}{' chained' if chain else ''}: {1e3 / ms:.0f} tok/s, x{plain_ms / ms:.2f}, "
              f"chained steps {st.chained_steps} (rows dropped {st.chained_rows_dropped}), accepted length "
              f"{st.mean_accepted_length:.2f}, tokens equal to plain decode's: {out == tokens}; host phases "
              f"{ {p: round(v, 3) for p, v in engine.phase_seconds.items() if v} }", flush=True)
        del engine
        gc.collect()
    return rows


# The published Qwen3-4B DFlash drafter's shape (z-lab/Qwen3-4B-DFlash-b16): five Qwen3 layers of the target's
# width, blocks of 16, reading five target layers.
DFLASH_QWEN3_4B = dict(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=16, num_target_layers=36,
                       dflash_config=dict(mask_token_id=151669), hidden_size=2560, num_hidden_layers=5,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                       vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=40960,
                       rope_parameters=dict(rope_type="default", rope_theta=1000000.0), hidden_act="silu")


def dflash_cost(context: int, verify_ms: float | None, bound_ms: float | None) -> list[dict]:
    """Section 3: the drafter's own work a verify step at the published Qwen3-4B drafter's shape (random weights,
    bf16, batch 1): writing the step's 16 rows of context, and one block pass over a context of `context`."""
    from jaxinfer.model.kv_cache import KVCache
    from jaxinfer.ops import get_ops
    from jaxinfer.spec.dflash_config import dflash_config_from_hf, random_dflash_params
    from jaxinfer.spec.dflash_proposer import draft_block, write_context

    dcfg = dflash_config_from_hf(DFLASH_QWEN3_4B, "bfloat16")
    ops = get_ops("pallas" if jax.devices()[0].platform == "gpu" else "reference")
    params = random_dflash_params(dcfg)
    cfg, bs, ps = dcfg.model, dcfg.block_size, 16
    n_pages = -(-(context + 2 * bs) // ps) + 1
    pool = KVCache.allocate(cfg, n_pages, ps)
    pages = np.arange(1, n_pages, dtype=np.int32)
    embed = jax.random.normal(jax.random.key(1), (cfg.vocab_size, cfg.hidden_size), cfg.jnp_dtype) * 0.02
    states = jax.random.normal(jax.random.key(2), (len(dcfg.target_layer_ids), bs, cfg.hidden_size), cfg.jnp_dtype)
    write = jax.jit(functools.partial(write_context, dcfg, ops), donate_argnums=(1,))
    draft = jax.jit(functools.partial(draft_block, dcfg, ops), donate_argnums=(1,))
    box = {"pool": pool}
    positions = jnp.arange(context - bs, context, dtype=jnp.int32)
    slots = jnp.asarray(slots_for(pages.tolist(), context - bs, context, ps))
    block_slots = jnp.asarray(slots_for(pages.tolist(), context - 1, context - 1 + bs, ps))[None]

    def do_write():
        box["pool"] = write(params, box["pool"], states, positions, slots)
        return box["pool"].k

    def do_draft():
        box["pool"], d = draft(params, box["pool"], embed, embed, jnp.array([7], jnp.int32),
                               jnp.array([context - 1], jnp.int32), jnp.asarray(pages)[None], block_slots)
        return d
    write_ms, draft_ms = _time(do_write), _time(do_draft)
    ms = write_ms + draft_ms
    print(f"# dflash drafter: context write {write_ms:.3f} ms, block pass {draft_ms:.3f} ms", flush=True)
    rows = [dict(case="dflash drafter (write 16 rows + one block pass)", step_ms=ms, write_ms=write_ms,
                 draft_ms=draft_ms)]
    for label, accepted in (("math, published ~6.3 a verify", 6.3), ("chat, published ~3.4", 3.4)):
        if verify_ms is None:
            continue
        step = verify_ms + ms + (bound_ms or 0.0)
        rows.append(dict(case=f"dflash projected, {label}", step_ms=step, tok_s=1e3 * accepted / step))
    return rows


def batched(model_dir: Path, n: int, prompt_len: int, new: int) -> list[dict]:
    """Section 4: n concurrent requests, adaptive n-gram speculation off and on; on random prompts (the random
    model's text gives n-gram proposals rarely) and on prompts that repeat one 32-token block (proposals from the
    start, which the random target rejects). Each engine runs the requests six times; the last five are timed, their
    tokens checked equal to speculation off's. Also counted: verify steps, drafted tokens, and decode dispatches
    launched unchained (the host's work not overlapped with the device), in the timed run."""
    rows, base = [], {}
    engine = None
    cases = [(None, "random"), (None, "repeating"), ("ngram", "random"), ("ngram", "repeating")]
    for spec, kind in cases:
        if engine is None or spec is not None or engine.speculator is not None:   # speculation: a fresh policy
            del engine
            gc.collect()
            engine = _engine(model_dir, prompt_len, new, batch=n, speculative=spec)
            unchained, launch = [0], engine._launch_decode
            engine._launch_decode = lambda seqs, launch=launch, unchained=unchained: (
                unchained.__setitem__(0, unchained[0] + 1), launch(seqs))[1]
        vocab = engine.cfg.vocab_size
        prompt_rng = np.random.default_rng(3)
        if kind == "random":
            prompts = [prompt_rng.integers(100, vocab - 100, prompt_len).tolist() for _ in range(n)]
        else:
            prompts = [(prompt_rng.integers(100, vocab - 100, 32).tolist() * prompt_len)[:prompt_len] for _ in range(n)]
        params = SamplingParams(max_tokens=new, **GREEDY)
        st = engine.speculator.stats if engine.speculator else None
        first = None
        for rep in range(6):   # the first run learns (and compiles what is left); the other five are timed
            if rep == 1:
                before = (st.verify_steps, st.drafted) if st else (0, 0)
                unchained[0], tokens, wall = 0, 0, 0.0
            t0 = time.perf_counter()
            ids = [engine.add_request(p, params) for p in prompts]
            got = 0
            while engine.has_unfinished():
                got += sum(len(d.token_ids) for d in engine.step())
            elapsed = time.perf_counter() - t0
            outs = [engine.take_finished(i).outputs[0].token_ids for i in ids]
            if rep == 0:
                first = got / elapsed
            else:
                tokens, wall = tokens + got, wall + elapsed
        if spec is None:
            base[kind] = (tokens / wall, outs)
        verify_steps, drafted = (st.verify_steps - before[0], st.drafted - before[1]) if st else (0, 0)
        rows.append(dict(case=f"batch {n}, {kind} prompts, speculation {spec or 'off'}", tok_s=tokens / wall,
                         wall_s=wall, speedup=tokens / wall / base[kind][0], equal=outs == base[kind][1],
                         first_run_tok_s=first,
                         verify_steps=verify_steps, drafted=drafted, unchained_decodes=unchained[0]))
        print(f"# batch {n} {kind} {spec}: {tokens / wall:.0f} output tok/s (first run {first:.0f}), "
              f"x{rows[-1]['speedup']:.2f}, verify steps "
              f"{verify_steps}, drafted {drafted}, unchained decode dispatches {unchained[0]}, tokens equal "
              f"{rows[-1]['equal']}", flush=True)
    del engine
    gc.collect()
    return rows


def real_acceptance(target: Path, draft: Path, drafter: Path | None, new: int) -> list[dict]:
    """Section 5 (the CPU, real weights): mean accepted length and tok/s of each proposer against decoding without
    speculation on stories260k: a copy-heavy prompt (a story the model told, then its opening again: it retells
    it) and open text (story openers). Greedy; tokens checked equal to decoding without speculation. Every step
    verifies what the proposer drafts (no adaptive choice): the acceptance at k = 7 (DFlash: its block)."""
    from jaxinfer import LLM

    story = LLM(target, progress=False, cache_dir="").generate(
        "Once upon a time", SamplingParams(max_tokens=160, temperature=0))[0]
    ids = story.prompt_token_ids + story.outputs[0].token_ids
    cases = {"copy-heavy": [ids + ids[:24]], "open text": [
        "Once upon a time, there was a little dog", "Tom and Sue went to the park", "One day, a bird"]}
    proposers = {"none": None, "ngram": "ngram", "draft model (llama2xs-260k)": f"draft:{draft}"}
    if drafter is not None:
        proposers["dflash (trained)"] = f"dflash:{drafter}"
    rows = []
    for case, prompts in cases.items():
        base = None
        for name, spec in proposers.items():
            llm = LLM(target, speculative=spec, num_speculative_tokens=None if spec is None or "dflash" in spec else 7,
                      max_num_seqs=1, enable_prefix_caching=False, progress=False, cache_dir="")
            if llm.engine.speculator is not None:   # every step verifies what is proposed: acceptance at k
                llm.engine.speculator.adaptive = False
            params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
            for p in prompts:   # every step shape compiled before the timed run
                llm.generate(p, params)
            e = llm.engine
            e.stats = dict.fromkeys(e.stats, 0)
            if e.speculator:
                e.speculator.stats = type(e.speculator.stats)()
            t0 = time.perf_counter()
            tokens = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
            wall = time.perf_counter() - t0
            tok_s = sum(map(len, tokens)) / wall
            base = (tokens, tok_s) if spec is None else base
            st = e.speculator.stats if e.speculator else None
            rows.append(dict(case=f"{case}: {name}", tok_s=tok_s, speedup=tok_s / base[1], equal=tokens == base[0],
                             mean_accepted_length=round(st.mean_accepted_length, 2) if st else "-"))
            print(f"# {rows[-1]}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--widths", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[7, 15])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch-prompt", type=int, default=256)
    ap.add_argument("--sections", nargs="+", default=["verify", "oracle", "dflash", "batched"])
    ap.add_argument("--dflash-drafter", default=None, help="a trained drafter for stories260k (section real)")
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    bw = hbm_read_ceiling(4 if jax.devices()[0].platform == "gpu" else 0.125)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; HBM read bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    model_dir = bench_model(args.models, args.shape) if set(args.sections) - {"real"} else None
    out: dict = dict(device=jax.devices()[0].device_kind, shape=args.shape, bandwidth=bw)
    if "verify" in args.sections:
        out["verify"] = verify_cost(model_dir, args.contexts, args.widths)
    if "oracle" in args.sections:
        out["oracle"] = oracle_bound(model_dir, args.prompt, args.new, args.ks)
    if "dflash" in args.sections:
        # projected step: the verify step, the drafter's work, and the host time a verify step costs beyond its
        # device time (from the oracle run at k = 15: its ms a step less the verify step's)
        v16 = next((r["verify_ms"] for r in out.get("verify", []) if r["Q"] == 16 and r["context"] == args.prompt), None)
        o15 = next((r for r in out.get("oracle", []) if r["k"] == 15 and not r.get("chain")), None)
        host = o15["step_ms"] * o15["mean_accepted_length"] - v16 if o15 and v16 else None
        try:
            out["dflash"] = dflash_cost(args.prompt, v16, host)
        except Exception as e:
            out["dflash"] = [dict(case="dflash", error=f"{type(e).__name__}: {e}")]
    if "real" in args.sections:   # the CPU: stories260k's real weights
        shared = Path(__file__).resolve().parents[2] / "shared" / "models"
        out["real"] = real_acceptance(shared / "stories260k", shared / "llama2xs-260k",
                                      Path(args.dflash_drafter) if args.dflash_drafter else None, args.new)
    if "batched" in args.sections:
        out["batched"] = batched(model_dir, args.batch, args.batch_prompt, args.new)
    Path(args.out, "speculative.json").write_text(json.dumps(out, indent=1, default=str))

    print(f"\n{args.shape}, bf16, batch 1 after a {args.prompt}-token prompt unless said (real: stories260k, float32, "
          f"the CPU); {out['device']}")
    if "verify" in out:
        print("\n| context | Q (k + 1) | verify step ms | decode step ms | verify / decode |\n|---|---|---|---|---|")
        for r in out["verify"]:
            print(f"| {r['context']} | {r['Q']} | {r['verify_ms']:.3f} | {r['decode_ms']:.3f} | {r['ratio']:.2f} |")
    rest = out.get("oracle", []) + out.get("dflash", []) + out.get("batched", []) + out.get("real", [])
    if rest:
        print("\n| case | tok/s | ms a token or step | vs decode | accepted length | tokens equal |\n|---|---|---|---|---|---|")
        for r in rest:
            if "error" in r:
                print(f"| {r['case']} | failed: {r['error'][:100]} | | | | |")
                continue
            tok_s = f"{r['tok_s']:.0f}" if r.get("tok_s") else "-"
            ms = f"{r['step_ms']:.3f}" if r.get("step_ms") else f"{r['wall_s']:.1f} s wall" if "wall_s" in r else "-"
            print(f"| {r['case']} | {tok_s} | {ms} | {r.get('speedup', 0):.2f}x | "
                  f"{r.get('mean_accepted_length', '-')} | {r.get('equal', '-')} |")


if __name__ == "__main__":
    main()
