"""
The recipes and the presets: the one place every setting of a run gets its default (docs/method.md §4-§5).

    Recipe      the method: its reward function (`score`, one of rewards.py's), exploration anchoring, nFrames
                gating and the K it draws from, where the KL goes, reward shaping. RECIPES: para_grpo (ParaVT's
                PARA-GRPO), vtgr (Video-o3's trajectory-guided reward), combined, vanilla (the ablation).
    PRESETS     a whole run as a paper ran it (paravt, videoo3) or as the embedded default runs it (tiny): the
                recipe, the rollout protocol (overview, limits, tool mode), the optimisation (group, batch, learning
                rates, clip range, temperature) and the synthetic task's knobs. Complete literals: every key of a run
                is in COMMON or the preset, nowhere else.
    TINY_FRAMES the embedded tiny model's frame sizes (64 x 64 frames, a short prompt), whatever the preset.
    model_preset the preset a model gets unless one is named (tiny for the tiny model, else paravt): train.py, eval.py.
    parse_train_args / resolve   train.py's command line: flag > --set KEY=VALUE > tiny frames > preset > recipe.

A setting without a flag of its own (a study's knob, a chunk size) is still reachable: `--set KEY=VALUE`, with
KEY any key below (`python train.py --help` lists them with each preset's value). The settings dataclasses
(rollout.RolloutConfig, grpo.GRPOSettings, sft.SFTSettings) take their defaults from the resolved tiny preset,
so a bare dataclass is what `python train.py` runs.
"""
import argparse
import json
import os
from dataclasses import dataclass
from typing import Callable

import torch

import rewards


@dataclass(frozen=True)
class Recipe:
    """One reward recipe and the step's settings that belong to it (a preset or a flag may override each)."""
    title: str                  # how the run's first line names it
    reward: str                 # ... and the terms `score` adds up
    score: Callable             # (traj, record, anchoring, released_scoring) -> (total, components): rewards.py's
    anchoring: str              # exploration anchoring: sequence | token | none (docs/method.md §4.1)
    gating: bool                # nFrames gating: the overview of a prompt's group has K frames, K drawn per prompt
    gating_choices: tuple       # the K it draws from
    kl_coef: float              # beta; 0 = no KL
    kl_estimator: str           # k1 | k3 (grpo.kl_penalty)
    kl_in_reward: bool          # True: R -= beta sum_t k1 before the advantages (ParaVT); False: a loss term
    shaping: bool               # ParaVT's clip(10 (R - 0.2), +-20)

    def settings(self) -> dict:
        return dict(anchoring=self.anchoring, gating=self.gating, gating_choices=self.gating_choices,
                    kl_coef=self.kl_coef, kl_estimator=self.kl_estimator, kl_in_reward=self.kl_in_reward,
                    shaping=self.shaping)


GATING_CHOICES = (4, 8, 16, 32, 64)      # ParaVT's nFrames gating: the overview frame counts K is drawn from
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")     # --set rollout_correction: grpo.grpo_token_terms' correction
_PARAVT_KL = dict(kl_coef=0.01, kl_estimator="k1", kl_in_reward=True, shaping=True)
RECIPES = {
    # ParaVT's PARA-GRPO: accuracy + format with exploration anchoring + tool reward, nFrames gating over
    # K in {4..64}, the k1 KL folded into the reward, then shaped (docs/method.md §4.1-§4.3)
    "para_grpo": Recipe("PARA-GRPO", "R_acc + R_fmt + R_tool", rewards.para_grpo_score, "sequence", True,
                        GATING_CHOICES, **_PARAVT_KL),
    # Video-o3's VTGR: accuracy + strict format + hybrid clue score x turn decay; no KL, no gating (§4.4)
    "vtgr": Recipe("Video-o3's VTGR", "R_acc + strict R_fmt + clue score x turn decay", rewards.vtgr_score, "none",
                   False, GATING_CHOICES, kl_coef=0.0, kl_estimator="k3", kl_in_reward=False, shaping=False),
    # PARA-GRPO with VTGR's tool term wherever a record has clue windows
    "combined": Recipe("PARA-GRPO with VTGR's tool term", "R_acc + R_fmt + VTGR tool term where clues exist",
                       rewards.combined_score, "sequence", True, GATING_CHOICES, **_PARAVT_KL),
    # the ablation: PARA-GRPO without its two contributions (no anchoring, no gating), the rest equal
    "vanilla": Recipe("vanilla GRPO", "R_acc + R_fmt + R_tool", rewards.para_grpo_score, "none", False,
                      GATING_CHOICES, **_PARAVT_KL),
}

