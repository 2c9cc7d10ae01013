"""The generative judge on its own colocated vLLM engine (--judge_use_vllm): its greedy replies
equal the HF engine's, so the parsed rewards are the same. Real vLLM (`make test-vllm`); skipped without it."""

import pytest
from PIL import Image

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

from mmgrpo.rewards.judge import JudgeReward  # noqa: E402

pytestmark = pytest.mark.vllm


def test_the_vllm_judge_replies_as_the_hf_judge():
    on_vllm = JudgeReward("tiny:qwen2-vl", max_new_tokens=8, batch_size=4,
                          vllm=dict(max_model_len=1024, kv_cache_memory_bytes=64 * 2**20))
    on_hf = JudgeReward("tiny:qwen2-vl", max_new_tokens=8, batch_size=4)
    prompt = [{"role": "user", "content": "<image>What colour is the shape?"}]
    images = [[Image.new("RGB", (56, 56), colour)] for colour in ("red", "blue", "green")]
    encoded = on_vllm.judge_prompts(["red", "blue", "a long wrong answer"], [prompt] * 3, images, ["red"] * 3, ["a", "b", "c"])
    replies = on_vllm.replies(encoded)
    assert replies == on_hf.replies(encoded) and len(replies) == 3
    assert on_vllm.score_replies(replies) == on_hf.score_replies(replies)
