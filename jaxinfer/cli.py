"""The `jaxinfer` command: generate, chat."""

from __future__ import annotations

import argparse
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
    return parser


def _sampling(args):
    from jaxinfer.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed)


def _engine(args):
    from jaxinfer.engine import Engine

    return Engine(args.model, dtype=args.dtype, max_model_len=args.max_model_len, ops=args.ops,
                  max_num_seqs=1)


def _stream_to_stdout(engine, prompt, params) -> None:
    from jaxinfer.engine import stream

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
        from jaxinfer.engine import stream

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"generate": cmd_generate, "chat": cmd_chat}[args.command](args)
    except (JaxinferError, ValueError, OSError) as e:
        message = " ".join(str(e).split())  # one line, whatever the exception carried
        print(f"jaxinfer: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
