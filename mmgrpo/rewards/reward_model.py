"""Reward models: an HF sequence-classification checkpoint scores prompt + completion.

    mmgrpo train ... --reward_funcs format --reward_model path/to/rm [path/to/rm2] --reward_model_device cuda:1

The conversation (the sample's messages, then the completion as the assistant's turn) is rendered
with the reward model's OWN chat template; media appear as their text tags (`<image>`), since a
text reward model sees no pixels. Completions are scored in batches of --reward_model_batch_size on
--reward_model_device; the reward is the model's single logit. Checked at start-up: one label, a
chat template, a pad token, and a tokenizer whose ids fit the model's embedding table.

    >>> text_messages([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}])
    [{'role': 'user', 'content': '<image>Colour?'}]
"""

from __future__ import annotations

import os

import torch

from mmgrpo.errors import ConfigError


def text_messages(messages: list[dict]) -> list[dict]:
    """Messages with list content flattened to text, media parts as their tags."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = "".join(
                part.get("text", "") if part.get("type") == "text" else f"<{part.get('type', 'media')}>" for part in content
            )
        out.append({"role": message["role"], "content": content})
    return out


def default_device() -> str:
    """This process's accelerator (its LOCAL_RANK's under torchrun), else the CPU."""
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


class RewardModelReward:
    """A reward function backed by a sequence-classification model (see the module docstring)."""

    def __init__(self, path: str, *, device: str | None = None, batch_size: int = 16, max_length: int = 4096):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from mmgrpo.models.loading import checkpoint_path
        from mmgrpo.models.tiny_reward import TINY_REWARD_MODEL, build_tiny_reward_model

        spec = path
        if path == TINY_REWARD_MODEL:
            path = str(build_tiny_reward_model())
        folder = checkpoint_path(path)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.tokenizer.padding_side = "right"
        self.device = torch.device(device or default_device())
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(folder).to(self.device).eval()
        except ValueError as exc:  # a config with no sequence-classification head class
            raise ConfigError(f"--reward_model {path}: not a sequence-classification checkpoint ({exc})") from None
        except (OSError, RuntimeError, AssertionError) as exc:  # missing or mismatched weights
            raise ConfigError(f"--reward_model {path}: cannot load it ({type(exc).__name__}: {exc})") from None
        check_fits(path, self.tokenizer, self.model)
        self.batch_size, self.max_length = batch_size, max_length
        self.reward_name = f"reward_model:{os.path.basename(os.path.normpath(spec)).removeprefix('tiny:')}"

    @torch.no_grad()
    def __call__(self, completions: list[str], prompts: list | None = None, **columns) -> list[float]:
        if prompts is None:
            raise ValueError("a reward model needs the `prompts` column (the sample's messages; mmgrpo train passes it)")
        texts = [
            self.tokenizer.apply_chat_template(
                text_messages(messages) + [{"role": "assistant", "content": completion}], tokenize=False
            )
            for messages, completion in zip(prompts, completions, strict=True)
        ]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                   truncation=True, max_length=self.max_length).to(self.device)
            logits = self.model(**batch).logits  # [batch, 1]
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores


def check_fits(path: str, tokenizer, model) -> None:
    """ConfigError unless the reward model can score: one label, a chat template, a pad token,
    token ids inside its embedding table."""
    labels = model.config.num_labels
    if labels != 1:
        raise ConfigError(
            f"--reward_model {path}: the classifier has {labels} labels; a reward model has one (a scalar score). "
            "Give a checkpoint trained as a reward model (num_labels=1)."
        )
    if not tokenizer.chat_template:
        raise ConfigError(f"--reward_model {path}: its tokenizer has no chat template to render prompt + completion with.")
    if tokenizer.pad_token_id is None and model.config.pad_token_id is None:
        raise ConfigError(f"--reward_model {path}: no pad token in its tokenizer or config; batches cannot be padded.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = model.config.pad_token_id
    model.config.pad_token_id = tokenizer.pad_token_id  # the head reads the last non-pad token
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ConfigError(
            f"--reward_model {path}: its tokenizer has {len(tokenizer)} tokens but the model embeds {vocab}; "
            "the tokenizer does not belong to this model."
        )

