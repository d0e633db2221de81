"""
A rehearsal of the real run through train.py's own functions: one RL step and one SFT step of the paravt preset and
the RL update of the videoo3 preset, on a cut Qwen3-VL-8B (vocab 151,936 with Qwen's tokenizer, 8 KV heads x 128,
the vision width; the depth and text width cut by flags) at the real sequence lengths, --precision bf16, gradient
checkpointing, FSDP2 on 2 gloo ranks; each part's peak memory measured beside bench/plan.py's `memory_parts`.

    python bench/rehearsal.py                    # CPU, 2 ranks, the real lengths (~16k-token overview)
    python bench/rehearsal.py --ci               # under a minute: tiny widths, a small video (tests/test_plan.py)
    python bench/rehearsal.py --steps videoo3    # only the Video-o3 update (8 rows of ~28k tokens)
    python bench/rehearsal.py --ranks 1 --device cuda --hidden 4096 --mlp 12288 --heads 32 --text-layers 4

RL step: grpo.collect_groups in each tool mode, G = 2 rows a rank, a scripted policy (the real sampler runs, its
draws replaced by two rounds of two parallel crops, then A or B), then grpo.policy_update. SFT step:
sft.sft_backward with TDAM, then AdamW. Video-o3: grpo.policy_update on 8 recorded episodes (the 12,288-token
overview, two rounds of two fine crops), one row a micro-batch: no dense SDPA mask (counted). Measured per rank
(CPU: live tensor bytes, common.LiveTensors; CUDA: the allocator): weights, reference, AdamW's moments, gradients;
kv, the most pool blocks in use at once; activations, backward and loss of the largest micro-batch. Last line: one
JSON object, measured, projected and their ratio per part (the Video-o3 update's under "videoo3"), and the sizes.
"""
import argparse
import contextlib
import dataclasses
import json
import os
import resource
import tempfile
import time
import types

import torch
from common import LiveTensors, Script, print_json, rss_mb, table  # bench/common.py (puts the repo on sys.path)

import grpo
import kvcache
import model as model_lib
import ops
import plan
import recipes
import rollout
import runtime
import sft
import train
import video
import policy

RECORD = {"id": "rehearsal", "video": "rehearsal.mp4", "question": "Which colour fills the frame first?",
          "options": ["red", "green", "blue", "yellow"], "task": "mcq", "answer": "A"}
SAMPLE_SEED = 0                       # Run.seed: the scripted rows are found by their sampling seeds
GROUP = 2                             # rows a rank samples (one prompt a rank)
VIDEOO3_ROWS = 8                      # rows of the Video-o3 update over all ranks
PARTS = ("weights_shard", "weights_rollout", "reference", "optimizer", "grads", "kv", "activations", "backward", "loss")
VIDEOO3_PARTS = ("weights_shard", "optimizer", "grads", "activations", "backward", "loss")    # the update's


def call(start: float, end: float, resolution: str | None = None) -> str:
    level = f', "resolution": "{resolution}"' if resolution else ""
    return ('<tool_call>\n{"name": "crop_video", "arguments": {"start_time": %.1f, "end_time": %.1f%s}}\n</tool_call>'
            % (start, end, level))


def turns(duration: float, answer: str, level: str | None = None, row: int = 0) -> list[str]:
    """Two tool rounds of two parallel calls each, then the answer (after the forced "<think>\\n"). Video-o3's episode
    crops at the fine level (3,072 visual tokens a clip) and 4 s windows in its second round; `row` more words of
    thought in its first turn set its rows apart in length."""
    d, close, more = duration, 4 if level else 2, " Again." * row
    return [f"Two moments to check.{more}\n</think>\n{call(d / 8, d / 4, level)}\n{call(d / 2, d * 5 / 8, level)}",
            f"Closer on both.\n</think>\n{call(d / 8, d / 8 + close, level)}\n{call(d / 2, d / 2 + close, level)}",
            f"The first clip shows it.\n</think>\n<answer>{answer}</answer>"]


