"""The tiny models' tokenizer, built offline: byte-level BPE on a fixed corpus, and chat templates.

`build_tokenizer` trains Qwen2's byte-level BPE on `tokenizer_corpus()` (deterministic, so the
same call always gives byte-identical files), appends a family's special tokens at ids
`BPE_VOCAB_SIZE + i`, pads the vocabulary and sets a Jinja chat template. The templates
(`QWEN_VL_CHAT_TEMPLATE`, `GEMMA3_CHAT_TEMPLATE`, `chatml_jinja`) live here too.
`mmgrpo.models.tiny` uses these to build each family's checkpoint.
"""

from __future__ import annotations

import json

from mmgrpo.errors import ConfigError

BPE_VOCAB_SIZE = 1500  # trained byte-level BPE tokens; the special tokens start right after


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------

# Our own Jinja template, equivalent in output to Qwen2-VL's: a default system turn, one
# vision block per image or video part, text parts concatenated as they are.
QWEN_VL_CHAT_TEMPLATE = (
    "{% set counts = namespace(image=0, video=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message.role != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set counts.image = counts.image + 1 %}"
    "{% if add_vision_id %}Picture {{ counts.image }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'video' or 'video' in part %}"
    "{% set counts.video = counts.video + 1 %}"
    "{% if add_vision_id %}Video {{ counts.video }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part.text }}"
    "{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_jinja(default_system: str | None, parts: dict[str, str]) -> str:
    """A ChatML chat template; `parts[kind]` is the Jinja one media part renders to.

    `counts.<kind>` is the 1-based index of that part among its kind. Text parts are written as
    they are; a string content is written as it is.
    """
    branches = "".join(
        f"{{% elif part.type == '{kind}' or '{kind}' in part %}}{{% set counts.{kind} = counts.{kind} + 1 %}}{body}"
        for kind, body in parts.items()
    )
    system = (
        "{% if loop.first and message.role != 'system' %}"
        f"<|im_start|>system\n{default_system}<|im_end|>\n"
        "{% endif %}"
        if default_system is not None
        else ""
    )
    return (
        "{% set counts = namespace(image=0, video=0, audio=0) %}"
        "{% for message in messages %}" + system + "<|im_start|>{{ message.role }}\n"
        "{% if message.content is string %}{{ message.content }}"
        "{% else %}{% for part in message.content %}"
        "{% if false %}" + branches + "{% elif 'text' in part %}{{ part.text }}{% endif %}"
        "{% endfor %}{% endif %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


QWEN_VL_PARTS = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}
QWEN_OMNI_PARTS = {
    "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
    "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
}
# Qwen3-Omni: Qwen3-VL's vision parts, audio between its own start and end tokens.
QWEN3_OMNI_PARTS = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
    "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
}

# Gemma3's format: <bos>, turns `<start_of_turn>user|model\n...<end_of_turn>\n`, the system text
# prefixed to the first user turn, text parts trimmed, each image one <start_of_image>.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0].role == 'system' %}"
    "{% if messages[0].content is string %}{% set system_text = messages[0].content %}"
    "{% else %}{% set system_text = messages[0].content | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{% endif %}"
    "{% set first_user_prefix = system_text + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "<start_of_turn>{{ 'model' if message.role == 'assistant' else message.role }}\n"
    "{{ first_user_prefix if loop.first else '' }}"
    "{% if message.content is string %}{{ message.content | trim }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}<start_of_image>"
    "{% elif part.type == 'text' %}{{ part.text | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


# GLM-4.1V-Thinking's format (the official chat_template.jinja renders the same for string contents):
# "[gMASK]<sop>", then per turn `<|system|>\n`, `<|user|>\n` or `<|assistant|>\n` and the content,
# no end-of-turn token (the model ends its turn by writing `<|user|>`); each image or video part is
# one begin / placeholder / end triple. The official template drops tool turns; here they are
# `<|observation|>\n` turns, GLM's tool-result role (mmgrpo.templates.glm4v renders the same).
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|observation|>\n{% else %}<|{{ message.role }}|>\n{% endif %}"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'video' or 'video' in part %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif part.type == 'image' or 'image' in part %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif 'text' in part %}{{ part.text }}"
    "{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Gemma 4's format (its chat_template.jinja without tools and thinking): <bos>; a system turn
