"""
The run and its processes: everything a training run needs around the method, none of the method itself
(nanochat's common + checkpoint manager). train.py calls these; eval.py uses the distributed helpers.

    Run                     a run directory as the loops see it: metrics rows, counters kept across resumes,
                            atomic checkpoints, --keep-last pruning, the best-by-eval checkpoint, skip-and-count
    checkpoints             save_checkpoint / load_train_state (torch.distributed.checkpoint + a Hugging Face
                            export), checkpoints / latest_checkpoint / prune_checkpoints, truncate_metrics
    curves                  plot_run: RUN_DIR/curves.png from metrics.jsonl
    processes               setup_distributed (gloo on CPU, nccl on CUDA), shard_model (FSDP2), full_weights,
                            all_sum / all_sums / all_max / all_mean / all_gather_objects / barrier,
                            gather_objects / broadcast_object, die_with_parent, launch(main, args)
    the run directory lock  RunLock, stale_run

Layout of a run directory: metrics.jsonl, curves.png, best.json, ckpt-<stage>-<step>/ (model.safetensors +
config + processor, train_state/ (DCP), trainer.pt), eval/, report/, .lock.
"""
import contextlib
import ctypes
import datetime
import fcntl
import functools
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import model as model_lib
import recipes
import rollout

# -----------------------------------------------------------------------------
# the run directory as the loops see it

STAGE_ORDER = {"sft": 0, "rl": 1}


class Run:
    """A run directory as the loops see it: metrics rows, counters kept across resumes, atomic checkpoints
    (torch.distributed.checkpoint for model + optimizer, resumable on any number of ranks, and a Hugging Face
    export of the weights beside it), --keep-last pruning, the best-by-eval checkpoint, skip-and-count."""

    def __init__(self, run_dir: str, rank: int, world: int, seed: int, save_every: int, keep_last: int,
                 strict: bool, max_bad_fraction: float, report_to: str = "none", export_dtype: torch.dtype | None = None,
                 group=None, max_grad_norm: float = recipes.TINY["max_grad_norm"]):
        self.run_dir, self.rank, self.world, self.seed = run_dir, rank, world, seed
        self.group = group                           # the ranks that train and save (None: all; async_rl.py's trainers)
        self.export_dtype = export_dtype             # the Hugging Face export's dtype (None: the parameters')
        self.save_every, self.keep_last, self.strict = save_every, keep_last, strict
        self.max_bad_fraction, self.max_grad_norm = max_bad_fraction, max_grad_norm
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.counters = {"skipped_steps": 0, "bad_samples": 0}
        self.failed = 0                              # RL samples failed since this process started (`sampled`)
        self.static, self.best, self.warned, self.processor = {}, None, set(), None
        self.tracker = make_tracker(report_to, run_dir) if rank == 0 else None
        os.makedirs(run_dir, exist_ok=True)

    def log(self, stage: str, step: int, row: dict) -> None:
        """One JSON line per step, flushed at once (a killed run loses at most the step in flight)."""
        if self.rank != 0:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"stage": stage, "step": step, **row, **self.counters, **self.static}) + "\n")
        if self.tracker is not None:
            self.tracker(stage, step, row)

    def optimizer_step(self, model, optimizer, loss: torch.Tensor, stage: str, step: int, sample_ids: list) -> float:
        """Clip to norm max_grad_norm and step; a non-finite loss or gradient skips the step (counted), or raises
        with --strict. Returns the gradient norm (nan when skipped)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            msg = f"non-finite loss/grad at {stage} step {step} (samples {sample_ids[:8]})"
            if self.strict:
                raise FloatingPointError(msg)
            print0(self.rank, "skipped:", msg)
            self.counters["skipped_steps"] += 1
            optimizer.zero_grad(set_to_none=True)
            return float("nan")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)                      # .item() sync, once per step

    def warn_sample(self, traj, step: int) -> None:
        if traj.error is not None and traj.record_id not in self.warned:
            self.warned.add(traj.record_id)
            tqdm.write(f"skipped sample {traj.record_id} (rl step {step}, rank {self.rank}): {traj.error}")

    def sampled(self, trajs: list, step: int, start: int, group_size: int) -> None:
        """Count an RL step's failed samples (bad_samples; `failed` since `start`): each group's first failure
        warned once; past max_bad_fraction of the samples (after 5 steps) a RuntimeError, so a run never dies on
        one bad sample nor goes on when most fail. Both RL loops (train.run_rl, async_rl.rollout_loop)."""
        n_bad = sum(t.error is not None for t in trajs)
        self.counters["bad_samples"] += n_bad
        self.failed += n_bad
        for t in trajs[::group_size]:
            self.warn_sample(t, step)
        if self.failed > self.max_bad_fraction * (step - start) * max(1, len(trajs)) and step - start > 5:
            raise RuntimeError(f"more than {self.max_bad_fraction:.0%} of samples failed by step {step}: "
                               f"see the skipped-sample messages above")

    def save(self, stage: str, step: int, model, optimizer) -> str:
        path = save_checkpoint(self.run_dir, step, model, self.processor, optimizer,
                               {"stage": stage, "counters": self.counters}, rank=self.rank, world=self.world,
                               export_dtype=self.export_dtype, group=self.group)
        if self.rank == 0 and self.keep_last > 0:
            prune_checkpoints(self.run_dir, self.keep_last)
        return path

    def resume(self, ckpt: str, model) -> dict:
        """The trainer state of `ckpt` and its master weights (train_state/, fp32 where training keeps fp32 weights;
        the Hugging Face export may be bf16); metrics after it are dropped."""
        state = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=True)   # tensors and plain data only
        load_train_state(ckpt, model, None, self.group)
        self.counters.update(state.get("counters", {}))
        torch.set_rng_state(state["rng_torch"])
        random.setstate(state["rng_random"])
        if self.rank == 0:
            truncate_metrics(self.metrics_path, state["stage"], state["step"])
        self.best = read_best(self.run_dir)
        print0(self.rank, f"resumed from {ckpt} ({state['stage']} step {state['step']})")
        return state

    def load_optimizer(self, ckpt: str | None, model, optimizer, state: dict | None, stage: str) -> None:
        """AdamW's moments from the checkpoint's distributed state, when it was saved in this stage."""
        if ckpt and state and state["stage"] == stage:
            load_train_state(ckpt, model, optimizer, self.group)

    def is_best(self, result: dict) -> bool:
        score = eval_score(result)
        return score is not None and (self.best is None or score > self.best[1])

    def mark_best(self, stage: str, step: int, result: dict) -> None:
        self.best = (f"ckpt-{stage}-{step:06d}", eval_score(result))
        if self.rank == 0:
            atomic_write_json(os.path.join(self.run_dir, "best.json"), {"checkpoint": self.best[0], "eval": result})

    def evaluated(self, stage: str, step: int, result: dict, model, optimizer, saved: bool) -> None:
        """A held-out evaluation at `step`: logged; a new best is checkpointed (unless this step's checkpoint is
        `saved` already) and marked in best.json. `result` must be the same on every rank (one decision, one save)."""
        self.log("eval", step, result)
        if self.is_best(result):
            if not saved:
                self.save(stage, step, model, optimizer)
            self.mark_best(stage, step, result)


def eval_score(result: dict) -> float | None:
    """The figure the best checkpoint is chosen by: the reward's accuracy, else the official-style accuracy."""
    return result.get("r_acc", result.get("accuracy"))


