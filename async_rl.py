"""
Rollout and training side by side: the asynchronous mode of the papers' releases (ParaVT trains with AReaL's, rollout
on 1 GPU beside FSDP2 on 7; Video-o3 with verl's asynchronous multi-turn rollout), with a staleness bound and
AReaL's decoupled PPO objective (grpo.grpo_token_terms; docs/method.md §5.1), or its weight truncated (--set
rollout_correction=tis) or masked by sequence (mis) instead (§5.2).

    python train.py --gpus 8 --async-staleness 1 --rollout-ranks 1 --model CKPT ...   # 1 rollout rank, 7 trainers
    python train.py --gpus 3 --device cpu --async-staleness 1 --rollout-ranks 1      # the same on CPU (gloo)

--async-staleness 0 (the default) never enters this file: train.run_rl, the synchronous loop.

The layout (`Layout`). Of W ranks the last R roll out and the first W - R train: FSDP2 over their own mesh, rank 0
(a trainer) logs and saves. Beside the world, three process groups: `trainers` (FSDP2, the update's sums, the
checkpoints), and two gloo groups of rank 0 and the rollout ranks: `sync` (the weight broadcast) and `mail` (the
steps' groups). The SFT warm start and every held-out evaluation run on all W ranks, as in a synchronous run; the
RL stage builds its two models from the SFT's last checkpoint (or --resume's, or --model).

The schedule. Version v = the weights after v updates (the RL step that made them). Step u's groups may be sampled
by a version v >= u - 1 - eta (the staleness bound; AReaL's max_head_offpolicyness eta; eta = 0 is the synchronous
loop). The rollout takes v = max(start, u - 1 - eta), the oldest version the bound allows: it waits for no update
it does not need, and a step's samples come from the same version on every run, whatever the timings. Every send
is asynchronous and every receive waits only for what its rank needs next:

    trainers:  recv groups u | update u | send v = u (in flight) | recv groups u + 1 | update u + 1 ...
    rollout:   take v = w - 1 - eta | sample w | send groups w (in flight) | take v = w - eta | sample w + 1 ...

so the rollout runs up to eta steps ahead of the update and waits only on a version the bound needs, and the
trainers wait only on the groups of the step they train. With eta = 1 the two sides meet at every step (step u + 1
is sampled during update u with v = u - 1, and step u + 2 needs v = u); with eta = 2 (ParaVT's release) a step's
jitter on either side is absorbed by the other's queue. No rank waits on one that waits on it: a version is sent
after the update that needs only earlier groups, a step's groups after the version that the bound needs. A group
is held, not split: one version samples it from its first token to its last (a weight update never lands inside a
trajectory: its earlier turns' K/V stay the policy's that extends them, and each behaviour log-prob is one
policy's); Trajectory.versions records the version of each turn.

Messages. Rollout rank -> rank 0: a step's kept items (trajectories with their behaviour log-probs, advantages,
reward components) and its rollout figures, one pickled object (`send_groups`); rank 0 deals each trainer its share
of the items, point to point over the trainers' gloo group (`deal_groups`: host memory, only the share reaches a
trainer, the pixels in the rollout model's dtype: bf16 under --precision bf16). Weights: the trainers gather the
full weights parameter by parameter, each cast to the compute dtype on its device and copied to rank 0's host
(`full_state`: bf16 on GPU, half the bytes of the fp32 masters; fp32 in a CPU fp32 run, so the rollout samples from
the trainers' weights bit for bit); rank 0 copies them into host buckets of BUCKET_BYTES and broadcasts each over
`sync` without waiting (`broadcast_weights`); a rollout rank keeps the next version's receive posted into its host
buckets and copies them into its model when it takes the version (`load_weights`); no files. Both go over gloo, on
the host, even on GPU runs: asynchronous at both ends with no NCCL collective pending on a GPU stream beside the
rollout's kernels. Rank 0 holds at most eta + 1 versions in flight, each the model's size in the compute dtype on
its host (16 GB for an 8B model in bf16); gloo sends them while the trainers update.

Events. A crash loses the groups in flight (checkpoints are the trainers', atomic, every --save-every updates). On
--resume the trainers load the last checkpoint and send it as version `start`; steps start+1.. are drawn again
(grpo.draw_prompts is seeded by the step). A rollout rank that raises ends the run with its rank named (the
launcher stops the others); a trainer whose rollout rank died raises naming the rank it waited on.
"""
import copy
import dataclasses
import datetime
import pickle
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import eval as evaluation
import grpo
import policy
import runtime

BUCKET_BYTES = 256 * 2 ** 20       # one weight broadcast's size at most (a larger parameter goes alone)


@dataclasses.dataclass
class Layout:
    """Who does what in an asynchronous run: ranks 0 .. world - rollout_ranks - 1 train, the rest roll out."""
    world: int
    rollout_ranks: int
    trainers: object = None        # process group of the trainers
    deal: object = None            # gloo group of the trainers: rank 0 deals each its share of a step's items
    sync: object = None            # gloo group of rank 0 and the rollout ranks: the weight broadcast
    mail: object = None            # gloo group of rank 0 and the rollout ranks: the steps' groups

    @property
    def n_trainers(self) -> int:
        return self.world - self.rollout_ranks

    @property
    def rollout(self) -> list[int]:
        return list(range(self.n_trainers, self.world))

    def is_rollout(self, rank: int) -> bool:
        return rank >= self.n_trainers


def make_layout(world: int, rollout_ranks: int, timeout_s: float | None = None) -> Layout:
    """The layout and its four process groups (every rank calls this, in the same order), each wait in them limited
    to `timeout_s` (the run's; None: torch's 30 minutes)."""
    if not 1 <= rollout_ranks < world:
        raise ValueError(f"async_rl: {rollout_ranks} rollout ranks of {world}: need at least one of each kind")
    kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    layout = Layout(world, rollout_ranks)
    layout.trainers = dist.new_group(list(range(layout.n_trainers)), **kw)
    layout.deal = dist.new_group(list(range(layout.n_trainers)), backend="gloo", **kw)   # host memory: no GPU copy
    layout.sync = dist.new_group([0] + layout.rollout, backend="gloo", **kw)   # host tensors, beside NCCL on GPU runs
    layout.mail = dist.new_group([0] + layout.rollout, backend="gloo", **kw)
    return layout


# -----------------------------------------------------------------------------
# weights: trainers -> rollout ranks, in buckets over the process group

def buckets(shapes: list[tuple[str, torch.Size]], element_bytes: int, limit: int = BUCKET_BYTES) -> list[list]:
    """Consecutive runs of (name, shape) of at most `limit` bytes each (a larger tensor alone): both sides of a
    broadcast cut the same parameter list the same way."""
    out, size = [], limit
    for name, shape in shapes:
        n = shape.numel() * element_bytes
        if size + n > limit:
            out.append([])
            size = 0
        out[-1].append((name, shape))
        size += n
    return out


@dataclasses.dataclass
class Transfer:
    """One version's weight broadcast in flight: its works, its bucket tensors (alive until the works are done), the
    (name, shape) runs each bucket holds, the bytes per rank."""
    works: list
    flats: list
    cut: list
    bytes: int

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def broadcast_weights(model, full: dict | None, group, dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES,
                      into: list | None = None) -> Transfer:
    """Rank 0's weights onto every rank of `group` (gloo), without waiting on either side: `full` (name -> full
    tensor, rank 0: the trainers' weights) is copied bucket by bucket into flat host tensors of `dtype` and each is
    broadcast asynchronously, so the trainers go on to the next update while gloo's thread sends it; the other
    ranks (full None) post the receives into host buckets (`into`: the last version's, reused) and take the
    version with `load_weights` when they need it. The parameter list is model.named_parameters() on both sides
    (tied weights once). Host tensors over gloo, not NCCL: both ends stay asynchronous without a collective
    pending on a GPU stream beside the rollout's kernels and graphs, and rank 0's weights are on its host already
    (`full_state`: cast to `dtype` on the device, then copied)."""
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    cut = buckets(shapes, torch.empty(0, dtype=dtype).element_size(), bucket_bytes)
    pin = full is None and next(model.parameters()).is_cuda        # the receiver's host-to-device copy from pinned
    works, flats = [], []
    for k, bucket in enumerate(cut):
        if full is not None:          # a copy (cat), so the next update may change the weights while this sends
            flat = torch.cat([full[n].detach().reshape(-1).to("cpu", dtype) for n, _ in bucket])
        elif into is not None:
            flat = into[k]
        else:
            flat = torch.empty(sum(s.numel() for _, s in bucket), dtype=dtype, pin_memory=pin)
        works.append(dist.broadcast(flat, src=0, group=group, async_op=True))
        flats.append(flat)
    return Transfer(works, flats, cut, sum(f.numel() * f.element_size() for f in flats))


def load_weights(model, transfer: Transfer) -> None:
    """A receiver takes the version `transfer` brings: waits for each bucket, copies it into the parameters."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for work, flat, bucket in zip(transfer.works, transfer.flats, transfer.cut):
            work.wait()
            offset = 0
            for n, s in bucket:
                params[n].copy_(flat[offset:offset + s.numel()].view(s))
                offset += s.numel()


def full_state(model, n_trainers: int, dtype: torch.dtype) -> dict | None:
    """The trainers' full weights in `dtype` on rank 0's host (None on the other trainers), parameter by parameter:
    each all-gathered on its device (an FSDP2 shard's DTensor.full_tensor(): every trainer joins, in the same order),
    cast to `dtype` there, then copied to the host. A GPU holds one full parameter at a time beside its shards, and
    the host copy carries 2 bytes a parameter in bf16 (FSDP2's full state dict would copy the fp32 masters to host
    memory and leave the cast to the CPU, on the trainers' path). A single trainer's own parameters, cast."""
    from torch.distributed.tensor import DTensor
    rank0 = n_trainers == 1 or dist.get_rank() == 0
    full = {}
    for n, p in model.named_parameters():
        t = p.detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if rank0:
            full[n] = t.to(dtype).to("cpu")
    return full if rank0 else None


def weight_dtype(s) -> torch.dtype:
    """The weight broadcast's dtype: the compute dtype (bf16 on GPU, fp32 in a CPU fp32 run)."""
    return policy.PRECISION[s.precision]


# -----------------------------------------------------------------------------
# groups: rollout ranks -> rank 0 -> the trainers

def send_object(obj, dst: int, group) -> list:
    """One pickled object to rank `dst` over `group` (its size, then its bytes), without waiting: returns the pending
    sends with their tensors (keep them until done)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return [(dist.isend(size, dst=dst, group=group), size), (dist.isend(payload, dst=dst, group=group), payload)]


def receive_object(src: int, group):
    """The object `send_object` sent from rank `src` over `group` (waits for it)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(payload, src=src, group=group)
    return pickle.loads(payload.numpy().tobytes())


def send_groups(message: dict, group) -> list:
    """A rollout rank's step to rank 0 over `group`, without waiting (`send_object`: keep the sends until done)."""
    return send_object(message, 0, group)


def receive_groups(src: int, step: int, group=None) -> dict:
    """Rank 0 receives rollout rank `src`'s step over `group`; a rank that died is named, not waited on forever."""
    try:
        message = receive_object(src, group)
    except RuntimeError as e:
        raise RuntimeError(f"rank 0 lost rollout rank {src} while waiting for RL step {step}'s groups (it died or "
                           f"failed: see its error): {e}") from e
    if message["step"] != step:
        raise RuntimeError(f"rank 0 expected RL step {step}'s groups from rollout rank {src}, got step {message['step']}")
    return message


def deal_groups(messages: list | None, rank: int, n_trainers: int, group) -> list:
    """Rank 0 (holding the step's `messages`) deals the kept items to the trainers point to point over `group` (gloo:
    host memory; a trainer's GPU sees only the share its update collates): trainer r gets items[r n / T:(r + 1) n / T]
    of the step's n, in the order one rank would train them. Returns this trainer's share. A broadcast of every item
    over the trainers' NCCL group would land every pixel on every trainer's GPU."""
    if rank != 0:
        return receive_object(0, group)
    items = [it for m in messages for it in m["items"]]
    shares = [items[r * len(items) // n_trainers:(r + 1) * len(items) // n_trainers] for r in range(n_trainers)]
    sends = [x for r in range(1, n_trainers) for x in send_object(shares[r], r, group)]
    for work, _ in sends:
        work.wait()
    return shares[0]


# -----------------------------------------------------------------------------
# the two loops

def rollout_loop(run, layout: Layout, model, ref_model, processor, job: grpo.RLJob) -> None:
    """A rollout rank: for each step u, take versions until it holds max(start, u - 1 - eta), sample the step's
    groups of this rank's share (grpo.collect_groups, the R rollout ranks splitting the prompts as ranks do), stamp
    each turn with the version and send them to rank 0 without waiting; then take the last versions (the final
    evaluation reads them). A held-out evaluation runs after each version v with v % eval_every == 0, on every rank.
    Raises naming this rank on any failure (the launcher then stops the others)."""
    s, start, steps = job.s, job.start, job.s.rl_steps
    index, version = layout.rollout.index(run.rank), start - 1
    cfg = dataclasses.replace(job.cfg, record_logprobs=True)        # the behaviour log-probs of the decoupled loss
    share = copy.copy(run)                                     # collect_groups' view: this rank among the rollout ranks
    share.rank, share.world = index, layout.rollout_ranks
    by_id, idle_from = {str(r["id"]): r for r in job.records}, time.time()
    posted, outbox = None, []        # the next version's receive, posted; sends to rank 0 in flight, with their tensors

    def next_version():
        nonlocal version, posted
        load_weights(model, posted)                 # waits only if the trainers have not sent this version yet
        version += 1
        if s.eval_every and job.evaluate is not None and version > start and version % s.eval_every == 0:
            job.evaluate(model, f"rl-{version:06d}")
        if version < steps:                         # the next version lands in the same host buckets meanwhile
            posted = broadcast_weights(model, None, layout.sync, weight_dtype(s), into=posted.flats)

    try:
        posted = broadcast_weights(model, None, layout.sync, weight_dtype(s))
        next_version()                                           # version `start`: the trainers' weights now
        for u in range(start + 1, steps + 1):
            while version < max(start, u - 1 - s.async_staleness):
                next_version()
            t0, last_idle = time.time(), idle_from
            model.eval()
            g = grpo.collect_groups(share, model, ref_model, processor, job.records, job.video_root, cfg, s, u,
                                    processor.tokenizer.pad_token_id, job.pool)
            for t in g.trajs:
                for x in [t] + t.subagents:
                    x.versions = [version] * max(1, len(x.turns))
            run.sampled(g.trajs, u, start, s.group_size)
            n, figures = evaluation.rollout_figures(g, by_id)
            rollout_s, idle_from = time.time() - t0, time.time()       # idle from here to the next sampling
            outbox = [(w, x) for w, x in outbox if not w.is_completed()] + send_groups(
                {"step": u, "version": version, "items": g.items, "n": n, "groups": g.n_groups,
                 "draws": g.draws, "bad": sum(t.error is not None for t in g.trajs), "figures": figures,
                 "tokens": sum(len(t.token_ids) for t in g.trajs), "rollout_s": rollout_s,
                 "rollout_wait_s": t0 - last_idle}, layout.mail)
            grpo.prefetch(job, processor, run.seed, index, layout.rollout_ranks, u + 1)   # decoded while it waits
        while version < steps:
            next_version()
        for w, _ in outbox:
            w.wait()
    except Exception as e:
        raise RuntimeError(f"rollout rank {run.rank} failed at policy version {version}: {e}") from e


def trainer_loop(run, layout: Layout, model, ref_model, processor, optimizer, job: grpo.RLJob) -> None:
    """A trainer rank (`run`: the trainers' Run, its group and world): send version `start`; then for each step u:
    take its groups (rank 0 receives them from every rollout rank and deals the items over the trainers), the
    decoupled PPO update (grpo.policy_update over the trainers' group), the step's row and checkpoint, send version
    u without waiting, and evaluate every `eval_every` steps on every rank."""
    s, start, steps = job.s, job.start, job.s.rl_steps
    n_trainers, trainer0 = layout.n_trainers, run.rank == 0
    t_row, in_flight = time.time(), []         # in_flight: rank 0's version broadcasts not yet done

    def send_version():
        nonlocal in_flight
        full = full_state(model, n_trainers, weight_dtype(s))           # every trainer joins the gather
        if trainer0:
            in_flight = [x for x in in_flight if not x.done()] + [broadcast_weights(model, full, layout.sync,
                                                                                     weight_dtype(s))]

    send_version()
    for u in tqdm(range(start + 1, steps + 1), desc="rl async", disable=not trainer0, initial=start, total=steps):
        t = time.time()                                        # rank 0: step u's groups from every rollout rank
        messages = [receive_groups(src, u, layout.mail) for src in layout.rollout] if trainer0 else None
        wait_s = time.time() - t                               # rank 0's time waiting on the rollout
        if n_trainers > 1:                                     # each trainer its share, point to point
            mine = deal_groups(messages, run.rank, n_trainers, layout.deal)
        else:
            mine = [it for m in messages for it in m["items"]]
        lr = policy.set_lr(optimizer, policy.get_lr(u - 1, steps, s.lr, s.warmup_steps, s.min_lr_ratio))
        model.train()
        t1 = time.time()
        gn, stats = grpo.policy_update(run, model, ref_model, optimizer, mine, job, u, processor)
        update_s = time.time() - t1
        stats = runtime.all_mean({**stats, "update_s": update_s}, n_trainers, layout.trainers)
        if trainer0:
            versions = sorted({v for m in messages for t, _, _ in m["items"] for v in t.versions})
            run.counters["bad_samples"] += sum(m["bad"] for m in messages)
            update = {"trajectories": sum(m["n"] for m in messages), **stats, "wait_s": wait_s,
                      "kept": sum(len(m["items"]) for m in messages),
                      "lr": lr, "grad_norm": float("nan") if gn is None else gn,
                      "draws": max(m["draws"] for m in messages), "policy_version": min(m["version"] for m in messages),
                      "trained_versions": versions, "staleness": u - 1 - min(m["version"] for m in messages),
                      "rollout_s": max(m["rollout_s"] for m in messages),
                      "rollout_wait_s": max(m["rollout_wait_s"] for m in messages), "step_time": time.time() - t_row,
                      "tokens_per_s": sum(m["tokens"] for m in messages) / max(1e-9, time.time() - t_row)}
            row = evaluation.step_row([(m["n"], m["figures"]) for m in messages], update,
                                      sum(m["groups"] for m in messages))
            run.log("rl", u, row)
            tqdm.write(f"rl {u}/{steps} | R {row['reward']:.3f} | acc {row['accuracy']:.2f} | tool "
                       f"{row['tool_call_ratio']:.2f} | version {row['policy_version']} (staleness {row['staleness']}) | "
                       f"update {update_s:.1f}s wait {wait_s:.1f}s | {row['step_time']:.1f}s")
        t_row = time.time()
        saved = u % run.save_every == 0 or u == steps
        if saved:
            run.save("rl", u, model, optimizer)
        send_version()
        if s.eval_every and job.evaluate is not None and u % s.eval_every == 0:
            result = job.evaluate(model, f"rl-{u:06d}")          # every rank: the rollout ranks hold version u too
            run.evaluated("rl", u, result, model, optimizer, saved)
    for x in in_flight:                                        # the rollout ranks take the last versions
        x.wait()
    model.eval()


def run_rl(run, layout: Layout, processor, job: grpo.RLJob, device):
    """The RL stage of an asynchronous run on this rank: its model (job.model_source's architecture; a trainer:
    FSDP2 over the trainers' mesh, its weights loaded from job.checkpoint when given; a rollout rank: unsharded, its
    weights the trainers' first broadcast, held in the compute dtype), the reference on the side that computes the
    recipe's KL (job.reference builds it), then its loop. Returns the model (the final evaluation's)."""
    s, rollout_rank = job.s, layout.is_rollout(run.rank)
    if rollout_rank:                          # samples only: compute-dtype weights, no gradients (policy.sampler_model)
        model, _ = policy.sampler_model(job.model_source, device, s.precision, run.seed)
    else:
        model, _ = policy.policy_model(job.model_source, device, s.precision, 1, run.seed, s.grad_checkpointing)
    ref_model = job.reference() if grpo.uses_reference(s, rollout_rank) else None   # only where the KL is computed
    if rollout_rank:
        rollout_loop(run, layout, model, ref_model, processor, job)
        return model
    trun = copy.copy(run)                                      # the trainers' view of the run: its group and size
    trun.world, trun.group = layout.n_trainers, layout.trainers
    if layout.n_trainers > 1:
        from torch.distributed.device_mesh import DeviceMesh
        runtime.shard_model(model, policy.PRECISION[s.precision], DeviceMesh.from_group(layout.trainers, device.type))
    if job.checkpoint is not None:
        runtime.load_train_state(job.checkpoint, model, None, layout.trainers)
    optimizer = policy.make_optimizer(model, s.lr, s.vision_lr_scale)
    trun.load_optimizer(job.checkpoint, model, optimizer, job.state, "rl")     # AdamW's moments when resuming RL
    trainer_loop(trun, layout, model, ref_model, processor, optimizer, job)
    return model
