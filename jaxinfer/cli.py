"""The `jaxinfer` command: generate, chat, serve."""

from __future__ import annotations

import argparse
import os
import sys
import time

from jaxinfer.errors import JaxinferError

DEFAULT_MODEL = "../shared/models/stories260k"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2, as for every other bad input
        print(f"jaxinfer: error: {message}", file=sys.stderr)
        sys.exit(2)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hugging Face model folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--ops", default="reference", help="op backend")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache storage: auto (the model's dtype) or fp8 (float8 e4m3: twice the tokens, "
                        "half the KV reads, 3 mantissa bits)")


def _sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="continue a prompt, streaming to stdout")
    _engine_args(g)
    _sampling_args(g, temperature=0.0)
    g.add_argument("prompt")
    c = sub.add_parser("chat", help="interactive chat (the model's chat template where it has one)")
    _engine_args(c)
    _sampling_args(c, temperature=0.7)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("JAXINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on all but /health (default: $JAXINFER_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API (default: folder name)")
    s.add_argument("--max-num-seqs", type=int, default=16, help="sequences in the running batch")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of a prompt step (default: 2048 on GPUs, 512 on CPUs)")
    s.add_argument("--decode-steps", type=int, default=None,
                   help="decode steps per dispatch (default 8): fewer let a new request start sooner")
    s.add_argument("--short-decode-max-batch", type=int, default=None,
                   help="batches of at most this many sequences run dispatches of --short-decode-steps "
                        "(default 0: off)")
    s.add_argument("--short-decode-steps", type=int, default=None,
                   help="decode steps per dispatch of those small batches (default 2)")
    s.add_argument("--chain-early-ms", type=float, default=None,
                   help="launch the next decode dispatch this much before the running one's expected end less a "
                        "launch (default 1: less device idle between dispatches; newcomers in the window wait "
                        "one dispatch more)")
    s.add_argument("--gpu-memory-fraction", type=float, default=None,
                   help="share of device memory for weights and KV cache")
    s.add_argument("--enable-prompt-logprobs", action="store_true",
                   help="score prompt tokens too (completions with echo and logprobs); compiles more steps")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for a slot; beyond that, 503 at once")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--overlap-mixed", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each prompt step before reading the previous one back, so the host's work between "
                        "prompt steps overlaps the device's (default: on GPUs)")
    s.add_argument("--prefill-behind-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="with --overlap-mixed: launch a newcomer's prompt step behind the decode dispatch in flight "
                        "(default: on GPUs)")
    s.add_argument("--fresh-prompt-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="a prompt step of at least 1,024 tokens that is one prompt from position 0 runs its attention "
                        "on cuDNN's flash attention instead of the paged kernel (default: on GPUs)")
    s.add_argument("--prefixed-chunk-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="with the fresh-prompt attention: a prompt chunk of at least 1,024 tokens after a cached prefix "
                        "runs on cuDNN too (two attentions merged by log-sum-exp; default: on GPUs)")
    s.add_argument("--prompt-step-head-layers", type=int, default=None,
                   help="run a one-prompt step as two executables, this many layers in the first, so the device "
                        "starts while the host launches the rest (0: one executable; default: 6 on GPUs)")
    s.add_argument("--generation-config", default="auto",
                   help="sampling defaults for the fields a request leaves out: auto (the model's "
                        "generation_config.json, as vLLM), none (temperature 1, no filters), or a folder holding one")
    s.add_argument("--plain-sampling-step", action=argparse.BooleanOptionalAction, default=None,
                   help="sampling steps without top-k or top-p rows run a variant without the sort over the vocabulary, "
                        "and no sampling step has a device-side branch (which the GPU runtime reads back mid-step) "
                        "(default: on GPUs)")
    s.add_argument("--no-freeze-gc", action="store_true",
                   help="leave start-up's objects in the garbage collector's scans (by default they are frozen "
                        "after start-up: shorter collections while serving)")
    b = sub.add_parser("bench", help="offline latency and throughput on random prompts")
    _engine_args(b)
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    b.add_argument("--output-len", type=int, default=128, help="generated tokens per request (EOS ignored)")
    b.add_argument("--batch-size", type=int, default=8, help="requests running at once")
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--overlap-mixed", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each prompt step before reading the previous one back (default: on GPUs)")
    b.add_argument("--like-serve", action="store_true",
                   help="build the engine as `jaxinfer serve` does (tokenizer loaded and outputs detokenized, top "
                        "logprobs computed, prefix caching, the model's context length unless --max-model-len): "
                        "the offline figure for a server's throughput")
    return parser


def _sampling(args):
    from jaxinfer.sampling.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed)


def _engine(args):
    from jaxinfer.engine.engine import Engine

    return Engine(args.model, dtype=args.dtype, max_model_len=args.max_model_len, ops=args.ops,
                  kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=1)