def read_best(run_dir: str) -> tuple[str, float] | None:
    """(checkpoint, score) of best.json, so a resumed run only replaces it with a better one; None when there is
    none or its checkpoint is not complete (the run died while saving it)."""
    path = os.path.join(run_dir, "best.json")
    if not os.path.exists(path):
        return None
    best = json.load(open(path))
    if not os.path.exists(os.path.join(run_dir, best["checkpoint"], "trainer.pt")):
        return None
    return best["checkpoint"], eval_score(best["eval"])


def make_tracker(report_to: str, run_dir: str):
    """--report-to: metrics also go to TensorBoard or Weights & Biases (imported only when asked for)."""
    if report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        return lambda stage, step, row: [writer.add_scalar(f"{stage}/{k}", v, step) for k, v in row.items()
                                         if isinstance(v, (int, float))] and writer.flush()
    if report_to == "wandb":
        import wandb
        wandb.init(dir=run_dir, config={"run_dir": run_dir})
        return lambda stage, step, row: wandb.log({f"{stage}/{k}": v for k, v in row.items()
                                                   if isinstance(v, (int, float))})
    return None


def atomic_write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# checkpoints: atomic, resumable on any number of ranks

def save_checkpoint(run_dir: str, step: int, model, processor, optimizer, extra: dict, rank: int = 0,
                    world: int = 1, export_dtype: torch.dtype | None = None, group=None) -> str:
    """RUN_DIR/ckpt-<stage>-<step>: `train_state/` (torch.distributed.checkpoint: model and optimizer as trained,
    fp32 master weights and AdamW moments, each rank its shard, loadable on any number of ranks), the Hugging Face
    export (model.safetensors + config + processor, gathered on rank 0; in `export_dtype` when given, e.g. bf16
    for a bf16 run, the dtype its config.json names) and `trainer.pt` (step, counters, RNG: tensors and plain
    data, no pickled code). Atomic: everything goes to `.tmp`, and one rename makes it visible; trainer.pt is
    written last. `group`: the ranks that hold the model (None: every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    final = os.path.join(run_dir, f"ckpt-{extra['stage']}-{step:06d}")   # SFT step 2 and RL step 2 are two models
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(world, group)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():             # one process, no process group: DCP says so, rightly
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "train_state"),
                 process_group=group)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if world > 1 or export_dtype is not None else None
    if rank == 0:
        if full is None:
            model_lib.save_model(model, processor, tmp)
        else:
            cast = (lambda t: t.to(export_dtype) if t.is_floating_point() else t) if export_dtype else (lambda t: t)
            model.save_pretrained(tmp, state_dict={k: cast(v) for k, v in full.items()}, safe_serialization=True)
            processor.save_pretrained(tmp)
            if export_dtype is not None:          # save_pretrained names the parameters' dtype (fp32 masters)
                _set_config_dtype(tmp, export_dtype)
        torch.save({"step": step, "rng_torch": torch.get_rng_state(), "rng_random": random.getstate(),
                    **{k: v for k, v in extra.items()}}, os.path.join(tmp, "trainer.pt"))
        shutil.rmtree(final + ".old", ignore_errors=True)
        if os.path.exists(final):                # saving a step again: move the old one aside whole
            os.replace(final, final + ".old")
        os.replace(tmp, final)                   # the only moment a checkpoint becomes visible
        shutil.rmtree(final + ".old", ignore_errors=True)
    barrier(world, group)
    return final


def _set_config_dtype(folder: str, dtype: torch.dtype) -> None:
    """config.json's "dtype" (and each sub-config's): the dtype loaders with dtype="auto" and servers use."""
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    for sub in config.values():
        if isinstance(sub, dict) and "dtype" in sub:
            sub["dtype"] = name
    with open(path, "w") as f:                  # inside the checkpoint's .tmp folder: not visible yet
        json.dump(config, f, indent=2, sort_keys=True)


def load_train_state(ckpt: str, model, optimizer, group=None) -> None:
    """Model and optimizer (None: the model alone) from a checkpoint's `train_state/`, resharded to this run's
    ranks (`group`: those that hold the model; None: every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)
    path = os.path.join(ckpt, "train_state")
    if not os.path.isdir(path):
        raise ValueError(f"{ckpt} has no train_state/ (written by an older train.py): resume needs it for the master "
                         f"weights and AdamW's state")
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    # partial: a parameter that never had a gradient has no AdamW state in the file and keeps fresh zeros
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True), process_group=group)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def checkpoints(run_dir: str) -> list[tuple[int, int, str]]:
    """(stage order, step, name) of the complete checkpoints (a `.tmp` dir or one without trainer.pt is not)."""
    if not os.path.isdir(run_dir):
        return []
    return sorted((STAGE_ORDER[m[1]], int(m[2]), d) for d in os.listdir(run_dir)
                  if (m := re.fullmatch(r"ckpt-(sft|rl)-(\d{6})", d)) and os.path.exists(os.path.join(run_dir, d, "trainer.pt")))