# Settings every preset shares (rollout.RolloutConfig's, the step's, the SFT's, the synthetic task's).
COMMON = dict(
    # the rollout
    top_p=1.0, min_window=1.0, overview_fps=2.0, overview_max_frames=768, overview_max_pixels=None, crop_fps=2.0,
    crop_max_frames=128, crop_max_pixels=None, subagent_fps=1.0, subagent_max_frames=16, subagent_max_pixels=224 * 224,
    subagent_max_new_tokens=512, tools_block=True, max_calls_per_turn=5,
    # the sampled token's log p_T kept at sampling time (one logsumexp a decode step): what the update's mismatch
    # figures compare with its own forward (mismatch/* in the metrics), and what tis / mis weigh by
    record_logprobs=True,
    # the RL step
    rl_steps=20, warmup_steps=0, ppo_epochs=1, micro_batch=8, micro_batch_tokens=16384, pack_prompts=True,
    packed_tokens=32768,   # a packed micro-batch's tokens (no padding): one ParaVT group, 16k + 8 x 1.3k; no more than
                           # the longest single row the update already forwards (max_context)
    max_draws=4, placebo=False,
    train_subagents=False, released_scoring=False, logprob_chunk=1024, loss_chunk=0, eval_every=0, final_eval=False,
    eval_before=False,
    # the SFT step
    sft_steps=500, sft_micro_batch=2, tdam_ratio=0.1, sft_cache_gb=8.0, keep_bad_calls=False,
    sft_warmup_steps=None,    # None: min(10, sft_steps // 10), filled by resolve
    # both steps: the gradient's norm clipped to max_grad_norm; the cosine schedule ends at min_lr_ratio x the peak rate
    max_grad_norm=1.0, min_lr_ratio=0.1,
    # the run: a checkpoint every save_every steps, the newest keep_last of a stage kept (0: all); it stops when more
    # than max_bad_fraction of the records, of the SFT trajectories or of the RL samples are bad
    save_every=50, keep_last=3, max_bad_fraction=0.2,
    # the synthetic task: n_train SFT prompts, n_eval held out (seeds data.SPLIT_SEEDS + --seed); its SFT data
    # (docs/experiments.md has what each changed)
    n_train=256, n_eval=192, n_rl=0, task_duration=64.0, task_mix=None, direct_crop=0.5, sft_budget_fraction=0.1,
    sft_gated_overviews=None, always_call=False,
    # real data: with --data and no --eval-data, records held out of training for evaluation (at most 20 %)
    held_out=32,
    # video decoding (frame_cache: a folder that also keeps decoded overviews on disk, size-capped)
    decode_workers=2, decode_timeout=120.0, frame_cache_gb=2.0, frame_cache=None,
    # rollout beside training (async_rl.py; ParaVT's release: AReaL's asynchronous mode, behaviour weight cap 5)
    async_staleness=0, rollout_ranks=1, behav_weight_cap=5.0,
    # the correction for the gap between the sampler's log-probs and the trainer's (docs/method.md §5.2): none;
    # tis, each token's term x min(pi_old / pi_behav, cap) (Yao et al. 2025, cap 2); mis, each sequence's terms x
    # rho 1[rho <= cap], rho = prod_t pi_old / pi_behav (Liu et al. 2025). Asynchronous: none is the decoupled
    # loss's token mask at behav_weight_cap, tis / mis replace it
    rollout_correction="none", rollout_correction_cap=2.0,
    # the process groups: the longest any collective or receive may wait (rank 0 on a rollout step, the trainers on
    # an evaluation the rollout ranks reach eta steps later) before the run ends naming it; torch's is 30 minutes
    dist_timeout_min=120.0,
    # one policy: the exact mode, the engine's log-probs the trainer's bit for bit (docs/method.md, "One policy")
    exact_policy=False,
)