def _stream_to_stdout(engine, prompt, params) -> None:
    from jaxinfer.engine.engine import stream

    for delta in stream(engine, prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()


def cmd_generate(args) -> None:
    params = _sampling(args)
    engine = _engine(args)
    print(f"[loaded in {engine.load_seconds:.1f} s, compiled in {engine.compile_seconds:.1f} s]", file=sys.stderr)
    sys.stdout.write(args.prompt)
    _stream_to_stdout(engine, args.prompt, params)
    sys.stdout.write("\n")
    s = engine.stats
    prefill = s["prefill_tokens"] / max(s["prefill_seconds"], 1e-9)
    decode = s["decode_tokens"] / max(s["decode_seconds"], 1e-9)
    print(f"[prefill {s['prefill_tokens']} tokens at {prefill:.0f} tok/s; "
          f"decode {s['decode_tokens']} tokens at {decode:.0f} tok/s]", file=sys.stderr)


def cmd_chat(args) -> None:
    params = _sampling(args)
    engine = _engine(args)
    tok = engine.tokenizer
    templated = tok.chat_template is not None
    print(f"[{'chat template' if templated else 'no chat template: plain continuation'}; /exit or Ctrl-D leaves]",
          file=sys.stderr)
    messages: list[dict[str, str]] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if not line.strip():
            continue
        if templated:
            messages.append({"role": "user", "content": line})
            prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                                add_special_tokens=False)
        else:
            prompt = line
        reply = []
        from jaxinfer.engine.engine import stream

        try:
            for delta in stream(engine, prompt, params):
                reply.append(delta.text)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        except (JaxinferError, ValueError) as e:  # e.g. the conversation outgrew the context
            print(f"\njaxinfer: error: {e}", file=sys.stderr)
            if templated:
                messages.pop()
            continue
        sys.stdout.write("\n")
        if templated:
            messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(args) -> None:
    if args.port < 0 or args.port > 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.gpu_memory_fraction is not None and not 0 < args.gpu_memory_fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {args.gpu_memory_fraction}")
    from jaxinfer.serve.server import serve

    serve(args.model, host=args.host, port=args.port, api_key=args.api_key,
          served_model_name=args.served_model_name, max_waiting=args.max_waiting, log_level=args.log_level,
          freeze_gc=not args.no_freeze_gc, dtype=args.dtype, ops=args.ops, max_num_seqs=args.max_num_seqs,
          max_model_len=args.max_model_len,
          max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_fraction=args.gpu_memory_fraction,
          enable_prompt_logprobs=args.enable_prompt_logprobs or None, decode_steps=args.decode_steps,
          short_decode_max_batch=args.short_decode_max_batch, short_decode_steps=args.short_decode_steps,
          chain_early_ms=args.chain_early_ms,
          kv_cache_dtype=args.kv_cache_dtype, overlap_mixed=args.overlap_mixed,
          fresh_prompt_attention=args.fresh_prompt_attention, prefill_behind_decode=args.prefill_behind_decode,
          prefixed_chunk_attention=args.prefixed_chunk_attention, plain_sampling_step=args.plain_sampling_step,
          prompt_step_head_layers=args.prompt_step_head_layers, generation_config=args.generation_config)


def cmd_bench(args) -> None:
    """Like `vllm bench latency/throughput`: a single request first, then num_prompts at batch-size."""
    import numpy as np

    from jaxinfer.engine.engine import Engine
    from jaxinfer.sampling.sampling import SamplingParams

    if min(args.input_len, args.output_len, args.batch_size, args.num_prompts) < 1:
        raise ValueError("--input-len, --output-len, --batch-size and --num-prompts must be >= 1")
    if args.like_serve:
        from jaxinfer.serve.server import engine_options

        engine = Engine(args.model, **engine_options(dtype=args.dtype, ops=args.ops, max_num_seqs=args.batch_size,
                                                     max_model_len=args.max_model_len,
                                                     kv_cache_dtype=args.kv_cache_dtype,
                                                     overlap_mixed=args.overlap_mixed))
    else:
        engine = Engine(args.model, dtype=args.dtype, ops=args.ops, max_num_seqs=args.batch_size,
                        max_model_len=args.max_model_len or args.input_len + args.output_len + 1,
                        max_num_batched_tokens=max(16, min(2048, args.input_len * args.batch_size)),
                        skip_tokenizer_init=True, max_logprobs=0, enable_prefix_caching=False,
                        kv_cache_dtype=args.kv_cache_dtype, overlap_mixed=args.overlap_mixed)
    rng = np.random.default_rng(args.seed)
    vocab = engine.cfg.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        ids = [engine.add_request(rng.integers(0, vocab, args.input_len).tolist(), params) for _ in range(n)]
        while engine.has_unfinished():
            engine.step()
        for i in ids:
            engine.take_finished(i)
        return time.perf_counter() - t0

    run(1)  # warm-up
    engine.stats = {k: 0 for k in engine.stats}
    single = run(1)
    s = engine.stats
    print(f"single request: {args.input_len} prompt + {args.output_len} new tokens in {single * 1e3:.1f} ms; "
          f"prefill {s['prefill_tokens'] / max(s['prefill_seconds'], 1e-9):,.0f} tok/s, "
          f"decode {s['decode_tokens'] / max(s['decode_seconds'], 1e-9):,.0f} tok/s")
    engine.stats = {k: 0 for k in engine.stats}
    engine.phase_seconds = dict.fromkeys(engine.phase_seconds, 0.0)
    wall = run(args.num_prompts)
    s = engine.stats
    tokens = args.num_prompts * args.output_len
    print(f"throughput: {args.num_prompts} requests at batch {args.batch_size} in {wall:.2f} s = "
          f"{args.num_prompts / wall:.2f} req/s, {tokens / wall:,.0f} output tok/s, "
          f"{args.num_prompts * (args.input_len + args.output_len) / wall:,.0f} total tok/s; of the wall time "
          f"prefill steps {s['prefill_seconds'] / wall:.0%}, decode {s['decode_seconds'] / wall:.0%}")
    print("engine phases, share of the wall time: " + ", ".join(f"{p} {v / wall:.1%}"
                                                               for p, v in engine.phase_seconds.items()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "bench": cmd_bench}[args.command](args)
    except (JaxinferError, ValueError, OSError) as e:
        message = " ".join(str(e).split())  # one line, whatever the exception carried
        print(f"jaxinfer: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
