"""The production engine: vLLM inside the torchrun process. All contact with vLLM lives here.

Every rank builds one `vllm.LLM` with `distributed_executor_backend="external_launcher"`:
vLLM joins the process group torchrun already made, forms tensor-parallel groups of
contiguous ranks, and runs its engine core in this process (no workers, no HTTP). The
ranks of one TP group submit identical requests with the same seed, so they step in
lockstep; different groups get different seeds. The engine starts with dummy weights:
the trainer's first push fills it, and it never reads the checkpoint again.

Departures from vLLM defaults, and why:
- Log-probabilities are reported under the full tempered distribution, softmax(logits /
  temperature) over the whole vocabulary: what the trainer recomputes and what the native
  engine reports. Without top-k/top-p that is vLLM's `processed_logprobs` (after temperature;
  vLLM's default reports the untempered one). With top-k/top-p, `processed_logprobs` are
  renormalised over the kept tokens, off by log(kept mass) at every token, so the engine
  reports `raw_logprobs` instead, which equal the tempered ones only at temperature 1
  (config.validate refuses the other combination).
- Generation stops only at the call's stop ids (`ignore_eos`): vLLM would add the model's EOS ids from
  its generation config, which the trainer already puts into the stop ids, and a benchmark that
  ignores EOS leaves out.
- Stop text (SamplingParams.stop_text) is not vLLM's to match: it runs without a tokenizer (token ids in and
  out), so it stops at the tokens that hold a whole stop string and otherwise goes on past the text, and the
  engine contract cuts its completions there (rl/rollout/engine.py).
- A prompt group (identical prompts, `prompt_groups`) is one request with `n` samples, so
  its KV is prefilled once and shared.
- A call seed seeds the call, not each request: the call's sampling draws from PyTorch's default generators,
  seeded with it for the call (and restored after, so the trainer's random state is untouched), and vLLM's
  requests carry no seed of their own. A request with a seed of its own gets its own generator, which vLLM's
  sampler fills one request at a time (a loop of ~500 kernel launches in every decode step of a 64 x 8
  rollout) where unseeded requests take one batched draw. The same call still draws the same samples whatever
  the engine ran before (a resumed run redraws them), since the same requests in the same order are scheduled
  the same way.
- Log-probabilities come back flat (`flat_logprobs`): plain lists per sequence instead of a dict and
  a `Logprob` object per token, which vLLM otherwise builds on the host at every step.
- CUDA graphs are captured for decode batches up to `max_batch_size` (vLLM's default goes to twice
  max_num_seqs, batches this engine never runs).
- Weight sync on the GPU copies each tensor into vLLM's parameters in place through the model's own
  `load_weights` (TP slicing, qkv and gate_up fusion). vLLM's `reload_weights` instead rebuilds every
  layer on the meta device, loads into fresh tensors, post-processes and copies back: the work a load
  from disk needs, and on CUDA without quantization the post-processing is empty. On CPU it is not
  (vLLM's CPU backend repacks linear weights after loading), so the CPU engine keeps `reload_weights`.
- `rollout.precision = "fp8"` is vLLM's online FP8 (`quantization="fp8_per_channel"`, per-channel weights and
  per-token activations, or `"fp8_per_block"`, 128x128 weight tiles, by `rollout.fp8_scale`; its plain `"fp8"`
  now refuses unquantized weights). Its linear layers hold FP8 weights made from the bf16 ones by
  `process_weights_after_loading`, so a push cannot copy bf16 tensors into them in place: every load goes through
  `reload_weights`, which rebuilds each layer, loads it and quantizes it again once all of its weights are in.
- `rollout.kv_precision = "fp8"` is vLLM's `kv_cache_dtype="fp8"` (e4m3 on CUDA; uncalibrated, its scales are 1.0);
  a `kv_cache_dtype` of the user's in `rollout.vllm.kwargs` is refused then, as two settings of one thing.
- With TP > 1 on GPUs, NVLink multicast stays off: vLLM 0.26 otherwise builds flashinfer's `mnnvl`
  all-reduce workspace (multicast) for its all-reduce + RMSNorm fusion and takes symmetric-memory
  all-reduce. Here `pass_config.fuse_allreduce_rms` is off, and the environment gets
  VLLM_ALLREDUCE_USE_SYMM_MEM=0 and VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm unless it sets them.
- `rollout.vllm.kwargs` is passed to `vllm.LLM` last; a `compilation_config` table in it is merged
  into this file's key by key (its own `pass_config` replaces this file's whole).
- Before vLLM maps its memory back at a wake-up, the trainer's caching allocator returns the blocks it holds
  (`torch.cuda.empty_cache`) if the device's free memory would not hold what vLLM maps (its unmapped pools):
  vLLM allocates outside PyTorch's allocator, so what training used and freed is not free to it until given
  back, and a KV cache that fit at start-up would not fit after the first train phase. When it fits, the
  blocks stay cached for the next train phase (`vmem.make_room`; the native engine does the same).
- A text-only Qwen3.5 checkpoint (`Qwen3_5ForCausalLM`, what this trainer exports) is served where vLLM knows
  Qwen3.5 only as the multimodal `Qwen3_5ForConditionalGeneration` (vLLM before 0.32): vLLM has the text
  model's class but registers it under no architecture and without the hybrid-model interface that sizes its
  linear-attention state, which the multimodal class declares from the text config alone. `register_text_models`
  registers the text class with that interface; a vLLM that has the architecture keeps its own.
- Sleep mode is CUDA-only in vLLM (`enable_sleep_mode` is refused on CPU). On CPU the
  same calls still go through vLLM's engine core (scheduler pause, prefix-cache reset),
  whose CPU worker keeps weights and KV resident.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Iterable

import torch

from rl.config import RolloutConfig
from rl.rollout import vmem
from rl.rollout.engine import Completion, Engine, SamplingParams, prompt_groups

# rollout.fp8_scale -> vLLM's online FP8 quantization of the same scales (module docstring)
FP8_QUANTIZATION = {"channel": "fp8_per_channel", "block": "fp8_per_block"}


def engine_kwargs(model_path: str, cfg: RolloutConfig, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    on_gpu, own = device.type == "cuda", cfg.vllm
    kwargs = dict(
        model=model_path,
        skip_tokenizer_init=True,  # token ids in, token ids out
        load_format="dummy",  # weights arrive from the trainer
        dtype=dtype,
        seed=seed,
        tensor_parallel_size=cfg.tensor_parallel_size,
        distributed_executor_backend="external_launcher",
        enable_prefix_caching=own.enable_prefix_caching,
        enable_sleep_mode=on_gpu and cfg.sleep_level > 0,
        max_model_len=cfg.max_context_len,
        max_num_seqs=cfg.max_batch_size,
        enforce_eager=own.enforce_eager or not on_gpu,  # CPU graph compilation costs minutes at start-up
        logprobs_mode=logprobs_mode(cfg),
    )
    if cfg.precision == "fp8":  # module docstring
        kwargs["quantization"] = FP8_QUANTIZATION[cfg.fp8_scale]
    if cfg.kv_precision == "fp8":  # module docstring
        if "kv_cache_dtype" in own.kwargs:
            raise ValueError("rollout.vllm.kwargs sets kv_cache_dtype and rollout.kv_precision='fp8' sets it too: "
                             "set one")
        kwargs["kv_cache_dtype"] = "fp8"
    if own.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = own.kv_cache_memory_bytes
    else:
        kwargs["gpu_memory_utilization"] = own.gpu_memory_utilization
    compilation = {"max_cudagraph_capture_size": cfg.max_batch_size} if on_gpu else {}
    if on_gpu and cfg.tensor_parallel_size > 1:
        compilation["pass_config"] = {"fuse_allreduce_rms": False}  # module docstring: no NVLink multicast
    extra = dict(own.kwargs)
    compilation |= extra.pop("compilation_config", {})
    if compilation:
        kwargs["compilation_config"] = compilation
    return kwargs | extra


def logprobs_mode(cfg: RolloutConfig) -> str:
    """vLLM's logprobs that equal log softmax(logits / temperature) over the whole vocabulary (module docstring)."""
    if cfg.top_p >= 1.0 and cfg.top_k == -1:
        return "processed_logprobs"
    if cfg.temperature != 1.0:
        raise ValueError("vLLM reports no full-vocabulary tempered logprobs with top_p/top_k and temperature != 1")
    return "raw_logprobs"