def write_video(root: str, size: tuple[int, int], duration: float) -> None:
    """RECORD's video: `duration` s at 2 fps, `size` (W, H), a colour field that drifts (cheap to encode)."""
    (w, h), n = size, int(duration * 2)
    t = torch.linspace(0, 1, n)[:, None, None, None]
    y, x = torch.linspace(0, 1, h)[None, None, :, None], torch.linspace(0, 1, w)[None, None, None, :]
    rgb = torch.tensor([0.9, 0.4, 0.2])[None, :, None, None]
    frames = (255 * (0.5 + 0.5 * torch.sin(6.28 * (x * rgb + y * (1 - rgb) + t)))).to(torch.uint8)
    video.write_video(os.path.join(root, RECORD["video"]), frames, fps=2.0)


def build_checkpoint(path: str, args) -> None:
    """The cut Qwen3-VL-8B (random weights, fp32) and its processor, saved where policy.policy_model loads it."""
    text = dict(hidden_size=args.hidden, intermediate_size=args.mlp, num_attention_heads=args.heads)
    vision = dict(hidden_size=args.vision_width, intermediate_size=args.vision_mlp) if args.vision_width else None
    config = model_lib.qwen3vl_config("8b", text_layers=args.text_layers, vision_depth=args.vision_depth,
                                      text_overrides=text, vision_overrides=vision)
    model, processor = model_lib.build_qwen3vl(config, dtype=torch.float32, seed=0)
    model_lib.save_model(model, processor, path)


class Meter:
    """Memory now and its peak since `reset`: CUDA's allocator counters, or on CPU the bytes of the live tensors
    created while `counting` (common.LiveTensors: the same in every run, comparable with `memory_allocated`)."""

    def __init__(self, device: torch.device, model: torch.nn.Module):
        self.live = None if device.type == "cuda" else LiveTensors(gathered_bytes(model))

    def counting(self):
        return self.live if self.live is not None else contextlib.nullcontext()

    def now(self) -> float:
        if self.live is None:
            return torch.cuda.memory_allocated()
        self.live._sweep()
        return self.live.now

    def reset(self) -> float:
        if self.live is None:
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        self.live.peak = self.now()
        return self.live.peak

    def peak_since(self, start: float) -> float:
        peak = torch.cuda.max_memory_allocated() if self.live is None else max(self.live.peak, self.now())
        return peak - start


def gathered_bytes(model: torch.nn.Module):
    """A function giving the bytes of FSDP2's all-gathered parameters now (0 without FSDP): FSDP2 keeps them in
    storages it resizes in place, which no operation creates, so LiveTensors cannot see them."""
    from torch.distributed.fsdp import FSDPModule
    groups = {id(g): g for m in model.modules() if isinstance(m, FSDPModule)         # a unit of several modules:
              for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None}      # one group, counted once
    params = [p for g in groups.values() for p in g.fsdp_params]
    return lambda: sum(t.untyped_storage().nbytes() for p in params for t in p.all_gather_outputs)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages (a DTensor: its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.untyped_storage().data_ptr(), t.device)
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


@contextlib.contextmanager
def pools():
    """The K/V pools (kvcache.BlockPool) the rollouts inside create, in a list (each one's `peak`, the most blocks
    in use at once, read after the rollout); the list holds them, and their memory, until the block ends."""
    made, init = [], kvcache.BlockPool.__init__

    def record(pool, *a, **k):
        init(pool, *a, **k)
        made.append(pool)
    kvcache.BlockPool.__init__ = record
    try:
        yield made
    finally:
        kvcache.BlockPool.__init__ = init


def pool_bytes(pool) -> tuple[int, int]:
    """(bytes of the most blocks in use at once, bytes allocated) of one pool, over all its layers."""
    total = pool.nbytes()
    return pool.peak * total // max(1, pool.n_blocks), total