def latest_checkpoint(run_dir: str) -> str | None:
    """Newest complete checkpoint, RL after SFT, then by step."""
    done = checkpoints(run_dir)
    return os.path.join(run_dir, done[-1][2]) if done else None


def prune_checkpoints(run_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints of each stage; the last SFT checkpoint (the RL start and
    reference) and the best-by-eval one (best.json) are always kept. Returns the deleted names."""
    best = None
    if os.path.exists(os.path.join(run_dir, "best.json")):
        best = json.load(open(os.path.join(run_dir, "best.json"))).get("checkpoint")
    done = checkpoints(run_dir)
    deleted = []
    for order in STAGE_ORDER.values():
        stage = [d for o, _, d in done if o == order]
        for d in stage[:-keep_last] if keep_last else []:
            if d != best:
                shutil.rmtree(os.path.join(run_dir, d), ignore_errors=True)
                deleted.append(d)
    return deleted


def truncate_metrics(path: str, stage: str, step: int) -> None:
    """On resume: drop rows logged after the checkpoint, so no step appears twice."""
    if not os.path.exists(path):
        return
    rows = [json.loads(l) for l in open(path) if l.strip()]
    order = {**STAGE_ORDER, "eval": STAGE_ORDER["rl"]}
    keep = [r for r in rows if (order.get(r.get("stage"), 0), r.get("step", 0)) <= (order[stage], step)]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# curves

# The panels of curves.png: (stage, title, [(metrics key, legend label)], y range); ParaVT's training curves,
# with accuracy and tool use split by whether the overview the rollout drew shows the answer (data.tool_needed).
PANELS = [("sft", "SFT: loss", [("loss", "loss")], None),
          ("rl", "RL: reward", [("reward", "reward")], None),
          ("rl", "RL: format compliance", [("format_compliance", "format compliance")], (0, 1.02)),
          ("rl", "RL: accuracy", [("acc_tool_needed", "tool needed"), ("acc_tool_not_needed", "tool not needed")],
           (0, 1.02)),
          ("rl", "RL: tool-call ratio", [("tool_call_ratio_needed", "tool needed"),
                                         ("tool_call_ratio_not_needed", "tool not needed"),
                                         ("tool_call_ratio", "all")], (0, 1.02))]


def plot_run(run_dir: str) -> str | None:
    """RUN_DIR/curves.png from metrics.jsonl (PANELS): the SFT loss, then against RL step the reward, format
    compliance, accuracy and tool-call ratio on the sampled questions that needed the tool and on those that did
    not: faint raw points, a moving average, ratios on a fixed [0, 1] axis, held-out evaluations (greedy, K = the
    evaluation overview) as markers where the row has the key. None when the run logged no step (--rl-steps 0)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else []
    if not any(r.get("stage") in ("sft", "rl") for r in rows):
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(PANELS), figsize=(3.8 * len(PANELS), 3.2))
    for ax, (stage, title, series, ylim) in zip(axes, PANELS):
        drawn = False
        for i, (key, label) in enumerate(series):
            colour = f"C{i}"
            pts = [(r["step"], r[key]) for r in rows if r.get("stage") == stage and isinstance(r.get(key), (int, float))]
            if pts:
                x, y = np.array(pts, dtype=float).T
                w = max(1, len(y) // 10)
                smooth = np.convolve(y, np.ones(w) / w, mode="valid")
                ax.plot(x, y, ".", alpha=0.25, color=colour)
                ax.plot(x[w - 1:], smooth, color=colour, label=f"{label} (mean of {w})" if w > 1 else label)
            evals = [(r["step"], r[key]) for r in rows if r.get("stage") == "eval" and isinstance(r.get(key), (int, float))]
            if evals:
                ax.plot(*zip(*evals), "D", color=colour, markeredgecolor="k", label=f"{label}, held-out")
            drawn |= bool(pts or evals)
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"{stage.upper()} step")
        if drawn:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# -----------------------------------------------------------------------------