# `<|turn>system\n...<turn|>\n` whose text parts are each trimmed and followed by a space; turns
# `<|turn>user|model\n...<turn|>\n` with text parts trimmed and one <|image|> / <|audio|> / <|video|>
# per medium; the generation prompt `<|turn>model\n` closes an empty thought channel (thinking off).
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0].role in ['system', 'developer'] %}<|turn>system\n"
    "{% if messages[0].content is string %}{{ messages[0].content | trim }}"
    "{% else %}{% for part in messages[0].content %}{{ part.text | trim + ' ' }}{% endfor %}{% endif %}"
    "<turn|>\n{% set loop_messages = messages[1:] %}"
    "{% else %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "<|turn>{{ 'model' if message.role == 'assistant' else message.role }}\n"
    "{% if message.content is string %}{{ message.content | trim }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'text' %}{{ part.text | trim }}"
    "{% elif part.type == 'image' %}<|image|>{% elif part.type == 'audio' %}<|audio|>"
    "{% elif part.type == 'video' %}<|video|>{% endif %}"
    "{% endfor %}{% endif %}"
    "<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n<|channel>thought\n<channel|>{% endif %}"
)

# ---------------------------------------------------------------------------------------------
# The fixed tokenizer corpus
# ---------------------------------------------------------------------------------------------

_COLOURS = "red green blue yellow orange purple pink brown black white gray grey cyan magenta"
_SHAPES = "circle square triangle rectangle star ellipse oval line dot box diamond hexagon polygon"
_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve twenty thirty forty "
    "fifty hundred thousand first second third fourth fifth half"
)
_WORDS = (
    "the a an is are was were be of in on at to from with and or not no yes this that these those "
    "what which where when who how many much there here it its image picture photo video frame "
    "audio sound speech left right top bottom middle center above below next between inside "
    "outside big small large tiny bigger smaller largest smallest count number color colour shape "
    "object objects answer question think reasoning step final box bounding coordinates point "
    "x y width height area total sum minus plus times equals correct wrong true false please "
    "describe explain find locate show give tell me you i we they he she user assistant system "
    "helpful hello thanks sure let us first then so because therefore output format only"
)
_TEMPLATES = (
    "<think>{reasoning}</think><answer>{answer}</answer>",
    "How many {shape}s are in the image? <answer>{n}</answer>",
    "The {colour} {shape} is at ({x}, {y}) and its box is [{x}, {y}, {x2}, {y2}].",
    "What colour is the {shape}? The answer is {colour}.",
    "User: what is {a} plus {b}? Assistant: {a} + {b} = {c}.",
    "You are a helpful assistant. Please think step by step and answer in the format.",
    "system\nYou are a helpful assistant.\nuser\nWhat is in the picture?\nassistant\nAnswer: {answer}",
)


def tokenizer_corpus() -> list[str]:
    """The fixed text the tiny tokenizer is trained on (deterministic, about 5k lines)."""
    colours, shapes, numbers = _COLOURS.split(), _SHAPES.split(), _NUMBERS.split()
    lines = [_COLOURS, _SHAPES, _NUMBERS, _WORDS, " ".join(str(i) for i in range(1001))]
    for i in range(3000):
        colour, shape, word = colours[i % len(colours)], shapes[i % len(shapes)], numbers[i % len(numbers)]
        a, b = (i * 7) % 100, (i * 13) % 100
        fields = {
            "reasoning": f"I see {word} {colour} {shape}s, so the count is {i % 11}.",
            "answer": word if i % 2 else str(i % 11),
            "shape": shape,
            "colour": colour,
            "n": i % 11,
            "x": (i * 37) % 1000,
            "y": (i * 91) % 1000,
            "x2": (i * 37) % 1000 + 50,
            "y2": (i * 91) % 1000 + 50,
            "a": a,
            "b": b,
            "c": a + b,
        }
        lines.append(_TEMPLATES[i % len(_TEMPLATES)].format(**fields))
    # Answers as the datasets write them: a real tokenizer's large vocabulary holds these words
    # whole; split into pieces, a colour answer sampled early in training is often misspelt.
    for colour in colours:
        lines += [f"The {shape} is {colour}: <answer>{colour}</answer>" for shape in shapes]
    return lines


