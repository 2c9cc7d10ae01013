"""Multi-turn rollouts with tools: the model calls a tool, the environment answers, the model
goes on, up to `--max_turns` model turns.

    engine = MultiTurnRollout(inner, template, ToolEnvironment.from_specs(["image_zoom_in_tool"]), max_turns=3)
    rollout = engine.generate(prompts, SamplingParams(num_generations=8, max_new_tokens=256))

It wraps any rollout engine (`inner`: HF generate, the shared-prefix sampler, vLLM) and keeps
its interface. One call runs every episode of the batch turn by turn:

    turn 1   inner.generate(B prompts, G)            each prompt shared by its group of G
    then     for each episode whose last turn called a tool: run the calls (environment.py),
             render their results as the family's tool turn (text, or images encoded by the
             template's media hooks), and make prompt + turns so far its next prompt
    turn k   inner.generate(those prompts, 1)         one row each: episodes differ after turn 1

An episode ends when a model turn calls no tool (its answer), when its turn `max_turns` is done
(a call in it is not run: counted in `tools/max_turns_reached`), or when the token budget is
spent. The budget, `max_new_tokens` (= `--max_completion_length`, or the dataset's own), covers the whole trajectory
after the prompt: the model's tokens and the tool turns' (image tokens included), so the
training forward's length stays bounded. A turn that reaches it, or a tool turn that does not
fit in what is left, ends the episode as truncated.

The Rollout's completion is the whole trajectory (`completion_mask` over all of it); its
`loss_mask` marks the model's own tokens, the only ones trained; `completion_media` holds each
row's tool-turn media, which the training forward feeds in order after the prompt's; `logps`
are the sampler's, 0 on tool tokens (None if the inner engine gives none). Rewards score each
episode's last model turn (`texts`) and get `trajectory`, `tool_calls`, `tool_errors` and
`turns` as columns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mmgrpo.rollout.base import Rollout, RolloutEngine, SamplingParams
from mmgrpo.templates.turns import ToolTurn, encode_tool_turn, extend_prompt, merge_media
from mmgrpo.tools.calls import parse_tool_calls
from mmgrpo.tools.environment import ERROR_KINDS, ToolEnvironment, ToolResult
from mmgrpo.tools.tool_funcs import ToolContext


@dataclass
class Episode:
    """One completion's turns so far."""

    prompt: object  # PromptInputs of the next model turn (the sample's, extended after each tool turn)
    budget: int  # tokens the whole episode may have after the prompt (its dataset's max_completion_length)
    pieces: list = field(default_factory=list)  # (ids [n], is the model's, sampler logps [n] | None)
    model_texts: list[str] = field(default_factory=list)
    tool_texts: list[str] = field(default_factory=list)
    media: dict = field(default_factory=dict)  # media tensors of the tool turns, in order
    calls: int = 0
    errors: dict = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))
    done: bool = False
    truncated: bool = False
    max_turns_reached: bool = False

    @property
    def length(self) -> int:
        return sum(len(ids) for ids, _, _ in self.pieces)

    @property
    def turns(self) -> int:
        return len(self.model_texts)

    def trajectory(self) -> str:
        """The episode as text: model turns and tool turns (one placeholder per image) in order."""
        tool_texts = iter(self.tool_texts)
        return "".join(text + next(tool_texts, "") for text in self.model_texts)


