"""A generative judge: a vision-language model that sees the image(s), the question, the reference
and the completion, and whose reply, parsed, is the reward.

    mmgrpo train ... --reward_funcs format --judge_model path/to/vlm [--judge_model_type qwen2-vl] \\
        [--judge_prompt my_prompt.txt] [--judge_parse score|verdict] [--judge_max_new_tokens 64]

The judge runs through the same rollout engines as the policy (`build_rollout_engine` on a
`Policy` of the judge model and its template: the shared-prefix engine where its family allows;
with --judge_use_vllm a colocated vLLM engine of its own, sized by the --vllm_* flags), greedy, one batched generate over all the step's completions (in chunks of
--reward_model_batch_size), on --reward_model_device.

The prompt (`--judge_prompt FILE`, default `DEFAULT_JUDGE_PROMPT`) is a text with the fields
{question}, {reference} and {completion}; the sample's images come first, one placeholder each.
The reply is parsed by --judge_parse:

- `score` (default): the last "Score: N" (N a number, "Score: 7/10" too) divided by
  --judge_score_max (10) and clipped to [0, 1];
- `verdict`: the last "Verdict: correct" / "Verdict: incorrect" (also right/wrong, yes/no) -> 1 / 0.

A reply that does not parse is None for that sample (skipped by this reward, as any None), counted
in `unparsed` and logged (the first one shown), never a crash.

    >>> parse_reply("The answer matches. Score: 8", "score", 10)
    0.8
    >>> parse_reply("Verdict: incorrect", "verdict", 10), parse_reply("no idea", "score", 10)
    (0.0, None)
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from mmgrpo.errors import ConfigError

logger = logging.getLogger("mmgrpo.rewards")

DEFAULT_JUDGE_PROMPT = (
    "You grade an answer to a question about the image(s) above.\n"
    "Question: {question}\nReference answer: {reference}\nAnswer to grade: {completion}\n"
    "Is the answer to grade correct, given the reference and the image(s)? "
    "Reply with one line, `Score: N`, N from 0 (wrong) to 10 (fully correct)."
)
PARSE_MODES = ("score", "verdict")
_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?", re.IGNORECASE)
_VERDICT = re.compile(r"verdict\s*[:=]\s*\**\s*(correct|incorrect|right|wrong|yes|no)\b", re.IGNORECASE)
_POSITIVE = {"correct", "right", "yes"}


def parse_reply(reply: str, mode: str, score_max: float) -> float | None:
    """The reward a judge's reply gives, or None if it does not follow the template (module docstring).

    >>> parse_reply("Score: 7/10 ... no wait, Score: 9/10", "score", 10)   # the last one counts
    0.9
    >>> parse_reply("Score: 15", "score", 10), parse_reply("Verdict: **Correct**", "verdict", 10)
    (1.0, 1.0)
    """
    if mode == "score":
        found = _SCORE.findall(reply)
        if not found:
            return None
        value, out_of = found[-1]
        scale = float(out_of) if out_of else score_max
        return min(1.0, max(0.0, float(value) / scale)) if scale > 0 else None
    found = _VERDICT.findall(reply)
    return (1.0 if found[-1].lower() in _POSITIVE else 0.0) if found else None


def question_text(messages: list[dict]) -> str:
    """The last user turn as text, media tags removed (the judge gets the media itself).

    >>> question_text([{"role": "user", "content": "<image>What colour is the <b>circle</b>?"}])
    'What colour is the <b>circle</b>?'
    """
    from mmgrpo.rewards.reward_model import text_messages

    users = [m for m in text_messages(messages) if m["role"] == "user"]
    text = users[-1]["content"] if users else ""
    return re.sub(r"<(?:image|video|audio)>", "", text).strip()


def reference_text(solution) -> str:
    if isinstance(solution, (list, tuple)):
        return " | ".join(dict.fromkeys(str(s.get("answer", s) if isinstance(s, dict) else s) for s in solution))
    return "" if solution is None else str(solution)


class JudgeReward:
    """The judge as a reward function (see the module docstring). `unparsed`: replies that did not
    parse, over the run; `last_unparsed`: in the latest call."""

    reward_name = "judge"

    def __init__(self, path: str, *, model_type: str | None = None, device: str | None = None,
                 prompt_file: str | None = None, parse: str = "score", score_max: float = 10.0,
                 max_new_tokens: int = 64, batch_size: int = 16, vllm: dict | None = None):
        from mmgrpo.forward.policy import Policy
        from mmgrpo.models.loading import load_model, load_template
        from mmgrpo.rewards.reward_model import default_device
        from mmgrpo.rollout import build_rollout_engine

        if parse not in PARSE_MODES:
            raise ConfigError(f"--judge_parse {parse!r}: choose one of {', '.join(PARSE_MODES)}.")
        self.prompt = DEFAULT_JUDGE_PROMPT
        if prompt_file:
            if not Path(prompt_file).is_file():
                raise ConfigError(f"--judge_prompt {prompt_file}: no such file.")
            self.prompt = Path(prompt_file).read_text()
        try:
            self.prompt.format(question="", reference="", completion="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"--judge_prompt: the template may use only {{question}}, {{reference}} and {{completion}} "
                f"(double other braces): {exc!r}"
            ) from None
        path, _, self.template = load_template(path, model_type)
        if "image" not in self.template.modalities:
            raise ConfigError(f"--judge_model {path}: its family {self.template.name!r} takes no images; a judge must see them.")
        if vllm is not None:  # --judge_use_vllm: its own colocated vLLM engine (the judge's weights never change)
            from mmgrpo.rollout.vllm_colocate import VLLMColocateRollout

            self.engine = VLLMColocateRollout(str(path), self.template, **vllm)
        else:
            model = load_model(path, template=self.template).to(torch.device(device or default_device()))
            self.engine = build_rollout_engine(Policy(model.requires_grad_(False), self.template))
        self.parse, self.score_max = parse, score_max
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.unparsed = 0
        self.last_unparsed = 0

    def judge_prompts(self, completions, prompts, images, solution, sample_ids) -> list:
        from mmgrpo.data.sample import LoadedSample
        from mmgrpo.rewards.text import extract_answer

        encoded = []
        for i, completion in enumerate(completions):
            sample_images = list(images[i] or []) if images is not None else []
            text = self.prompt.format(question=question_text(prompts[i]), reference=reference_text(solution[i]),
                                      completion=extract_answer(completion) or completion)
            content = "<image>" * len(sample_images) + text
            loaded = LoadedSample(id=f"judge:{sample_ids[i] if sample_ids else i}",
                                  messages=[{"role": "user", "content": content}], images=sample_images)
            encoded.append(self.template.encode_prompt(loaded))
        return encoded

    @torch.no_grad()
    def replies(self, encoded: list) -> list[str]:
        from mmgrpo.rollout.base import SamplingParams

        sampling = SamplingParams(num_generations=1, max_new_tokens=self.max_new_tokens, greedy=True)
        out: list[str] = []
        for start in range(0, len(encoded), self.batch_size):
            rollout = self.engine.generate(encoded[start : start + self.batch_size], sampling)
            out.extend(self.template.decode(rollout.completion_ids, rollout.completion_mask))
        return out

    def score_replies(self, replies: list[str], sample_ids=None) -> list[float | None]:
        """Parsed rewards; the unparsable ones are None, counted and logged (the first shown)."""
        scores = [parse_reply(reply, self.parse, self.score_max) for reply in replies]
        missed = [i for i, s in enumerate(scores) if s is None]
        self.last_unparsed = len(missed)
        self.unparsed += len(missed)
        if missed:
            first = missed[0]
            name = f" (sample {sample_ids[first]})" if sample_ids else ""
            logger.warning("judge: %d of %d replies did not parse as --judge_parse %s; scored None. First%s: %r",
                           len(missed), len(replies), self.parse, name, replies[first][:200])
        return scores

    def __call__(self, completions: list[str], prompts=None, images=None, solution=None, sample_id=None,
                 **columns) -> list[float | None]:
        if prompts is None:
            raise ValueError("the judge needs the `prompts` column (the sample's messages; mmgrpo train passes it)")
        solution = solution if solution is not None else [None] * len(completions)
        encoded = self.judge_prompts(completions, prompts, images, solution, sample_id)
        return self.score_replies(self.replies(encoded), sample_id)

    def stats(self) -> dict[str, float]:
        """Per-step counters the training log shows (judge/unparsed)."""
        return {"judge/unparsed": float(self.last_unparsed)}
