"""Run by tests/test_tensor_parallel.py in a process of its own, with 8 CPU devices (the device count is fixed
before jax starts, so the other tests' processes keep theirs). Prints one JSON line per result.

    python tests/tensor_parallel_worker.py logits FAMILY...    each family's prompt logits at TP 1, 2, 4 and 8
    python tests/tensor_parallel_worker.py greedy OPS N FAMILY...  the engine's greedy tokens at TP N
    python tests/tensor_parallel_worker.py one OPS FAMILY...    two prompts one at a time at TP 1, then TP 2 on split
                                                                layers
    python tests/tensor_parallel_worker.py quantized            8-bit models' logits at TP 1, 2, 4 and 8, their layout
    python tests/tensor_parallel_worker.py quantized-greedy     8-bit models' greedy tokens on the Pallas kernels, TP 1
                                                                and 2
    python tests/tensor_parallel_worker.py settings             sampled, n-gram speculation, int8 KV cache, split layers
    python tests/tensor_parallel_worker.py features             prefix cache, preemption, structured output, penalties,
                                                                logprobs, float8 and int8 caches, at TP 1 and 2
    python tests/tensor_parallel_worker.py commands             the CLI and a server at TP 2, what TP 2 refuses
    python tests/tensor_parallel_worker.py distributed RANK N PORT  the same, one of N processes (TP N over all)
    python tests/tensor_parallel_worker.py follower RANK N PORT     process 0 generates, the others follow its calls
"""

import atexit
import functools
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "tests" / "data" / "models"
GOLDEN = REPO / "tests" / "data" / "golden"
STORIES = REPO.parent / "shared" / "models" / "stories260k"


# logits' variants of a tiny model: (its folder, the config's changes, the prompt's length); Gemma 3's window cut
# to 8 on its sliding layers (0 and 2), so that a 40-token prompt's window bites
VARIANTS = {"gemma3_windows": ("gemma3", dict(layer_windows=(8, 0, 8)), 40)}
NARROWED = "qwen3_moe_27"   # Qwen3-MoE's experts cut to 27 intermediate rows: 2, 4 and 8 devices pad them


def model_dir(family: str) -> Path:
    if family == NARROWED:
        return narrowed_experts("qwen3_moe", 27)
    return STORIES if family == "stories260k" else MODELS / family