class MultiTurnRollout(RolloutEngine):
    """`generate(prompts, sampling) -> Rollout` over episodes of up to `max_turns` model turns."""

    def __init__(self, inner, template, environment: ToolEnvironment, max_turns: int):
        """inner: the engine that samples each turn; template: the policy's (it renders tool turns
        and encodes their images); environment: the tools; max_turns: model turns per episode."""
        template.render_tool_turn([[{"type": "text", "text": "ok"}]])  # a family without tool turns fails now
        self.inner, self.template, self.environment, self.max_turns = inner, template, environment, max_turns

    @property
    def separate_weights(self) -> bool:
        return self.inner.separate_weights

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def update_weights(self, named_tensors, version: int) -> None:
        self.inner.update_weights(named_tensors, version)

    def close(self) -> None:
        self.inner.close()

    def generate(self, prompts: list, sampling: SamplingParams) -> Rollout:
        """B prompts -> B x G episodes, the G of a prompt contiguous (see the module docstring)."""
        group = sampling.num_generations
        first = self.inner.generate(prompts, sampling)
        episodes = [Episode(prompts[row // group], sampling.budget(row // group)) for row in range(len(prompts) * group)]
        self._add_model_turns(episodes, first)
        tool_seconds = 0.0
        for turn in range(2, self.max_turns + 1):
            waiting = []
            for episode in episodes:
                if episode.done:
                    continue
                started = time.perf_counter()
                results = self.environment.answer(episode.model_texts[-1], self._context(episode, turn - 1))
                tool_seconds += time.perf_counter() - started
                if not results:  # an answer: the episode is over
                    episode.done = True
                    continue
                self._add_tool_turn(episode, results)
                if not episode.done:
                    waiting.append(episode)
            if not waiting:
                break
            left = [episode.budget - episode.length for episode in waiting]
            params = SamplingParams(
                num_generations=1, max_new_tokens=max(left), temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, greedy=sampling.greedy,
                seed=None if sampling.seed is None else sampling.seed + 7919 * turn,
                max_new_tokens_per_prompt=None if min(left) == max(left) else left, suppress_eos=sampling.suppress_eos,
            )
            self._add_model_turns(waiting, self.inner.generate([episode.prompt for episode in waiting], params))
        for episode in episodes:  # a call in the last allowed turn is not run
            if not episode.done and parse_tool_calls(episode.model_texts[-1]):
                episode.max_turns_reached = True
            episode.done = True
        return self._assemble(episodes, first, tool_seconds)

    # ---- turns ------------------------------------------------------------------------------

    def _add_model_turns(self, episodes: list[Episode], rollout: Rollout) -> None:
        """Row i of `rollout` is episode i's next model turn, cut where the episode's budget ends."""
        lengths = rollout.completion_mask.sum(1).tolist()
        for row, episode in enumerate(episodes):
            left = episode.budget - episode.length
            length = min(int(lengths[row]), left)
            ids = rollout.completion_ids[row, :length]
            logps = None if rollout.logps is None else rollout.logps[row, :length]
            episode.pieces.append((ids, True, logps))
            episode.model_texts.append(self.template.decode(ids[None], torch.ones_like(ids)[None])[0])
            if bool(rollout.truncated[row]) or length < lengths[row]:
                episode.done = episode.truncated = True

    def _add_tool_turn(self, episode: Episode, results: list[ToolResult]) -> None:
        """Count the calls, encode their results as a tool turn and extend the episode's prompt;
        an episode whose tool turn leaves no room for a model token ends, truncated."""
        turn = self._encode(results)
        episode.calls += len(results)
        for result in results:
            if result.error:
                episode.errors[result.error] += 1
        if episode.length + len(turn.ids) >= episode.budget:
            episode.done = episode.truncated = True
            return
        model_ids = episode.pieces[-1][0]
        episode.prompt = extend_prompt(self.template, episode.prompt, model_ids, turn)
        episode.pieces.append((turn.ids.to(model_ids.device), False, None))
        episode.tool_texts.append(turn.text)
        if turn.mm:
            episode.media = merge_media(self.template, episode.media, turn.mm)

    def _encode(self, results: list[ToolResult]) -> ToolTurn:
        images = [image for result in results for image in result.images]
        try:
            return encode_tool_turn(self.template, [result.parts for result in results], images)
        except Exception as err:  # e.g. an image the processor cannot take: the model is told, the run goes on
            failed = [ToolResult.failure("result", f"the tool's image cannot be shown ({type(err).__name__}: {err}).")
                      if result.images else result for result in results]
            for result in results:
                if result.images and result.error is None:
                    result.error = "result"
            return encode_tool_turn(self.template, [result.parts for result in failed], [])

    def _context(self, episode: Episode, turn: int) -> ToolContext:
        prompt = episode.prompt
        return ToolContext(
            sample_id=prompt.id, images=list(prompt.images), image_sizes=list(prompt.image_sizes),
            input_sizes=list(prompt.input_sizes), columns=prompt.columns, template=self.template, turn=turn,
        )

    # ---- the rollout ------------------------------------------------------------------------

    def _assemble(self, episodes: list[Episode], first: Rollout, tool_seconds: float) -> Rollout:
        device = first.completion_ids.device
        width = max(1, max(episode.length for episode in episodes))
        num_rows = len(episodes)
        completion_ids = torch.full((num_rows, width), self.template.completion_pad_id, dtype=torch.long, device=device)
        completion_mask = torch.zeros((num_rows, width), dtype=torch.long, device=device)  # [N, T]
        loss_mask = torch.zeros((num_rows, width), dtype=torch.long, device=device)  # [N, T]
        has_logps = all(logps is not None for e in episodes for ids, own, logps in e.pieces if own)
        logps = torch.zeros((num_rows, width), dtype=torch.float32, device=device) if has_logps else None
        for row, episode in enumerate(episodes):
            start = 0
            for ids, own, piece_logps in episode.pieces:
                end = start + len(ids)
                completion_ids[row, start:end] = ids
                completion_mask[row, start:end] = 1
                loss_mask[row, start:end] = int(own)
                if logps is not None and own:
                    logps[row, start:end] = piece_logps.float()
                start = end
        calls = [e.calls for e in episodes]
        errors = {kind: sum(e.errors[kind] for e in episodes) for kind in ERROR_KINDS}
        metrics = {
            "tools/calls_per_completion": sum(calls) / num_rows,
            "tools/used": sum(c > 0 for c in calls) / num_rows,  # share of episodes with a tool call
            "tools/turns": sum(e.turns for e in episodes) / num_rows,
            "tools/max_turns_reached": sum(e.max_turns_reached for e in episodes) / num_rows,
            "tools/model_tokens": float(loss_mask.sum()) / num_rows,
            "tools/tool_tokens": float((completion_mask - loss_mask).sum()) / num_rows,
        }
        totals = {  # add up across rollouts (rounds of one step)
            "tools/errors": float(sum(errors.values())),
            **{f"tools/errors_{kind}": float(count) for kind, count in errors.items()},
            "tools/seconds": tool_seconds,
        }
        return Rollout(
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            truncated=torch.tensor([e.truncated for e in episodes], device=device),
            logps=logps,
            weight_version=first.weight_version,
            loss_mask=loss_mask,
            completion_media=[e.media for e in episodes],
            texts=[e.model_texts[-1] for e in episodes],
            columns={
                "trajectory": [e.trajectory() for e in episodes],
                "tool_calls": calls,
                "tool_errors": [sum(e.errors.values()) for e in episodes],
                "turns": [e.turns for e in episodes],
            },
            metrics=metrics,
            totals=totals,
        )

