"""Log-probs of the completion tokens without ever holding [B, T, V] logits.

Full-vocabulary logits cost about tokens x vocab x 7 bytes through log_softmax and its backward
(8.7 GB for 8K tokens at a 152K vocabulary). ``completion_logprobs`` takes the last hidden
states instead and goes through the B*T rows ``chunk_size`` at a time:

    forward:  logits = softcap(h @ W.T + b) / temperature   (fp32, [chunk, V], freed after the chunk)
              logp   = logits[target] - logsumexp(logits)
    backward: the chunk's logits are computed again and
              d logits = g * (onehot(target) - softmax(logits)) / temperature * softcap'(h @ W.T + b)

so what is saved for backward is hidden, weight, targets and one logsumexp per row, and the
peak extra memory is a few [chunk_size, V] fp32 blocks (plus one fp32 copy of W, and of its
gradient, when W is not fp32). The matmul runs in fp32 (at least): bf16 logits are off by
~0.1 at the scale of 20, enough to bias importance ratios (MiniMax-M1 moved its LM head to fp32).

    >>> import torch
    >>> hidden, weight = torch.randn(2, 3, 8), torch.randn(11, 8)
    >>> target_ids = torch.randint(0, 11, (2, 3))
    >>> logps, _ = completion_logprobs(hidden, weight, target_ids, chunk_size=4)
    >>> reference, _ = naive_completion_logprobs(hidden, weight, target_ids)
    >>> torch.allclose(logps, reference, atol=1e-5)
    True

``softcap`` is the final-logit soft-capping of Gemma 2 and Gemma 4 checkpoints (their text config's
``final_logit_softcapping``, 30.0 in the published ones): raw logits z become cap * tanh(z / cap),
after the bias and before the temperature, as transformers' forward caps what the head returns and
generate's temperature then divides it (``cap_logits``). Its derivative is 1 - tanh(z / cap)**2,
one more [chunk_size, V] block in the backward (three at most, with the entropy's gradient).
transformers caps the head's output in the head's dtype (bf16 in a bf16 model); here it is capped
in fp32, as the whole head runs (equal for fp32 models).

Alignment is the caller's: ``hidden[b, t]`` is the state that predicts ``target_ids[b, t]``
(i.e. hidden of position p - 1 for the completion token at position p). A negative target id
(-100, padding) gives logp 0 and no gradient.
"""

import torch
from torch import Tensor

LOGITS_CHUNK_BYTES = 128 * 2**20
"""Memory of one fp32 [rows, vocab] block of logits; up to three such blocks are alive at once."""


