"""Synonym replacement: the text augmentation beside image rotation and audio noise (mmgrpo/data/augment.py).

    augment: {synonyms: data/synonyms.txt, synonym_prob: 0.2, protected_words: [circle]}

No maintained thesaurus on PyPI ships its data in the wheel (nltk's WordNet and `wn` download
their corpora at run time, which an offline machine cannot do), so the synonyms come from a file
you give:

- `.json`: `{"big": ["large", "huge"], ...}` (a word -> its replacements);
- any other extension: one group of interchangeable words per line, comma-separated
  (`big, large, huge`); `#` starts a comment.

Each word of the user turns that the table knows is replaced, with probability `synonym_prob`,
by one of its synonyms (uniformly), keeping a leading capital. Never touched: media tags
(`<image>`), system and assistant turns, and the protected words. `synonym_protect` names the
kinds protected (default all three): `answers` (every word of the sample's `solution`, so the
answer never changes under the model), `option_letters` (a lone capital letter: "A", "(B)", "C."),
`numbers` (any word holding a digit, and the number words zero..twenty); `protected_words` adds
literal words. Draws come from the sample's generator (seed, epoch, index), like the image keys.

    >>> table = parse_synonym_lines(["big, large", "red, crimson"])
    >>> import torch
    >>> text, swaps = replace_synonyms("Is the big shape red? Answer A or B.", table, 1.0, {"red"}, torch.Generator().manual_seed(0))
    >>> text, swaps
    ('Is the large shape red? Answer A or B.', [['big', 'large']])
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mmgrpo.errors import ConfigError

PROTECT_KINDS = ("answers", "option_letters", "numbers")
NUMBER_WORDS = {
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
}
_LETTERS = re.compile(r"[A-Za-z][A-Za-z'-]*")
_TAG_OR_WORD = re.compile(r"<(?:image|video|audio)>|[A-Za-z][A-Za-z'-]*")  # a media tag is matched whole, and kept


def parse_synonym_lines(lines) -> dict[str, list[str]]:
    """Groups of interchangeable words, one per line -> each word's synonyms (lower-case).

    >>> parse_synonym_lines(["big, large, huge  # sizes", "", "# a comment"])["large"]
    ['big', 'huge']
    """
    table: dict[str, list[str]] = {}
    for line in lines:
        words = [w.strip().lower() for w in line.split("#", 1)[0].split(",") if w.strip()]
        for word in words:
            table.setdefault(word, [])
            table[word].extend(w for w in words if w != word and w not in table[word])
    return {word: synonyms for word, synonyms in table.items() if synonyms}


def load_synonyms(path: str, where: str) -> dict[str, list[str]]:
    """The synonym table of a file (see the module docstring); a bad file is a ConfigError naming it."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{where}, key 'augment.synonyms': no such file {str(file)!r} (paths are relative to the working directory)")
    text = file.read_text(encoding="utf-8")
    if file.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}, key 'augment.synonyms': {file} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(data, dict) or not all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in data.values()):
            raise ConfigError(f"{where}, key 'augment.synonyms': {file} must map each word to a list of synonyms")
        table = {word.lower(): [s.lower() for s in synonyms if s.lower() != word.lower()] for word, synonyms in data.items()}
        table = {word: synonyms for word, synonyms in table.items() if synonyms}
    else:
        table = parse_synonym_lines(text.splitlines())
    if not table:
        raise ConfigError(f"{where}, key 'augment.synonyms': {file} holds no synonyms")
    return table


def protected_words(solution, kinds, extra) -> set[str]:
    """The lower-case words a sample's replacement must leave alone (see the module docstring).

    >>> sorted(protected_words(["a red circle", "crimson"], ["answers"], ["shape"]))
    ['a', 'circle', 'crimson', 'red', 'shape']
    """
    words = {w.lower() for w in extra}
    if "answers" in kinds and solution is not None:
        values = solution if isinstance(solution, (list, tuple)) else [solution]
        for value in values:
            text = value.get("answer", "") if isinstance(value, dict) else value
            if isinstance(text, str):
                words.update(w.lower() for w in _LETTERS.findall(text))
    return words


def _is_kept(word: str, protected: set[str], kinds) -> bool:
    lower = word.lower()
    if lower in protected:
        return True
    if "option_letters" in kinds and len(word) == 1 and word.isupper():
        return True
    return "numbers" in kinds and (any(c.isdigit() for c in word) or lower in NUMBER_WORDS)


def replace_synonyms(text: str, table: dict, prob: float, protected: set[str], generator,
                     kinds=PROTECT_KINDS) -> tuple[str, list[list[str]]]:
    """`text` with words replaced (module docstring); the swaps made, as [word, replacement] pairs."""
    import torch

    swaps = []

    def swap(match: re.Match) -> str:
        word = match.group(0)
        synonyms = table.get(word.lower())
        if not synonyms or word.startswith("<") or _is_kept(word, protected, kinds):
            return word
        if float(torch.rand((), generator=generator)) >= prob:
            return word
        choice = synonyms[int(torch.randint(len(synonyms), (), generator=generator))]
        if word[0].isupper():
            choice = choice[0].upper() + choice[1:]
        swaps.append([word, choice])
        return choice

    return _TAG_OR_WORD.sub(swap, text), swaps


def augment_messages(messages: list[dict], table: dict, prob: float, protected: set[str], generator,
                     kinds=PROTECT_KINDS) -> tuple[list[dict], list[list[str]]]:
    """The messages with the user turns' text passed through `replace_synonyms` (new objects)."""
    out, swaps = [], []
    for message in messages:
        if message.get("role") != "user":
            out.append(message)
            continue
        content = message["content"]
        if isinstance(content, str):
            content, made = replace_synonyms(content, table, prob, protected, generator, kinds)
            swaps += made
        else:
            parts = []
            for part in content:
                if part.get("type") == "text":
                    text, made = replace_synonyms(part["text"], table, prob, protected, generator, kinds)
                    part, swaps = {**part, "text": text}, swaps + made
                parts.append(part)
            content = parts
        out.append({**message, "content": content})
    return out, swaps
