"""Code that runs the model forward for the training step: completion log-probs under the policy
and its reference (`Policy`), and the group-shared prefix that runs each prompt once for its
G completions (`shared_prefix_hidden`). The maths on the resulting tensors is in mmgrpo/grpo/."""

from mmgrpo.forward.policy import ForwardBatch, Policy, plain_call
from mmgrpo.forward.shared_prefix import shared_prefix_hidden, supports_shared_prefix

__all__ = ["ForwardBatch", "Policy", "plain_call", "shared_prefix_hidden", "supports_shared_prefix"]