@functools.cache
def narrowed_experts(family: str, width: int) -> Path:
    """A copy of a tiny MoE model (per-expert gate_proj, up_proj, down_proj) whose experts keep their first `width`
    intermediate rows (and down's columns), in a folder of its own."""
    import shutil
    import tempfile

    from safetensors.numpy import load_file, save_file

    src, out = MODELS / family, Path(tempfile.mkdtemp(prefix=f"{family}_{width}_"))
    atexit.register(shutil.rmtree, out, True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    cut = {"gate_proj.weight": lambda a: a[:width], "up_proj.weight": lambda a: a[:width],
           "down_proj.weight": lambda a: a[:, :width]}
    tensors = {k: next((f(v) for end, f in cut.items() if ".experts." in k and k.endswith(end)), v)
               for k, v in load_file(src / "model.safetensors").items()}
    save_file({k: v.copy() for k, v in tensors.items()}, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["moe_intermediate_size"] = width
    (out / "config.json").write_text(json.dumps(config))
    return out


def logits(families: list[str]) -> None:
    import dataclasses

    import jax
    import numpy as np

    from jaxinfer.model.config import load_config
    from jaxinfer.model.transformer import prompt_logits
    from jaxinfer.model.weights import load_params
    from jaxinfer.ops import get_ops
    from jaxinfer.ops.tensor_parallel import tensor_parallel_ops
    from jaxinfer.runner.mesh import make_mesh

    ops = get_ops("reference")
    for family in families:
        base, changes, length = VARIANTS.get(family, (family, {}, 21))
        d = model_dir(base)
        cfg = dataclasses.replace(load_config(d), **changes)
        ids = np.random.default_rng(len(family)).integers(0, cfg.vocab_size, length)
        ref = np.asarray(prompt_logits(cfg, ops, load_params(d, cfg, progress=False), ids))
        for n in (2, 4, 8):
            mesh = make_mesh(n)
            params = load_params(d, cfg, progress=False, mesh=mesh)
            sharded = sum(not a.sharding.is_fully_replicated for a in jax.tree.leaves(params))
            out = np.asarray(prompt_logits(cfg, tensor_parallel_ops(ops, mesh), params, ids))
            print(json.dumps(dict(family=family, n=n, shape=list(out.shape), ref_shape=list(ref.shape),
                                  max_abs=float(np.abs(out - ref).max()), sharded=sharded,
                                  argmax_equal=bool((out.argmax(-1) == ref.argmax(-1)).all()))), flush=True)


# 8-bit models: (the folder, quantization at load; None: the checkpoint's own), for logits at TP 1, 2, 4 and 8
QUANTIZED = [("qwen3", "int8"), ("qwen3", "fp8"), ("qwen3-fp8-block", None), ("qwen3-w8a8-int8", None),
             ("qwen3-fp8-dynamic", None), ("phi3", "int8"), ("gpt2", "int8"), ("gemma3", "fp8"), ("qwen3_moe", "int8"),
             ("qwen3_moe-fp8-block", None), ("mixtral", "fp8"), (NARROWED, "int8")]


def quantized() -> None:
    """Each QUANTIZED model's prompt logits at TP 2, 4 and 8 against TP 1 of the same 8-bit model (the reference
    ops), and whether every layer array, stacked (and at TP 2 split), lies on the mesh as shard_map's specs say (no
    resharding in a step)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    from jaxinfer.model.config import load_config
    from jaxinfer.model.tensor_parallel import layer_specs
    from jaxinfer.model.transformer import prompt_logits
    from jaxinfer.model.weights import load_params
    from jaxinfer.ops import get_ops
    from jaxinfer.ops.quantized import QuantizedWeight
    from jaxinfer.ops.tensor_parallel import tensor_parallel_ops
    from jaxinfer.runner.mesh import make_mesh

    ops = get_ops("reference")
    is_q = lambda a: isinstance(a, QuantizedWeight)
    for family, fmt in QUANTIZED:
        d = model_dir(family)
        cfg = load_config(d)
        ids = np.random.default_rng(len(family)).integers(0, cfg.vocab_size, 21)
        ref = np.asarray(prompt_logits(cfg, ops, load_params(d, cfg, progress=False, quantization=fmt), ids))
        for n in (2, 4, 8):
            mesh = make_mesh(n)
            for per_layer in (False, True) if n == 2 else (False,):   # split layers' layout: at TP 2
                params = load_params(d, cfg, progress=False, mesh=mesh, quantization=fmt, per_layer=per_layer)
                layers = {k: params[k] for k in ("layers", "layer_vectors") if k in params}
                misplaced = []
                jax.tree_util.tree_map_with_path(
                    lambda path, a, s: None if a.sharding.is_equivalent_to(NamedSharding(mesh, s), a.ndim)
                    else misplaced.append(jax.tree_util.keystr(path)), layers, layer_specs(cfg, layers))
                row = dict(family=family, fmt=fmt, n=n, per_layer=per_layer, misplaced=misplaced,
                           quantized=sum(map(is_q, jax.tree.leaves(params, is_leaf=is_q))))
                if not per_layer:
                    out = np.asarray(prompt_logits(cfg, tensor_parallel_ops(ops, mesh), params, ids))
                    row.update(shape=list(out.shape), ref_shape=list(ref.shape), max_abs=float(np.abs(out - ref).max()),
                               argmax_equal=bool((out.argmax(-1) == ref.argmax(-1)).all()))
                print(json.dumps(row), flush=True)


def quantized_greedy() -> None:
    """Greedy tokens of 8-bit models on the Pallas kernels (interpret mode) at TP 1 and 2: Qwen3 int8 at a batch of
    two (the batched GEMMs), the official FP8 block format of Qwen3-MoE one sequence at a time on split layers (the
    routed GEMVs' block scales on each device's rows and columns)."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for family, folder, fmt, seqs in (("qwen3", "qwen3", "int8", 2), ("qwen3_moe", "qwen3_moe-fp8-block", None, 1)):
        golden = np.load(GOLDEN / f"{family}.npz")
        prompts = [golden[f"prompt_{i}"].tolist() for i in (0, 3)]
        for n in (1, 2):
            llm = LLM(MODELS / folder, tensor_parallel_size=n, ops="pallas-interpret", quantization=fmt,
                      max_num_seqs=seqs, max_num_batched_tokens=32, decode_steps=4, skip_tokenizer_init=True,
                      progress=False, cache_dir="", unroll_layers=seqs == 1 and n > 1)
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            print(json.dumps(dict(family=folder, n=n, tokens=tokens)), flush=True)


def greedy(ops: str, n: int, families: list[str], **settings) -> None:
    """The greedy tokens of the golden files' prompts (tests/data/golden), 16 a prompt, at TP n."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for family in families:
        golden = np.load(GOLDEN / f"{family}.npz")
        prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
        llm = LLM(model_dir(family), tensor_parallel_size=n, ops=ops, max_num_seqs=4, max_num_batched_tokens=32,
                  decode_steps=4, skip_tokenizer_init=True, progress=False, cache_dir="", **settings)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        print(json.dumps(dict(family=family, n=n, ops=ops, tokens=tokens)), flush=True)


def one_at_a_time(ops: str, families: list[str]) -> None:
    """Greedy tokens of the golden files' first and last prompts (16 each), one sequence at a time (the batch-1
    decode kernels: a mixture of experts' routed GEMVs), at TP 1 and at TP 2 on split layers (unroll_layers)."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for family in families:
        golden = np.load(GOLDEN / f"{family.removesuffix('_27')}.npz")
        prompts = [golden[f"prompt_{i}"].tolist() for i in (0, 3)]
        for n in (1, 2):
            llm = LLM(model_dir(family), tensor_parallel_size=n, ops=ops, max_num_seqs=1, max_num_batched_tokens=32,
                      decode_steps=4, skip_tokenizer_init=True, progress=False, cache_dir="", unroll_layers=n > 1)
            assert isinstance(llm.engine.runner.params["layers"], list) == (n > 1)
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            print(json.dumps(dict(family=family, n=n, ops=ops, tokens=tokens)), flush=True)


def settings() -> None:
    """Sampled tokens (a seed, top-k and top-p) with n-gram speculation, an int8 KV cache and split layers, at TP 1
    and 2."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams

    golden = np.load(GOLDEN / "qwen3.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=3, ignore_eos=True)
    for n in (1, 2):
        llm = LLM(model_dir("qwen3"), tensor_parallel_size=n, max_num_seqs=4, max_num_batched_tokens=32,
                  decode_steps=4, skip_tokenizer_init=True, progress=False, cache_dir="", speculative="ngram",
                  kv_cache_dtype="int8", unroll_layers=True)
        assert isinstance(llm.engine.runner.params["layers"], list)   # split layers
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        print(json.dumps(dict(n=n, tokens=tokens)), flush=True)


def features() -> None:
    """At TP 1 and 2: greedy stories260k (vocabulary 512) with prefix-cache hits and preemption (a pool too small
    for everyone) on a float8 cache, and structured output (a JSON Schema, a regex, a choice: llguidance's masks
    over the sharded logits); sampled Qwen3 (vocabulary 1063, odd: padded to 1064 on two devices) with penalties,
    top-k/top-p/min-p, logprobs and prompt logprobs on an int8 cache."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.sampling import StructuredOutput

    system = "once upon a time there was a little girl named lily. she liked to play in the park. " * 2
    prompts = [system + w for w in ("the dog", "a red ball", "her mom said", "one day", "they went home", "lily saw")]
    greedy = [SamplingParams(max_tokens=12 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
              "required": ["name", "legs"], "additionalProperties": False}
    constrained = [StructuredOutput(json=json.dumps(schema)), StructuredOutput(regex=r"[a-c]{2,4}-[0-9]{2}"),
                   StructuredOutput(choice=["yes", "no", "maybe"])]
    golden = np.load(GOLDEN / "qwen3.npz")
    ids = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    sampled = [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=7 + i,
                              repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, logprobs=3,
                              prompt_logprobs=2, ignore_eos=True) for i in range(4)]
    for n in (1, 2):
        tight = LLM(STORIES, tensor_parallel_size=n, max_num_seqs=6, num_pages=13, max_model_len=128,
                    max_num_batched_tokens=64, kv_cache_dtype="fp8", progress=False, cache_dir="")
        tokens = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy)]
        structured = [o.outputs[0].text for o in tight.generate(["The cat", "A code:", "Is it"], [
            SamplingParams(max_tokens=40, temperature=0, structured=c) for c in constrained])]
        e = tight.engine
        llm = LLM(model_dir("qwen3"), tensor_parallel_size=n, max_num_seqs=4, max_num_batched_tokens=32,
                  kv_cache_dtype="int8", enable_prompt_logprobs=True, max_logprobs=3, skip_tokenizer_init=True,
                  progress=False, cache_dir="")
        outs = llm.generate(ids, sampled)
        print(json.dumps(dict(
            n=n, tokens=tokens, preemptions=e.scheduler.num_preemptions, hit_rate=e.prefix_cache_hit_rate,
            structured=structured, sampled=[o.outputs[0].token_ids for o in outs],
            logprobs=[o.outputs[0].logprobs for o in outs],
            top=[[[t for t, _ in row] for row in o.outputs[0].top_logprobs] for o in outs],
            prompt_logprobs=[[row[0] for row in o.prompt_logprobs[1:]] for o in outs])), flush=True)