@contextlib.contextmanager
def phases(meter: Meter, out: dict):
    """Per training micro-batch, the largest: activations (kept by policy.hidden_and_targets), loss (the fused loss's
    peak) and backward (its peak); the most rows in a forward, and the SDPA calls handed a dense mask."""
    saved = policy.hidden_and_targets, grpo.grpo_loss, sft.sft_token_loss, torch.Tensor.backward
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out.setdefault("dense_masks", 0)

    def attention(*a, **k):
        out["dense_masks"] += k.get("attn_mask") is not None and k["attn_mask"].dim() == 4
        return sdpa(*a, **k)

    def hidden_and_targets(*a, **k):
        start = meter.reset()
        result = saved[0](*a, **k)
        out["activations"] = max(out.get("activations", 0), meter.now() - start)
        out["flight_tokens"] = max(out.get("flight_tokens", 0), int(a[1]["attention_mask"].sum()))
        out["flight_rows"] = max(out.get("flight_rows", 0), int(a[1]["input_ids"].shape[0]))
        pixels = a[1].get("pixel_values_videos")
        out["flight_patches"] = max(out.get("flight_patches", 0), 0 if pixels is None else int(pixels.shape[0]))
        return result

    def measured(fn, mask_arg: int):
        def wrapped(*a, **k):
            start = meter.reset()
            result = fn(*a, **k)
            out["loss"] = max(out.get("loss", 0), meter.peak_since(start))
            out["policy_tokens"] = max(out.get("policy_tokens", 0), int(a[mask_arg].sum()))
            return result
        return wrapped

    def backward(tensor, *a, **k):
        start = meter.reset()
        saved[3](tensor, *a, **k)
        out["backward"] = max(out.get("backward", 0), meter.peak_since(start))

    policy.hidden_and_targets, torch.Tensor.backward = hidden_and_targets, backward
    grpo.grpo_loss, sft.sft_token_loss = measured(saved[1], 5), measured(saved[2], 3)   # the args' masks
    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        with meter.counting():
            yield
    finally:
        policy.hidden_and_targets, grpo.grpo_loss, sft.sft_token_loss, torch.Tensor.backward = saved
        torch.nn.functional.scaled_dot_product_attention = sdpa


def sft_messages(duration: float, video_name: str, texts: list[str] | None = None) -> list[dict]:
    """The scripted interleaved episode (`texts`, default `turns`) as a recorded trajectory: each turn, then its
    clips as the tool's turn."""
    msgs = []
    for i, text in enumerate(texts or turns(duration, "A")):
        msgs.append({"role": "assistant", "content": rollout.THINK_PREFIX + text})
        for c in rollout.parse_tool_calls(text) if i < 2 else []:
            a, b = c.arguments["start_time"], c.arguments["end_time"]
            msgs.append({"role": "tool", "content": [{"type": "video", "video": video_name, "video_start": a,
                                                      "video_end": b}]})
    return msgs


def train_args(args, ckpt: str, device: torch.device, run_dir: str, *flags: str):
    """train.py's flags for a rehearsed step: `flags` on --precision bf16, gradient checkpointing, torch.compile on
    CUDA, this run's --micro-batch-tokens (none: train.py's default), and a row per sample in the update
    (--set pack_prompts=0): plan.memory_parts counts one row per sample, which is what packing makes of the real
    lengths under the shipped budget (a 17k-32k-token sample is a micro-batch alone, its prompt and suffix one row)."""
    budget = ["--micro-batch-tokens", str(args.micro_batch_tokens)] if args.micro_batch_tokens else []
    return recipes.parse_train_args(["--model", ckpt, *flags, "--precision", "bf16", "--device", device.type,
                               "--grad-checkpointing", "--compile", str(int(device.type == "cuda")), *budget,
                               "--run-dir", run_dir, "--set", "pack_prompts=0"])


