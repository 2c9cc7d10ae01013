"""What judging costs next to the rollout it judges: the generative judge (--judge_model) and a
reward model (--reward_model) against the policy's rollout of the same step.

    python benchmarks/judge.py                      # tiny Qwen2-VL as policy and judge, about a minute
    python benchmarks/judge.py --completion_tokens 64 --judge_tokens 16 --repeats 5

One step's rollout: B prompts (shapes-color images) x G completions of up to --completion_tokens
(a random tiny policy rarely stops early), on the shared-prefix engine. The judge then reads B x G
English completions of about the same length (about 4 characters a token) with their images and
writes --judge_tokens greedy tokens each (batches of --batch_size); the reward model scores the
same B x G conversations. Measured
alternately (rollout, judge, reward model) --repeats times after one warm-up, one torch thread;
printed: median seconds and the judge / rollout and reward model / rollout ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--completion_tokens", type=int, default=32)
    parser.add_argument("--judge_tokens", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from mmgrpo.data.catalog import resolve_dataset
    from mmgrpo.forward.policy import Policy
    from mmgrpo.models.loading import load_model, load_template
    from mmgrpo.rewards.judge import JudgeReward
    from mmgrpo.rewards.reward_model import RewardModelReward
    from mmgrpo.rollout import build_rollout_engine
    from mmgrpo.rollout.base import SamplingParams

    path, _, template = load_template("tiny:qwen2-vl", None)
    model = load_model(path, template=template)
    policy_engine = build_rollout_engine(Policy(model, template))
    dataset = resolve_dataset("shapes-color")
    samples = [dataset[i].load_media() for i in range(args.prompts)]
    encoded = [template.encode_prompt(s) for s in samples]
    G = args.num_generations
    sampling = SamplingParams(num_generations=G, max_new_tokens=args.completion_tokens)
    judge = JudgeReward("tiny:qwen2-vl", max_new_tokens=args.judge_tokens, batch_size=args.batch_size)
    reward_model = RewardModelReward("tiny:reward-qwen2", batch_size=args.batch_size)
    prompts = [s.messages for s in samples for _ in range(G)]
    images = [s.images for s in samples for _ in range(G)]
    solutions = [s.columns.get("solution") for s in samples for _ in range(G)]

    def rollout():
        with torch.no_grad():
            out = policy_engine.generate(encoded, sampling)
        return template.decode(out.completion_ids, out.completion_mask)

    rollout()  # warm-up
    # What is judged: text of about --completion_tokens tokens. (A random tiny policy's own output is
    # reserved-token soup that another tokenizer splits into 5-10x as many tokens: not what a judge reads.)
    words = "<think>The shape in the image looks round and its colour is close to red.</think>"
    completions = [(words * (1 + args.completion_tokens // 20))[: 4 * args.completion_tokens] + "<answer>red</answer>"
                   for _ in range(args.prompts * G)]
    judge(completions, prompts=prompts, images=images, solution=solutions)
    reward_model(completions, prompts=prompts)
    seconds = {"rollout": [], "judge": [], "reward_model": []}
    for _ in range(args.repeats):
        for name, call in (("rollout", rollout),
                           ("judge", lambda: judge(completions, prompts=prompts, images=images, solution=solutions)),
                           ("reward_model", lambda: reward_model(completions, prompts=prompts))):
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    n = args.prompts * G
    print(f"{n} completions of {args.completion_tokens} tokens; judge writes {args.judge_tokens} tokens each")
    for name, value in median.items():
        print(f"  {name:13s} {value:7.3f} s  ({value / median['rollout']:.2f} x rollout)")


if __name__ == "__main__":
    main()
