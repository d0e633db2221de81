"""Benchmark the rollout engine (rollout.py) against the simple ways of doing the same work.

    python bench/rollout_bench.py                          # tiny Qwen3-VL, CPU, a few minutes
    python bench/rollout_bench.py --overview-frames 32 --size 64 --repeats 3

1. multi-turn   One interleaved trajectory of --turns assistant turns (a crop_video call in each but
                the last, which answers), the model's outputs scripted so both sides do the same work.
                ours:     run_agent: the prompt (overview video) prefilled once, then each turn only
                          the new chunk (tool response + clip) is prefilled on top of the KV cache.
                re-encode the released behaviour: at every turn a full forward over the whole
                          sequence so far (every frame through the vision tower again), then that
                          turn's tokens decoded on a fresh cache.
                The re-encode side is timed on model work alone (the trajectory's token ids and
                pixels are given); ours is timed end to end (video decoding, cropping, processor
                included), so the time ratio is conservative.
                Targets: >= 2x fewer prefilled tokens, >= 1.5x faster.
2. sub-agents   --calls parallel crop_video calls: all their sub-agents as ONE batched generation
                (rollout.run_subagents) vs one call of run_subagents per job. Same clips, greedy,
                <|im_end|> masked so every sub-agent writes exactly --sub-tokens tokens. Target >= 2x.
3. decode       our engine on plain generation (`one_turn`: prompts prefilled, then token by token) vs
                model.generate on the same prompts (overview video + question), greedy, exactly
                --new-tokens tokens each (generate: min_new_tokens = max_new_tokens; ours: <|im_end|> is no
                stop). Tokens/s at batch 1 and --batch. Target ratio >= 1.0.
4. scale        G = 8 rows from one long video prompt at Qwen widths (2 layers, vocab 151,936), each side in its
                own process, --scale-runs times: peak live tensor bytes beyond the weights (LiveTensors, the same
                in every run; RSS beside it), tokens/s, host syncs per decode step (measured: runtime.HostSyncCounter).
                Targets >= 4x less memory, >= 1.5x tokens/s, <= 1 sync, the memory ratio within 5 % over the runs.
5. budget       --budget-prompts x --budget-group rows whose turns take --budget-min to --budget-max tokens (one
                tool turn for half of them): all at once (the budget unbounded), then under a budget of a quarter
                of that run's peak memory, by continuous batching and by fixed waves (the batch waits for its
                longest row each turn). Targets: peak <= 1.1 x budget, continuous >= 1.3x the waves' tokens/s,
                every trajectory's tokens and log-probs equal to the unbounded run's.

Each measurement runs its two sides interleaved (A, B, A, B) after one warm-up and reports medians;
ratios are baseline / ours (> 1 means ours is better). `same_tokens` flags check that the two sides
produced the same tokens. The last line of output is one JSON object.
"""
import argparse
import json
import os
import tempfile
import time

import torch
from common import (  # bench/common.py (puts the repo on sys.path)
    LiveTensors,
    PeakRSS,
    ab_times,
    median,
    print_json,
    set_threads,
    table,
)
from transformers import DynamicCache

import kvcache
import rollout
import runtime
import video
from model import load_model, special_token_ids

QUESTION = "What colour is the shape shown in the video?"
OPTIONS = ["red", "green", "blue", "yellow"]


# ----------------------------------------------------------------------------- inputs

def make_video(root: str, duration: float, size: int) -> dict:
    """A synthetic 2 fps video of `duration` s at size x size and an mcq record pointing at it."""
    path = os.path.join(root, "bench.mp4")
    video.write_video(path, video.synthetic_frames(round(duration * 2), size, size, seed=0), 2.0)
    return {"id": "bench", "video": "bench.mp4", "question": QUESTION, "options": OPTIONS, "task": "mcq",
            "answer": "A", "duration": duration}