PRESETS = {
    # The embedded default (`python train.py`): PARA-GRPO on the synthetic task, 2-core CPU; why: docs/experiments.md
    "tiny": dict(COMMON, recipe="para_grpo", gating_choices=(4, 8, 16, 32), kl_coef=0.0, kl_estimator="k3",
                 kl_in_reward=False, shaping=False,
                 tool_mode="interleaved", overview_nframes=8, overview_tokens=16384, max_turns=3, eval_max_turns=3,
                 max_new_tokens=128, max_context=32768, temperature=0.7, group_size=16, prompts_per_step=4, lr=5e-5,
                 sft_lr=2e-3, clip_low=0.2, clip_high=0.3, dynamic_sampling=False, mask_truncated=True,
                 vision_lr_scale=0.0, eval_batch=64, sft_batch=10, sft_tool_free=1.0),
    # ParaVT's release: sub-agents, a 64-frame overview, 3 tool rounds of at most 5 calls, 2,048 new tokens a turn,
    # 7 prompts x G 8 a step, clip 0.2 / 0.2 (docs/method.md §5)
    "paravt": dict(COMMON, recipe="para_grpo",
                   tool_mode="subagent", overview_nframes=64, overview_tokens=16384, max_turns=3, eval_max_turns=3,
                   max_new_tokens=2048, max_context=32768, temperature=0.7, group_size=8, prompts_per_step=7,
                   lr=2e-6, sft_lr=1e-5, clip_low=0.2, clip_high=0.2, dynamic_sampling=False, mask_truncated=False,
                   vision_lr_scale=1.0, eval_batch=8, sft_batch=8, sft_tool_free=0.0),
    # Video-o3's release: crops interleaved, 2 fps <= 768 frames; prompts of at most 18,432 tokens (a 12,288-token
    # overview and 384 timestamps leave 1,536 to the system prompt, tools and question), 8,192 new tokens a turn,
    # 6 tool rounds (8 in evaluation), clip higher 0.3, dynamic sampling; a context that holds the whole protocol,
    # so no full-length row is cut and masked: 7 turns x 8,192 + 6 rounds x (96 + 5 fine clips x (3,072 + 64 x 16
    # + 64) + 64) (kvcache.row_blocks' worst case; docs/method.md §5, §7)
    "videoo3": dict(COMMON, recipe="vtgr",
                    tool_mode="interleaved", overview_nframes=None, overview_tokens=12288, max_turns=6,
                    eval_max_turns=8, max_new_tokens=8192,
                    max_context=18432 + 7 * 8192 + 6 * (96 + 5 * (3072 + 64 * 16 + 64) + 64),     # 201,536
                    temperature=1.0, group_size=16, prompts_per_step=32, lr=1e-6, sft_lr=1e-5, clip_low=0.2,
                    clip_high=0.3, dynamic_sampling=True, mask_truncated=True, vision_lr_scale=1.0, eval_batch=8,
                    sft_batch=8, sft_tool_free=0.0),
}

# The embedded tiny model's frames, under any preset: 64 x 64 pixels, short sub-agent summaries, no tools block in
# the system prompt (it still names the tool; the SFT warm start teaches the format).
TINY_FRAMES = dict(overview_max_pixels=64 * 64, crop_fps=1.0, crop_max_frames=16, crop_max_pixels=64 * 64,
                   subagent_max_pixels=64 * 64, subagent_max_new_tokens=48, tools_block=False)