# the frozen reference model

def reference_model(run_dir: str, model_path: str, after_sft: bool, device, seed: int,
                    dtype: torch.dtype = torch.float32):
    """The frozen reference for KL: the policy as RL began (this run's last SFT checkpoint when SFT ran before,
    else the model RL started from), in the compute dtype (bf16 for --precision bf16: no master copy needed)."""
    sft = [d for o, _, d in checkpoints(run_dir) if o == STAGE_ORDER["sft"]]
    src = os.path.join(run_dir, sft[-1]) if sft and after_sft else model_path
    ref, _ = model_lib.load_model(src, device=device, dtype=dtype, seed=seed, tiny_corpus=rollout.prompt_corpus())
    return ref.requires_grad_(False).eval()


# -----------------------------------------------------------------------------
# processes: launch, process group, FSDP2, collectives

def print0(rank: int, *a, **k) -> None:
    if rank == 0:
        tqdm.write(" ".join(str(x) for x in a), **k)


def launch(main, args, lock_dir: str | None = None):
    """Run `main(rank, args)` on every rank: under torchrun's environment, as `args.gpus` processes spawned here
    (`args.device` cuda: one per GPU; cpu: gloo), or in this process. `lock_dir`: held under RunLock for the
    whole run (a second run on it is refused). A bad device request is a ValueError before anything starts.
    Returns main's result when it ran in this process (None when spawned)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible (use --device cpu, or leave --device auto)")
    if args.gpus is None:   # default: every visible CUDA device, or one CPU process
        args.gpus = torch.cuda.device_count() if args.device != "cpu" and torch.cuda.is_available() else 1
    spawn = "RANK" not in os.environ and (args.gpus or 1) > 1
    if spawn and args.device != "cpu" and args.gpus > torch.cuda.device_count():
        raise ValueError(f"--gpus {args.gpus} but only {torch.cuda.device_count()} CUDA devices are visible "
                         f"(use --device cpu for a gloo run on CPU)")
    first = os.environ.get("RANK", "0") == "0"       # under torchrun, rank 0 holds the lock
    lock = RunLock(lock_dir) if first and lock_dir else None
    try:
        if "RANK" in os.environ:                      # started by torchrun (multi-node, or habit)
            return main(int(os.environ.get("LOCAL_RANK", 0)), args)
        elif spawn:                                   # python train.py --gpus 8
            os.environ.setdefault("MASTER_ADDR", "localhost")
            os.environ.setdefault("MASTER_PORT", str(find_free_port()))
            torch.multiprocessing.spawn(main, args=(args,), nprocs=args.gpus)
        else:                                         # one GPU or CPU: no process group
            return main(0, args)
    finally:
        if lock is not None:
            lock.release()


def die_with_parent() -> None:
    """A spawned rank dies with its launcher: the kernel sends SIGKILL when the parent goes (Linux prctl
    PR_SET_PDEATHSIG), and a watchdog thread checks the parent's pid elsewhere. Orphaned ranks would train on,
    alongside a --resume started meanwhile."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)
    threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:                           # the parent died before the signal was armed
        os._exit(1)