def sampled_logprobs(logprobs, tokens: list[int]) -> list[float]:
    """The sampled tokens' logprobs from vLLM's flat logprobs of a sequence: with `logprobs=0` one entry per
    position, the sampled token's."""
    if logprobs.token_ids != tokens:
        raise RuntimeError(f"vLLM returned logprobs for other tokens than it sampled "
                           f"({len(logprobs.token_ids)} entries for {len(tokens)} tokens)")
    return list(logprobs.logprobs)


def completion(token_ids, logprobs, reason: str) -> Completion:
    """A sequence as vLLM holds it (its token ids and flat logprobs) as a Completion; no tokens, no logprobs."""
    tokens = list(token_ids)
    return Completion(tokens, sampled_logprobs(logprobs, tokens) if tokens else [], reason)


def register_text_models(architectures: list[str]) -> None:
    """Make vLLM serve the text-only model of a family it registers only as multimodal (module docstring)."""
    from vllm import ModelRegistry

    if "Qwen3_5ForCausalLM" not in architectures or "Qwen3_5ForCausalLM" in ModelRegistry.get_supported_archs():
        return
    from vllm.model_executor.models.interfaces import IsHybrid
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    multimodal = Qwen3_5ForConditionalGeneration  # its state sizes read only the text config

    class Qwen3_5TextForCausalLM(Qwen3_5ForCausalLM, IsHybrid):
        get_mamba_state_dtype_from_config = classmethod(multimodal.get_mamba_state_dtype_from_config.__func__)
        get_mamba_state_shape_from_config = classmethod(multimodal.get_mamba_state_shape_from_config.__func__)
        get_mamba_state_copy_func = classmethod(multimodal.get_mamba_state_copy_func.__func__)

    ModelRegistry.register_model("Qwen3_5ForCausalLM", Qwen3_5TextForCausalLM)