def preset_values(preset: str, recipe: str | None = None, tiny: bool = False) -> dict:
    """Every setting of `preset` run with `recipe` (default: the preset's) on the tiny model or a checkpoint:
    the recipe's settings, then the preset's keys over them, then TINY_FRAMES on the tiny model."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    recipe = recipe or PRESETS[preset]["recipe"]
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {sorted(RECIPES)}")
    own = {k: v for k, v in PRESETS[preset].items() if k != "recipe"}
    return {**RECIPES[recipe].settings(), **own, "recipe": recipe, **(TINY_FRAMES if tiny else {})}


# The compute by device, unless --compile / --precision say: compiled kernels and bf16 autocast on CUDA
ON_DEVICE = {"cpu": dict(compile=0, precision="fp32"), "cuda": dict(compile=1, precision="bf16")}


def sft_warmup(sft_steps: int, sft_warmup_steps: int | None) -> int:
    """The SFT warmup: sft_warmup_steps, else min(10, sft_steps // 10)."""
    return min(10, sft_steps // 10) if sft_warmup_steps is None else sft_warmup_steps


TINY = preset_values("tiny", tiny=True)          # what `python train.py` runs: the settings dataclasses' defaults
TINY["sft_warmup_steps"] = sft_warmup(TINY["sft_steps"], TINY["sft_warmup_steps"])
TINY_PROTOCOL = preset_values("tiny")             # ... but the frames: RolloutConfig's defaults (TINY_FRAMES on top)


# -----------------------------------------------------------------------------
# train.py's command line


def is_tiny(name_or_path: str) -> bool:
    """The embedded tiny model, fresh ('tiny', 'tiny-qwen') or trained (its config.json says so)."""
    if name_or_path in ("tiny", "tiny-qwen"):
        return True
    config = os.path.join(name_or_path, "config.json")
    return os.path.isfile(config) and "tiny_model_config" in json.load(open(config))


def model_preset(name_or_path: str, preset: str | None) -> tuple[str, bool]:
    """(preset, tiny) of a model, for train.py and eval.py alike: `preset` if given, else 'tiny' for the embedded
    tiny model (fresh or trained, `is_tiny`) and 'paravt' for a checkpoint, which never inherits the tiny settings."""
    tiny = is_tiny(name_or_path)
    return preset or ("tiny" if tiny else "paravt"), tiny


def per_preset(key: str) -> str:
    """' (default: tiny X; paravt Y; videoo3 Z)', or ' (default: X)' when the presets agree: a flag's defaults as
    `resolve` (train.py) or eval.py sets them."""
    show = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else f"{v:,}" if isinstance(v, int) and not \
        isinstance(v, bool) else str(v)
    values = {p: show(preset_values(p)[key]) for p in PRESETS}
    if len(set(values.values())) == 1:
        return f" (default: {values[next(iter(PRESETS))]})"
    return " (default: " + "; ".join(f"{p} {v}" for p, v in values.items()) + ")"


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each default; a flag whose default is None (set by the preset) says its own (`per_preset`)."""
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_train_args(argv=None, description: str = "") -> argparse.Namespace:
    """train.py's flags -> the run's settings (`resolve`): every default from PRESETS / RECIPES, checked once."""
    p = argparse.ArgumentParser(description=description, formatter_class=_Help,
                                epilog="--set keys (tiny / paravt / videoo3): " + "; ".join(
                                    f"{k} {' / '.join(str(preset_values(q)[k]) for q in PRESETS)}"
                                    for k in sorted(TINY)))
    opt = lambda g, flag, kind, help_: g.add_argument(flag, type=kind, default=None,
                                                      help=help_ + per_preset(flag[2:].replace("-", "_")))
    g = p.add_argument_group("run")
    g.add_argument("--stage", choices=("all", "sft", "rl"), default="all",
                   help="all = the default pipeline: SFT warm start, then RL, then held-out evaluation")
    g.add_argument("--run-dir", default="runs/default", help="checkpoints, metrics.jsonl, curves.png")
    g.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --run-dir")
    g.add_argument("--seed", type=int, default=0, help="seeds the model init, the data draws and the sampling")
    g.add_argument("--strict", action="store_true", help="raise on a non-finite loss/grad instead of skipping the step")
    g.add_argument("--plot", metavar="RUN_DIR", default=None, help="only draw RUN_DIR/curves.png from its metrics.jsonl")
    opt(g, "--save-every", int, "checkpoint every N steps (and at the end)")
    opt(g, "--keep-last", int, "keep the newest N checkpoints of each stage (0 = all); the last SFT one and the best "
                               "by evaluation are always kept")
    g.add_argument("--report-to", choices=("none", "tensorboard", "wandb"), default="none",
                   help="also send the metrics there (metrics.jsonl and curves.png are always written)")
    g.add_argument("--debug", action="store_true", help="show the traceback of a bad-input error")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other setting of the presets (repeatable; the keys are listed at the end)")
    g = p.add_argument_group("hardware")
    g.add_argument("--gpus", type=int, default=None, help="processes on this node (default: visible CUDA devices, or 1)")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto = cuda when visible")
    g.add_argument("--threads", type=int, default=0,
                   help="CPU threads per process (0 = torch's default; 1 is far faster on a busy or shared CPU)")
    g.add_argument("--compile", type=int, default=None, help="torch.compile the log-prob kernels (default: 1 on CUDA, 0 on CPU)")
    g.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward (large models)")
    g.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="bf16: bf16 compute on fp32 master weights and fp32 AdamW state (autocast; with FSDP2 the "
                        "weights are also all-gathered in bf16 and gradients reduced in fp32), the checkpoints' Hugging "
                        "Face export in bf16 (default: bf16 on CUDA, fp32 on CPU; --device cpu --precision bf16 runs "
                        "the GPU's arithmetic on CPU)")
    g.add_argument("--rollout-memory-gb", type=float, default=None,
                   help="K/V the rollout engine may hold (per rank); a row's next turn waits until every admitted "
                        "group could still reach its worst case (default: 80%% of the free GPU memory beside the weights and autocast's weight copies; "
                        "kvcache.CPU_BUDGET_GB on CPU)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="tiny", help="'tiny' (embedded default) or a Qwen3-VL / Qwen2.5-VL checkpoint dir")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a whole run's settings (PRESETS); default: tiny for the embedded model, paravt for a "
                        "checkpoint")
    g.add_argument("--data", default=None, help="RL prompt records JSONL (docs/data.md); default: the synthetic task")
    g.add_argument("--sft-data", default=None, help="SFT trajectory records JSONL (docs/data.md); needs --data")
    g.add_argument("--video-root", default=None, help="folder the records' video paths are relative to (needs --data)")
    g.add_argument("--eval-data", default=None, help="held-out prompt records (default: --set held_out records split off --data)")
    opt(g, "--max-bad-fraction", float, "stop if more than this fraction of the records, SFT trajectories or RL "
                                        "samples is bad")
    opt(g, "--n-train", int, "synthetic task: training prompts")
    opt(g, "--n-eval", int, "synthetic task: held-out prompts (also the size of eval.py's synthetic split)")
    g = p.add_argument_group("SFT")
    opt(g, "--sft-steps", int, "SFT optimizer steps")
    opt(g, "--sft-batch", int, "trajectories per SFT step, over all ranks")
    opt(g, "--sft-lr", float, "SFT peak learning rate")
    opt(g, "--tdam-ratio", float, "fraction of SFT batches trained with TDAM masks")
    opt(g, "--vision-lr-scale", float, "learning rate of the vision tower as a multiple of --sft-lr / --lr (0 freezes it)")
    g = p.add_argument_group("RL")
    opt(g, "--rl-steps", int, "RL optimizer steps")
    g.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="reward recipe (RECIPES): its reward, anchoring, gating, KL and shaping unless the preset or a "
                        "flag sets them" + per_preset("recipe"))
    opt(g, "--group-size", int, "G: samples per prompt (>= 2)")
    opt(g, "--prompts-per-step", int, "prompts (groups) per step over ALL ranks, split over the ranks (the remainder "
                                      "on the first ranks; a rank with none still joins each update)")
    opt(g, "--lr", float, "RL peak learning rate")
    opt(g, "--micro-batch", int, "trajectories per training forward (at most)")
    opt(g, "--micro-batch-tokens", int, "padded tokens per training forward at most (rows x the longest row); a "
                                        "longer row goes alone, unpadded, so attention keeps SDPA's flash path")
    opt(g, "--clip-low", float, "PPO clip eps_low")
    opt(g, "--clip-high", float, "PPO clip eps_high (Video-o3's clip higher)")
    opt(g, "--kl-coef", float, "beta of the KL to the frozen reference (0 = off)")
    opt(g, "--dynamic-sampling", int, "1: drop zero-variance groups and draw more prompts until the batch is full")
    opt(g, "--gating", int, "nFrames gating on/off")
    g.add_argument("--gating-choices", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                   help="overview frame counts K is drawn from" + per_preset("gating_choices"))
    opt(g, "--kl-in-reward", int, "1: fold beta * sum_t k1 into the reward (ParaVT); 0: a KL loss term (--set kl_estimator)")
    opt(g, "--mask-truncated", int, "1: exclude trajectories cut by a limit from the loss")
    g.add_argument("--anchoring", choices=("sequence", "token", "none"), default=None,
                   help="exploration anchoring" + per_preset("anchoring"))
    g.add_argument("--tool-mode", choices=("interleaved", "subagent"), default=None,
                   help="crops interleaved into the context (Video-o3) or summarised by sub-agents (ParaVT)"
                        + per_preset("tool_mode"))
    opt(g, "--max-turns", int, "tool rounds before the forced answer")
    opt(g, "--max-new-tokens", int, "new tokens per assistant turn")
    opt(g, "--max-context", int, "tokens a trajectory may hold (prompt, turns, tool responses); a row that reaches "
                                 "it ends truncated")
    opt(g, "--overview-tokens", int, "visual tokens of the whole overview (frames sized to fit)")
    opt(g, "--overview-nframes", int, "overview frames when gating is off (0 = the fps rule)")
    opt(g, "--temperature", float, "RL sampling temperature (every log-prob of the loss is taken at it)")
    g.add_argument("--final-eval", action="store_true", help="held-out evaluation at the end (always on for --stage all)")
    g = p.add_argument_group("asynchronous RL (async_rl.py)")
    opt(g, "--async-staleness", int, "eta: 0 = the synchronous loop; >= 1: rollout ranks sample while trainer ranks "
                                     "update, a step's groups sampled by a policy at most eta versions old, the "
                                     "decoupled PPO loss")
    opt(g, "--rollout-ranks", int, "with --async-staleness >= 1: the last R of --gpus ranks roll out, the rest train")
    opt(g, "--behav-weight-cap", float, "the decoupled loss drops tokens whose pi_prox / pi_behav exceeds it")
    args = p.parse_args(argv)
    try:
        resolve(args)
    except ValueError as e:
        p.error(str(e))
    return args


def _parse_set(key: str, text: str, like):
    """--set's VALUE in the type of the setting's default `like` (bools 0/1/true/false, tuples comma-separated)."""
    if isinstance(like, bool):
        if text.lower() not in ("0", "1", "true", "false"):
            raise ValueError(f"--set {key}={text}: expected 0/1/true/false")
        return text.lower() in ("1", "true")
    if isinstance(like, tuple):
        return tuple(int(x) for x in text.split(","))
    if like is None:
        if text.lower() == "none":
            return None
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text
    return type(like)(text)


def resolve(args) -> None:
    """Fill every setting (flag > --set > tiny frames > preset > recipe), then refuse what cannot work."""
    args.preset, args.tiny = model_preset(args.model, args.preset)
    values = preset_values(args.preset, args.recipe, args.tiny)
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or key not in values:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {sorted(values)}")
        try:
            values[key] = _parse_set(key, text, values[key])
        except ValueError as e:
            raise ValueError(f"--set {item!r}: {e}") from None
    for k, v in values.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.gating_choices = tuple(args.gating_choices)
    if args.sft_gated_overviews is None:   # the synthetic warm start shows the overview sizes RL will gate to
        args.sft_gated_overviews = bool(args.gating)
    if args.overview_nframes == 0:
        args.overview_nframes = None                      # the fps rule
    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    for key, value in ON_DEVICE["cuda" if on_cuda else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sft_warmup_steps = sft_warmup(args.sft_steps, args.sft_warmup_steps)
    for flag in ("kl_in_reward", "shaping", "dynamic_sampling", "mask_truncated", "gating", "pack_prompts"):
        setattr(args, flag, bool(getattr(args, flag)))
    if not 0.0 <= args.sft_tool_free <= 1.0:
        raise ValueError(f"sft_tool_free is a probability (0: the oracle alone, 1: a twin beside every recording "
                         f"that calls the tool), got {args.sft_tool_free}")
    if args.eval_batch < 1:
        raise ValueError(f"eval_batch must be >= 1 (held-out questions per batched rollout), got {args.eval_batch}")
    if args.rollout_correction not in ROLLOUT_CORRECTIONS or args.rollout_correction_cap <= 1.0:
        raise ValueError(f"--set rollout_correction must be one of {', '.join(ROLLOUT_CORRECTIONS)} and "
                         f"rollout_correction_cap > 1, got {args.rollout_correction!r} and {args.rollout_correction_cap}")
    if args.rollout_correction != "none" and not (args.record_logprobs or args.async_staleness):
        raise ValueError(f"--set rollout_correction={args.rollout_correction} weighs by the behaviour log-probs the "
                         f"rollout records: it needs record_logprobs=1")
    if args.exact_policy and not args.record_logprobs:
        raise ValueError("--set exact_policy=1 trains on the log-probs the rollout records (its pi_old, and the check "
                         "that they are the trainer's): it needs record_logprobs=1")
    if args.async_staleness < 0 or args.behav_weight_cap <= 1.0:
        raise ValueError(f"--async-staleness must be >= 0 and --behav-weight-cap > 1, got {args.async_staleness} and "
                         f"{args.behav_weight_cap}")
    world = int(os.environ.get("WORLD_SIZE", args.gpus or 1))       # torchrun's, else --gpus (setup_distributed)
    if args.async_staleness and not 1 <= args.rollout_ranks < world:
        raise ValueError(f"--async-staleness {args.async_staleness} needs --rollout-ranks R >= 1 and more ranks than R "
                         f"(the ranks that train), got --rollout-ranks {args.rollout_ranks} of {world} ranks")
    if args.dist_timeout_min <= 0:
        raise ValueError(f"dist_timeout_min must be > 0 minutes, got {args.dist_timeout_min}")
    if args.vision_lr_scale < 0:
        raise ValueError(f"--vision-lr-scale must be >= 0 (0 freezes the vision tower), got {args.vision_lr_scale}")
    if args.gating and not args.data and not args.sft_gated_overviews:
        raise ValueError("gating with a synthetic SFT of K = 8 overviews only (sft_gated_overviews=0): RL would "
                         "sample on overview sizes the tiny model never saw; pass --gating 0")
    if args.group_size < 2:
        raise ValueError("--group-size must be >= 2 (group advantages need a group)")
    if args.max_context < 1 or args.overview_tokens < 1:
        raise ValueError(f"--max-context and --overview-tokens are token counts >= 1, got {args.max_context} and "
                         f"{args.overview_tokens}")
    if args.prompts_per_step < 1:
        raise ValueError(f"--prompts-per-step must be >= 1 (prompts per step over all ranks), got {args.prompts_per_step}")
    if args.micro_batch < 1 or args.micro_batch_tokens < 1 or args.packed_tokens < 1:
        raise ValueError(f"--micro-batch, --micro-batch-tokens and packed_tokens must be >= 1 (rows, padded tokens and "
                         f"packed tokens per training forward), got {args.micro_batch}, {args.micro_batch_tokens} and "
                         f"{args.packed_tokens}")
    if args.rollout_memory_gb is not None and args.rollout_memory_gb <= 0:
        raise ValueError(f"--rollout-memory-gb must be > 0 (the rollout's K/V budget in GB), got {args.rollout_memory_gb}")
    if args.recipe == "vtgr" and args.anchoring == "sequence":
        raise ValueError("--recipe vtgr --anchoring sequence: VTGR's strict format reward has no anchor term to "
                         "weight; use --anchoring token (credit on the closing tags) or --anchoring none")
    if args.kl_coef and args.kl_estimator == "k1" and not args.kl_in_reward:
        raise ValueError("kl_estimator k1 as a loss term has zero expected gradient on-policy (it regularises "
                         "nothing); use --set kl_in_reward=1 (ParaVT) or --set kl_estimator=k3")
    if args.video_root and not (args.data or args.eval_data):
        raise ValueError("--video-root without --data: the synthetic task renders its own videos and ignores it; "
                         "pass --data RECORDS.jsonl with it")
    if args.sft_data and not args.data:
        raise ValueError("--sft-data without --data: RL and the held-out evaluation would run on the synthetic task, "
                         "not on the records the trajectories belong to; pass --data too")