class Script:
    """Stand-in for rollout.sample_tokens: each row (told apart by its seed) walks through the token
    lists `turns` (one per assistant turn, the last one repeating)."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.state = turns, {}

    def one(self, key: int) -> int:
        t, p = self.state.get(key, (0, 0))
        toks = self.turns[min(t, len(self.turns) - 1)]
        self.state[key] = (t + 1, 0) if p + 1 == len(toks) else (t, p + 1)
        return toks[p]

    def __call__(self, logits, seeds, counters, temperature, top_p):
        return torch.tensor([self.one(s) for s in seeds.tolist()])


def masked_greedy(stop_id: int):
    """Greedy with <|im_end|> never chosen (what generate's min_new_tokens does), so lengths are fixed."""
    def sample(logits, seeds, counters, temperature, top_p):
        return logits.index_fill(1, torch.tensor([stop_id]), -float("inf")).argmax(-1)
    return sample


class Counter:
    """Wraps GroupKV.add_prompts / extend (prefill) and GroupKV.step (decode) to count the tokens and vision
    patches of a run."""

    def __init__(self):
        self.prefill_tokens = self.decode_tokens = self.patches = 0

    def install(self):
        add_prompts, extend, step = kvcache.GroupKV.add_prompts, kvcache.GroupKV.extend, kvcache.GroupKV.step

        def count(chunks):
            self.prefill_tokens += sum(len(c.ids) for c in chunks)
            self.patches += sum(len(c.pixels) for c in chunks if c.pixels is not None)

        def counted_prompts(kv, model, chunks, pad_id):
            count(chunks)
            return add_prompts(kv, model, chunks, pad_id)

        def counted_extend(kv, model, rows, chunks, pad_id):
            count(chunks)
            return extend(kv, model, rows, chunks, pad_id)

        def counted_step(kv, model, rows, tokens):
            self.decode_tokens += len(rows)
            return step(kv, model, rows, tokens)

        kvcache.GroupKV.add_prompts, kvcache.GroupKV.extend = counted_prompts, counted_extend
        kvcache.GroupKV.step = counted_step
        return lambda: (setattr(kvcache.GroupKV, "add_prompts", add_prompts), setattr(kvcache.GroupKV, "extend", extend),
                        setattr(kvcache.GroupKV, "step", step))


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


def video_tokens(grid: torch.Tensor, merge: int) -> int:
    return int((grid.prod(-1) // (merge * merge)).sum())


@torch.no_grad()
def reencode_rollout(model, processor, traj: rollout.Trajectory, path: str, cfg: rollout.RolloutConfig) -> dict:
    """The released loop on a known trajectory: per turn, a full forward over everything before the
    turn (all its videos through the vision tower), then the turn's tokens one by one on that cache.
    The video work is the same as ours (overview and every crop decoded once); the processor is not
    re-run (token ids and pixels are taken from `traj`), which favours this side."""
    factor, merge = rollout.video_factor(processor), processor.video_processor.merge_size
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    duration = video.probe(path).duration
    rollout.load_overview(path, duration, cfg, factor, cfg.overview_nframes)
    for calls in traj.calls:
        rollout.run_calls(calls, path, duration, cfg, factor)
    video_id = model.config.video_token_id
    prefill = patches = decoded = 0
    for a, b in turn_spans(traj.roles):
        n_video = sum(t == video_id for t in traj.token_ids[:a])
        videos, seen = [], 0
        for p, g in traj.videos:          # the videos whose tokens lie before this turn
            seen += video_tokens(g, merge)
            if seen > n_video:
                break
            videos.append((p, g))
        part = rollout.Trajectory(traj.record_id, 0, traj.token_ids[:a], traj.roles[:a], traj.prompt_len, videos)
        batch = rollout.collate([part], model, pad_id)
        batch.pop("roles")
        cache = DynamicCache(config=model.config)
        out = model.model(**batch, cache=cache, use_cache=True)
        logits = model.lm_head(out.last_hidden_state[:, -1]).float()                  # (1, V)
        mask, next_pos = batch["attention_mask"], int(batch["position_ids"].max()) + 1
        prefill += a
        patches += sum(len(p) for p, _ in videos)
        for j, tok in enumerate(traj.token_ids[a:b]):
            float(torch.log_softmax(logits[0], -1)[tok])      # the per-token work ours does too
            if j == b - a - 1:
                break                                           # the stop token is never fed back
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
            pos = torch.full((3, 1, 1), next_pos, dtype=torch.long)
            next_pos += 1
            out = model.model(input_ids=torch.tensor([[tok]]), attention_mask=mask, position_ids=pos,
                              cache=cache, use_cache=True)
            logits = model.lm_head(out.last_hidden_state[:, -1]).float()
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
    cfg = rollout.RolloutConfig(tool_mode="interleaved", max_turns=args.turns - 1, max_new_tokens=128,
                                temperature=1.0, group_size=1, overview_nframes=args.overview_frames,
                                overview_max_pixels=args.size ** 2, crop_fps=2.0, crop_max_pixels=args.crop_size ** 2,
                                tools_block=False)
    counter = Counter()

    def ours():
        rollout.sample_tokens = Script([enc(t) for t in texts])
        return rollout.run_agent(model, processor, [rec], root, cfg, seed=0)[0]

    restore = counter.install()
    try:
        traj = ours()
    finally:
        restore()
    assert traj.n_tool_turns == args.turns - 1 and traj.answer == "A", "the scripted trajectory did not run"
    path = os.path.join(root, rec["video"])
    reencode = lambda: reencode_rollout(model, processor, traj, path, cfg)
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
    tok = processor.tokenizer
    ids = special_token_ids(processor)
    stop, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    cfg = rollout.RolloutConfig(temperature=0.0, group_size=1, overview_nframes=args.decode_frames,
                                overview_max_pixels=args.crop_size ** 2, tools_block=False)
    path = os.path.join(root, rec["video"])
    overview = rollout.load_overview(path, video.probe(path).duration, cfg, rollout.video_factor(processor),
                                     cfg.overview_nframes)
    records = [{**rec, "question": QUESTION + " Look carefully." * k} for k in range(batch_size)]   # lengths differ
    texts = [rollout.prompt_text(processor, r, False) for r in records]
    chunks = [rollout.encode_chunk(processor, t, [overview]) for t in texts]
    old_side = tok.padding_side
    tok.padding_side = "left"
    inputs = processor(text=texts, videos=[overview.frames] * batch_size, padding=True, return_tensors="pt",
                       videos_kwargs=dict(do_sample_frames=False, do_resize=False,
                                          video_metadata=[rollout.clip_metadata(overview)] * batch_size))
    tok.padding_side = old_side
    n = args.new_tokens
    rollout.sample_tokens = masked_greedy(stop)

    def ours():
        return one_turn(model, processor, chunks, 1, cfg, n, lambda i, s: 0)

    @torch.no_grad()
    def generate():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        return out[:, -n:].tolist()

    same = ours() == generate()
    wall, cpu = ab_times({"ours": ours, "generate": generate}, args.repeats)
    t_o, t_g = median(wall["ours"]), median(wall["generate"])
    return dict(batch=batch_size, new_tokens=n, ours_tok_s=batch_size * n / t_o, generate_tok_s=batch_size * n / t_g,
                ratio=t_g / t_o, cpu_ratio=median(cpu["generate"]) / median(cpu["ours"]), same_tokens=same)


# ----------------------------------------------------------------------------- 4. scale: group rollout vs generate

def scale_model(args):
    """A Qwen3-VL at the real per-token K/V ratios on a CPU budget: text hidden 1024, 8 KV heads x 128,
    vocab 151,936 (the embeddings resized past the tiny tokenizer), --scale-layers layers; tiny vision."""
    from model import ModelConfig, build_tiny
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
    ids = special_token_ids(processor)
    pad = ids["<|endoftext|>"]
    G, n = args.scale_group, args.scale_new_tokens
    with tempfile.TemporaryDirectory() as root:
        rec = make_video(root, args.scale_frames / 2, args.scale_size)
        cfg = rollout.RolloutConfig(temperature=0.7, top_p=1.0, group_size=G, overview_nframes=args.scale_frames,
                                    overview_max_pixels=args.scale_size ** 2, tools_block=False)
        path = os.path.join(root, rec["video"])
        overview = rollout.load_overview(path, video.probe(path).duration, cfg, rollout.video_factor(processor),
                                         cfg.overview_nframes)
        text = rollout.prompt_text(processor, rec, False) + rollout.THINK_PREFIX
        chunk = rollout.encode_chunk(processor, text, [overview])
        inputs = processor(text=[text], videos=[overview.frames], return_tensors="pt",
                           videos_kwargs=dict(do_sample_frames=False, do_resize=False,
                                              video_metadata=[rollout.clip_metadata(overview)]))

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
    before = rollout.STATS["decode_steps"]
    # the memory run: live tensor bytes, and the host syncs as they happen (both hooks slow: not the timed run)
    with LiveTensors() as live, runtime.HostSyncCounter("cpu") as syncs:
        fn()
    steps = rollout.STATS["decode_steps"] - before
    return dict(prompt_tokens=len(chunk.ids), peak_mb=live.mb, rss_mb=rss.mb, seconds=secs, tokens=sum(len(t) for t in toks),
                host_syncs_per_step=syncs.in_steps / steps if steps else None,
                host_syncs_outside_steps=syncs.count - syncs.in_steps if steps else None,
                weights_mb=sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20)


def bench_scale(args) -> dict:
    """Each side in its own process (so one side's freed memory cannot hide the other's peak), --scale-runs times:
    peak live tensor bytes (LiveTensors: the same in every run) and resident memory (PeakRSS: noisy), beyond the
    weights."""
    import subprocess
    import sys
    runs = []
    for _ in range(args.scale_runs):
        res = {}
        for side in ("ours", "hf"):
            cmd = [sys.executable, __file__, "--scale-side", side, "--threads", str(args.threads),
                   "--scale-layers", str(args.scale_layers), "--scale-frames", str(args.scale_frames),
                   "--scale-size", str(args.scale_size), "--scale-group", str(args.scale_group),
                   "--scale-new-tokens", str(args.scale_new_tokens)]
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
    """Stand-in for rollout.sample_tokens that keeps the real draw (seeded Gumbel-max, special tokens banned) but
    shapes each row's turns: the row with seed s writes turn k in exactly L_k tokens, L_k uniform in [lo, hi]
    (drawn from s); half the rows call the tool in their first turn (the call's tokens end it), then answer; every
    turn ends with <|im_end|>. A function of (seed, counter) alone, as the real sampler: every schedule gives
    every row the same tokens."""

    def __init__(self, sample, stop: int, special: list[int], call: list[int], lo: int, hi: int):
        self.sample, self.stop, self.special, self.call, self.lo, self.hi = sample, stop, torch.tensor(special), call, lo, hi
        self.plans = {}

    def plan(self, seed: int) -> list[tuple[int, bool]]:
        """[(the counter after turn k's last token, whether turn k calls the tool)]."""
        if seed not in self.plans:
            import random
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
    """(fn's result, peak MB of the tensors the engine allocates while it runs): LiveTensors over Engine.admit (the
    prefills, the pool) and Engine.step (decode, sampling), not over the tools and the processor (the clips' and
    overviews' pixels, which the trajectories keep for training)."""
    live, saved = LiveTensors(), (rollout.Engine.admit, rollout.Engine.step)

    def counted(method):
        def inside(self, *a):
            with live:
                return method(self, *a)
        return inside

    rollout.Engine.admit, rollout.Engine.step = counted(saved[0]), counted(saved[1])
    try:
        return fn(), live.mb
    finally:
        rollout.Engine.admit, rollout.Engine.step = saved


def bench_budget(args) -> dict:
    """--budget-prompts x --budget-group rows of a 1-tool-turn interleaved rollout whose turns take --budget-min to
    --budget-max tokens: all at once (unbounded budget), then under a budget of a quarter of that run's peak, by
    continuous batching and by fixed waves (the same budget; each turn waits for the wave's longest row). Memory:
    the peak of the tensors the engine allocates (`engine_memory`). The tiny model with --budget-layers layers, and
    the working sizes shrunk to the small budget (--budget-scores: SCORES_BUDGET, --budget-prefill: PREFILL_TOKENS,
    --budget-join: JOIN_PROMPT) so that the attention's slabs, a prefill's activations and the prompt copies stay a
    few % of it, as they are of a real budget, and the block (--budget-block: BLOCK) a few per turn, as a real
    run's 256-token blocks are of its 2,048-token turns (at 256 a 24-160-token turn would take a whole block, and
    the worst cases the scheduler admits on would be rounded up by up to 10x). `decode_steps`: the decode forwards
    of each schedule (the saving continuous batching makes, whatever a step costs)."""
    from model import ModelConfig, build_tiny
    torch.manual_seed(0)
    model, processor = build_tiny(ModelConfig(layers=args.budget_layers), corpus=rollout.prompt_corpus())
    model.eval()
    ids = special_token_ids(processor)
    tok = processor.tokenizer
    call = tok("\n</think>\n<tool_call>\n{\"name\": \"crop_video\", \"arguments\": {\"start_time\": 4.0, "
               "\"end_time\": 8.0}}\n</tool_call>", add_special_tokens=False)["input_ids"]
    planned = Planned(rollout.sample_tokens, ids["<|im_end|>"], sorted(tok.get_added_vocab().values()), call,
                      args.budget_min, args.budget_max)
    saved = kvcache.SCORES_BUDGET, kvcache.PREFILL_TOKENS, kvcache.BLOCK, kvcache.JOIN_PROMPT
    kvcache.SCORES_BUDGET, kvcache.PREFILL_TOKENS = args.budget_scores, args.budget_prefill
    kvcache.BLOCK, kvcache.JOIN_PROMPT = args.budget_block, args.budget_join
    steps = {}

    def counted(name, **kw):                            # the decode steps of one run of a schedule
        before = rollout.STATS["decode_steps"]
        out = run(**kw)
        steps[name] = rollout.STATS["decode_steps"] - before
        return out
    try:
        with tempfile.TemporaryDirectory() as root:
            rec = make_video(root, 32.0, 64)
            recs = [{**rec, "id": f"q{i}", "question": QUESTION + " Look carefully." * i} for i in range(args.budget_prompts)]
            base = dict(tool_mode="interleaved", max_turns=1, max_calls_per_turn=1, max_new_tokens=args.budget_max,
                        temperature=1.0, group_size=args.budget_group, overview_nframes=args.budget_frames,
                        overview_max_pixels=64 * 64, crop_fps=1.0, crop_max_frames=4, crop_max_pixels=64 * 64,
                        tools_block=False)
            run = lambda **kw: rollout.run_agent(model, processor, recs, root, rollout.RolloutConfig(**base, **kw), seed=0)
            rollout.sample_tokens = planned
            ref, unbounded_mb = engine_memory(lambda: run(memory_budget_bytes=1 << 40))
            budget = int(unbounded_mb * 2 ** 20) // 4
            cont, peak_mb = engine_memory(lambda: counted("continuous", memory_budget_bytes=budget))
            static, static_mb = engine_memory(lambda: counted("static", memory_budget_bytes=budget, continuous=False))
            wall, cpu = ab_times({"continuous": lambda: run(memory_budget_bytes=budget),
                                "static": lambda: run(memory_budget_bytes=budget, continuous=False)}, args.budget_repeats)
    finally:
        kvcache.SCORES_BUDGET, kvcache.PREFILL_TOKENS, kvcache.BLOCK, kvcache.JOIN_PROMPT = saved
        rollout.sample_tokens = planned.sample
    diff = max(abs(a - b) for other in (cont, static) for t, r in zip(other, ref) for a, b in zip(t.logprobs, r.logprobs))
    same = all(t.token_ids == r.token_ids for other in (cont, static) for t, r in zip(other, ref))
    tokens = sum(len(t.logprobs) for t in ref)
    turns = [n for t in ref for n in (b - a for a, b in turn_spans(t.roles))]
    return dict(rows=len(ref), tool_turns=sum(t.n_tool_turns for t in ref), sampled_tokens=tokens,
                turn_length_ratio=max(turns) / min(turns), budget_mb=budget / 2 ** 20, peak_mb=peak_mb,
                static_peak_mb=static_mb, unbounded_peak_mb=unbounded_mb, decode_steps=steps,
                steps_ratio=steps["static"] / steps["continuous"],
                static_tok_s=tokens / median(wall["static"]), continuous_tok_s=tokens / median(wall["continuous"]),
                speedup=median(wall["static"]) / median(wall["continuous"]),
                cpu_speedup=median(cpu["static"]) / median(cpu["continuous"]), max_logprob_diff=diff,
                exact=same and diff <= 1e-5)


# ----------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--overview-frames", type=int, default=128, help="overview frames (even)")
    p.add_argument("--size", type=int, default=128, help="frame side in pixels of the video and its overview")
    p.add_argument("--crop-size", type=int, default=64, help="frame side in pixels of crops (clips, sub-agents)")
    p.add_argument("--duration", type=float, default=64.0, help="video length, seconds (2 fps)")
    p.add_argument("--turns", type=int, default=4, help="assistant turns in the multi-turn trajectory")
    p.add_argument("--window", type=int, default=8, help="seconds per crop_video call")
    p.add_argument("--calls", type=int, default=5, help="parallel calls for the sub-agent bench")
    p.add_argument("--sub-tokens", type=int, default=48, help="tokens each sub-agent writes")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt in the decode bench")
    p.add_argument("--decode-frames", type=int, default=16,
                   help="overview frames (at --crop-size) in the decode bench's prompts: short, so decoding dominates")
    p.add_argument("--batch", type=int, default=4, help="prompts per batch in the decode bench (plus batch 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per side (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch default)")
    p.add_argument("--parts", default="1,2,3,4,5", help="which measurements to run, e.g. 1,3")
    p.add_argument("--scale-layers", type=int, default=2, help="scale bench: text layers (hidden 1024, 8 KV heads x 128)")
    p.add_argument("--scale-frames", type=int, default=128, help="scale bench: overview frames (2 frames -> 1 temporal patch)")
    p.add_argument("--scale-size", type=int, default=256, help="scale bench: frame side (256: 64 tokens per temporal patch)")
    p.add_argument("--scale-group", type=int, default=8, help="scale bench: group size G")
    p.add_argument("--scale-new-tokens", type=int, default=128, help="scale bench: tokens sampled per row (T = 0.7)")
    p.add_argument("--budget-prompts", type=int, default=20, help="budget bench: prompts (rows: prompts x group)")
    p.add_argument("--budget-group", type=int, default=4, help="budget bench: group size G")
    p.add_argument("--budget-frames", type=int, default=16, help="budget bench: overview frames (64x64)")
    p.add_argument("--budget-min", type=int, default=24, help="budget bench: fewest tokens of a turn")
    p.add_argument("--budget-max", type=int, default=160, help="budget bench: most tokens of a turn (max_new_tokens)")
    p.add_argument("--budget-repeats", type=int, default=3, help="budget bench: timed repeats per schedule")
    p.add_argument("--budget-layers", type=int, default=8, help="budget bench: text layers of the tiny model")
    p.add_argument("--budget-scores", type=int, default=2 ** 17, help="budget bench: kvcache.SCORES_BUDGET")
    p.add_argument("--budget-prefill", type=int, default=256, help="budget bench: kvcache.PREFILL_TOKENS")
    p.add_argument("--budget-block", type=int, default=32,
                   help="budget bench: kvcache.BLOCK (a turn of --budget-max tokens spans 5 blocks; the real run's 2,048 spans 8)")
    p.add_argument("--budget-join", type=int, default=2 ** 11, help="budget bench: kvcache.JOIN_PROMPT (2^17 / 64)")
    p.add_argument("--scale-runs", type=int, default=3, help="scale bench: runs of both sides (memory figures per run)")
    p.add_argument("--scale-side", choices=["ours", "hf"], help=argparse.SUPPRESS)   # internal: one side per process
    args = p.parse_args()
    if args.scale_side:
        print(json.dumps(scale_side(args.scale_side, args)))
        return
    threads = set_threads(args.threads)
    torch.manual_seed(0)
    model, processor = load_model("tiny", device="cpu", tiny_corpus=rollout.prompt_corpus())
    sampler = rollout.sample_tokens
    with tempfile.TemporaryDirectory() as root:
        rec = make_video(root, args.duration, args.size)
        parts = set(args.parts.split(","))
        try:
            mt = bench_multiturn(model, processor, root, rec, args) if "1" in parts else None
            sa = bench_subagents(model, processor, root, rec, args) if "2" in parts else None
            dec = [bench_decode(model, processor, root, rec, args, b) for b in sorted({1, args.batch})] if "3" in parts else []
            sc = bench_scale(args) if "4" in parts else None
            bu = bench_budget(args) if "5" in parts else None
        finally:
            rollout.sample_tokens = sampler

    print(f"tiny Qwen3-VL on CPU, {threads} thread(s); overview {args.overview_frames} frames at {args.size}x{args.size}, "
          f"crops at {args.crop_size}x{args.crop_size}; medians of {args.repeats} interleaved repeats")
    out = dict(threads=threads, overview_frames=args.overview_frames, size=args.size, crop_size=args.crop_size,
               repeats=args.repeats)
    targets = {}
    if mt:
        print("\n1. multi-turn interleaved rollout, cache reuse vs re-encoding every turn")
        print(table([["prefilled tokens", mt["ours_prefill_tokens"], mt["reencode_prefill_tokens"], mt["prefill_ratio"]],
                     ["vision patches", mt["ours_vision_patches"], mt["reencode_vision_patches"],
                      mt["reencode_vision_patches"] / mt["ours_vision_patches"]],
                     ["decoded tokens", mt["ours_decode_tokens"], mt["reencode_decode_tokens"], 1.0],
                     ["wall s", mt["ours_s"], mt["reencode_s"], mt["speedup"]],
                     ["cpu s", mt["ours_cpu_s"], mt["reencode_cpu_s"], mt["cpu_speedup"]]],
                    ["", "ours", "re-encode", "ratio"]))
        out["multiturn"] = mt
        targets.update(prefill_ratio_ge_2=mt["prefill_ratio"] >= 2, multiturn_speedup_ge_1_5=mt["speedup"] >= 1.5)
    if sa:
        print(f"\n2. {sa['calls']} sub-agents x {sa['tokens_each']} tokens: batched vs one at a time "
              f"(same tokens: {sa['same_tokens']})")
        print(table([["wall s", sa["batched_s"], sa["serial_s"], sa["speedup"]]], ["", "batched", "serial", "ratio"]))
        print(f"cpu ratio {sa['cpu_speedup']:.3g}")
        out["subagents"] = sa
        targets["subagent_speedup_ge_2"] = sa["speedup"] >= 2
    if dec:
        print(f"\n3. decode loop vs model.generate, {args.new_tokens} new tokens per prompt, greedy")
        print(table([[d["batch"], d["ours_tok_s"], d["generate_tok_s"], d["ratio"], d["cpu_ratio"], d["same_tokens"]]
                     for d in dec], ["batch", "ours tok/s", "generate tok/s", "ratio", "cpu ratio", "same tokens"]))
        out["decode"] = {f"batch{d['batch']}": d for d in dec}
        targets["decode_ratio_ge_1"] = all(d["ratio"] >= 1 for d in dec)
    if sc:
        print(f"\n4. scale: one prompt of {sc['prompt_tokens']} tokens, group {sc['group']}, {sc['new_tokens']} tokens "
              f"per row at T = 0.7; text hidden 1024, {sc['layers']} layers, 8 KV heads x 128, vocab 151,936 "
              f"(weights {sc['weights_mb']:.0f} MB, not counted)")
        print(table([["peak live tensor MB (beyond weights)", sc["ours_peak_mb"], sc["hf_peak_mb"], sc["memory_ratio"]],
                     ["peak RSS MB (beyond weights)", sc["ours_rss_mb"], sc["hf_rss_mb"], sc["rss_ratio_runs"][-1]],
                     ["tokens/s", sc["ours_tok_s"], sc["hf_tok_s"], sc["speedup"]]],
                    ["", "ours", "generate(num_return_sequences)", "ratio"]))
        print(f"memory ratio per run: live tensors {sc['memory_ratio_runs']}, RSS {sc['rss_ratio_runs']}")
        print(f"host syncs per decode step (measured, runtime.HostSyncCounter): {sc['host_syncs_per_step']}; outside "
              f"the steps (the prefill; on the CPU host-side reads too): {sc['host_syncs_outside_steps']}")
        out["scale"] = {k: sc[k] for k in ("group", "prompt_tokens", "ours_peak_mb", "hf_peak_mb", "memory_ratio",
                                           "memory_ratio_runs", "memory_ratio_spread", "ours_rss_mb", "hf_rss_mb",
                                           "rss_ratio_runs", "ours_tok_s", "hf_tok_s", "speedup", "host_syncs_per_step",
                                           "host_syncs_outside_steps")}
        targets.update(scale_memory_ratio_ge_4=sc["memory_ratio"] >= 4, scale_speedup_ge_1_5=sc["speedup"] >= 1.5,
                       scale_host_syncs_le_1=sc["host_syncs_per_step"] <= 1,
                       scale_memory_runs_within_5pct=sc["memory_ratio_spread"] <= 0.05)
    if bu:
        print(f"\n5. budget: {bu['rows']} rows, turns of {args.budget_min}-{args.budget_max} tokens (longest / shortest "
              f"{bu['turn_length_ratio']:.1f}), {bu['tool_turns']} tool turns; budget {bu['budget_mb']:.1f} MB = a quarter "
              f"of the unbounded run's peak; exact: {bu['exact']} (log-probs within {bu['max_logprob_diff']:.2g})")
        print(table([["peak live tensor MB", bu["unbounded_peak_mb"], bu["peak_mb"], bu["static_peak_mb"]],
                     ["tokens/s", None, bu["continuous_tok_s"], bu["static_tok_s"]],
                     ["decode steps", None, bu["decode_steps"]["continuous"], bu["decode_steps"]["static"]]],
                    ["", "unbounded", "budget: continuous", "budget: fixed waves"]))
        print(f"continuous / waves: {bu['speedup']:.3g}x wall time, {bu['cpu_speedup']:.3g}x CPU time")
        out["budget"] = bu
        targets.update(budget_le_quarter=bu["budget_mb"] <= bu["unbounded_peak_mb"] / 4,
                       budget_peak_le_1_1=bu["peak_mb"] <= 1.1 * bu["budget_mb"],
                       budget_speedup_ge_1_3=bu["speedup"] >= 1.3, budget_exact=bu["exact"])
    print_json({**out, "targets": targets})


if __name__ == "__main__":
    main()