def _copy_into_parameters(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Runs on vLLM's worker: the model's own loader, which copies each tensor into its parameter."""
    worker.get_model().load_weights(weights)


class VllmEngine(Engine):
    def __init__(self, model_path: str, cfg: RolloutConfig, device: torch.device, dtype: torch.dtype, seed: int):
        super().__init__(cfg.max_context_len)
        # The engine core must run in this process for external_launcher (and for weights to
        # be loaded by a plain function call).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if device.type == "cuda" and cfg.tensor_parallel_size > 1:  # module docstring: no NVLink multicast
            os.environ.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
            os.environ.setdefault("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "trtllm")
        from transformers import AutoConfig
        from vllm import LLM

        register_text_models(AutoConfig.from_pretrained(model_path).architectures or [])
        # With skip_tokenizer_init, LLM() still warms up a chat template and logs the failure
        # with a traceback; no chat template is ever used here.
        logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)

        self.llm = LLM(**engine_kwargs(model_path, cfg, device, dtype, seed))
        self.device = device
        # module docstring: CPU weights are repacked after a load, FP8 ones quantized
        self.in_place_loads = device.type == "cuda" and cfg.precision != "fp8"
        self.call_count = 0  # request ids are unique over the engine's life

    # ------------------------------------------------------------------ memory

    def _sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def _wake_up(self, tags: list[str]) -> None:
        if torch.cuda.is_initialized():  # module docstring: vLLM maps its memory outside PyTorch's allocator
            vmem.make_room(self.device, vmem.unmapped_allocator_bytes(self.device)[1])
        self.llm.wake_up(tags=tags)

    def _reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    # `release` lets nothing go: vLLM keeps no sequence by key; its prefix cache serves a continued prompt's prefix.

    # ------------------------------------------------------------------ weights

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hands HF-named full tensors to vLLM, which applies its TP slicing and fusions (qkv,
        gate_up): on CUDA copied straight into its parameters, on CPU and with FP8 weights through its in-place
        reload, which quantizes them again (module docstring)."""
        # vLLM computes its own rotary tables; the trainer's rotary buffers have no place here.
        params = ((name, t) for name, t in weights if ".rotary_emb." not in name)
        if self.in_place_loads:
            self.llm.collective_rpc(_copy_into_parameters, kwargs={"weights": params})
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": params,
                                                              "is_checkpoint_format": True})

    # ------------------------------------------------------------------ generation

    def requests(self, prompts: list[list[int]], params: SamplingParams,
                 prior: list[int] | None = None) -> tuple[list, list, list[list[int]]]:
        """vLLM's prompts and sampling parameters for `prompts`, and the groups they stand for: one request per
        prompt group (module docstring); a continued sample's request asks for the tokens it has left. No request
        has a seed of its own: the call seed seeds the whole call (module docstring)."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prior = prior or [0] * len(prompts)
        groups = prompt_groups(prompts, prior)
        requests = [TokensPrompt(prompt_token_ids=list(prompts[group[0]])) for group in groups]
        sampling = [VllmSamplingParams(n=len(group), max_tokens=params.max_new_tokens - prior[group[0]],
                                       temperature=params.temperature,
                                       top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0,
                                       stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
                                       logprobs=0, flat_logprobs=True, detokenize=False,
                                       skip_special_tokens=False, spaces_between_special_tokens=False,
                                       output_kind=RequestOutputKind.FINAL_ONLY)
                    for group in groups]
        return requests, sampling, groups

    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  on_finish: Callable[[dict[int, Completion]], bool | None] | None, prior: list[int],
                  keep: list[Hashable | None] | None) -> list[Completion]:
        """Steps vLLM's engine until every request is done, or until `on_finish` (told of each prompt group as it
        finishes) answers true: the unfinished requests then come back with what they generated ("abort"), read
        from vLLM's output processor, and are aborted (rl/rollout/engine.py). `keep` is ignored (see
        `release`)."""
        if params.seed is None:
            return self._step_until_done(prompts, params, on_finish, prior)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(params.seed)  # every device's default generator: the call's own stream
            return self._step_until_done(prompts, params, on_finish, prior)

    def _step_until_done(self, prompts: list[list[int]], params: SamplingParams,
                         on_finish: Callable[[dict[int, Completion]], bool | None] | None,
                         prior: list[int]) -> list[Completion]:
        requests, sampling, groups = self.requests(prompts, params, prior)
        engine = self.llm.llm_engine
        self.call_count += 1
        ids = [f"{self.call_count}-{i}" for i in range(len(groups))]
        for request_id, request, sp in zip(ids, requests, sampling):
            engine.add_request(request_id, request, sp)
        results: list[Completion | None] = [None] * len(prompts)
        group_of = dict(zip(ids, groups))
        while engine.has_unfinished_requests():
            finished = {}
            self.stats.decode_steps += 1
            self.stats.decode_row_steps += engine.get_num_unfinished_requests()
            for out in engine.step():
                if not out.finished:
                    continue
                group = group_of.pop(out.request_id)
                for choice in out.outputs:
                    finished[group[choice.index]] = completion(choice.token_ids, choice.logprobs,
                                                               choice.finish_reason or "abort")
            for i, out in finished.items():
                results[i] = out
            if finished and on_finish is not None and on_finish(finished):
                self._end_early(group_of, results)
                break
        return results

    def _end_early(self, group_of: dict[str, list[int]], results: list[Completion | None]) -> None:
        """The unfinished requests' tokens and logprobs so far, from vLLM's per-request output state (kept even
        when only final outputs are returned), then the requests aborted."""
        engine = self.llm.llm_engine
        for state in engine.output_processor.request_states.values():
            parent = state.parent_req.external_req_id if state.parent_req is not None else state.external_req_id
            if parent not in group_of:
                continue
            group = group_of[parent]
            results[group[state.request_index]] = completion(state.detokenizer.output_token_ids,
                                                             state.logprobs_processor.logprobs, "abort")
            # Samples of the group that did finish wait in the parent request until all of them have.
            for choice in state.parent_req.output_aggregator if state.parent_req is not None else []:
                if choice is not None and choice.finished():
                    results[group[choice.index]] = completion(choice.token_ids, choice.logprobs, choice.finish_reason)
        engine.abort_request(list(group_of))
        for group in group_of.values():
            for i in group:
                if results[i] is None:  # a child not yet scheduled
                    results[i] = Completion([], [], "abort")

    def _close(self) -> None:
        """Tears down vLLM's model-parallel groups; the caller then destroys the process group."""
        from vllm.distributed.parallel_state import destroy_model_parallel

        del self.llm
        destroy_model_parallel()