def measured_update(model, ref, optimizer, items: list, s, tok, world: int, run, meter: Meter, out: dict) -> tuple:
    """grpo.policy_update and AdamW's step under `phases` (each micro-batch's parts into `out`), and the bytes of
    the gradient shards and of AdamW's moments into `out`; returns (the gradient norm, seconds)."""
    def step(loss):
        out["grads"] = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        return run.optimizer_step(model, optimizer, loss, "rl", 1, [])

    model.train()
    t0 = time.time()
    with phases(meter, out):
        spy = types.SimpleNamespace(world=world, group=None, rank=run.rank,
                                    optimizer_step=lambda model_, optimizer_, loss, *a: step(loss))
        job = grpo.RLJob([], "", rollout.RolloutConfig(), s, spare=items[0][0])     # the filler: a zero-weight row
        norm, _ = grpo.policy_update(spy, model, ref, optimizer, items, job, 1, types.SimpleNamespace(tokenizer=tok))
    seconds = time.time() - t0
    out["optimizer"] = tensor_bytes(v for st in optimizer.state.values() for v in st.values()
                                    if torch.is_tensor(v) and v.dim())
    return norm, seconds


def videoo3_update(rank: int, world: int, args, ckpt: str, root: str, out_dir: str, model, processor, meter: Meter,
                   device: torch.device) -> dict:
    """The videoo3 preset's RL update (`measured_update`) on this rank's share of VIDEOO3_ROWS recorded episodes
    (`turns` at "fine", advantage +1 on the right answer, -1 on the wrong): the parts, the sizes, the seconds."""
    t0 = time.time()
    vargs = train_args(args, ckpt, device, os.path.join(out_dir, "run-videoo3"), "--preset", "videoo3", "--micro-batch", "8")
    s, cfg = train.grpo_settings(vargs), train.rollout_config_of_args(vargs)
    rec, tok = dict(RECORD, duration=args.duration), processor.tokenizer
    trajs = []
    for i in range(grpo.rank_share(VIDEOO3_ROWS, rank, world)):
        row = rank + world * i                                         # rows 0, 2, 4, 6 on rank 0 of 2
        t = sft.encode_messages(processor, rec, sft_messages(args.duration, rec["video"], turns(
            args.duration, "AB"[row % 2], "fine", row)), root, cfg)
        if t.n_calls != 4 or t.tool_failures or t.answer not in "AB":
            raise RuntimeError(f"videoo3: the recorded episode did not encode as written: {t.n_calls} calls, "
                               f"{t.tool_failures} failed, answer {t.answer!r}")
        if trajs:                  # the group's overview: one tensor for its rows, as a rollout's rows share it
            assert torch.equal(t.videos[0][1], trajs[0].videos[0][1])
            t.videos[0] = trajs[0].videos[0]
        trajs.append(t)
    items = [(t, 1.0 if t.answer == "A" else -1.0, {"anchor": 0.0}) for t in trajs]
    lengths = [len(t.token_ids) for t in trajs]
    think = len(tok(rollout.THINK_PREFIX, add_special_tokens=False)["input_ids"])
    sizes = dict(rows=len(trajs), tokens=lengths, overview_tokens=trajs[0].prompt_len + think,
                 micro_batch=s.micro_batch, micro_batch_tokens=s.micro_batch_tokens,
                 planned_rows=plan.update_rows(lengths, s.micro_batch, s.micro_batch_tokens))
    run = runtime.Run(vargs.run_dir, rank, world, SAMPLE_SEED, 10 ** 6, 0, False, 1.0)
    run.processor = processor
    optimizer = policy.make_optimizer(model, vargs.lr, vargs.vision_lr_scale)
    measured, timing = {"weights_shard": tensor_bytes(model.parameters())}, {"encode_s": time.time() - t0}
    sizes["grad_norm"], timing["update_s"] = measured_update(model, None, optimizer, items, s, tok, world, run, meter,
                                                             measured)
    for k in ("flight_tokens", "flight_rows", "flight_patches", "policy_tokens", "dense_masks"):
        sizes[k] = measured.pop(k)
    return dict(measured=measured, sizes=sizes, timing=timing)


def model_sizes(model) -> dict:
    """The parameter counts `shape` takes: the lm_head, the decoder layers, the root unit (all but those and the
    final norm), the vision tower."""
    text = model.model.language_model
    count = lambda mod: sum(p.numel() for p in mod.parameters())
    head, layers = count(model.lm_head), count(text.layers)
    return dict(params_head=head, params_layers=layers, params_root=count(model) - head - layers - count(text.norm),
                params_vision=count(model.model.visual))