def setup_distributed(rank: int, gpus: int | None, device: str, threads: int,
                      timeout_s: float | None = None) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). One process: no process group. Several: nccl on CUDA, gloo on CPU, every
    collective limited to `timeout_s` (None: torch's default, 30 minutes whatever the backend "cuda:nccl" is)."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", gpus or 1))
    if world > 1:
        if "RANK" not in os.environ:                     # spawned by this launcher (not torchrun)
            die_with_parent()
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        if use_cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        init_process_group(int(os.environ["RANK"]), world, use_cuda, timeout_s)
        rank = dist.get_rank()
    if threads or (world > 1 and not use_cuda):          # CPU ranks split the cores
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    return rank, world, torch.device(f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu")


def process_group_backend(use_cuda: bool) -> str:
    """The process group's device map: NCCL for CUDA tensors on GPUs, gloo for CPU tensors alone on CPU."""
    return "cuda:nccl" if use_cuda else "cpu:gloo"


def init_process_group(rank: int, world: int, use_cuda: bool, timeout_s: float | None = None) -> None:
    """The run's process group, with `process_group_backend`'s device map (the tests create theirs here too)."""
    kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group(process_group_backend(use_cuda), rank=rank, world_size=world, **kw)


def collective_device(backend_config: str | None = None) -> torch.device:
    """Where a collective's tensor must live: the device type the process group serves, read off its backend
    config ("cuda:nccl" -> this rank's CUDA device; "cpu:gloo" or "cpu:gloo, cuda:gloo" -> the CPU)."""
    config = dist.get_backend_config() if backend_config is None else backend_config
    served = {part.split(":")[0].strip() for part in config.split(",")}
    if "cpu" in served:
        return torch.device("cpu")
    if "cuda" in served:
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"collective_device: the process group serves {sorted(served)}, neither cpu nor cuda")


def shard_model(model, param_dtype: torch.dtype | None = None, mesh=None) -> None:
    """FSDP2: each decoder layer its own unit, the final norm with the lm_head (token_logprobs reads
    lm_head.weight directly), and the root (the vision tower and embeddings), which every forward enters.
    Tied embeddings (tie_word_embeddings: Qwen3-VL-2B/4B, lm_head.weight IS embed_tokens.weight): the embeddings
    join the [norm, lm_head] unit, so the one parameter has one shard, one all-gather and one gradient (FSDP2
    refuses a parameter shared between units).
    param_dtype bf16 (--precision bf16): the parameters stay fp32 (each rank's shard is the master copy AdamW
    updates), are all-gathered in bf16 for compute, and gradients are reduce-scattered in fp32
    (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)). mesh: the ranks that shard it (a DeviceMesh;
    None: every rank), the trainers of an asynchronous run (async_rl.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    fully_shard = functools.partial(fully_shard, mesh=mesh)
    if param_dtype is not None and param_dtype != torch.float32:
        if {p.dtype for p in model.parameters()} != {torch.float32}:
            raise ValueError(f"shard_model: mixed precision needs fp32 parameters (the master weights), got "
                             f"{sorted({str(p.dtype) for p in model.parameters()})}")
        fully_shard = functools.partial(fully_shard, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype,
                                                                                    reduce_dtype=torch.float32))
    # The root returns the visual features beside the hidden states (video_outputs.pooler_output: per-video
    # torch.split views), and the final-norm unit's output is a view on some torch versions; FSDP2 warns that an
    # in-place op on such a view would skip its hook. Nothing here writes into them (the loss slices and gathers
    # last_hidden_state out of place); tests/test_rl_correctness.py checks the 2-rank gradients against one
    # process's (untied, and tied with the embeddings in the norm's unit).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \((FSDPQwen3VLModel|(FSDPEmbedding, )?"
                                              r"FSDPQwen3VLTextRMSNorm, FSDPLinear)\) returned a view tensor")
    text = model.model.language_model
    tied = model.lm_head.weight is text.embed_tokens.weight
    for layer in text.layers:
        fully_shard(layer)
    fully_shard(([text.embed_tokens] if tied else []) + [text.norm, model.lm_head])
    fully_shard(model.model)


@contextlib.contextmanager
def full_weights(model):
    """FSDP: all-gather every shard once and keep the full weights for a block of no-grad forwards whose
    number differs between ranks (rollouts, evaluation; none at all on a rank without questions), so no rank
    waits in an all-gather that another never reaches; resharded on exit. FSDP's per-iteration record of
    those forwards (the forward root, the order units ran, for the next backward's prefetching) differs
    between the ranks too and is dropped on exit (`reset_iter_state`, where this torch has it), so every rank
    enters the next training step alike. A model without FSDP units passes through untouched."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model.model]
    root = [model.model] if isinstance(model.model, FSDPModule) else []
    for m in root + units:
        m.unshard()
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in units:
            m.set_reshard_after_forward(True, recurse=False)
        for m in root + units:
            m.reshard()
        _forget_forward_order(root + units)


def _forget_forward_order(units: list) -> None:
    """Reset FSDP2's per-iteration forward state after no-grad forwards, as its own post-backward callback does
    after a training step (which a no-grad pass never reaches): the order the units ran forward (kept to prefetch
    in backward), which modules of a unit such as [norm, lm_head] have yet to run, the pass's root and the units'
    training states. A rollout
    leaves them differing between ranks (the decode calls lm_head alone, so its unit waits for norm and keeps
    the root; a rank whose share of the prompts was 0 ran nothing), and the next training step would then finish
    that unit's forward and prefetch in backward at different points on different ranks: mismatched all-gathers,
    a hang. Through torch's private FSDP state (torch 2.14); the 2-rank run in which one rank rolls out nothing
    (tests/test_train.py) hung without it."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    for m in units:
        state = m._get_fsdp_state()
        state._state_ctx.iter_forward_root = None
        state._modules_to_run_forward.clear()
        state._training_state = TrainingState.IDLE
        if hasattr(state._comm_ctx, "post_forward_order"):     # set at the first forward (FSDP's lazy init)
            state._comm_ctx.post_forward_order.clear()
        for group in state._fsdp_param_groups:
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE


def finish(world: int) -> None:
    """The end of a rank: no rank tears the process group down while another still talks to it. A rank that
    torch.multiprocessing.spawn started (`launch`'s, or a test's) then leaves at once (os._exit(0), its output
    flushed; its files are closed, and spawn never reads its return value): a gloo rank at times aborted in the
    interpreter's teardown after its work was done ("terminate called without an active exception", SIGABRT: a C++
    destructor or thread met during finalization), which the launcher reports as a failed run; met now and then in
    full test runs (tests/test_eval_ranks.py, tests/test_rl_correctness.py). Ranks torchrun starts are its own
    processes and end as usual."""
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
        if multiprocessing.parent_process() is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def barrier(world: int, group=None) -> None:
    if world > 1:
        dist.barrier(group=group)


def _all_reduce(values: list[float], op, group=None) -> list[float]:
    """One all-reduce of a list of numbers over `group` (None: every rank), on the device the process group
    serves (NCCL: CUDA tensors only)."""
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_sum(value: int, group=None) -> int:
    return int(_all_reduce([value], dist.ReduceOp.SUM, group)[0])


def all_sum_float(value: float, group=None) -> float:
    return _all_reduce([value], dist.ReduceOp.SUM, group)[0]


def all_max(value: int, group=None) -> int:
    return int(_all_reduce([value], dist.ReduceOp.MAX, group)[0])


def rank_totals(n_tokens: int, n_batches: int, world: int, group=None) -> tuple[int, int]:
    """The policy tokens of all ranks (a step's loss is their token mean) and the zero-weight passes this rank owes:
    the most micro-batches any rank runs, less its own, so every rank joins the same FSDP collectives. Both are
    collectives themselves: every rank calls this at the same point, before its forwards."""
    if world == 1:
        return n_tokens, 0
    return all_sum(n_tokens, group), all_max(n_batches, group) - n_batches



def all_sums(values: list[float], world: int) -> list[float]:
    """Each entry summed over the ranks (one all-reduce for the list)."""
    return [float(v) for v in values] if world == 1 else _all_reduce([float(v) for v in values], dist.ReduceOp.SUM)


def gather_objects(obj, world: int) -> list | None:
    """Every rank's picklable `obj`, in rank order, on rank 0 (None on the other ranks)."""
    if world == 1:
        return [obj]
    out = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj, world: int, group=None) -> list:
    """Every rank's picklable `obj`, in rank order, on every rank of `group` (None: all ranks)."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, world: int):
    """Rank 0's picklable `obj` on every rank (what the others pass is ignored)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_mean(values: dict, world: int, group=None) -> dict:
    """Average scalar metrics across the `world` ranks of `group` (None: every rank)."""
    if world == 1:
        return {k: float(v) for k, v in values.items()}
    keys = sorted(values)
    return {k: v / world for k, v in zip(keys, _all_reduce([float(values[k]) for k in keys], dist.ReduceOp.SUM,
                                                           group))}


def find_free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------
# the run directory: one run at a time

class RunLock:
    """An exclusive fcntl lock on RUN_DIR/.lock for the life of the launcher: a second run on the same directory
    is refused with the holder's pid. The kernel drops the lock when the holder dies, even by SIGKILL."""

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, ".lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise ValueError(f"{run_dir} is in use by another run (pid {holder}); wait for it, stop it, or use "
                             f"another --run-dir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def stale_run(run_dir: str, stage: str, resume: bool) -> str | None:
    """Why a run must not start in run_dir, or None. Without --resume, a stage whose checkpoints (or, for
    SFT, whose metrics.jsonl) are already there would append to another run's curves and leave its
    checkpoints for a later --resume to pick up; nothing is deleted for the user."""
    if resume or not os.path.isdir(run_dir):
        return None
    stages = ("sft", "rl") if stage == "all" else (stage,)
    found = sorted(d for d in os.listdir(run_dir) if re.fullmatch(rf"ckpt-({'|'.join(stages)})-\d{{6}}", d))
    if "sft" in stages and os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        found.append("metrics.jsonl")
    if not found:
        return None
    return (f"{run_dir} already holds a run ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): pass --resume "
            f"to continue it, or another --run-dir (or delete this one)")


# -----------------------------------------------------------------------------
# measuring the rollout: host syncs as they happen

ROLLOUT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rollout.py")   # Engine.step's file


class HostSyncCounter(torch.overrides.TorchFunctionMode):
    """Counts the host syncs of the torch calls made while it is active (`with HostSyncCounter(device) as syncs:`),
    as they happen, not by design: each read of a `device` tensor's values into Python (item, tolist, numpy, bool /
    int / float / index of a tensor, and the ops whose output size depends on the values: nonzero, argwhere,
    masked_select, unique, equal, one-argument where, bool-mask indexing, repeat_interleave by a tensor without
    output_size), each copy of a GPU tensor to the host (cpu, to, copy_), and each blocking copy from the host to a
    GPU `device` (to or copy_ without non_blocking; torch.tensor / as_tensor of host data with `device`: on the
    CPU too, where a GPU run would block). On the CPU every tensor is on the device, so host-side bookkeeping
    tensors (the processor's, a chunk's positions) count as well: an upper bound outside the decode steps.
    count: all of them; in_steps: those inside Engine.step (a decode step: sampling, the stop check, the next
    forward); sites: a Counter of "op file:line" (the caller's frame), to find them."""

    READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__", "nonzero",
             "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose", "is_nonzero"}

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device).type
        self.count, self.in_steps, self.sites = 0, 0, Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self._syncs(name, args, kwargs):
            caller = sys._getframe(1)
            self.count += 1
            self.sites[f"{name} {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"] += 1
            f = caller
            while f is not None and not (f.f_code.co_name == "step" and f.f_code.co_filename == ROLLOUT_FILE):
                f = f.f_back
            self.in_steps += f is not None
        return func(*args, **kwargs)

    def _on(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == self.device

    def _syncs(self, name: str, args: tuple, kw: dict) -> bool:
        first = args[0] if args else None
        gpu = lambda t: isinstance(t, torch.Tensor) and t.device.type != "cpu"
        blocking = not kw.get("non_blocking", False) and not any(a is True for a in args[1:])
        if name in self.READS:
            return self._on(first)
        if name == "where":
            return len(args) + len(kw) == 1 and self._on(first)
        if name == "repeat_interleave":
            return self._on(first) and isinstance(args[1] if len(args) > 1 else kw.get("repeats"), torch.Tensor) \
                and kw.get("output_size") is None
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
            index = torch.utils._pytree.tree_leaves(args[1:2])
            return self._on(first) and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in index)
        if name == "cpu":
            return gpu(first) and self._on(first)
        if name == "to":
            target = [torch.device(a) for a in [*args[1:], kw.get("device")] if isinstance(a, (str, torch.device))]
            target += [a.device for a in args[1:] if isinstance(a, torch.Tensor)]
            if not target or not isinstance(first, torch.Tensor):
                return False
            if target[0].type == "cpu":
                return gpu(first) and self._on(first)                       # to the host
            return first.device.type == "cpu" and target[0].type == self.device and blocking
        if name == "copy_" and len(args) > 1:
            dst, src = first, args[1]
            if dst.device.type == "cpu":
                return gpu(src) and self._on(src)
            return isinstance(src, torch.Tensor) and src.device.type == "cpu" and self._on(dst) and blocking
        if name in ("tensor", "as_tensor", "asarray") and kw.get("device") is not None:
            return torch.device(kw["device"]).type == self.device and not isinstance(first, torch.Tensor)
        return False


class OpCounter(torch.overrides.TorchFunctionMode):
    """Counts the torch calls made while it is active (`with OpCounter() as ops:`), as they happen: each a host-side
    launch of work (an op or a view; on a GPU about 5-10 us of the host's time each, whatever its size). Reads of a
    tensor's metadata (shape, dtype, size, dim, ...: METADATA) launch nothing and are not counted.
    count: the ops; attention: the attention kernels called (ATTENTION: a fused SDPA or flash call, flex_attention;
    the hand-written form's matmuls count as ops only); names: a Counter by op name. Divided by the decoder layers
    of the forward it watched: `ops per layer per step` and `attention calls per layer per step`
    (tests/test_kvcache.py; bench/rollout_bench.py can report them)."""

    METADATA = {"__get__", "size", "dim", "stride", "numel", "__len__", "data_ptr", "element_size", "is_contiguous",
                "storage_offset", "nelement", "ndimension", "is_floating_point", "is_complex", "get_device",
                "untyped_storage", "is_sparse", "__format__", "__repr__", "__hash__", "__iter__"}
    ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "flex_attention"}

    def __init__(self):
        super().__init__()
        self.count, self.attention, self.names = 0, 0, Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in self.METADATA:
            self.count += 1
            self.attention += name in self.ATTENTION
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