def train_bpe(vocab_size: int = BPE_VOCAB_SIZE) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train Qwen2's byte-level BPE on the fixed corpus; returns (vocab, merges).

    The vocab has exactly `vocab_size` entries (padded with never-produced filler tokens if the
    trainer stops short), so the special tokens that follow always get the same ids.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    state = json.loads(tokenizer.to_str())["model"]
    vocab: dict[str, int] = state["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    _pad_vocab(vocab, vocab_size)
    return vocab, merges


def _pad_vocab(vocab: dict[str, int], size: int) -> None:
    """Fill `vocab` up to `size` ids with tokens no merge produces (never encoded, decode as text)."""
    next_id = len(vocab)
    while next_id < size:
        vocab[f"<|unused_{next_id}|>"] = next_id
        next_id += 1


def build_tokenizer(
    special_tokens: tuple[str, ...],
    chat_template: str,
    vocab_size: int | None,
    *,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
    bos_token: str | None = None,
    named_tokens: dict[str, str] | None = None,
    text_tokens: tuple[str, ...] = (),
):
    """Qwen2Tokenizer: trained BPE, then `special_tokens` at ids BPE_VOCAB_SIZE + i, then
    `text_tokens`, then fillers.

    `vocab_size` None pads to a multiple of 64; a larger value (151936 like the real Qwen
    vocabularies) pads with unused tokens, so len(tokenizer) always equals the model's vocab.
    `named_tokens` become tokenizer attributes that some processors read, e.g.
    {"image_token": "<|IMAGE|>"} gives `tokenizer.image_token` and `tokenizer.image_token_id`.
    `text_tokens` are pieces of plain text the tokenizer keeps whole and lists under their own text
    in `get_vocab()` (not special: decoding keeps them), e.g. Gemma's runs of newlines.
    """
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = train_bpe()
    for token in special_tokens + text_tokens:
        vocab[token] = len(vocab)
    min_size = len(vocab)
    vocab_size = vocab_size or -(-min_size // 64) * 64
    if vocab_size < min_size:
        raise ConfigError(f"tiny model vocab_size={vocab_size} is below the {min_size} tokens it needs")
    _pad_vocab(vocab, vocab_size)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token=eos_token,
        pad_token=pad_token,
        bos_token=bos_token,
        **({"model_specific_special_tokens": dict(named_tokens)} if named_tokens else {}),
        errors="replace",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    # The tokens exist in the vocab already: adding them as special keeps their ids.
    tokenizer.add_special_tokens(
        {"extra_special_tokens": [AddedToken(t, special=True, normalized=False) for t in special_tokens]}
    )
    if text_tokens:  # matched before BPE, longest first: "\n\n\n" is one token, as in Gemma's vocabulary
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in text_tokens])
    tokenizer.chat_template = chat_template
    return tokenizer


def qwen3_5_jinja(thinking: bool) -> str:
    """Qwen3.5's chat format: no default system turn, each message's text trimmed, a vision block
    per image or video part, `<think>` blocks on the assistant turns after the last user query
    (earlier ones keep only their answer), and a generation prompt that opens the thinking block
    (`thinking`, the checkpoint's default, or `enable_thinking=True`) or closes an empty one.

    Equivalent in output to the chat template the Qwen3.5 checkpoints ship, for the messages mmgrpo
    renders (no tool definitions or tool calls; those are the model's own text here).
    """
    on = "enable_thinking is not defined or enable_thinking" if thinking else "enable_thinking is defined and enable_thinking"
    return (
        "{%- macro body(content) -%}{%- if content is string -%}{{ content }}{%- else -%}"
        "{%- for part in content -%}"
        "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}<|vision_start|><|image_pad|><|vision_end|>"
        "{%- elif part.type == 'video' or 'video' in part -%}<|vision_start|><|video_pad|><|vision_end|>"
        "{%- elif 'text' in part -%}{{ part.text }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
        "{%- set ns = namespace(last_query=messages | length - 1, found=false) -%}"
        "{%- for message in messages[::-1] -%}"
        "{%- set text = body(message.content) | trim -%}"
        "{%- if not ns.found and message.role == 'user'"
        " and not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}"
        "{%- set ns.found = true -%}{%- set ns.last_query = messages | length - 1 - loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- for message in messages -%}"
        "{%- set content = body(message.content) | trim -%}"
        "{%- if message.role == 'assistant' -%}"
        "{%- set reasoning = '' -%}"
        "{%- if '</think>' in content -%}"
        "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') | trim -%}"
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
        "{%- if loop.index0 > ns.last_query -%}"
        "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
        "{%- else -%}{{ '<|im_start|>assistant\\n' + content }}{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
        "{{ '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
        "{%- else -%}{{ '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
        "{%- if " + on + " -%}{{ '<think>\\n' }}{%- else -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
        "{%- endif -%}"
    )
