"""Benchmark the rollout engine (rollout.py) against the simple ways of doing the same work (tiny Qwen3-VL, CPU).

    python bench/rollout_bench.py                          # all six parts
    python bench/rollout_bench.py --parts 5                # one part

1. multi-turn  a scripted interleaved trajectory of --turns turns: run_agent (the prompt prefilled once, each turn's
               new chunk on the KV cache) vs the released loop (a full forward over the sequence every turn, every
               frame through the vision tower again; model work only). Targets: >= 2x fewer prefilled tokens, >= 1.5x.
2. sub-agents  --calls parallel calls' sub-agents as one batched generation vs one at a time. Target >= 2x.
3. decode      our engine vs model.generate on the same prompts, greedy, exactly --new-tokens each, at batch 1 and
               --batch. Targets >= 1.0, the same tokens.
4. scale       G = 8 rows from one long video prompt at Qwen widths (vocab 151,936) vs generate(num_return_sequences),
               each side in its own process: peak live tensor bytes beyond the weights (LiveTensors; RSS beside),
               tokens/s, host syncs per decode step (runtime.HostSyncCounter). Targets >= 4x, >= 1.5x, <= 1 sync.
5. budget      rows whose turns take --budget-min to --budget-max tokens, unbounded, then under a quarter of that
               peak by continuous batching and by fixed waves. Targets: peak <= 1.1 x budget, >= 1.3x the waves'
               tokens/s, every trajectory's tokens and log-probs equal to the unbounded run's.
6. gpu_shape   8 groups x 8 rows cropping a 1280x720 H.264 file: the torch ops and attention kernels per decoder layer of
               a decode step of all 64 rows after their first turn, and the tools beside the decoding (overlap =
               (decode_s + tool_s - wall_s) / min of the two). Targets <= 2 calls, <= 60 ops, overlap >= 0.7, exact.
               Beside it, `deep`: the same step's figures on the tiny widths at Qwen3-VL-8B's 36 layers (the work of a
               forward outside the layers spread as on the real model), the prompts read once each (two calls and the
               merge, as Qwen-width video prompts are) and read with their rows (one call).
Two sides run interleaved after one warm-up; medians; ratios are baseline / ours (> 1: ours is better). The last
line is one JSON object.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch
from common import LiveTensors, PeakRSS, Script, ab_times, median, print_json, set_threads, table  # bench/common.py
from engines import STATS, Timed, Waves, swapped  # bench/engines.py: the engine clocked, and in fixed waves
from transformers import DynamicCache

import kvcache
import rollout
import runtime
import video
from model import ModelConfig, load_model, special_token_ids

QUESTION = "What colour is the shape shown in the video?"
OPTIONS = ["red", "green", "blue", "yellow"]


# ----------------------------------------------------------------------------- inputs

def make_video(root: str, duration: float, size: int) -> dict:
    """A synthetic 2 fps video of `duration` s at size x size and an mcq record pointing at it."""
    path = os.path.join(root, "bench.mp4")
    video.write_video(path, video.synthetic_frames(round(duration * 2), size, size, seed=0), 2.0)
    return {"id": "bench", "video": "bench.mp4", "question": QUESTION, "options": OPTIONS, "task": "mcq",
            "answer": "A", "duration": duration}


def masked_greedy(stop_id: int):
    """Greedy with <|im_end|> never chosen (what generate's min_new_tokens does), so lengths are fixed."""
    return lambda logits, *_: logits.index_fill(1, torch.tensor([stop_id]), -float("inf")).argmax(-1)


class Counter:
    """Counts the tokens and vision patches prefilled (GroupKV.add_prompts / extend) and the tokens decoded
    (GroupKV.step) while installed."""

    def __init__(self):
        self.prefill_tokens = self.decode_tokens = self.patches = 0

    def install(self):
        saved = {name: getattr(kvcache.GroupKV, name) for name in ("add_prompts", "extend", "step")}

        def counted(name):
            def call(kv, model, *a):
                if name == "step":                                      # (rows, tokens)
                    self.decode_tokens += len(a[0])
                else:                                                   # ([rows,] chunks, pad_id)
                    self.prefill_tokens += sum(len(c.ids) for c in a[-2])
                    self.patches += sum(len(c.pixels) for c in a[-2] if c.pixels is not None)
                return saved[name](kv, model, *a)
            return call
        for name in saved:
            setattr(kvcache.GroupKV, name, counted(name))
        return lambda: [setattr(kvcache.GroupKV, name, fn) for name, fn in saved.items()]


def one_turn(model, processor, chunks: list, group: int, cfg: rollout.RolloutConfig, n: int, seeds) -> list[list[int]]:
    """Our engine on plain generation: `group` rows of each prompt chunk write exactly n tokens each (one turn, no
    tools, <|im_end|> not a stop), greedy or seeded as cfg says; returns each row's tokens."""
    engine = rollout.Engine(model, processor, cfg, special_token_ids(processor))
    engine.stop = -1                                          # never stops: n tokens each
    rows = []
    for i, c in enumerate(chunks):
        group_rows = [rollout._Row(rollout.Trajectory("", s, [], [], 0, []), "", seeds(i, s), max_new=n, tools=False,
                                   reserve=kvcache.blocks_for(n)) for s in range(group)]
        engine.add_group(c, group_rows)
        rows += group_rows
    engine.run()
    return [r.turn_tokens for r in rows]


def both_prompts(processor, path: str, cfg: rollout.RolloutConfig, texts: list[str]) -> tuple[list, dict]:
    """The overview of `path` (cfg's K and pixels) after each prompt text, as our engine's chunks and as generate's
    inputs (the processor on the same frames, left-padded)."""
    overview = rollout.load_overview(path, video.probe(path).duration, cfg, rollout.video_factor(processor),
                                     cfg.overview_nframes)
    tok, side = processor.tokenizer, processor.tokenizer.padding_side
    tok.padding_side = "left"
    inputs = processor(text=texts, videos=[overview.frames] * len(texts), padding=True, return_tensors="pt",
                       videos_kwargs=dict(do_sample_frames=False, do_resize=False,
                                          video_metadata=[rollout.clip_metadata(overview)] * len(texts)))
    tok.padding_side = side
    return [rollout.encode_chunk(processor, t, [overview]) for t in texts], inputs


# ----------------------------------------------------------------------------- 1. multi-turn

def turn_spans(roles: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of POLICY tokens: one per assistant turn."""
    spans, start = [], None
    for i, r in enumerate(roles + [rollout.ENV]):
        if r == rollout.POLICY and start is None:
            start = i
        elif r != rollout.POLICY and start is not None:
            spans.append((start, i))
            start = None
    return spans


@torch.no_grad()
def reencode_rollout(model, processor, traj: rollout.Trajectory, record: dict, path: str,
                     cfg: rollout.RolloutConfig) -> dict:
    """The released loop on a known trajectory: per turn, a full forward over everything before it (every video
    through the vision tower), then the turn's tokens one by one on that cache. The videos are decoded and the
    processor runs over each once, as ours does (the released loop re-runs it over the whole conversation every
    turn, which this side is spared); the forwards read the ids and pixels of `traj`."""
    factor, merge = rollout.video_factor(processor), processor.video_processor.merge_size
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    duration = video.probe(path).duration
    overview = rollout.load_overview(path, duration, cfg, factor, cfg.overview_nframes)
    rollout.encode_chunk(processor, rollout.prompt_text(processor, record, cfg.tools_block), [overview])
    for calls in traj.calls:
        parts, clips = rollout.tool_response_parts(rollout.run_calls(calls, path, duration, cfg, factor))
        rollout.encode_chunk(processor, rollout.response_chunk_text(parts, False), clips)
    video_id = model.config.video_token_id
    prefill = patches = decoded = 0
    for a, b in turn_spans(traj.roles):
        n_video = sum(t == video_id for t in traj.token_ids[:a])
        videos, seen = [], 0
        for p, g in traj.videos:          # the videos whose tokens lie before this turn
            seen += int((g.prod(-1) // (merge * merge)).sum())              # its video tokens
            if seen > n_video:
                break
            videos.append((p, g))
        part = rollout.Trajectory(traj.record_id, 0, traj.token_ids[:a], traj.roles[:a], traj.prompt_len, videos)
        batch = rollout.collate([part], model, pad_id)
        batch.pop("roles")
        cache = DynamicCache(config=model.config)
        out = model.model(**batch, cache=cache, use_cache=True)
        model.lm_head(out.last_hidden_state[:, -1]).float()     # the next token's (1, V) logits, as ours computes
        mask, next_pos = batch["attention_mask"], int(batch["position_ids"].max()) + 1
        prefill += a
        patches += sum(len(p) for p, _ in videos)
        for j, tok in enumerate(traj.token_ids[a:b]):
            if j == b - a - 1:
                break                                           # the stop token is never fed back
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
            pos = torch.full((3, 1, 1), next_pos, dtype=torch.long)
            next_pos += 1
            out = model.model(input_ids=torch.tensor([[tok]]), attention_mask=mask, position_ids=pos,
                              cache=cache, use_cache=True)
            model.lm_head(out.last_hidden_state[:, -1]).float()  # (the token fed next is traj's, not a draw)
            decoded += 1
    return dict(prefill_tokens=prefill, decode_tokens=decoded, patches=patches)


def bench_multiturn(model, processor, root: str, rec: dict, args) -> dict:
    tok = processor.tokenizer
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"] + [stop]
    duration = rec["duration"]
    starts = [round((k + 0.5) * duration / args.turns) for k in range(args.turns - 1)]
    texts = [f"I need a closer look.\n</think>\n<tool_call>\n{{\"name\": \"crop_video\", \"arguments\": "
             f"{{\"start_time\": {s}.0, \"end_time\": {s + args.window}.0}}}}\n</tool_call>" for s in starts]
    texts.append("The shape is red.\n</think>\n<answer>A</answer>")
    cfg = rollout.RolloutConfig(tool_mode="interleaved", max_turns=args.turns - 1, max_new_tokens=128, group_size=1,
                                temperature=1.0, overview_nframes=args.overview_frames,
                                overview_max_pixels=args.size ** 2, crop_fps=2.0, crop_max_pixels=args.crop_size ** 2,
                                tools_block=False)
    counter, turns = Counter(), [enc(t) for t in texts]      # tokenized once: the script's work is not the engine's

    def ours():
        rollout.sample_tokens = Script(lambda seed: turns)      # every row the same turns
        return rollout.run_agent(model, processor, [rec], root, cfg, seed=0)[0]

    restore = counter.install()                     # the first run counted
    try:
        traj = ours()
    finally:
        restore()
    assert traj.n_tool_turns == args.turns - 1 and traj.answer == "A", "the scripted trajectory did not run"
    path = os.path.join(root, rec["video"])
    reencode = lambda: reencode_rollout(model, processor, traj, rec, path, cfg)
    base = reencode()
    wall, cpu = ab_times({"ours": ours, "reencode": reencode}, args.repeats)
    return dict(turns=args.turns, sequence_tokens=len(traj.token_ids), policy_tokens=sum(traj.roles),
                ours_prefill_tokens=counter.prefill_tokens, reencode_prefill_tokens=base["prefill_tokens"],
                ours_vision_patches=counter.patches, reencode_vision_patches=base["patches"],
                ours_decode_tokens=counter.decode_tokens, reencode_decode_tokens=base["decode_tokens"],
                ours_s=median(wall["ours"]), reencode_s=median(wall["reencode"]),
                ours_cpu_s=median(cpu["ours"]), reencode_cpu_s=median(cpu["reencode"]),
                prefill_ratio=base["prefill_tokens"] / counter.prefill_tokens,
                speedup=median(wall["reencode"]) / median(wall["ours"]),
                cpu_speedup=median(cpu["reencode"]) / median(cpu["ours"]))


# ----------------------------------------------------------------------------- 2. sub-agents

def bench_subagents(model, processor, root: str, rec: dict, args) -> dict:
    ids = special_token_ids(processor)
    path = os.path.join(root, rec["video"])
    factor = rollout.video_factor(processor)
    starts = [round(k * (rec["duration"] - args.window) / max(1, args.calls - 1)) for k in range(args.calls)]
    clips = [video.crop(path, s, s + args.window, level=None, fps=1.0, max_frames=16, max_pixels=args.crop_size ** 2,
                        tokens_per_pixel_area=factor * factor) for s in starts]
    jobs = [(0, k, clip) for k, clip in enumerate(clips)]
    cfg = rollout.RolloutConfig(temperature=0.0, group_size=1, subagent_max_new_tokens=args.sub_tokens)
    rollout.sample_tokens = masked_greedy(ids["<|im_end|>"])
    batched = lambda: [t.text for t in rollout.run_subagents(model, processor, jobs, cfg, [0] * len(jobs), ids)]
    serial = lambda: [rollout.run_subagents(model, processor, [j], cfg, [0], ids)[0].text for j in jobs]
    same = batched() == serial()
    wall, cpu = ab_times({"batched": batched, "serial": serial}, args.repeats)
    t_b, t_s = median(wall["batched"]), median(wall["serial"])
    return dict(calls=args.calls, tokens_each=args.sub_tokens, batched_s=t_b, serial_s=t_s, speedup=t_s / t_b,
                cpu_speedup=median(cpu["serial"]) / median(cpu["batched"]), same_tokens=same)


# ----------------------------------------------------------------------------- 3. decode loop vs generate

def bench_decode(model, processor, root: str, rec: dict, args, batch_size: int) -> dict:
    ids = special_token_ids(processor)
    stop, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    cfg = rollout.RolloutConfig(temperature=0.0, group_size=1, overview_nframes=args.decode_frames,
                                overview_max_pixels=args.crop_size ** 2, tools_block=False)
    records = [{**rec, "question": QUESTION + " Look carefully." * k} for k in range(batch_size)]   # lengths differ
    chunks, inputs = both_prompts(processor, os.path.join(root, rec["video"]), cfg,
                                  [rollout.prompt_text(processor, r, False) for r in records])
    n = args.new_tokens
    rollout.sample_tokens = masked_greedy(stop)

    def ours():
        return one_turn(model, processor, chunks, 1, cfg, n, lambda i, s: 0)

    @torch.no_grad()
    def generate():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        return out[:, -n:].tolist()

    same = ours() == generate()                     # transformers' cache read as it should be (layers.py)
    wall, cpu = ab_times({"ours": ours, "generate": generate}, args.repeats)
    t_o, t_g = median(wall["ours"]), median(wall["generate"])
    return dict(batch=batch_size, new_tokens=n, ours_tok_s=batch_size * n / t_o, generate_tok_s=batch_size * n / t_g,
                ratio=t_g / t_o, cpu_ratio=median(cpu["generate"]) / median(cpu["ours"]), same_tokens=same)


# ----------------------------------------------------------------------------- 4. scale: group rollout vs generate

def scale_model(args):
    """A Qwen3-VL at the real per-token K/V ratios on a CPU budget: text hidden 1024, 8 KV heads x 128,
    vocab 151,936 (the embeddings resized past the tiny tokenizer), --scale-layers layers; tiny vision."""
    from model import build_tiny
    cfg = ModelConfig(hidden=1024, layers=args.scale_layers, heads=8, kv_heads=8, head_dim=128, intermediate=3072,
                      mrope_section=(24, 20, 20))
    torch.manual_seed(0)
    model, processor = build_tiny(cfg, corpus=rollout.prompt_corpus())
    model.resize_token_embeddings(151_936, mean_resizing=False)
    return model.eval(), processor


def scale_side(side: str, args) -> dict:
    """One side of the scale bench in this process: prompt setup, then the timed, memory-sampled run."""
    set_threads(args.threads)
    model, processor = scale_model(args)
    pad = special_token_ids(processor)["<|endoftext|>"]
    G, n = args.scale_group, args.scale_new_tokens
    with tempfile.TemporaryDirectory() as root:
        rec = make_video(root, args.scale_frames / 2, args.scale_size)
        cfg = rollout.RolloutConfig(temperature=0.7, top_p=1.0, group_size=G, overview_nframes=args.scale_frames,
                                    overview_max_pixels=args.scale_size ** 2, tools_block=False)
        [chunk], inputs = both_prompts(processor, os.path.join(root, rec["video"]), cfg,
                                       [rollout.prompt_text(processor, rec, False) + rollout.THINK_PREFIX])

    def ours():
        return one_turn(model, processor, [chunk], G, cfg, n, lambda i, s: rollout.row_seed(0, 0, s))

    @torch.no_grad()
    def hf():
        out = model.generate(**inputs, do_sample=True, temperature=0.7, top_p=1.0, top_k=0, num_return_sequences=G,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
        return out[:, -n:].tolist()

    fn = ours if side == "ours" else hf
    with PeakRSS() as rss:                                   # the timed run: wall time and resident memory
        t0 = time.perf_counter()
        toks = fn()
        secs = time.perf_counter() - t0
    before = STATS["decode_steps"]
    # the memory run: live tensor bytes, and the host syncs as they happen (both hooks slow: not the timed run)
    with LiveTensors() as live, runtime.HostSyncCounter("cpu") as syncs, swapped(Timed):
        fn()
    steps = STATS["decode_steps"] - before
    return dict(prompt_tokens=len(chunk.ids), peak_mb=live.mb, rss_mb=rss.mb, seconds=secs, tokens=sum(len(t) for t in toks),
                host_syncs_per_step=syncs.in_steps / steps if steps else None,
                host_syncs_outside_steps=syncs.count - syncs.in_steps if steps else None,
                weights_mb=sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20)


def bench_scale(args) -> dict:
    """Each side in its own process (one side's freed memory cannot hide the other's peak), --scale-runs times."""
    runs = []
    for _ in range(args.scale_runs):
        res = {}
        for side in ("ours", "hf"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--scale-side", side]      # this run's flags, one side
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            res[side] = json.loads(out.strip().splitlines()[-1])
        runs.append(res)
    o, h = runs[-1]["ours"], runs[-1]["hf"]
    ratios = [r["hf"]["peak_mb"] / r["ours"]["peak_mb"] for r in runs]
    rss = [r["hf"]["rss_mb"] / r["ours"]["rss_mb"] for r in runs]
    return dict(group=args.scale_group, prompt_tokens=o["prompt_tokens"], layers=args.scale_layers,
                new_tokens=args.scale_new_tokens, weights_mb=o["weights_mb"],
                ours_peak_mb=o["peak_mb"], hf_peak_mb=h["peak_mb"], memory_ratio=median(ratios),
                memory_ratio_runs=ratios, memory_ratio_spread=max(ratios) / min(ratios) - 1,
                ours_rss_mb=o["rss_mb"], hf_rss_mb=h["rss_mb"], rss_ratio_runs=rss,
                ours_tok_s=median([r["ours"]["tokens"] / r["ours"]["seconds"] for r in runs]),
                hf_tok_s=median([r["hf"]["tokens"] / r["hf"]["seconds"] for r in runs]),
                speedup=median([r["hf"]["seconds"] / r["ours"]["seconds"] for r in runs]),
                host_syncs_per_step=o["host_syncs_per_step"], host_syncs_outside_steps=o["host_syncs_outside_steps"])


# ----------------------------------------------------------------------------- 5. budget: continuous batching

class Planned:
    """The real draw (seeded, special tokens banned), each row's turns shaped: the row with seed s writes turn k in
    L_k tokens, L_k uniform in [lo, hi]; half the rows call the tool in their first turn, then answer. A function of
    (seed, counter) alone, as the real sampler: every schedule gives every row the same tokens."""

    def __init__(self, sample, stop: int, special: list[int], call: list[int], lo: int, hi: int):
        self.sample, self.stop, self.special, self.call, self.lo, self.hi = sample, stop, torch.tensor(special), call, lo, hi
        self.plans = {}

    def plan(self, seed: int) -> list[tuple[int, bool]]:
        """[(the counter after turn k's last token, whether turn k calls the tool)]."""
        if seed not in self.plans:
            rng, ends, c = random.Random(seed), [], 0
            calls = rng.random() < 0.5
            for k in range(2 if calls else 1):
                c += rng.randint(self.lo, self.hi)
                ends.append((c, calls and k == 0))
            self.plans[seed] = ends
        return self.plans[seed]

    def __call__(self, logits, seeds, counters, temperature, top_p):
        tok = self.sample(logits.index_fill(1, self.special, float("-inf")), seeds, counters, temperature, top_p).tolist()
        for i, (s, c) in enumerate(zip(seeds.tolist(), counters.tolist())):
            for end, call in self.plan(s):
                if c < end:
                    left = end - 1 - c                        # tokens of the turn after this one
                    if left == 0:
                        tok[i] = self.stop
                    elif call and left <= len(self.call):
                        tok[i] = self.call[len(self.call) - left]
                    break
        return torch.tensor(tok, device=logits.device)


def engine_memory(fn):
    """(fn's result, peak MB of the tensors the engine allocates, decode steps of a Timed engine): LiveTensors over
    Engine.admit and Engine.step, not over the tools and the processor (the pixels the trajectories keep for
    training)."""
    live, saved, steps = LiveTensors(), (rollout.Engine.admit, rollout.Engine.step), STATS["decode_steps"]

    def counted(method):
        def inside(self, *a):
            with live:
                return method(self, *a)
        return inside

    rollout.Engine.admit, rollout.Engine.step = counted(saved[0]), counted(saved[1])
    try:
        return fn(), live.mb, STATS["decode_steps"] - steps
    finally:
        rollout.Engine.admit, rollout.Engine.step = saved


def bench_budget(args) -> dict:
    """--budget-prompts x --budget-group rows of a 1-tool-turn interleaved rollout: unbounded, then under a quarter of
    that peak (`engine_memory`) by continuous batching and by fixed waves (engines.Waves: a turn waits for the wave's
    longest row).
    kvcache's working sizes and block shrink with the budget (--budget-scores / -prefill / -join / -block /
    -gather), so they stay the share of it they are of a real one. `decode_steps`: the decode forwards of each schedule."""
    from model import build_tiny
    torch.manual_seed(0)
    model, processor = build_tiny(ModelConfig(layers=args.budget_layers), corpus=rollout.prompt_corpus())
    model.eval()
    tok = processor.tokenizer
    call = tok("\n</think>\n<tool_call>\n{\"name\": \"crop_video\", \"arguments\": {\"start_time\": 4.0, "
               "\"end_time\": 8.0}}\n</tool_call>", add_special_tokens=False)["input_ids"]
    planned = Planned(rollout.sample_tokens, special_token_ids(processor)["<|im_end|>"],
                      sorted(tok.get_added_vocab().values()), call, args.budget_min, args.budget_max)
    saved = kvcache.SCORES_BUDGET, kvcache.PREFILL_TOKENS, kvcache.BLOCK, kvcache.JOIN_PROMPT, kvcache.GATHER_BUDGET
    kvcache.SCORES_BUDGET, kvcache.PREFILL_TOKENS = args.budget_scores, args.budget_prefill
    kvcache.BLOCK, kvcache.JOIN_PROMPT, kvcache.GATHER_BUDGET = args.budget_block, args.budget_join, args.budget_gather
    steps = {}
    try:
        with tempfile.TemporaryDirectory() as root:
            rec = make_video(root, 32.0, 64)
            recs = [{**rec, "id": f"q{i}", "question": QUESTION + " Look carefully." * i} for i in range(args.budget_prompts)]
            base = dict(tool_mode="interleaved", max_turns=1, max_calls_per_turn=1, max_new_tokens=args.budget_max,
                        temperature=1.0, group_size=args.budget_group, overview_nframes=args.budget_frames,
                        overview_max_pixels=64 * 64, crop_fps=1.0, crop_max_frames=4, crop_max_pixels=64 * 64,
                        tools_block=False, record_logprobs=True)
            def run(engine=Timed, **kw):
                with swapped(engine):
                    return rollout.run_agent(model, processor, recs, root, rollout.RolloutConfig(**base, **kw), seed=0)
            rollout.sample_tokens = planned
            ref, unbounded_mb, _ = engine_memory(lambda: run(memory_budget_bytes=1 << 40))
            budget = int(unbounded_mb * 2 ** 20) // 4
            cont, peak_mb, steps["continuous"] = engine_memory(lambda: run(memory_budget_bytes=budget))
            static, static_mb, steps["static"] = engine_memory(lambda: run(Waves, memory_budget_bytes=budget))
            wall, cpu = ab_times({"continuous": lambda: run(memory_budget_bytes=budget),
                                "static": lambda: run(Waves, memory_budget_bytes=budget)}, args.budget_repeats)
    finally:
        kvcache.SCORES_BUDGET, kvcache.PREFILL_TOKENS, kvcache.BLOCK, kvcache.JOIN_PROMPT, kvcache.GATHER_BUDGET = saved
        rollout.sample_tokens = planned.sample
    diff = max(abs(a - b) for other in (cont, static) for t, r in zip(other, ref) for a, b in zip(t.logprobs, r.logprobs))
    same = all(t.token_ids == r.token_ids for other in (cont, static) for t, r in zip(other, ref))
    tokens = sum(t.draws for t in ref)
    turns = [n for t in ref for n in (b - a for a, b in turn_spans(t.roles))]
    return dict(rows=len(ref), tool_turns=sum(t.n_tool_turns for t in ref), sampled_tokens=tokens,
                turn_length_ratio=max(turns) / min(turns), budget_mb=budget / 2 ** 20, peak_mb=peak_mb,
                static_peak_mb=static_mb, unbounded_peak_mb=unbounded_mb, decode_steps=steps,
                steps_ratio=steps["static"] / steps["continuous"],
                static_tok_s=tokens / median(wall["static"]), continuous_tok_s=tokens / median(wall["continuous"]),
                speedup=median(wall["static"]) / median(wall["continuous"]),
                cpu_speedup=median(cpu["static"]) / median(cpu["continuous"]), max_logprob_diff=diff,
                exact=same and diff <= 1e-5)


# ----------------------------------------------------------------------------- 6. gpu shape: a step's ops, tools beside it

class CallThenAnswer(Planned):
    """Planned's draw, every row calling the tool in its first turn ([lo, hi] tokens), then answering ([hi, 2 hi])."""

    def plan(self, seed: int) -> list[tuple[int, bool]]:
        if seed not in self.plans:
            rng = random.Random(seed)
            first = rng.randint(self.lo, self.hi)
            self.plans[seed] = [(first, True), (first + rng.randint(self.hi, 2 * self.hi), False)]
        return self.plans[seed]


def bench_gpu_shape(model, processor, args) -> dict:
    """--shape-prompts groups of --shape-group rows, each crops a 1280x720 H.264 file in its first turn. Fixed waves
    (every tool turn waits for the batch, then its responses join at once): the first decode step of every row after
    its first turn, its torch ops and attention kernels per decoder layer (runtime.step_ops: a TorchFunctionMode).
    Continuous batching: the tools run beside the decoding (engines.STATS' decode_s, tool_s, wall_s), and its
    trajectories equal the waves' token for token (`exact`)."""
    tok = processor.tokenizer
    call = tok("\n</think>\n<tool_call>\n{\"name\": \"crop_video\", \"arguments\": {\"start_time\": 4.0, "
               "\"end_time\": 12.0}}\n</tool_call>", add_special_tokens=False)["input_ids"]
    planned = CallThenAnswer(rollout.sample_tokens, special_token_ids(processor)["<|im_end|>"],
                             sorted(tok.get_added_vocab().values()), call, args.shape_min, args.shape_max)
    seen, measured, step = set(), {}, kvcache.GroupKV.step
    rows_now = args.shape_prompts * args.shape_group

    def watched(kv, model, rows, tokens):                   # the first step of all rows after their first turn
        if measured or len(rows) < rows_now or not seen.issuperset(rows):
            return step(kv, model, rows, tokens)
        kvcache.GroupKV.step = step                         # measured once: the plain step from here on
        figures, logits = runtime.step_ops(model, kv, rows, tokens)
        measured.update(figures, rows=len(rows))
        return logits

    with tempfile.TemporaryDirectory() as root:
        video.write_video(os.path.join(root, "hd.mp4"), video.synthetic_frames(args.shape_seconds * 10, 720, 1280), 10.0)
        recs = [{"id": f"q{i}", "video": "hd.mp4", "question": QUESTION + " Look carefully." * i, "options": OPTIONS,
                 "task": "mcq", "answer": "A", "duration": float(args.shape_seconds)} for i in range(args.shape_prompts)]
        cfg = dict(tool_mode="interleaved", max_turns=1, max_calls_per_turn=1, max_new_tokens=2 * args.shape_max,
                   temperature=1.0, group_size=args.shape_group, overview_nframes=8, overview_max_pixels=64 * 64,
                   crop_fps=2.0, crop_max_frames=8, crop_max_pixels=64 * 64, tools_block=False,
                   memory_budget_bytes=1 << 40)
        def run(engine):
            with swapped(engine):
                return rollout.run_agent(model, processor, recs, root, rollout.RolloutConfig(**cfg), seed=0)
        extend = kvcache.GroupKV.extend
        kvcache.GroupKV.extend = lambda kv, m, rows, *a: (seen.update(rows), extend(kv, m, rows, *a))[1]
        kvcache.GroupKV.step = watched
        rollout.sample_tokens = planned
        try:
            waves = run(Waves)
        finally:
            kvcache.GroupKV.extend, kvcache.GroupKV.step = extend, step
        before = dict(STATS)
        overlapped = run(Timed)
    d = {k: STATS[k] - before[k] for k in ("decode_s", "tool_s", "wall_s")}
    d["overlap"] = (d["decode_s"] + d["tool_s"] - d["wall_s"]) / min(d["decode_s"], d["tool_s"])
    return dict(measured, tool_overlap=d, exact=all(a.token_ids == b.token_ids and a.windows == b.windows
                                                     for a, b in zip(waves, overlapped)),
                tool_turns=sum(t.n_tool_turns for t in overlapped), deep=deep_step_ops())


def deep_step_ops(layers: int = 36, groups: int = 8, group: int = 8) -> dict:
    """runtime.step_ops of a decode step of groups x group rows after a first turn (prompts and suffixes of different
    lengths) on the tiny widths at `layers` layers: {"two_calls": prompts read once each, "one_call": read with
    their rows}, each {attention_calls_per_layer_step, ops_per_layer_step, attention_ops_per_layer_step}."""
    model, _ = load_model("tiny", device="cpu", tiny_config=ModelConfig(layers=layers))
    gen, out, join = torch.Generator().manual_seed(0), {}, kvcache.JOIN_PROMPT
    text = lambda n: kvcache.Chunk(torch.randint(300, 1000, (n,), generator=gen), torch.zeros(n, dtype=torch.int32))
    for name, limit in (("two_calls", 0), ("one_call", join)):
        kvcache.JOIN_PROMPT = limit
        try:
            kv = kvcache.GroupKV(model, "cpu", kvcache.blocks_for(40000))
            prompts, _ = kv.add_prompts(model, [text(40 + 9 * i) for i in range(groups)], 0)
            rows = [r for p in prompts for r in kv.fork(p, group)]
            kv.extend(model, rows, [text(3 + (7 * i) % 20) for i in range(len(rows))], 0)
            out[name] = runtime.step_ops(model, kv, rows, torch.arange(len(rows)) + 400)[0]
        finally:
            kvcache.JOIN_PROMPT = join
    return dict(out, layers=layers)


# ----------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default, what in [("overview-frames", 128, "overview frames (even)"), ("size", 128, "frame side of the video"),
                                ("crop-size", 64, "frame side of crops (clips, sub-agents)"),
                                ("turns", 4, "assistant turns in the multi-turn trajectory"),
                                ("window", 8, "seconds per crop_video call"), ("calls", 5, "parallel calls (part 2)"),
                                ("sub-tokens", 48, "tokens each sub-agent writes"), ("new-tokens", 64, "tokens a prompt (part 3)"),
                                ("decode-frames", 16, "overview frames of part 3's prompts (short: decoding dominates)"),
                                ("batch", 4, "prompts a batch in part 3 (and batch 1)"), ("repeats", 5, "timed repeats a side"),
                                ("threads", 1, "torch intra-op threads (0: torch's default)")]:
        p.add_argument(f"--{flag}", type=int, default=default, help=what)
    p.add_argument("--duration", type=float, default=64.0, help="video length, seconds (2 fps)")
    p.add_argument("--parts", default="1,2,3,4,5,6", help="which measurements to run, e.g. 1,3")
    for flag, default, what in [("layers", 2, "text layers (hidden 1024, 8 KV heads x 128)"),
                                ("frames", 128, "overview frames (2 frames -> 1 temporal patch)"),
                                ("size", 256, "frame side (256: 64 tokens per temporal patch)"), ("group", 8, "group size G"),
                                ("new-tokens", 128, "tokens sampled per row (T = 0.7)"),
                                ("runs", 3, "runs of both sides (memory figures per run)")]:
        p.add_argument(f"--scale-{flag}", type=int, default=default, help=f"scale bench: {what}")
    for flag, default, what in [("prompts", 20, "prompts (rows: prompts x group)"), ("group", 4, "group size G"),
                                ("frames", 16, "overview frames (64x64)"), ("min", 24, "fewest tokens of a turn"),
                                ("max", 160, "most tokens of a turn (max_new_tokens)"),
                                ("repeats", 3, "timed repeats per schedule"), ("layers", 8, "text layers of the tiny model"),
                                ("scores", 2 ** 17, "kvcache.SCORES_BUDGET"), ("prefill", 256, "kvcache.PREFILL_TOKENS"),
                                ("block", 32, "kvcache.BLOCK (a --budget-max turn spans 5 blocks; a real 2,048 spans 8)"),
                                ("join", 2 ** 11, "kvcache.JOIN_PROMPT (2^17 / 64)"),
                                ("gather", 2 ** 17, "kvcache.GATHER_BUDGET (as the scores: the slabs bounded as before)")]:
        p.add_argument(f"--budget-{flag}", type=int, default=default, help=f"budget bench: {what}")
    for flag, default, what in [("prompts", 8, "groups"), ("group", 8, "rows a group"), ("seconds", 30, "seconds of 720p video"),
                                ("min", 48, "fewest tokens of a first turn (the call: ~40)"), ("max", 80, "most (an answer: max to 2 max)")]:
        p.add_argument(f"--shape-{flag}", type=int, default=default, help=f"gpu shape bench: {what}")
    p.add_argument("--scale-side", choices=["ours", "hf"], help=argparse.SUPPRESS)   # internal: one side per process
    args = p.parse_args()
    if args.scale_side:
        print(json.dumps(scale_side(args.scale_side, args)))
        return
    threads = set_threads(args.threads)
    torch.manual_seed(0)
    model, processor = load_model("tiny", device="cpu", tiny_corpus=rollout.prompt_corpus())
    sampler, parts, out = rollout.sample_tokens, set(args.parts.split(",")), {}
    with tempfile.TemporaryDirectory() as root:
        rec = make_video(root, args.duration, args.size)
        try:
            if "1" in parts:
                out["multiturn"] = bench_multiturn(model, processor, root, rec, args)
            if "2" in parts:
                out["subagents"] = bench_subagents(model, processor, root, rec, args)
            if "3" in parts:
                out["decode"] = {f"batch{b}": bench_decode(model, processor, root, rec, args, b)
                                 for b in sorted({1, args.batch})}
            if "4" in parts:
                out["scale"] = bench_scale(args)
            if "5" in parts:
                out["budget"] = bench_budget(args)
            if "6" in parts:
                out["gpu_shape"] = bench_gpu_shape(model, processor, args)
        finally:
            rollout.sample_tokens = sampler
    print(f"tiny Qwen3-VL on CPU, {threads} thread(s); overview {args.overview_frames} frames at {args.size}x{args.size}, "
          f"crops at {args.crop_size}x{args.crop_size}; medians of {args.repeats} interleaved repeats")
    for name, part in out.items():
        for sub, figures in (part.items() if name == "decode" else [("", part)]):     # decode: one table a batch
            print(f"\n{name} {sub}\n" + table([[k, v] for k, v in figures.items()], ["figure", "value"]))
    mt, sa, dec, sc, bu, gs = (out.get(k) for k in ("multiturn", "subagents", "decode", "scale", "budget", "gpu_shape"))
    targets = {}
    if mt:
        targets.update(prefill_ratio_ge_2=mt["prefill_ratio"] >= 2, multiturn_speedup_ge_1_5=mt["speedup"] >= 1.5)
    if sa:
        targets["subagent_speedup_ge_2"] = sa["speedup"] >= 2
    if dec:
        targets.update(decode_ratio_ge_1=all(d["ratio"] >= 1 for d in dec.values()),   # the same greedy tokens:
                       decode_same_tokens=all(d["same_tokens"] for d in dec.values()))  # generate did the work too
    if sc:
        targets.update(scale_memory_ratio_ge_4=sc["memory_ratio"] >= 4, scale_speedup_ge_1_5=sc["speedup"] >= 1.5,
                       scale_host_syncs_le_1=sc["host_syncs_per_step"] <= 1,
                       scale_memory_runs_within_5pct=sc["memory_ratio_spread"] <= 0.05)
    if bu:
        targets.update(budget_le_quarter=bu["budget_mb"] <= bu["unbounded_peak_mb"] / 4,
                       budget_peak_le_1_1=bu["peak_mb"] <= 1.1 * bu["budget_mb"],
                       budget_speedup_ge_1_3=bu["speedup"] >= 1.3, budget_exact=bu["exact"])
    if gs:
        targets.update(shape_rows_ge_64=gs.get("rows", 0) >= 64, shape_attention_calls_le_2=
                       gs.get("attention_calls_per_layer_step", 99) <= 2, shape_ops_le_60=gs.get("ops_per_layer_step", 1e9) <= 60,
                       shape_tool_overlap_ge_0_7=gs["tool_overlap"]["overlap"] >= 0.7, shape_exact=gs["exact"])
    print_json(dict(threads=threads, overview_frames=args.overview_frames, size=args.size, crop_size=args.crop_size,
                    repeats=args.repeats, **out, targets=targets))


if __name__ == "__main__":
    main()
