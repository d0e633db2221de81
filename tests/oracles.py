"""Test oracles: plain-PyTorch references the fused paths are held to (not collected by pytest: no test_ prefix).

    grpo_loss_on_logprobs   grpo.grpo_loss on (B, L) log-prob tensors instead of hidden states: the same terms
                            (grpo.grpo_token_terms), token mean and stats, over naive log-probs
"""
import torch

from grpo import grpo_token_terms


def grpo_loss_on_logprobs(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                          mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0,
                          ref_logprobs: torch.Tensor | None = None, kl_estimator: str = "k3",
                          num_tokens: float | torch.Tensor | None = None, behav_logprobs: torch.Tensor | None = None,
                          behav_cap: float = 5.0) -> tuple[torch.Tensor, dict]:
    """`grpo_loss` on (B, L) log-prob tensors instead of hidden states: the reference the tests and benches hold
    the fused path to (same terms, same token-mean, same stats). Masked positions are cut out before any
    arithmetic, so garbage there (inf, NaN) gets exactly zero gradient."""
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(f"grpo_loss_on_logprobs: logprobs {tuple(logprobs.shape)}, old_logprobs "
                         f"{tuple(old_logprobs.shape)} and mask {tuple(mask.shape)} must all be (B, L)")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"grpo_loss_on_logprobs: advantages {tuple(advantages.shape)} must be (B,) or (B, L) "
                         f"for logprobs {tuple(logprobs.shape)}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("grpo_loss_on_logprobs: kl_coef != 0 needs ref_logprobs")
    if ref_logprobs is not None and ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"grpo_loss_on_logprobs: ref_logprobs {tuple(ref_logprobs.shape)} != logprobs "
                         f"{tuple(logprobs.shape)}")
    mask = mask.bool()
    cut = lambda x: None if x is None else torch.where(mask, x, 0.0)       # (B, L), 0 where masked
    adv = cut((advantages[:, None] if advantages.dim() == 1 else advantages).to(logprobs.dtype))
    per_token, ratio, kl, clipped = grpo_token_terms(cut(logprobs), cut(old_logprobs.detach()), adv, clip_low,
                                                     clip_high, kl_coef, cut(None if ref_logprobs is None else
                                                                             ref_logprobs.detach()), kl_estimator,
                                                     cut(behav_logprobs), behav_cap)
    n_tokens = mask.sum()
    loss = torch.where(mask, per_token, 0.0).sum() / (n_tokens.clamp(min=1) if num_tokens is None else num_tokens)
    with torch.no_grad():
        denom = n_tokens.clamp(min=1)
        stats = {"clip_frac": float((clipped & mask).sum() / denom), "kl": float(kl.sum() / denom),
                 "n_tokens": int(n_tokens), "ratio_mean": float(torch.where(mask, ratio, 0.0).sum() / denom)}
    return loss, stats