def logits_chunk_rows(vocab_size: int, budget_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Rows per chunk so that one fp32 [rows, vocab] block of logits fits in `budget_bytes`.

    A fixed row count would not do: 4096 rows are 25 MB of logits at a 1.5K vocabulary but
    2.5 GB at Qwen's 151,936.

    >>> logits_chunk_rows(151936), logits_chunk_rows(1536)
    (220, 21845)
    """
    return max(16, budget_bytes // (4 * vocab_size))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 for bf16/fp16/fp32, fp64 stays fp64


def cap_logits(logits: Tensor, softcap: float | None) -> Tensor:
    """Final-logit soft-capping: cap * tanh(logits / cap), as Gemma 2 / Gemma 4 heads apply it;
    None or 0 leaves the logits as they are (the input is never changed in place).

    >>> cap_logits(torch.tensor([0.0, 1.0, 100.0]), 5.0).tolist()  # ~linear near 0, never beyond 5
    [0.0, 0.9868766069412231, 5.0]
    >>> cap_logits(torch.tensor([100.0]), None).tolist()
    [100.0]
    """
    if not softcap:
        return logits
    return torch.tanh(logits / softcap) * softcap


def _raw_logits(hidden_chunk: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    # autocast off: under a bf16 autocast region the matmul would otherwise run in bf16
    with torch.autocast(hidden_chunk.device.type, enabled=False):
        logits = hidden_chunk.to(weight.dtype) @ weight.T  # [chunk, V]
    if bias is not None:
        logits = logits + bias
    return logits


def _chunk_logits(hidden_chunk: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, softcap: float) -> Tensor:
    logits = _raw_logits(hidden_chunk, weight, bias)  # a new [chunk, V] block: capped and scaled in place
    if softcap:
        logits.div_(softcap).tanh_().mul_(softcap)  # cap_logits
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _chunk_logits_and_cap_slope(
    hidden_chunk: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, softcap: float
) -> tuple[Tensor, Tensor | None]:
    """The chunk's logits (as `_chunk_logits`) and d capped / d raw = 1 - tanh(z / cap)**2 [chunk, V]
    (None without a cap): one more [chunk, V] block, for the backward."""
    if not softcap:
        return _chunk_logits(hidden_chunk, weight, bias, temperature, softcap), None
    tanh = _raw_logits(hidden_chunk, weight, bias).div_(softcap).tanh_()  # [chunk, V], in place
    logits = tanh * softcap  # the forward's rounding, op for op: its saved logsumexp stays exact
    if temperature != 1.0:
        logits.div_(temperature)
    return logits, tanh.square_().neg_().add_(1.0)  # in place: the slope replaces tanh


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, chunk_size, temperature, softcap, compute_entropy):
        # hidden [M, H], weight [V, H], bias [V] | None, target_ids [M]
        compute_dtype = _compute_dtype(hidden.dtype)
        weight_c = weight.to(compute_dtype)  # no copy when already fp32
        bias_c = bias.to(compute_dtype) if bias is not None else None
        valid = target_ids >= 0  # [M]
        safe_targets = target_ids.clamp(min=0)
        num_rows = hidden.shape[0]
        logps = hidden.new_empty(num_rows, dtype=compute_dtype)
        logsumexp = hidden.new_empty(num_rows, dtype=compute_dtype)
        entropy = hidden.new_empty(num_rows, dtype=compute_dtype) if compute_entropy else None
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden[rows], weight_c, bias_c, temperature, softcap)  # [chunk, V]
            chunk_lse = torch.logsumexp(logits, dim=-1)  # [chunk]
            logsumexp[rows] = chunk_lse
            logps[rows] = logits.gather(-1, safe_targets[rows, None]).squeeze(-1) - chunk_lse
            if compute_entropy:
                # H = logsumexp - sum p * logits
                probs = torch.softmax(logits, dim=-1)
                entropy[rows] = chunk_lse - probs.mul_(logits).sum(-1)  # in place: no third [chunk, V] block
                del probs
            del logits
        logps = torch.where(valid, logps, 0.0)
        ctx.save_for_backward(hidden, weight, bias, safe_targets, valid, logsumexp, entropy)
        ctx.chunk_size, ctx.temperature, ctx.softcap = chunk_size, temperature, softcap
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, targets, valid, logsumexp, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        compute_dtype = logsumexp.dtype
        weight_c = weight.to(compute_dtype)
        bias_c = bias.to(compute_dtype) if bias is not None else None
        # padding rows (negative target) get no gradient from their log-prob
        if grad_logps is None:
            grad_logps = torch.zeros_like(logsumexp)
        grad_logps = torch.where(valid, grad_logps.to(compute_dtype), 0.0)  # [M]
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight_c) if need_weight else None
        grad_bias = torch.zeros_like(bias_c) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            hidden_chunk = hidden[rows].to(compute_dtype)  # [chunk, H]
            # cap_slope: d capped / d raw logits [chunk, V], or None without a soft cap
            logits, cap_slope = _chunk_logits_and_cap_slope(hidden_chunk, weight_c, bias_c, ctx.temperature, ctx.softcap)
            if grad_entropy is None:
                # d logp / d logits = onehot(target) - softmax; the softmax is built in place
                grad_logits = logits.sub_(logsumexp[rows, None]).exp_()  # [chunk, V], softmax
                grad_logits.mul_(-grad_logps[rows, None])
            else:
                # and d H / d logits = -softmax * (log-softmax + H): one more [chunk, V] block
                log_probs = logits.sub_(logsumexp[rows, None])  # in place
                probs = log_probs.exp()
                grad_logits = log_probs.add_(entropy[rows, None]).mul_(probs).mul_(-grad_entropy[rows, None])
                grad_logits.sub_(probs.mul_(grad_logps[rows, None]))
                del probs
            grad_logits.scatter_add_(-1, targets[rows, None], grad_logps[rows, None])
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            if cap_slope is not None:  # through cap * tanh(z / cap) to the raw logits z
                grad_logits.mul_(cap_slope)
            if need_hidden:
                grad_hidden[rows] = (grad_logits @ weight_c).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(grad_logits.T, hidden_chunk)
            if need_bias:
                grad_bias += grad_logits.sum(0)
            del logits, grad_logits, cap_slope
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        if need_bias:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def completion_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    lm_head_bias: Tensor | None = None,
    softcap: float | None = None,
    compute_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs of ``target_ids`` (and optionally the entropy), chunked over rows.

    Args:
        hidden: [B, T, H] final hidden states (after the last norm), any float dtype.
        lm_head_weight: [V, H] output projection (tied embeddings are fine); grads flow to it
            when it requires grad.
        target_ids: [B, T] token ids; negative ids are padding (logp 0, no gradient).
        chunk_size: rows of the flattened [B*T, H] processed at once; peak extra memory is a
            few chunk_size x V fp32 blocks (1024 x 152K x 4 B = 0.6 GB per block).
        temperature: logits are divided by it, as the sampler did, so the log-probs are those
            of the distribution the completions were drawn from.
        lm_head_bias: [V] or None.
        softcap: the model's final-logit soft-capping (``final_logit_softcapping``): logits become
            cap * tanh(logits / cap) before the temperature; None or 0: none.
        compute_entropy: also return the entropy of each row's distribution (with grad: an entropy
            term in the loss, --entropy_coeff, trains through it; unused, it costs no backward work).

    Returns:
        logps: [B, T] in fp32 (fp64 when hidden is fp64), with grad.
        entropy: [B, T] in fp32 (fp64 when hidden is fp64), or None.
    """
    if hidden.dim() != 3 or target_ids.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [B, T, H] and target_ids {tuple(target_ids.shape)} [B, T]"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    batch, seq_len, hidden_size = hidden.shape
    logps, entropy = _ChunkedLogprobs.apply(
        hidden.reshape(batch * seq_len, hidden_size),
        lm_head_weight,
        lm_head_bias,
        target_ids.reshape(-1),
        chunk_size,
        float(temperature),
        float(softcap or 0.0),
        compute_entropy,
    )
    logps = logps.view(batch, seq_len)
    return logps, entropy.view(batch, seq_len) if entropy is not None else None


def naive_completion_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    *,
    temperature: float = 1.0,
    lm_head_bias: Tensor | None = None,
    softcap: float | None = None,
    compute_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The same result the obvious way (full [B, T, V] logits); the reference in tests."""
    compute_dtype = _compute_dtype(hidden.dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        logits = hidden.to(compute_dtype) @ lm_head_weight.to(compute_dtype).T  # [B, T, V]
    if lm_head_bias is not None:
        logits = logits + lm_head_bias.to(compute_dtype)
    logits = cap_logits(logits, softcap) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)  # [B, T, V]
    valid = target_ids >= 0
    logps = log_probs.gather(-1, target_ids.clamp(min=0)[..., None]).squeeze(-1)  # [B, T]
    logps = torch.where(valid, logps, 0.0)
    entropy = None
    if compute_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy
