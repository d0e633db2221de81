"""The GPU plan on paper: one RL step of ParaVT's and of Video-o3's recipe on H200s, projected from first
principles (no GPU needed; pure arithmetic, prints a table and, last, one JSON line).

    python bench/plan.py                       # both recipes, Qwen3-VL-8B shapes, 141 GB GPUs (H200)
    python bench/plan.py --hbm-gb 80           # the same on 80 GB GPUs (H100)
    python bench/plan.py --roles roles.json    # with the code's coefficients as bench/roles.py measured them here
    python bench/plan.py --shared-prefix 0     # what the step would cost without the shared prompt cache

Memory per GPU, part by part (`memory_parts`, which bench/rehearsal.py evaluates at its own sizes beside its
measurements): the fp32 master weights sharded by FSDP, the rollout's all-gathered bf16 copy, ParaVT's bf16
reference, AdamW's two fp32 moments, fp32 gradient shards; the K/V in pool blocks of kvcache.BLOCK tokens (144 KiB
a token on 8B; with the shared prompt cache a group stores its prompt once, each row its suffix; a ParaVT sub-agent
is a sequence pair of its own); what a training forward keeps for backward under gradient checkpointing, for the
micro-batch policy.micro_batches forms at the recipe's lengths (`update_rows`: one unpadded row by default); the
backward's peak (the gradient shards and the largest of a recomputed decoder layer, a recomputed vision block and
FSDP2's root reduce-scatter, or the lm_head's backward if larger: the fused gather's grad W in fp32 beside a chunk's
buffers, then the gradient FSDP2 reduce-scatters); the loss's forward (one (V, C) logits buffer, ops' chunk rule).
Time: decode is bound by HBM bandwidth (4.8 TB/s at --hbm-efficiency: a step reads the weights once plus every
row's visible K/V, the shared prompt once per group, and the engine's attention writes ROLES' kv_written_per_read
bytes per K/V byte (its fp32 slabs), each read once more); prefill and training by bf16 FLOPs (989 TFLOP/s at --mfu: 2 N
a token forward, 8 N with backward under checkpointing, plus attention), the reference and old-policy forwards 2 N
a token each where the recipe needs them. The rollout runs under the engine's memory budget (--rollout-memory-gb;
default HBM - the bf16 weights - --workspace-gb): a GPU's groups run in `waves` of as many as fit side by side with
their whole worst cases; the engine admits at least this much (its banker's rule, docs/method.md §8), so the decode
time is an upper bound. `prompts` are the papers' prompts per step over all GPUs. ParaVT reports ~250 s a step on 8
GPUs (docs/method.md §5); efficiencies are assumptions, printed with the table.

Beside the colocated synchronous step (rollout on all 8 GPUs, then the update on all 8), each recipe's asynchronous
layout (`project(..., layout=(R, T))`, RECIPES' `layout`): the same prompts' groups over R rollout GPUs (more groups
a GPU: more waves under the same budget), the same tokens' update over T FSDP2 GPUs. A rollout GPU holds the
sampler's weights (ROLES: 2 bytes a parameter, policy.sampler_model) and its K/V, and where the KL is in the reward
(ParaVT) the bf16 reference and its k1 forwards over every row (collect_groups), which the trainers then skip; no
fp32 shards, AdamW or gradients; its default budget is HBM - what it holds - workspace. Rank 0 deals each trainer
its share of the step's items over gloo (ROLES' bytes a visual token) before their update. In steady state with staleness >= 1, step t+1's rollout runs
beside step t's update, and the bf16 weights (2 B a parameter) travel as async_rl.py sends them: rank 0 gathers
them to its host (FSDP2's full state dict) and a rollout GPU loads them from its host, each a copy at
--host-copy-gbps (an assumed 10 GB/s) on its side's path, while gloo carries them host to host at --gloo-gbps
beside both sides' work: step = max(rollout on R + copy, update on T + copy, gloo send); staleness 0 would add
them all. ParaVT's layout is its release's
(AReaL async: 1 rollout GPU + 7 trainers, max_head_offpolicyness 2); Video-o3's is ASSUMED (verl fully_async's
usual 4 + 4, one step off; the Video-o3-Qwen3VL repository's RL scripts run verl's hybrid engine colocated on 8
GPUs with rollout.mode=async, asynchronous within the rollout only: its release's step is the colocated one).
Printed: both layouts' rows, the busy fractions (rollout_s and update_s over the step) and the speed-up sync / async.
"""
import argparse
import json
import math

from common import table  # bench/common.py (puts the repo on sys.path: kvcache's block, ops' chunk rule)

import kvcache
import ops
import recipes
import policy

QWEN3VL_8B = dict(layers=36, d_model=4096, q_dim=32 * 128, kv_dim=8 * 128, mlp=12288, vocab=151936,
                  params=8.2e9, text_params=7.6e9, params_head=151936 * 4096, params_root=151936 * 4096 + 0.6e9,
                  params_vision=0.6e9, vision_width=1152, vision_depth=27, vision_mlp=4304, vision_taps=3,
                  head_dim=128)
KV_BYTES_PER_TOKEN = 36 * 8 * 128 * 2 * 2          # layers x kv_heads x head_dim x (K, V) x bf16
PARAMS, TEXT_PARAMS = QWEN3VL_8B["params"], QWEN3VL_8B["text_params"]   # text: the decoder (what a token reads)
LAYERS, D_MODEL = QWEN3VL_8B["layers"], QWEN3VL_8B["d_model"]
PATCHES_PER_TOKEN = 4                               # a visual token merges 2 x 2 patches (each 2 frames x 16 x 16)
PATCH_VALUES = 3 * 2 * 16 * 16                      # pixel values of one patch
HBM_BW, BF16_FLOPS, HBM_GB = 4.8e12, 989e12, 141
HOST_COPY_GBPS = 10            # assumed effective rate of a GPU's weights to or from its host (gather, load), GB/s
GLOO_GBPS = 1.08               # the weights over gloo between two processes, GB/s (GLOO_NOTE)
GLOO_NOTE = ("measured 12-07 by bench/async_bench.py's gloo_weights on this project's 2-core CPU machine, 1 GB in "
             "256 MiB buckets; a GPU server's host is likely faster")
# The code's own coefficients, measured by bench/roles.py (`--roles FILE` reads its JSON); without it these, its
# figures of 12-07 (2-core CPU, torch 2.14.1, --precision bf16), printed as fallbacks. tests/test_plan.py fails when
# the code's measurement and these differ by more than 15 %.
ROLES = dict(
    rollout_bytes_per_param=2.0,       # a rollout rank's resident weights (policy.sampler_model: bf16, no autocast copies)
    trainer_bytes_per_param=16.0,      # a trainer's fp32 weights, gradients, AdamW moments (/ T under FSDP2)
    send_copy_bytes_per_param=2.0,     # what crosses to rank 0's host a version (async_rl.full_state: cast on device)
    send_host_bytes_per_param=2.0,     # one version's host buckets in flight (async_rl.broadcast_weights)
    message_bytes_per_visual_token=12566.0,   # a trainer's share of a step's items (deal_groups), bf16 pixels
    kv_written_per_read=6.7,           # bytes a decode step's attention writes per bf16 K/V byte it reads (fp32 slabs)
)
ROLES_NOTE = "fallbacks: bench/roles.py's figures of 12-07 (2-core CPU, torch 2.14.1, bf16)"

RECIPES = {
    # prompts per step (global), group, overview tokens, tool rounds, tokens per assistant turn, tokens a
    # tool response adds to the context per round (clips in interleaved mode, summaries for sub-agents); the
    # asynchronous layout (rollout GPUs, trainer GPUs) and its off-policy bound in steps: ParaVT's release, AReaL's
    # async mode (1 rollout GPU, 7 FSDP2 GPUs, max_head_offpolicyness 2); Video-o3's ASSUMED: verl fully_async's
    # usual 4 + 4, one step off (the module docstring)
    "ParaVT": dict(gpus=8, prompts=7, group=8, overview_tokens=64 * 256 // 2, rounds=3, turn_tokens=2048,
                   response_tokens=300, subagent_tokens=512, subagent_calls=3, calls=3, ref_forward=True,
                   kl_in_reward=True, layout=(1, 7), offpolicy=2, layout_note="release: AReaL async"),
    "Video-o3": dict(gpus=8, prompts=32, group=16, overview_tokens=16384, rounds=6, turn_tokens=1024,
                     response_tokens=2048, subagent_tokens=0, subagent_calls=0, calls=5, ref_forward=False,
                     kl_in_reward=False, layout=(4, 4), offpolicy=1, layout_note="ASSUMED: verl fully_async's 4 + 4"),
}


def kv_bytes_per_token(m: dict) -> int:
    """K and V of one token over all layers, bf16."""
    return m["layers"] * m["kv_dim"] * 2 * 2


def loss_chunk(n: int, dim: int, vocab: int) -> int:
    """The rows of the losses' logits buffer (ops.token_logprobs with chunk_size None): ops' own chunk rule
    (`_auto_chunk`, shrunk to the next power of two >= n), or n when its plain path runs (the whole (n, V) logits)."""
    if n * vocab <= ops._MIN_CHUNK_LOGITS:
        return n
    return min(ops._auto_chunk(n, dim, vocab), 1 << max(n - 1, 0).bit_length())