def commands() -> None:
    """The CLI at --tensor-parallel-size 2 (generate; bench, Qwen3-MoE's too), a completion served at TP 2 against
    `generate`'s text at TP 1, 8-bit weights at TP 2 (generate's fp8 text against TP 1's; bench on a W8A8 checkpoint
    and with --quantization int8), and what TP 2 refuses: each one line on stderr and exit code 2 (one JSON line
    each)."""
    import contextlib
    import io

    import httpx

    from jaxinfer.cli import main
    from jaxinfer.engine.engine import Engine
    from jaxinfer.serve.app import create_app
    from jaxinfer.serve.server import ServerThread

    def cli(*args: str) -> dict:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as e:   # argparse's errors
                rc = e.code
        return dict(args=list(args), rc=rc, stdout=out.getvalue(), stderr=err.getvalue())

    prompt = "once upon a time"
    for n in ("1", "2"):
        print(json.dumps(cli("generate", "--model", str(STORIES), "--tensor-parallel-size", n, "--max-tokens", "12",
                             "--no-progress", "--cache-dir", "", prompt)), flush=True)
    for family in ("qwen3", "qwen3_moe"):
        print(json.dumps(cli("bench", "--model", str(MODELS / family), "--tensor-parallel-size", "2", "--input-len",
                             "8", "--output-len", "4", "--num-prompts", "2", "--max-num-seqs", "1", "--no-progress",
                             "--cache-dir", "")), flush=True)
    engine = Engine(STORIES, tensor_parallel_size=2, max_num_seqs=2, progress=False, cache_dir="")
    with ServerThread(create_app(engine)) as server:
        r = httpx.post(f"{server.url}/v1/completions", json=dict(model="stories260k", prompt=prompt, max_tokens=12,
                                                                temperature=0), timeout=120)
        print(json.dumps(dict(served=prompt + r.json()["choices"][0]["text"])), flush=True)
    bench = ("bench", "--input-len", "8", "--output-len", "4", "--num-prompts", "1", "--max-num-seqs", "1",
             "--no-progress", "--cache-dir", "")
    generate = ("generate", "--model", str(STORIES), "--no-progress", "--cache-dir", "", "--max-tokens", "4", prompt)
    for n in ("1", "2"):   # 8-bit weights: quantized at load, and a pre-quantized checkpoint
        print(json.dumps(cli(*generate[:-1], "--quantization", "fp8", "--max-tokens", "12", "--tensor-parallel-size", n,
                             prompt)), flush=True)
    for args in ((*bench, "--model", str(MODELS / "qwen3-w8a8-int8")),
                 (*bench, "--model", str(MODELS / "qwen3"), "--quantization", "int8")):
        print(json.dumps(cli(*args, "--tensor-parallel-size", "2")), flush=True)
    for args in ((*bench, "--model", str(MODELS / "qwen3"), "--speculative", "draft:" + str(MODELS / "qwen3")),
                 (*generate, "--speculative", "dflash:" + str(MODELS / "qwen3")),
                 (*generate, "--tensor-parallel-size", "3"), (*generate, "--tensor-parallel-size", "4096")):
        if "--tensor-parallel-size" not in args:
            args = (*args, "--tensor-parallel-size", "2")
        print(json.dumps(dict(refused=True, **cli(*args))), flush=True)