def forward_ops(model, kv, run) -> dict:
    """The forwards `run()` makes through the cache `kv` (a kvcache.GroupKV: a decode step, a chunk's prefill)
    measured by OpCounter, per decoder layer: attention_calls (attention kernels), ops (all, the host's preparation,
    embedding and head included) and attention_ops (those inside the cache's attention hook, GroupKV.attend)."""
    layers = len(model.model.language_model.layers)
    inner, attend = OpCounter(), kv.attend

    def counted(*args, **kwargs):
        with inner:
            return attend(*args, **kwargs)

    kv.attend = counted                                    # this cache only, for this call
    try:
        with OpCounter() as ops:
            run()
    finally:
        del kv.attend
    return dict(attention_calls=ops.attention / layers, ops=ops.count / layers, attention_ops=inner.count / layers)


def step_ops(model, kv, rows: list[int], tokens: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """One decode step (kvcache.GroupKV.step of `rows` with `tokens` (n,): a real one, the rows take the tokens)
    per decoder layer (`forward_ops`), as bench/rollout_bench.py reports it: ({attention_calls_per_layer_step,
    ops_per_layer_step, attention_ops_per_layer_step}, the step's (n, V) logits)."""
    logits = []
    out = forward_ops(model, kv, lambda: logits.append(kv.step(model, rows, tokens)))
    return {f"{k}_per_layer_step": v for k, v in out.items()}, logits[0]