def save_rank(out_dir: str, rank: int, world: int, model, result: dict) -> None:
    """Write out_dir/rank<r>.json (the result, the model's parameter counts, the resident memory) and leave the
    process group."""
    result["sizes"] = {**result.get("sizes", {}), **model_sizes(model)}
    result.update(params=model_lib.count_parameters(model),
                  text_params=sum(p.numel() for n, p in model.named_parameters() if ".visual." not in f".{n}"),
                  peak_rss_gb=rss_mb() / 1024, max_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def small_logits(args) -> None:
    """--ci: the losses take the fused chunks, as the real lengths do (CI's N x V is under ops' small-logits limit)."""
    ops._MIN_CHUNK_LOGITS = 1 if args.ci else ops._MIN_CHUNK_LOGITS


def rank_main(rank: int, world: int, port: int, args, ckpt: str, root: str, out_dir: str) -> None:
    """One rank of the rehearsal (--steps): the paravt RL step, then the SFT step, then the Video-o3 update;
    writes out_dir/rank<r>.json."""
    torch.set_num_threads(args.threads)
    small_logits(args)
    if world > 1:
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        runtime.init_process_group(rank, world, use_cuda=args.device != "cpu")
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    targs = train_args(args, ckpt, device, os.path.join(out_dir, "run"), "--preset", "paravt", "--group-size", str(GROUP),
                       "--prompts-per-step", str(world), "--gating", "0", "--micro-batch", str(GROUP))
    m, t0 = {}, time.time()
    model, processor = policy.policy_model(ckpt, device, targs.precision, world, 0, targs.grad_checkpointing)
    meter = Meter(device, model)
    tok, pad_id = processor.tokenizer, processor.tokenizer.pad_token_id
    m["weights_shard"] = tensor_bytes(model.parameters())
    if args.steps == "videoo3":
        vo3 = videoo3_update(rank, world, args, ckpt, root, out_dir, model, processor, meter, device)
        return save_rank(out_dir, rank, world, model, dict(rank=rank, videoo3=vo3, timing={"build_s": time.time() - t0}))
    ref = runtime.reference_model(targs.run_dir, ckpt, False, device, 0, policy.PRECISION[targs.precision])
    m["reference"] = tensor_bytes(ref.parameters())
    run = runtime.Run(targs.run_dir, rank, world, SAMPLE_SEED, 10 ** 6, 0, False, 1.0)
    run.processor = processor
    s, cfg = train.grpo_settings(targs), train.rollout_config_of_args(targs)
    rec = dict(RECORD, duration=args.duration)
    seed, place = grpo.draw_seed(SAMPLE_SEED, 1, 0), grpo.dealt(s.prompts_per_step, rank, world)[0]   # step 1, draw 0
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    scripted = {rollout.row_seed(seed, place, g): [enc(t) for t in turns(args.duration, "AB"[g % 2])]
                for g in range(s.group_size)}
    sub = [enc("A plain coloured frame.")]                      # what each sub-agent writes
    script = Script(lambda row: scripted.get(row, sub), rollout.sample_tokens)   # the real sampler runs, then the script
    optimizer = policy.make_optimizer(model, targs.lr, targs.vision_lr_scale)
    items, sizes, timing = [], {}, {"build_s": time.time() - t0}
    think = len(tok(rollout.THINK_PREFIX, add_special_tokens=False)["input_ids"])   # in the prompt's chunk
    m["kv"], m["kv_pool"] = 0, 0
    model.eval()
    rollout.sample_tokens = script
    try:
        for mode in ("subagent", "interleaved"):
            t0 = time.time()
            with pools() as made, runtime.full_weights(model):
                m["weights_rollout"] = tensor_bytes(model.parameters()) if world > 1 else 0   # 1: the master
                g = grpo.collect_groups(run, model, ref, processor, [rec], root,
                                         dataclasses.replace(cfg, tool_mode=mode), s, 1, pad_id)
                used, allocated = (max(x) for x in zip(*(pool_bytes(p) for p in made)))
            m["kv"], m["kv_pool"] = max(m["kv"], used), max(m["kv_pool"], allocated)
            sizes[f"kv_blocks_{mode}"] = max(p.peak for p in made)
            script.pos.clear()
            bad = [t.error or t.answer for t in g.trajs if t.error or t.n_calls != 4 or t.answer not in "AB"]
            if bad:
                raise RuntimeError(f"{mode}: the scripted episode did not run as written: {bad}")
            items += g.items
            timing[f"rollout_{mode}_s"] = time.time() - t0
            sizes[f"tokens_{mode}"] = max(len(t.token_ids) for t in g.trajs)
            sizes["overview_tokens"], sizes["group"] = g.trajs[0].prompt_len + think, s.group_size
            sizes[f"suffix_{mode}"] = max(len(t.token_ids) - t.prompt_len - think for t in g.trajs)
            subs = [sub for t in g.trajs for sub in t.subagents]
            if subs:
                sizes["subagent_prompt"] = max(sub.prompt_len for sub in subs)
                sizes["subagent_tokens"] = max(len(sub.token_ids) - sub.prompt_len for sub in subs)
                sizes["subagents_per_turn"] = max(len(c) for t in g.trajs for c in t.calls)
    finally:
        rollout.sample_tokens = script.sample
    gn, timing["rl_update_s"] = measured_update(model, ref, optimizer, items, s, tok, world, run, meter, m)
    sizes.update({f"rl_{k}": m.pop(k) for k in ("flight_tokens", "policy_tokens", "flight_patches", "flight_rows",
                                                 "dense_masks")}, rl_grad_norm=gn)
    # the SFT step: the scripted interleaved episode as a recorded trajectory, TDAM on, gradient checkpointing
    sft_items = [sft.encode_messages(processor, rec, sft_messages(args.duration, rec["video"]), root,
                                         dataclasses.replace(cfg, tool_mode="interleaved"))]
    del optimizer
    sft_opt = policy.make_optimizer(model, targs.sft_lr, targs.vision_lr_scale)
    sft_parts = {}
    t0 = time.time()
    with phases(meter, sft_parts):
        loss, n_tok = sft.sft_backward(model, sft_items, sft.SFTSettings(micro_batch=1, precision=targs.precision,
                                                         compile=False), pad_id, tok, run.counters, world)   # as run_sft
    run.optimizer_step(model, sft_opt, loss, "sft", 1, [])
    timing["sft_step_s"] = time.time() - t0
    sizes.update(sft_tokens=len(sft_items[0].token_ids), sft_policy_tokens=n_tok // world,     # one rank's episode
                 sft_patches=sft_parts["flight_patches"],
                 tdam_no_answer=run.counters.get("tdam_no_answer", 0))
    sft_parts = {k: sft_parts[k] for k in ("activations", "backward", "loss") if k in sft_parts}
    vo3 = None
    if args.steps == "all":
        del sft_opt, ref, items, sft_items, g
        vo3 = videoo3_update(rank, world, args, ckpt, root, out_dir, model, processor, meter, device)
    save_rank(out_dir, rank, world, model, dict(rank=rank, measured=m, sft=sft_parts, sizes=sizes, timing=timing, videoo3=vo3))


def shape(r: dict, args) -> dict:
    """The model shape plan.memory_parts takes (plan.QWEN3VL_8B's keys) of this run's cut checkpoint."""
    z, published = r["sizes"], model_lib.QWEN3VL_SHAPES["8b"]["vision"]
    taps = model_lib.cut_deepstack(published["deepstack_visual_indexes"], published["depth"], args.vision_depth,
                                   args.text_layers)                  # as model_lib.qwen3vl_config cut them
    return dict(layers=args.text_layers, d_model=args.hidden, q_dim=args.heads * 128, kv_dim=8 * 128, mlp=args.mlp,
                vocab=model_lib.QWEN_VOCAB_SIZE, params=r["params"], text_params=r["text_params"],
                params_root=z["params_root"], params_head=z["params_head"], params_vision=z["params_vision"],
                vision_width=args.vision_width or 1152, vision_depth=args.vision_depth,
                vision_mlp=args.vision_mlp or 4304, head_dim=128, vision_taps=len(taps))


def project(r: dict, args, world: int) -> dict:
    """plan.memory_parts at this run's sizes; the K/V: the larger of the two tool modes' (interleaved: the clips in
    the suffix; sub-agent: one turn's sub-agents beside the rows)."""
    z, m = r["sizes"], shape(r, args)
    common = dict(flight_tokens=z["rl_flight_tokens"], flight_patches=z["rl_flight_patches"],
                  policy_tokens=z["rl_policy_tokens"], shared=True, reference=True, compiled=args.device == "cuda",
                  temperature=recipes.preset_values("paravt")["temperature"])
    kv = lambda suffix, **sub: plan.memory_parts(m, world, prompts=1, rows=z["group"],
                                                 overview_tokens=z["overview_tokens"], suffix_tokens=suffix,
                                                 **common, **sub)
    inter = kv(z["suffix_interleaved"])
    sub = kv(z["suffix_subagent"], subagents=z["group"] * z.get("subagents_per_turn", 0),
             subagent_prompt=z.get("subagent_prompt", 0), subagent_tokens=z.get("subagent_tokens", 0))
    return dict(inter, kv=max(inter["kv"], sub["kv"]))


def project_videoo3(r: dict, args, world: int) -> dict:
    """plan.memory_parts for the Video-o3 update at this run's sizes: the micro-batch in flight as measured (one row
    at the real lengths: policy.micro_batches, as plan.update_rows counts it), no reference model."""
    z = r["videoo3"]["sizes"]
    parts = plan.memory_parts(shape(r, args), world, prompts=1, rows=1, overview_tokens=z["overview_tokens"],
                              suffix_tokens=0, flight_tokens=z["flight_tokens"], flight_patches=z["flight_patches"],
                              policy_tokens=z["policy_tokens"], shared=True, reference=False,
                              compiled=args.device == "cuda",
                              temperature=recipes.preset_values("videoo3")["temperature"])
    return {k: parts[k] for k in VIDEOO3_PARTS}


def compare(measured: dict, projected: dict, names: tuple, title: str) -> dict:
    """The table of measured vs projected bytes per part (printed) and its JSON form."""
    gb = lambda b: b / 2 ** 30
    ratio = lambda k: measured[k] / projected[k] if projected[k] else None
    rows = [[k, gb(measured[k]), gb(projected[k]), ratio(k) or float("nan")] for k in names]
    print(table(rows, [f"{title} (per rank)", "measured GB", "plan GB", "ratio"]))
    return {k: dict(measured_gb=gb(measured[k]), plan_gb=gb(projected[k]), ratio=ratio(k)) for k in names}


def report(ranks: list[dict], args) -> dict:
    """The tables, a line on the SFT step and one on the Video-o3 update, and the last-line JSON (the ranks' raw
    figures in it)."""
    r0 = ranks[0]
    gb = lambda b: b / 2 ** 30
    summary = dict(ci=args.ci, ranks=args.ranks, device=args.device, params=r0["params"], sizes=r0["sizes"],
                   shape=dict(text_layers=args.text_layers, vision_depth=args.vision_depth, hidden=args.hidden,
                              mlp=args.mlp, heads=args.heads, kv_heads=8, head_dim=128,
                              vision_width=args.vision_width or 1152, vocab=model_lib.QWEN_VOCAB_SIZE,
                              video=args.size, duration=args.duration), timing=r0["timing"])
    if "measured" in r0:                                # the paravt RL and SFT steps
        measured = {k: max(r["measured"][k] for r in ranks) for k in r0["measured"]}
        summary["parts"] = compare(measured, project(r0, args, args.ranks), PARTS, "paravt RL step")
        print(f"K/V pool allocated: {gb(measured['kv_pool']):.3f} GB (the blocks in use at their most: "
              f"{gb(measured['kv']):.3f} GB)")
        sft_gb = {k: gb(max(r["sft"].get(k, 0) for r in ranks)) for k in ("activations", "backward", "loss")}
        print("SFT step (GB):", json.dumps({k: round(v, 3) for k, v in sft_gb.items()}), "| sizes:",
              json.dumps(r0["sizes"]), "| seconds:", json.dumps({k: round(v, 1) for k, v in r0["timing"].items()}),
              flush=True)
        summary.update(kv_pool_gb=gb(measured["kv_pool"]), sft_gb=sft_gb)
    if r0.get("videoo3"):
        v0 = r0["videoo3"]
        measured = {k: max(r["videoo3"]["measured"][k] for r in ranks) for k in VIDEOO3_PARTS}
        parts = compare(measured, project_videoo3(r0, args, args.ranks), VIDEOO3_PARTS, "videoo3 RL update")
        print("Video-o3 update | sizes:", json.dumps(v0["sizes"]), "| seconds:",
              json.dumps({k: round(v, 1) for k, v in v0["timing"].items()}), flush=True)
        summary["videoo3"] = dict(parts=parts, sizes=v0["sizes"], timing=v0["timing"],
                                  dense_masks=sum(r["videoo3"]["sizes"]["dense_masks"] for r in ranks),
                                  rows=[r["videoo3"]["sizes"]["rows"] for r in ranks])
    summary.update(peak_rss_gb=max(r["peak_rss_gb"] for r in ranks),
                   max_rss_gb=max(r.get("max_rss_gb", 0.0) for r in ranks), per_rank=ranks)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print_json(summary)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ci", action="store_true", help="tiny widths and a small video: under a minute (CI)")
    ap.add_argument("--ranks", type=int, default=2, help="processes (gloo on CPU, nccl on CUDA)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--text-layers", type=int, default=2, help="decoder layers (8B: 36)")
    ap.add_argument("--vision-depth", type=int, default=2, help="vision blocks (8B: 27)")
    ap.add_argument("--hidden", type=int, default=1024, help="text hidden size (8B: 4096)")
    ap.add_argument("--mlp", type=int, default=3072, help="text MLP size (8B: 12288)")
    ap.add_argument("--heads", type=int, default=8, help="query heads of 128 (8B: 32; KV heads stay 8)")
    ap.add_argument("--vision-width", type=int, default=0, help="vision hidden size (0: the published 1152)")
    ap.add_argument("--vision-mlp", type=int, default=0, help="vision MLP size (with --vision-width)")
    ap.add_argument("--size", default="1280x720", help="the video's W x H (the overview's budget decides the tokens)")
    ap.add_argument("--duration", type=float, default=64.0, help="the video's seconds")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--steps", choices=("all", "paravt", "videoo3"), default="all",
                    help="all: the paravt RL and SFT steps, then the Video-o3 update; paravt: the first two; videoo3: "
                         "the Video-o3 update alone")
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="train.py's --micro-batch-tokens for both RL updates (default: train.py's; --ci: 2048, "
                         "which its rows of ~1-2k tokens fill one at a time, as the real lengths fill the default)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    if args.ci:
        args.text_layers, args.vision_depth, args.hidden, args.mlp, args.heads = 2, 1, 256, 512, 8
        args.vision_width, args.vision_mlp, args.size, args.duration = 64, 128, "128x96", 16.0
        args.micro_batch_tokens = args.micro_batch_tokens or 2048
    small_logits(args)                                       # the plan projects the path the ranks take
    size = tuple(int(x) for x in args.size.split("x"))             # W x H
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, root, out_dir = (os.path.join(tmp, d) for d in ("ckpt", "videos", "out"))
        for d in (root, out_dir):
            os.makedirs(d)
        write_video(root, size, args.duration)
        build_checkpoint(ckpt, args)
        if args.ranks > 1:
            torch.multiprocessing.spawn(rank_main, args=(args.ranks, runtime.find_free_port(), args, ckpt, root, out_dir),
                                        nprocs=args.ranks)
        else:
            rank_main(0, 1, 0, args, ckpt, root, out_dir)
        ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(args.ranks)]
    report(ranks, args)


if __name__ == "__main__":
    main()