def distributed(rank: int, processes: int, port: int) -> None:
    """One of `processes` processes: greedy tokens at TP over all of them; the least of the processes' numbers."""
    greedy("reference", processes, ["qwen3"], distributed=f"localhost:{port},{processes},{rank}")
    from jaxinfer.runner.distributed import least_of_all_processes

    print(json.dumps(dict(rank=rank, least=least_of_all_processes(10 + rank))), flush=True)


def follower(rank: int, processes: int, port: int) -> None:
    """Process 0 generates through a Leader (engine.followers); the others follow its engine calls."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.engine.followers import Leader, follow

    llm = LLM(model_dir("qwen3"), tensor_parallel_size=processes, max_num_seqs=4, max_num_batched_tokens=32,
              decode_steps=4, skip_tokenizer_init=True, progress=False, cache_dir="",
              distributed=f"localhost:{port},{processes},{rank}")
    if rank > 0:
        print(json.dumps(dict(rank=rank, calls=follow(llm.engine))), flush=True)
        return
    llm.engine = Leader(llm.engine)
    golden = np.load(GOLDEN / "qwen3.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    try:   # refused on every process: process 0's note that it raised, the follower's call passed over
        llm.engine.add_request([], params)
    except ValueError:
        pass
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)]
    rest = [o.outputs[0].token_ids for o in llm.generate(prompts[2:], params)]   # a second batch, later
    llm.engine.stop_followers()
    print(json.dumps(dict(rank=rank, n=processes, tokens=first + rest)), flush=True)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "follower":
        follower(int(args[0]), int(args[1]), int(args[2]))
    elif mode == "distributed":
        distributed(int(args[0]), int(args[1]), int(args[2]))
    elif mode == "settings":
        settings()
    elif mode == "features":
        features()
    elif mode == "commands":
        commands()
    elif mode == "quantized":
        quantized()
    elif mode == "quantized-greedy":
        quantized_greedy()
    elif mode == "logits":
        logits(args)
    elif mode == "one":
        one_at_a_time(args[0], args[1:])
    else:
        greedy(args[0], int(args[1]), args[2:])