def memory_parts(m: dict, gpus: int, prompts: float, rows: float, overview_tokens: float, suffix_tokens: float,
                 flight_tokens: float, flight_patches: float, policy_tokens: int, shared: bool = True,
                 reference: bool = False, subagents: float = 0, subagent_prompt: float = 0,
                 subagent_tokens: float = 0, compiled: bool = True, temperature: float = 0.7) -> dict:
    """Bytes per GPU of each part of an RL step (the module docstring), for model shape `m` (QWEN3VL_8B's keys).
    prompts / rows: this GPU's prompt groups and rows in the rollout at once, of overview_tokens and suffix_tokens;
    subagents alive at once, of subagent_prompt and subagent_tokens; flight_tokens / flight_patches / policy_tokens:
    one training micro-batch's; compiled: the loss's chunk kernels under torch.compile (CUDA's default; eager, the
    CPU's, keeps fp32 (V, C) temporaries: two in the forward, five in the backward, one fewer each at T = 1)."""
    P, D, V = m["params"], m["d_model"], m["vocab"]
    chunk = loss_chunk(int(policy_tokens), D, V)
    W = m["vision_width"]
    blocks = lambda tokens: math.ceil(tokens / kvcache.BLOCK)
    kv_blocks = ((prompts if shared else rows) * blocks(overview_tokens) + rows * blocks(suffix_tokens)
                 + subagents * (blocks(subagent_prompt) + blocks(subagent_tokens)))
    layer = flight_tokens * 2 * (2 * m["q_dim"] + 4 * m["kv_dim"] + 4 * m["mlp"] + 6 * D)
    block = flight_patches * 2 * (6 * W + 2 * m["vision_mlp"])
    stream = 2 if gpus > 1 else 4        # the text residual stream: bf16 params under FSDP2; fp32 under autocast
    kept_weights = (2 * (m["params_root"] + m["params_head"]) if gpus > 1     # FSDP2: these units stay gathered
                    else 2 * (P - m["params_root"] - m["params_head"] + m["params_vision"]))  # autocast's bf16 casts
    stream_acts = (flight_tokens * (D * (stream * (m["layers"] + 2) + 4) + 2 * m["head_dim"] * stream)
                   + flight_patches * 2 * (W * (m["vision_depth"] + 4 + 3 * m["vision_taps"]) + PATCH_VALUES))
    root_reduce = 4 * m["params_root"] - stream_acts if gpus > 1 else 0
    n, divides = int(policy_tokens), temperature != 1.0
    # the lm_head's backward: fp32 grad W beside a chunk's temporaries (or its bf16 GEMM), then the gradient handed
    # on: FSDP2's bf16 grad, unsharded copy and fp32 reduce-scatter buffer (8 B/param); one process, bf16 + fp32 cast
    kernel = (V * D * 4 + max(V * chunk * (2 + (0 if compiled else (4 + divides) * 4)), V * chunk * 2 + V * D * 2)
              + n * D * 2)
    head_backward = max(kernel, V * D * (8 if gpus > 1 else 6))
    return dict(
        weights_shard=4 * P / gpus,
        weights_rollout=2 * P if gpus > 1 else 0.0,     # one process: the rollout computes from its fp32 weights
        reference=2 * P if reference else 0.0,
        optimizer=8 * P / gpus,
        grads=4 * P / gpus,
        kv=kv_blocks * kvcache.BLOCK * kv_bytes_per_token(m),
        activations=kept_weights + stream_acts,
        backward=max(max(layer, block, root_reduce) + 4 * (P - m["params_head"]) / gpus, head_backward),
        loss=(2 * 4 * n * V if n * V <= ops._MIN_CHUNK_LOGITS
              else V * chunk * (2 + (0 if compiled else (1 + divides) * 4))),
    )


def update_rows(lengths: list[int], micro_batch: int, micro_batch_tokens: int) -> int:
    """Rows in flight in the RL update: the largest micro-batch policy.micro_batches forms from rows of these
    lengths (in order) under --micro-batch and --micro-batch-tokens."""
    return max([sl.stop - sl.start for sl in policy.micro_batches(lengths, micro_batch, micro_batch_tokens)] + [0])


