"""Bad input gets a clear exception from the Python API, and one line plus exit code 2 from the CLI."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import STORIES
from jaxinfer import LLM, SamplingParams
from jaxinfer.model.config import load_config
from jaxinfer.errors import ModelLoadError, PromptTooLongError
from jaxinfer.model.weights import load_params


def _copy(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(STORIES, d)
    for f in d.iterdir():
        f.chmod(0o644)
    d.chmod(0o755)
    return d


def _broken(tmp_path, kind: str):
    d = _copy(tmp_path)
    if kind == "missing folder":
        return tmp_path / "nowhere"
    if kind == "missing config":
        (d / "config.json").unlink()
    elif kind == "corrupt config":
        (d / "config.json").write_text("{not json")
    elif kind == "unknown architecture":
        cfg = json.loads((d / "config.json").read_text())
        cfg["architectures"] = ["MambaForCausalLM"]
        (d / "config.json").write_text(json.dumps(cfg))
    elif kind == "missing weights":
        (d / "model.safetensors").unlink()
    elif kind == "truncated weights":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif kind == "garbage weights":
        (d / "model.safetensors").write_bytes(b"\x00\x01garbage" * 10)
    elif kind == "wrong shape":
        tensors = load_file(d / "model.safetensors")
        tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
        save_file(tensors, d / "model.safetensors")
    elif kind == "missing tensor":
        tensors = load_file(d / "model.safetensors")
        del tensors["model.layers.2.mlp.up_proj.weight"]
        save_file(tensors, d / "model.safetensors")
    return d


CASES = {
    "missing folder": "does not exist",
    "missing config": "config.json not found",
    "corrupt config": "not valid JSON",
    "unknown architecture": "unknown architecture 'MambaForCausalLM'",
    "missing weights": "no model.safetensors",
    "truncated weights": "truncated",
    "garbage weights": "not a readable safetensors file",
    "wrong shape": "model.layers.1.self_attn.k_proj.weight' has shape (16, 64), expected (32, 64)",
    "missing tensor": "model.layers.2.mlp.up_proj.weight' is missing",
}


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_model_folder_raises_clear_error(tmp_path, kind):
    d = _broken(tmp_path, kind)
    with pytest.raises(ModelLoadError, match=CASES[kind].replace("(", r"\(").replace(")", r"\)")):
        cfg = load_config(d)
        load_params(d, cfg, progress=False)


@pytest.fixture(scope="module")
def llm():
    return LLM(STORIES, max_num_seqs=2, max_num_batched_tokens=64, progress=False)


def test_prompt_longer_than_context(llm):
    with pytest.raises(PromptTooLongError, match="maximum context length is 512 tokens"):
        llm.generate("Once upon a time " * 200, SamplingParams(max_tokens=4))
    # a prompt that fits but asks for more tokens than the context has room for: rejected, not cut short
    with pytest.raises(PromptTooLongError, match="you asked for 605 tokens"):
        llm.generate("Once upon a time", SamplingParams(max_tokens=600))
    # the engine keeps serving afterwards
    assert llm.generate("Once", SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].finish_reason == "length"


def test_a_step_out_of_device_memory_says_what_to_lower(monkeypatch):
    """XLA's RESOURCE_EXHAUSTED at a step's read-back (where an allocation failure inside the step surfaces) becomes a
    DeviceMemoryError naming the KV pool and the settings that shrink it; the CLI prints it as one line, exit 2.
    Other runtime errors pass through as they are."""
    import jax

    from jaxinfer import cli
    from jaxinfer.errors import DeviceMemoryError

    def fails(message):
        def device_get(x):
            raise jax.errors.JaxRuntimeError(message)
        return device_get

    llm = LLM(STORIES, max_num_seqs=2, max_num_batched_tokens=64, progress=False)
    pages = llm.engine.runner.num_pages
    monkeypatch.setattr(jax, "device_get", fails("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 20.25GiB"
                                                 " with allocator GPU_0_bfc on device 0.\nmore lines"))
    with pytest.raises(DeviceMemoryError, match=rf"allocate 20.25GiB.*KV pool holds 0.0 GiB \({pages} pages\): "
                                                r"lower gpu_memory_fraction, max_num_seqs or max_model_len"):
        llm.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0))
    monkeypatch.setattr(jax, "device_get", fails("INTERNAL: something else"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
        LLM(STORIES, max_num_seqs=2, max_num_batched_tokens=64, progress=False).generate(
            "Once", SamplingParams(max_tokens=2, temperature=0))
    monkeypatch.setattr(jax, "device_get", fails("RESOURCE_EXHAUSTED: Out of memory"))
    assert cli.main(["generate", "--model", str(STORIES), "--max-tokens", "4", "Once"]) == 2


def test_empty_prompt_and_bad_ids(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 99999]], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("prompt", [[1, 99999], [-1, 5], np.array([3, 512]), (7, -2), [2.0, 600.0]])
def test_bad_ids_by_either_path(llm, prompt):
    """Engine.encode checks integer lists and arrays with numpy and anything else element by element: both
    refuse ids outside the vocabulary (stories260k: 512), and both give the same list for good ids."""
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
        llm.engine.encode(prompt)
    good = [5, 0, 511]
    for form in (good, np.array(good, np.int64), np.array(good, np.int32), tuple(good), [5.0, 0.0, 511.0]):
        text, ids = llm.engine.encode(form)
        assert text is None and ids == good and all(type(t) is int for t in ids), form


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -5),
                                          ("max_tokens", 0), ("min_p", 2.0), ("repetition_penalty", 0.0)])
def test_invalid_sampling_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kind", ["missing folder", "missing config", "unknown architecture", "truncated weights",
                                  "wrong shape"])
def test_cli_bad_model_one_line_exit_2(tmp_path, kind):
    r = _cli("generate", "--model", str(_broken(tmp_path, kind)), "--max-tokens", "4", "Once")
    assert r.returncode == 2, r.stderr
    # progress bars end with carriage returns; what the terminal shows is each line's last segment
    lines = [line.split("\r")[-1] for line in r.stderr.splitlines()]
    lines = [line for line in lines if line.startswith("jaxinfer: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-tokens", "many"], "invalid int value"),
    (["--dtype", "int4"], "invalid choice"),
])
def test_cli_bad_arguments_one_line_exit_2(args, message):
    r = _cli("generate", "--model", str(STORIES), *args, "Once")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_prompt_too_long(tmp_path):
    r = _cli("generate", "--model", str(STORIES), "--max-model-len", "32", "--max-tokens", "4", "Once upon a time " * 20)
    assert r.returncode == 2
    assert "maximum context length is 32 tokens" in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr


def test_cli_generate_streams_and_reports_speed():
    r = _cli("generate", "--model", str(STORIES), "--max-tokens", "30", "Once upon a time")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time, there was a little girl named Lily")
    assert "prefill" in r.stderr and "decode" in r.stderr and "tok/s" in r.stderr


@pytest.mark.parametrize("options, message", [
    (dict(decode_steps=0), "decode_steps must be >= 1"),
    (dict(short_decode_max_batch=2, short_decode_steps=9), "short_decode_steps"),
    (dict(short_decode_max_batch=-1), "short_decode_max_batch"),
    (dict(chain_early_ms=-1.0), "chain_early_ms"),
    (dict(prompt_step_head_layers=-2), "prompt_step_head_layers must be >= 0"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
])
def test_invalid_engine_options(options, message):
    from jaxinfer.engine.engine import Engine

    with pytest.raises(ValueError, match=message):
        Engine(STORIES, progress=False, **options)


@pytest.mark.parametrize("family, changes, args, message", [
    ("qwen3_moe", {"mlp_only_layers": [1]}, [], "Qwen3-MoE with dense layers ([1]"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, [], "Gemma 3's attn_logit_softcapping is not supported"),
    ("apertus", {"post_norm": True}, [], "Apertus with mlp_bias, post_norm or without qk_norm is not supported"),
])
def test_cli_refused_family_settings_one_line_exit_2(tmp_path, family, changes, args, message):
    """What the new families refuse (a MoE model's dense layers, Gemma 3's attention softcap, an Apertus variant
    transformers lacks) reaches the command line as one line and exit code 2."""
    from conftest import DATA

    d = tmp_path / family
    shutil.copytree(DATA / "models" / family, d)
    for name in ("tokenizer.json", "tokenizer_config.json"):   # the tokenizer is read before the weights
        shutil.copy(STORIES / name, d / name)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf, **changes}))
    r = _cli("generate", "--model", str(d), *args, "--max-tokens", "2", "Once")
    assert r.returncode == 2, r.stderr
    lines = [line.split("\r")[-1] for line in r.stderr.splitlines()]
    errors = [line for line in lines if line.startswith("jaxinfer: error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in r.stderr, r.stderr
