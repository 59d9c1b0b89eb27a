"""`python tests/vllm_export_check.py HF_FOLDER OUT.json`: vLLM (CPU build) loads an exported folder from disk and
reports the log-probabilities it gives a fixed token sequence, for tests/test_checkpoint.py to compare with HF."""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(folder: str, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = [1, 5, 9, 13, 40, 41]
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 26, max_model_len=128,
              seed=0)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    logprobs = [step[token].logprob for token, step in zip(ids[1:], result.prompt_logprobs[1:], strict=True)]
    with open(out, "w") as f:
        json.dump({"ids": ids, "logprobs": logprobs}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