def waves(groups_gpu: float, group_kv: float, budget: float) -> tuple[int, int]:
    """(concurrency, waves): how many prompt groups the budget admits at once (at least one: a group that does
    not fit alone is refused by the engine, so `fits` is false then), and how many rounds a GPU's groups take."""
    fit = max(1, int(budget // group_kv))
    groups = max(1, math.ceil(groups_gpu))
    return min(fit, groups), math.ceil(groups / fit)


def engine_time(steps: float, turns: float, calls: int, ops_per_layer_step: float = 0, launch_us: float = 10,
                tool_s: float = 0, workers: int = 8, overlap: bool = False) -> tuple[float, float, float]:
    """(host seconds of the decode steps, tool seconds on `workers` threads, seconds the decoding stalls on tools) per
    GPU: each step launches ops_per_layer_step x LAYERS ops of launch_us each (rollout_bench's gpu_shape measures the
    count); `turns` tool turns of `calls` crops of tool_s each (crop + processor, rollout_bench measures it). Tools in
    the decode loop stall every row for a turn's calls, min(calls, workers) at a time; overlapped, none."""
    host = steps * ops_per_layer_step * LAYERS * launch_us * 1e-6
    work = turns * calls * tool_s
    return host, work / workers, 0.0 if overlap else work / min(calls, workers)


def project(name: str, r: dict, shared: bool, mfu: float, hbm_eff: float, decode_batch_eff: float,
            workspace_gb: float, budget_gb: float | None, micro_batch: int = 8, micro_batch_tokens: int = 16384,
            tools: dict | None = None, layout: tuple[int, int] | None = None,
            host_copy_gbps: float = HOST_COPY_GBPS, gloo_gbps: float = GLOO_GBPS, roles: dict | None = None,
            hbm_gb: float = HBM_GB) -> dict:
    """One recipe's step on GPUs of `hbm_gb` (H200: 141; H100: 80). tools: the engine's host side (`engine_time`'s
    keywords; None: none counted). roles: the code's coefficients (ROLES, bench/roles.py). layout: None, colocated on
    r["gpus"] (rollout, then update); (R, T), the asynchronous split: the rollout's groups over R GPUs that hold the
    sampler's weights (roles' bytes a parameter), the reference where the KL is in the reward (ParaVT: the rollout
    computes k1, with its policy and reference forwards over every row), and their K/V; the update's rows over T
    FSDP2 GPUs, each trainer's share of the step's items dealt from rank 0 over gloo; the new weights sent to the
    rollout GPUs each step (a copy to and from a host on each side's path, the gloo send beside both); with
    r["offpolicy"] >= 1 the two sides and the send overlap."""
    roles = {**ROLES, **(roles or {})}
    G, P = r["group"], r["prompts"]
    R, T = layout or (r["gpus"], r["gpus"])
    rows = P * G
    rows_gpu = rows / R                                                 # the rollout's rows and groups per GPU
    prompts_gpu = P / R
    suffix = r["rounds"] * (r["turn_tokens"] + r["response_tokens"]) + r["turn_tokens"]
    seq = r["overview_tokens"] + suffix                                # tokens of one trajectory
    weights = PARAMS * 2
    kl_rollout = bool(layout) and r["kl_in_reward"]          # the rollout GPUs compute the KL: the reference is theirs
    held = (roles["rollout_bytes_per_param"] * PARAMS + (2 * PARAMS if kl_rollout else 0)) if layout else weights
    # the rollout budget and the waves it implies: one group = its prompt (once, or G times unshared) + G suffixes
    budget = (budget_gb * 2 ** 30) if budget_gb else hbm_gb * 2 ** 30 - held - workspace_gb * 2 ** 30
    sub_prompt = r["response_tokens"] * 2 if r["subagent_tokens"] else 0        # a clip prompt: ~2 summaries' worth
    # a group's K/V: its prompt, its rows' suffixes and one turn's sub-agents of every row (the engine's worst case)
    group_kv = ((1 if shared else G) * r["overview_tokens"] + G * suffix
                + G * r["subagent_calls"] * (sub_prompt + r["subagent_tokens"])) * KV_BYTES_PER_TOKEN
    concurrency, n_waves = waves(prompts_gpu, group_kv, budget)
    # memory per GPU, part by part (memory_parts): the rollout holds the resident state, the full bf16 weights and
    # the K/V of the groups in flight (a rollout GPU of a layout: the bf16 weights and K/V alone, no fp32 shards,
    # AdamW, gradients or reference); the update the resident state and one micro-batch in flight: the rows
    # policy.micro_batches forms from this GPU's rows (all of length seq: no padding), a prompt's rows sharing its
    # overview's vision pass (collate share_videos)
    prompt_copies = concurrency if shared else concurrency * G
    sub = r["subagent_calls"] * concurrency * G if r["subagent_tokens"] else 0   # one turn's sub-agents, every row
    flight = update_rows([seq] * math.ceil(rows / T), micro_batch, micro_batch_tokens)
    policy = flight * (r["rounds"] + 1) * r["turn_tokens"]
    patches = PATCHES_PER_TOKEN * (math.ceil(flight / G) * r["overview_tokens"]
                                   + flight * (0 if r["subagent_tokens"] else r["rounds"] * r["response_tokens"]))
    parts = memory_parts(QWEN3VL_8B, T, concurrency, concurrency * G, r["overview_tokens"], suffix, flight * seq,
                         patches, policy, shared, r["ref_forward"] and not kl_rollout, sub, sub_prompt,
                         r["subagent_tokens"])
    kv = parts["kv"]
    resident = parts["weights_shard"] + parts["optimizer"] + parts["reference"]
    mem_rollout = ((held + kv) if layout else (resident + parts["weights_rollout"] + kv)) / 2 ** 30 + workspace_gb
    mem_train = (resident + parts["grads"] + parts["activations"] + max(parts["loss"], parts["backward"])) / 2 ** 30
    # rollout time: prefill (FLOPs) + decode (bandwidth), per GPU
    attn = lambda n_tokens, ctx: 4 * LAYERS * D_MODEL * n_tokens * ctx
    prefill_tokens = (prompts_gpu if shared else rows_gpu) * r["overview_tokens"] + rows_gpu * r["rounds"] * r["response_tokens"]
    prefill_flops = 2 * TEXT_PARAMS * prefill_tokens + attn(prefill_tokens, r["overview_tokens"] / 2)
    decode_tokens_row = (r["rounds"] + 1) * r["turn_tokens"]
    steps = decode_tokens_row * n_waves                                 # a wave's rows decode together
    kv_read_per_step = ((prompt_copies * r["overview_tokens"]) + concurrency * G * suffix / 2) * KV_BYTES_PER_TOKEN
    # the engine's attention writes kv_written_per_read bytes (its fp32 slabs) per bf16 byte it reads, each read again
    kv_traffic = kv_read_per_step * (1 + 2 * roles["kv_written_per_read"])
    decode_s = steps * (TEXT_PARAMS * 2 + kv_traffic) / (HBM_BW * hbm_eff) / decode_batch_eff
    sub_s = 0.0
    if r["subagent_tokens"]:                                            # sub-agents: one batched generation per round
        sub_s = n_waves * r["rounds"] * r["subagent_tokens"] * (TEXT_PARAMS * 2) / (HBM_BW * hbm_eff) / decode_batch_eff
    sub_steps = n_waves * r["rounds"] * r["subagent_tokens"]             # sub-agents: one batched generation a round
    host_s, tool_s, stall_s = engine_time(steps + sub_steps, rows_gpu * r["rounds"], r["calls"], **(tools or {}))
    device_s = decode_s + sub_s
    decode_s_host = max(device_s, host_s)        # a step's kernel launches overlap the device's work, not the reverse
    rollout_s = prefill_flops / (BF16_FLOPS * mfu) + (max(decode_s_host, tool_s) if tools and tools.get("overlap")
                                                      else decode_s_host + stall_s)
    # the KL in the reward on the rollout GPUs: the policy's and the reference's forwards over every row they sampled
    kl_s = 2 * (2 * TEXT_PARAMS * rows_gpu * seq + attn(rows_gpu * seq, seq / 2)) / (BF16_FLOPS * mfu) \
        if kl_rollout else 0.0
    rollout_s += kl_s
    # update: old/ref forwards + forward/backward with checkpointing over every token of every row
    train_tokens = rows / T * seq
    fwd = 2 * TEXT_PARAMS * train_tokens + attn(train_tokens, seq / 2)
    update_s = (fwd * 4 + fwd * (1 + (r["ref_forward"] and not kl_rollout))) / (BF16_FLOPS * mfu)
    out = dict(recipe=name, gpus=R + T if layout else R, rows=rows, seq_tokens=seq, update_rows=flight,
               budget_gb=budget / 2 ** 30, group_kv_gb=group_kv / 2 ** 30, concurrency=concurrency, waves=n_waves,
               kv_gb_per_gpu=kv / 2 ** 30, mem_rollout_gb=mem_rollout, mem_train_gb=mem_train,
               fits=group_kv <= budget and mem_rollout < hbm_gb and mem_train < hbm_gb, hbm_gb=hbm_gb,
               rollout_headroom_gb=hbm_gb - mem_rollout, train_headroom_gb=hbm_gb - mem_train, kl_s=kl_s,
               rollout_s=rollout_s, update_s=update_s, step_s=rollout_s + update_s, decode_device_s=device_s,
               decode_host_s=host_s, tool_s=tool_s, tool_stall_s=stall_s,
               parts_gb={k: v / 2 ** 30 for k, v in parts.items()})
    if layout:        # steady state: step t+1's rollout beside step t's update and the last version's send
        copy_s = roles["send_copy_bytes_per_param"] * PARAMS / (host_copy_gbps * 1e9)
        send_s = roles["send_host_bytes_per_param"] * PARAMS / (gloo_gbps * 1e9)
        # a step's items: each group's videos (its overview once, its rows' clips), a trainer's share dealt from rank
        # 0, which sends the T - 1 other shares over gloo before their update
        clip_tokens = r["subagent_calls"] * sub_prompt if r["subagent_tokens"] else r["response_tokens"]
        group_visual = r["overview_tokens"] + G * r["rounds"] * clip_tokens
        message = P * group_visual * roles["message_bytes_per_visual_token"]
        message_s = message * (T - 1) / T / (gloo_gbps * 1e9)
        step_s = (max(rollout_s + copy_s, update_s + copy_s + message_s, send_s) if r["offpolicy"] >= 1
                  else rollout_s + update_s + 2 * copy_s + send_s + message_s)
        out.update(rollout_gpus=R, trainer_gpus=T, offpolicy=r["offpolicy"], copy_s=copy_s, send_s=send_s,
                   message_gb_per_trainer=message / T / 1e9, message_s=message_s, step_s=step_s)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shared-prefix", type=int, default=1, help="1: one K/V copy of each prompt per group (GroupKV)")
    p.add_argument("--mfu", type=float, default=0.4, help="fraction of bf16 peak reached by prefill and training")
    p.add_argument("--hbm-efficiency", type=float, default=0.7, help="fraction of HBM bandwidth reached by decode")
    p.add_argument("--decode-batch-efficiency", type=float, default=0.8,
                   help="decode slowdown from ragged rows and the host loop (1 = none)")
    p.add_argument("--workspace-gb", type=float, default=10.0,
                   help="per-GPU memory kept for activations, logits and the allocator beside weights and K/V")
    p.add_argument("--rollout-memory-gb", type=float, default=None,
                   help="the rollout's K/V budget per GPU (train.py's flag); default: HBM - bf16 weights - workspace")
    flags = recipes.parse_train_args([])                        # train.py's defaults (the one place they live)
    p.add_argument("--micro-batch", type=int, default=flags.micro_batch, help="train.py's flag: rows per training forward")
    p.add_argument("--micro-batch-tokens", type=int, default=flags.micro_batch_tokens,
                   help="train.py's flag: padded tokens per training forward")
    p.add_argument("--ops-per-layer-step", type=float, default=59.5, help="torch ops a decode step launches per layer "
                   "(measured 12-06 by rollout_bench.py's gpu_shape, `deep`: 64 rows of 8 groups at 36 layers, video "
                   "prompts read once each, two attention calls and the merge; one call: 39.0; before layers.py: "
                   "161.5 at 2 layers); 0: host time not counted")
    p.add_argument("--tool-s", type=float, default=0.97, help="seconds of one crop call of a 720p file, decode + "
                   "processor (measured on the 2-core CPU: 5 parallel crops 4.85 s); 0: tools not counted")
    p.add_argument("--tool-workers", type=int, default=8, help="threads per GPU that run the crops")
    p.add_argument("--tools-overlap", type=int, default=1, help="1: tools run beside the decoding; 0: in its loop")
    p.add_argument("--host-copy-gbps", type=float, default=HOST_COPY_GBPS, help="assumed GB/s of a GPU's bf16 "
                   "weights to its host (rank 0's gather) or from it (a rollout GPU's load)")
    p.add_argument("--gloo-gbps", type=float, default=GLOO_GBPS, help="GB/s of the weights over gloo from rank 0 to "
                   "a rollout rank (" + GLOO_NOTE + ")")
    p.add_argument("--roles", metavar="FILE", help="bench/roles.py's JSON (--out): the code's coefficients; "
                   "default: its figures of 12-07, printed as fallbacks")
    p.add_argument("--hbm-gb", type=float, default=HBM_GB, help="GPU memory in GB (H200: 141; H100: 80)")
    p.add_argument("--parts", metavar="JSON", help="print memory_parts' bytes for each keyword set of a JSON list (the "
                   "8B shape, its keys overridden by a set's 'model') and exit")
    return p


def load_roles(path: str | None) -> tuple[dict, str]:
    """(the coefficients, where they come from): bench/roles.py's JSON at `path`, else ROLES (fallbacks)."""
    if not path:
        return dict(ROLES), ROLES_NOTE
    with open(path) as f:
        measured = json.load(f)
    missing = sorted(set(ROLES) - set(measured))
    if missing:
        raise SystemExit(f"plan.py --roles {path}: no {', '.join(missing)} (write it with bench/roles.py --out)")
    return {k: float(measured[k]) for k in ROLES}, f"measured: {path}"


def exact_mode(r: dict, row: dict, mfu: float, hbm_eff: float, decode_batch_eff: float) -> dict:
    """The exact mode's step (--set exact_policy=1, ops.py §4) beside the fast one's `row` (`project`'s, colocated):
    every GEMM on tiles of ops.EXACT_ROWS rows reads the layer's weights once a tile, so a decode step of a wave's rows
    reads the bf16 weights ceil(rows / EXACT_ROWS) times, and prefill and the update run at the larger of their FLOPs
    (at `mfu`) and their tiles' weight reads (at `hbm_eff`); the attention writes its fp32 scores (s, then e^(s - M),
    each written and read: 16 bytes a score and head) instead of a fused kernel's tiles. The update's loss forward,
    its recompute and its backward (two GEMMs a forward GEMM) are the exact forward's; the reference's forward stays
    the fast one; the pi_old recompute it skips is none here (ppo_epochs 1). Sub-agents and the K/V traffic as fast."""
    G, seq = r["group"], row["seq_tokens"]
    heads = QWEN3VL_8B["q_dim"] // QWEN3VL_8B["head_dim"]
    gemm = lambda tokens, passes: passes * max(2 * TEXT_PARAMS * tokens / (BF16_FLOPS * mfu),
                                               math.ceil(tokens / ops.EXACT_ROWS) * 2 * TEXT_PARAMS / (HBM_BW * hbm_eff))
    scores = lambda tokens, ctx, passes: passes * LAYERS * tokens * ctx * heads * 16 / (HBM_BW * hbm_eff)
    tiles = math.ceil(row["concurrency"] * G / ops.EXACT_ROWS)          # a wave's rows, in tiles
    decode_extra = (tiles - 1) * 2 * TEXT_PARAMS / (HBM_BW * hbm_eff) / decode_batch_eff
    steps = (r["rounds"] + 1) * r["turn_tokens"] * row["waves"]
    prompts_gpu, rows_gpu = r["prompts"] / r["gpus"], row["rows"] / r["gpus"]
    prefill_tokens = prompts_gpu * r["overview_tokens"] + rows_gpu * r["rounds"] * r["response_tokens"]
    fast_prefill = 2 * TEXT_PARAMS * prefill_tokens / (BF16_FLOPS * mfu)
    rollout_s = (row["rollout_s"] + steps * decode_extra - fast_prefill + gemm(prefill_tokens, 1)
                 + scores(prefill_tokens, r["overview_tokens"] / 2, 1))
    train_tokens = row["rows"] / r["gpus"] * seq
    fast_loss = 4 * 2 * TEXT_PARAMS * train_tokens / (BF16_FLOPS * mfu)     # forward, recompute, backward (x2)
    update_s = row["update_s"] - fast_loss + gemm(train_tokens, 4) + scores(train_tokens, seq / 2, 4)
    return dict(rollout_s=rollout_s, update_s=update_s, step_s=rollout_s + update_s, decode_tiles=tiles,
                slowdown=(rollout_s + update_s) / row["step_s"])


def settings(args: argparse.Namespace) -> dict:
    """`project`'s keywords from the command line's flags (tests/test_plan.py projects with the defaults' too)."""
    return dict(roles=load_roles(args.roles)[0], hbm_gb=args.hbm_gb, shared=bool(args.shared_prefix), mfu=args.mfu,
                hbm_eff=args.hbm_efficiency, decode_batch_eff=args.decode_batch_efficiency, workspace_gb=args.workspace_gb,
                budget_gb=args.rollout_memory_gb, micro_batch=args.micro_batch,
                micro_batch_tokens=args.micro_batch_tokens, host_copy_gbps=args.host_copy_gbps, gloo_gbps=args.gloo_gbps,
                tools=dict(ops_per_layer_step=args.ops_per_layer_step, tool_s=args.tool_s, workers=args.tool_workers,
                           overlap=bool(args.tools_overlap)))


def main() -> None:
    args = parser().parse_args()
    if args.parts:
        print(json.dumps([memory_parts({**QWEN3VL_8B, **kw.pop("model", {})}, **kw) for kw in json.loads(args.parts)]))
        return
    kw = settings(args)
    rows = [project(n, r, **kw) for n, r in RECIPES.items()]
    for r in rows:                      # the exact mode's step beside the fast one
        r["exact"] = exact_mode(RECIPES[r["recipe"]], r, kw["mfu"], kw["hbm_eff"], kw["decode_batch_eff"])
    split = {n: project(n + " async", r, layout=r["layout"], **kw) for n, r in RECIPES.items()}
    for r in rows:                      # the asynchronous layout beside the colocated synchronous step
        a = split[r["recipe"]]
        r["async"] = dict(rollout_gpus=a["rollout_gpus"], trainer_gpus=a["trainer_gpus"], offpolicy=a["offpolicy"],
                          note=RECIPES[r["recipe"]]["layout_note"], rollout_s=a["rollout_s"], update_s=a["update_s"],
                          copy_s=a["copy_s"], send_s=a["send_s"], step_s=a["step_s"], sync_step_s=r["step_s"],
                          speedup=r["step_s"] / a["step_s"], rollout_busy=a["rollout_s"] / a["step_s"],
                          trainer_busy=a["update_s"] / a["step_s"], concurrency=a["concurrency"], waves=a["waves"],
                          mem_rollout_gb=a["mem_rollout_gb"], mem_train_gb=a["mem_train_gb"], fits=a["fits"],
                          rollout_headroom_gb=a["rollout_headroom_gb"], train_headroom_gb=a["train_headroom_gb"],
                          budget_gb=a["budget_gb"], group_kv_gb=a["group_kv_gb"], kl_s=a["kl_s"],
                          message_gb_per_trainer=a["message_gb_per_trainer"], message_s=a["message_s"])
    head = ["recipe", "GPUs", "rows", "tokens/row", "update rows", "budget GB", "group KV GB", "groups x waves", "KV GB/GPU",
            "rollout GB/GPU", "train GB/GPU", f"fits {args.hbm_gb:g} GB", "rollout s", "update s", "step s"]
    cells = [[r["recipe"], f"{r['rollout_gpus']}+{r['trainer_gpus']}" if "rollout_gpus" in r else r["gpus"], r["rows"],
              r["seq_tokens"], r["update_rows"], f"{r['budget_gb']:.1f}", f"{r['group_kv_gb']:.1f}",
              f"{r['concurrency']} x {r['waves']}", f"{r['kv_gb_per_gpu']:.1f}", f"{r['mem_rollout_gb']:.1f}",
              f"{r['mem_train_gb']:.1f}", r["fits"], f"{r['rollout_s']:.0f}", f"{r['update_s']:.0f}", f"{r['step_s']:.0f}"]
             for r in rows + list(split.values())]
    roles, source = load_roles(args.roles)
    print(f"{args.hbm_gb:g} GB GPUs; H200 rates: {HBM_BW / 1e12:.1f} TB/s at {args.hbm_efficiency:.0%}, "
          f"{BF16_FLOPS / 1e12:.0f} bf16 TFLOP/s at MFU {args.mfu:.0%}; Qwen3-VL-8B, {KV_BYTES_PER_TOKEN // 1024} KiB KV "
          f"per token; shared prefix: {bool(args.shared_prefix)}. ParaVT reports ~250 s per step on 8 GPUs.")
    print(f"The code's coefficients ({source}): " + ", ".join(f"{k} {v:g}" for k, v in roles.items()))
    print(table(cells, head))
    print(f"Asynchronous layouts (R rollout GPUs + T trainer GPUs), steady state with staleness >= 1: step = "
          f"max(rollout on R + copy, update on T + copy + message, send): the weights copied to or from a host at an "
          f"assumed {args.host_copy_gbps:g} GB/s on each side, sent over gloo at {args.gloo_gbps:g} GB/s beside "
          "both; each trainer's share of the items dealt by rank 0 over gloo; a rollout GPU holds the sampler's "
          "weights, the reference where the KL is in the reward (ParaVT: its forwards in the rollout), and its K/V.")
    print(table([[r["recipe"], f"{a['rollout_gpus']}+{a['trainer_gpus']}", a["offpolicy"], f"{a['rollout_s']:.0f}",
                  f"{a['kl_s']:.0f}", f"{a['update_s']:.0f}", f"{a['copy_s']:.1f}", f"{a['send_s']:.1f}",
                  f"{a['message_gb_per_trainer']:.2f}", f"{a['message_s']:.1f}", f"{a['step_s']:.0f}",
                  f"{a['sync_step_s']:.0f}", f"{a['speedup']:.2f}x", f"{a['rollout_busy']:.0%}",
                  f"{a['trainer_busy']:.0%}", f"{a['mem_rollout_gb']:.1f} ({a['rollout_headroom_gb']:+.1f})",
                  f"{a['mem_train_gb']:.1f} ({a['train_headroom_gb']:+.1f})", a["fits"], a["note"]]
                 for r in rows for a in [r["async"]]],
                ["recipe", "R+T", "off-policy", "rollout s", "of it KL s", "update s", "copy s", "send s",
                 "msg GB/trainer", "msg s", "async step s", "sync step s", "speed-up", "rollout busy", "trainer busy",
                 "rollout GB (headroom)", "train GB (headroom)", "fits", "layout"]))
    print(f"The exact mode (--set exact_policy=1: GEMMs on {ops.EXACT_ROWS}-row tiles, unfused fp32 attention "
          "scores), colocated, beside the fast step:")
    print(table([[r["recipe"], f"{r['rollout_s']:.0f}", f"{r['exact']['rollout_s']:.0f}", f"{r['update_s']:.0f}",
                  f"{r['exact']['update_s']:.0f}", f"{r['step_s']:.0f}", f"{r['exact']['step_s']:.0f}",
                  f"{r['exact']['slowdown']:.1f}x", r["exact"]["decode_tiles"]] for r in rows],
                ["recipe", "rollout s", "exact rollout s", "update s", "exact update s", "step s", "exact step s",
                 "slowdown", "decode tiles"]))
    rnd = lambda v: (round(v, 2) if isinstance(v, float) else {k: rnd(x) for k, x in v.items()}
                     if isinstance(v, dict) else v)
    print(json.dumps({"shared_prefix": bool(args.shared_prefix), "mfu": args.mfu, "hbm_efficiency": args.hbm_efficiency,
                      "hbm_gb": args.hbm_gb, "roles": roles, "roles_source": source,
                      "recipes": {r["recipe"]: {k: rnd(v) for k, v in r.items() if k != "recipe"} for r in rows}}))


if __name__ == "__main__":
    main()
