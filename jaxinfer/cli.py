"""The `jaxinfer` command: generate, chat, serve, bench.

Engine flags are made from EngineConfig's fields (jaxinfer/settings.py), server flags from ServerConfig's:
a setting is declared once, with its help. A flag left out keeps the setting's default; `--tuning KEY=VALUE`
sets a Tuning switch by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types
import typing
from typing import Any

from jaxinfer import __version__
from jaxinfer.errors import JaxinferError
from jaxinfer.settings import EngineConfig, ServerConfig, Tuning


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2, as for every other bad input
        print(f"jaxinfer: error: {message}", file=sys.stderr)
        sys.exit(2)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        # the settings' flags default to SUPPRESS (only what the user types is passed on): show the setting's
        default = getattr(action, "setting_default", action.default)
        if default in (argparse.SUPPRESS, None, []) or action.required or "(default:" in (action.help or ""):
            return action.help
        return f"{action.help} (default: {default})" if action.option_strings else action.help


def _base_type(hint: Any) -> type:
    """int for `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def add_settings(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """A flag per field of the settings dataclass `cls` (with its help, choices and default), each left out
    of the parsed namespace unless given."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} settings")
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("flag", True):
            continue
        flag, kind = "--" + f.name.replace("_", "-"), _base_type(hints[f.name])
        kw: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=f.metadata["help"])
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            choices = f.metadata.get("choices")
            kw.update(type=kind, choices=choices, metavar=None if choices else f.name.split("_")[-1].upper())
        action = group.add_argument(flag, **kw)
        action.setting_default = f.default


def _parse_bool(text: str) -> bool:
    value = {"true": True, "1": True, "on": True, "yes": True, "false": False, "0": False, "off": False, "no": False}
    if text.lower() not in value:
        raise ValueError(f"expected true or false, got {text!r}")
    return value[text.lower()]


def parse_tuning(items: list[str]) -> dict[str, Any]:
    """`--tuning KEY=VALUE` items as Tuning fields; an unknown key is an error that names it."""
    hints, names = typing.get_type_hints(Tuning), {f.name for f in dataclasses.fields(Tuning)}
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in names:
            raise ValueError(f"--tuning {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(names))}")
        kind = _base_type(hints[key])
        try:
            if text.lower() in ("none", ""):
                out[key] = None
            elif kind is bool:
                out[key] = _parse_bool(text)
            elif kind is tuple:
                out[key] = tuple(int(x) for x in text.split(","))
            else:
                out[key] = kind(text)
        except ValueError as e:
            raise ValueError(f"--tuning {key}: {e}") from None
    return out


def _engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model folder (config.json, *.safetensors, "
                   "tokenizer.json)")
    add_settings(p, EngineConfig, skip)
    p.add_argument("--tuning", action="append", default=[], metavar="KEY=VALUE",
                   help="a measured GPU switch (docs/tuning.md), e.g. overlap_mixed=false; repeatable")


def _sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=temperature, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this share of the mass")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the most likely's")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 is none")
    s = g.add_mutually_exclusive_group()   # structured output (docs/structured_output.md)
    s.add_argument("--json-schema", metavar="FILE|JSON", help="the output follows this JSON Schema (a file or the text)")
    s.add_argument("--regex", help="the output matches this regular expression")
    s.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these strings (repeat it)")
    s.add_argument("--grammar", metavar="FILE|TEXT", help="the output follows this Lark or GBNF grammar (a file or "
                   "the text)")


# generate and chat run one sequence at a time; serve and bench compile every shape at start-up
ONE_SEQUENCE = {"max_num_seqs": 1}
SERVING = {"compile_all_at_start": True}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxinfer", description="LLM inference in JAX with Pallas GPU kernels",
                     formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"jaxinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="continue a prompt, streaming to stdout", formatter_class=_Help)
    _engine_args(g, skip=tuple(ONE_SEQUENCE))
    _sampling_args(g, temperature=0.0)
    g.add_argument("prompt", help="the text to continue")
    c = sub.add_parser("chat", help="interactive chat (the model's chat template where it has one)",
                       formatter_class=_Help)
    _engine_args(c, skip=tuple(ONE_SEQUENCE))
    _sampling_args(c, temperature=0.7)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                       formatter_class=_Help)
    _engine_args(s)
    add_settings(s, ServerConfig)
    b = sub.add_parser("bench", help="offline latency and throughput on random prompts", formatter_class=_Help)
    _engine_args(b)
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    b.add_argument("--output-len", type=int, default=128, help="generated tokens per request (EOS ignored)")
    b.add_argument("--num-prompts", type=int, default=32, help="requests, up to --max-num-seqs of them at once")
    b.add_argument("--like-serve", action="store_true",
                   help="build the engine as `jaxinfer serve` does (tokenizer loaded and outputs detokenized, top "
                        "logprobs computed, prefix caching, the model's context length unless --max-model-len): "
                        "the offline figure for a server's throughput")
    return parser


def _given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.metadata.get("flag", True) and hasattr(args, f.name)}


def engine_settings(args: argparse.Namespace, preset: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine settings the command line gives: the command's preset, then the flags typed."""
    return {**(preset or {}), **_given(args, EngineConfig), **parse_tuning(args.tuning)}


def _sampling(args):
    from jaxinfer.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          structured=_structured(args))


def _structured(args):
    """The constraint the sampling flags give (None: free text); a file's path is read."""
    from jaxinfer.sampling import StructuredOutput

    def text(value: str) -> str:
        if len(value) < 4096 and os.path.isfile(value):
            with open(value) as f:
                return f.read()
        return value

    if args.json_schema is not None:
        return StructuredOutput(json=text(args.json_schema))
    if args.grammar is not None:
        return StructuredOutput(grammar=text(args.grammar))
    if args.regex is not None or args.choice is not None:
        return StructuredOutput(regex=args.regex, choice=args.choice)
    return None


def _engine(args, preset: dict[str, Any]):
    from jaxinfer.engine.engine import Engine

    engine = Engine(args.model, **engine_settings(args, preset))
    print(engine.summary, file=sys.stderr)
    import jax

    if jax.process_index() > 0:   # several hosts run the same command; process 0 alone prints its output
        sys.stdout = open(os.devnull, "w")
    return engine


def cmd_generate(args) -> None:
    params = _sampling(args)
    engine = _engine(args, ONE_SEQUENCE)
    from jaxinfer.engine.llm import stream

    deltas = stream(engine, args.prompt, params)
    first = next(deltas)   # a prompt the engine rejects (too long for the context) fails before any output
    sys.stdout.write(args.prompt + first.text)
    sys.stdout.flush()
    for delta in deltas:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = engine.stats
    prefill = s["prefill_tokens"] / max(s["prefill_seconds"], 1e-9)
    decode = s["decode_tokens"] / max(s["decode_seconds"], 1e-9)
    spec = engine.speculator.stats if engine.speculator is not None else None
    accepted = (f" ({engine.config.speculative.partition(':')[0]}: {spec.accepted}/{spec.drafted} drafts accepted, "
                f"{spec.mean_accepted_length:.2f} tokens a verify)") if spec is not None else ""
    print(f"[prefill {s['prefill_tokens']} tokens at {prefill:.0f} tok/s; "
          f"decode {s['decode_tokens']} tokens at {decode:.0f} tok/s{accepted}; "
          f"steps compiled or loaded on first use in {engine.runner.first_call_seconds:.1f} s]", file=sys.stderr)


def cmd_chat(args) -> None:
    try:
        import readline  # noqa: F401 -- line editing and history for input()
    except ImportError:
        pass
    params = _sampling(args)
    engine = _engine(args, ONE_SEQUENCE)
    from jaxinfer.engine.llm import stream

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
    given = _given(args, ServerConfig)
    given.setdefault("api_key", os.environ.get("JAXINFER_API_KEY"))
    server = ServerConfig(**given)
    server.validate()
    from jaxinfer.serve.server import serve

    serve(args.model, server, **engine_settings(args, SERVING))


def cmd_bench(args) -> None:
    """Like `vllm bench latency/throughput`: a single request first, then num_prompts, up to max_num_seqs at once."""
    import numpy as np

    from jaxinfer.sampling import SamplingParams

    if min(args.input_len, args.output_len, args.num_prompts) < 1:
        raise ValueError("--input-len, --output-len and --num-prompts must be >= 1")
    preset = dict(SERVING)
    if not args.like_serve:   # a bare engine: token ids only, no logprobs, no prefix cache, a context to fit
        preset.update(skip_tokenizer_init=True, max_logprobs=0, enable_prefix_caching=False,
                      max_model_len=args.input_len + args.output_len + 1)
    engine = _engine(args, preset)
    rng = np.random.default_rng(engine.config.seed)
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
    print(f"throughput: {args.num_prompts} requests, up to {engine.config.max_num_seqs} at once, in {wall:.2f} s = "
          f"{args.num_prompts / wall:.2f} req/s, {tokens / wall:,.0f} output tok/s, "
          f"{args.num_prompts * (args.input_len + args.output_len) / wall:,.0f} total tok/s; of the wall time "
          f"prefill steps {s['prefill_seconds'] / wall:.0%}, decode {s['decode_seconds'] / wall:.0%}")
    print("engine phases, share of the wall time: " + ", ".join(f"{p} {v / wall:.1%}"
                                                               for p, v in engine.phase_seconds.items()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "distributed", None) and args.command == "chat":
            raise ValueError("chat runs on one host; over several (--distributed) serve, or run the same generate, "
                             "bench or LLM script on every host (docs/tensor_parallel.md)")
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
