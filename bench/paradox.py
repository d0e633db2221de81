"""
ParaVT's Tool Prior Paradox (arXiv 2605.20342), in miniature: five GRPO variants from one tool-native
warm start, on the synthetic "needle in a long video" task, on a CPU.

The claim under test. A model that learned in SFT to call `crop_video` on every question is trained
with GRPO. Under vanilla GRPO with a 64-frame overview its format compliance decays (closing tags get
lost under temperature sampling: format fragility) and its tool-call rate falls (the overview alone
answers the question, so the tool earns no extra reward: the tool necessity gap). PARA-GRPO's two fixes,
nFrames gating (K ~ Uniform{4..64} overview frames per prompt) and exploration anchoring (a format
reward aimed at the closing tags), are meant to hold both up.

What runs (one process at a time, identical seeds, steps, group size and prompts per step):
    sft                   train.py --stage sft --always-call    (the oracle calls the tool every time)
    5 variants x seeds    train.py --stage rl --model <sft ckpt> --final-eval --temperature 1.0 ...
The variants are the VARIANTS dict below. Every run, SFT included, gets `--overview-nframes 64`: it is
the overview of the ungated runs, the gated runs replace it by their per-prompt K while training, and so
the final held-out evaluation (greedy, 64 frames, the same records for a given seed) is identical for
all. The warm start sees 64 frames too, so vanilla GRPO starts from a model whose tool prior holds in its
own setting: an SFT on the tiny default's 8-frame overview hardly calls the tool on a 64-frame one, a
"collapse" at step 0 that RL had no part in.
A seed changes the RL sampling and the synthetic train/held-out records (train.py draws them from
--seed); the SFT warm start is shared (seed 0).

Outputs under --out (default runs/paradox):
    paradox.png   format compliance and tool-call ratio vs RL step: one line per variant, the mean over
                  seeds (trailing moving average over --smooth steps), a shaded min-max band over seeds
    paradox.md    final held-out accuracy, tool-call ratio, clue score, turns, format compliance per
                  variant: mean over seeds (min-max over seeds)
    <variant>-s<seed>/   each run's train.py run dir (metrics.jsonl, checkpoint, train.log, final.json)
The last line of stdout is one JSON object: per-variant finals and the curves' first/last values.

What this does NOT show. The model has ~5M parameters and a 1.3k-token vocabulary, each run is minutes
of CPU with a handful of rollouts per step, and the task is synthetic. At most it shows the DIRECTION
of the effects (does the tool-call rate fall under vanilla GRPO and not under PARA-GRPO?), never the
paper's magnitudes (format compliance during RL 0.13 -> 0.64 on Qwen3-VL). With the
default budget the bands are wide; scale up with --rl-steps, --seeds, --group-size, --prompts-per-step.

    python bench/paradox.py                                  # the default budget: under 30 min on 2 CPU cores
    python bench/paradox.py --skip-sft runs/paradox/sft      # reuse a warm start
    python bench/paradox.py --plot-only                      # redraw from the run dirs under --out
    python bench/paradox.py --rl-steps 60 --seeds 3 --n-eval 32   # a longer study
Any flag this script does not know is passed to every train.py call (e.g. --lr 1e-4, --max-turns 2).

The default budget (sized on a 2-core CPU shared with other jobs, one torch thread per process): an SFT
step (batch 16, 64-frame overviews) took 6-9 s, an RL step of 4 x 2 rollouts 2.5-5 s, and each run's
start-up + greedy evaluation of 16 held-out prompts 15-25 s. So 100 SFT steps (~13 min) + 10 runs x
(16 RL steps + overhead) (~14 min) fit in 30 minutes. With two threads on a busy box the same RL step
took 10x longer (OpenMP oversubscription): hence --threads 1.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent          # the repo root, where train.py lives
sys.path.insert(0, str(ROOT))
from train import latest_checkpoint  # noqa: E402

# The five variants: train.py flags on top of the common RL flags (see rl_command).
VARIANTS = {
    "vanilla":   ["--recipe", "vanilla", "--gating", "0", "--anchoring", "none"],       # 1. vanilla GRPO, 64 frames
    "gating":    ["--recipe", "vanilla", "--gating", "1", "--anchoring", "none"],       # 2. + nFrames gating
    "anchoring": ["--recipe", "vanilla", "--gating", "0", "--anchoring", "sequence"],   # 3. + exploration anchoring
    "para-grpo": ["--recipe", "paravt", "--gating", "1", "--anchoring", "sequence"],    # 4. PARA-GRPO (both fixes)
    "para+vtgr": ["--recipe", "combined", "--gating", "1", "--anchoring", "sequence"],  # 5. PARA-GRPO + VTGR tool term
}
LABELS = {"vanilla": "vanilla GRPO (64 frames)", "gating": "+ nFrames gating", "anchoring": "+ exploration anchoring",
          "para-grpo": "PARA-GRPO", "para+vtgr": "PARA-GRPO + VTGR tool term"}
OVERVIEW_NFRAMES = 64                                     # ungated training overview and the final evaluation's
CURVES = ("format_compliance", "tool_call_ratio")        # the two panels
FINALS = ("accuracy", "tool_call_ratio", "clue_score", "turns", "format_compliance")   # the table's columns


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Unknown flags are passed to every train.py call.")
    p.add_argument("--out", default="runs/paradox", help="output folder: run dirs, video cache, paradox.png/.md")
    p.add_argument("--seeds", type=int, default=2, help="seeds per variant (0 .. N-1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--skip-sft", metavar="DIR", default=None,
                   help="reuse a warm start: a checkpoint dir, or a run dir (its newest checkpoint)")
    p.add_argument("--plot-only", action="store_true", help="only redraw the figure and table from the run dirs")
    p.add_argument("--sft-steps", type=int, default=100, help="SFT warm-start steps (batch --sft-batch, train.py's)")
    p.add_argument("--rl-steps", type=int, default=16, help="RL steps of every run")
    p.add_argument("--group-size", type=int, default=4, help="GRPO samples per prompt")
    p.add_argument("--prompts-per-step", type=int, default=2, help="prompts per RL step (rollouts = this x group)")
    p.add_argument("--n-train", type=int, default=256, help="synthetic training prompts (SFT and RL)")
    p.add_argument("--n-eval", type=int, default=16, help="synthetic held-out prompts for the final evaluation")
    p.add_argument("--temperature", type=float, default=1.0, help="RL sampling temperature (format fragility needs 1.0)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per run (OMP_NUM_THREADS); 1 avoids oversubscription on a busy 2-core box")
    p.add_argument("--smooth", type=int, default=3, help="trailing moving-average window of the plotted curves (steps)")
    args, passthrough = p.parse_known_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.seeds < 1 or args.smooth < 1:
        p.error("--seeds and --smooth must be >= 1")
    return args, passthrough


# -----------------------------------------------------------------------------
# running train.py

def sft_command(args, run_dir: str, passthrough: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--stage", "sft", "--always-call", "--run-dir", run_dir,
            "--seed", "0", "--sft-steps", str(args.sft_steps), "--n-train", str(args.n_train),
            "--n-eval", str(args.n_eval), "--overview-nframes", str(OVERVIEW_NFRAMES), *passthrough]


def rl_command(args, variant: str, seed: int, ckpt: str, run_dir: str, passthrough: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--stage", "rl", "--model", ckpt, "--run-dir", run_dir,
            "--seed", str(seed), "--final-eval", "--temperature", str(args.temperature),
            "--rl-steps", str(args.rl_steps), "--group-size", str(args.group_size),
            "--prompts-per-step", str(args.prompts_per_step), "--n-train", str(args.n_train),
            "--n-eval", str(args.n_eval), "--overview-nframes", str(OVERVIEW_NFRAMES), *VARIANTS[variant], *passthrough]


def run_once(cmd: list[str], run_dir: str, env: dict) -> dict:
    """Run one train.py process, its output to run_dir/train.log. Returns {"cmd", "seconds", "summary"}
    where summary is the last stdout line parsed as JSON (train.py's --final-eval summary) or None.
    A run whose run_dir/final.json holds the same command is not run again (an interrupted study resumes);
    any other run_dir (unfinished, or another command) is this study's own output and is started afresh."""
    done = os.path.join(run_dir, "final.json")
    if os.path.exists(done):
        prev = json.load(open(done))
        if prev.get("cmd") == cmd[1:]:          # the interpreter path may differ between machines
            print(f"reusing {run_dir} ({prev['seconds']:.0f} s when it ran)", flush=True)
            return prev
    shutil.rmtree(run_dir, ignore_errors=True)  # train.py refuses a run dir holding another run
    os.makedirs(run_dir, exist_ok=True)
    print(f"running {run_dir} ...", flush=True)
    t0 = time.time()
    log = os.path.join(run_dir, "train.log")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, cwd=ROOT)
        f.write(proc.stdout)
    if proc.returncode != 0:
        tail = open(log).read()[-2000:]
        raise RuntimeError(f"{' '.join(cmd)}\nexited with {proc.returncode}; the end of {log}:\n{tail}")
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    summary = None
    if lines and lines[-1].startswith("{"):
        summary = json.loads(lines[-1])
    result = {"cmd": cmd[1:], "seconds": round(time.time() - t0, 1), "summary": summary}
    with open(done, "w") as f:
        json.dump(result, f)
    print(f"  done in {result['seconds']:.0f} s", flush=True)
    return result


def resolve_warm_start(path: str) -> str:
    """A checkpoint dir (has config.json) as is, or a run dir's newest checkpoint."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint dir (no config.json) nor a run dir with a ckpt-* inside")
    return ckpt


# -----------------------------------------------------------------------------
# reading the runs back

def read_curves(run_dir: str) -> dict[str, np.ndarray]:
    """RL rows of run_dir/metrics.jsonl -> {metric: (steps,) array}, indexed by RL step 1..n."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: missing (run the study first, or point --out at it)")
    rows = [json.loads(l) for l in open(path) if l.strip()]
    rows = sorted((r for r in rows if r.get("stage") == "rl"), key=lambda r: r["step"])
    return {k: np.array([r.get(k, np.nan) for r in rows], dtype=float) for k in (*CURVES, "step")}


def read_final(run_dir: str) -> dict:
    path = os.path.join(run_dir, "final.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: missing (the run did not finish)")
    summary = json.load(open(path)).get("summary") or {}
    if "after" not in summary:
        raise ValueError(f"{path}: no final evaluation (train.py's last line had no 'after')")
    return summary["after"]


def seed_band(curves: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seeds, steps) -> mean, min, max over seeds per step; runs of unequal length are cut to the shortest."""
    n = min(len(c) for c in curves)
    stack = np.stack([c[:n] for c in curves])
    return stack.mean(0), stack.min(0), stack.max(0)


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` steps (fewer at the start), same length as x."""
    c = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def spread(values: list[float]) -> dict:
    return {"mean": float(np.mean(values)), "min": float(np.min(values)), "max": float(np.max(values))}


def collect(out: str, variants: list[str], seeds: list[int]) -> dict:
    """{variant: {"curves": {metric: [per-seed arrays]}, "finals": {metric: [per-seed values]}}}."""
    res = {}
    for v in variants:
        dirs = [os.path.join(out, f"{v}-s{s}") for s in seeds]
        curves = [read_curves(d) for d in dirs]
        finals = [read_final(d) for d in dirs]
        res[v] = {"curves": {k: [c[k] for c in curves] for k in CURVES},
                  "finals": {k: [f[k] for f in finals] for k in FINALS}}
    return res


# -----------------------------------------------------------------------------
# figure, table, JSON

def plot(res: dict, path: str, smooth: int, n_seeds: int) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key in zip(axes, CURVES):
        for v, r in res.items():
            mean, lo, hi = (moving_average(a, smooth) for a in seed_band(r["curves"][key]))
            steps = np.arange(1, len(mean) + 1)
            ax.plot(steps, mean, label=LABELS[v])
            ax.fill_between(steps, lo, hi, alpha=0.15)
        ax.set_title(key.replace("_", " ") + f" (rollouts, {smooth}-step mean)")
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-0.03, 1.03)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Tool Prior Paradox in miniature: mean over {n_seeds} seed(s), band = min-max over seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(res: dict, n_seeds: int) -> str:
    head = "| variant | " + " | ".join(FINALS) + " |"
    lines = [f"Final held-out evaluation (greedy, {OVERVIEW_NFRAMES}-frame overview): mean over {n_seeds} "
             "seed(s) (min-max over seeds).", "", head, "|" + "---|" * (len(FINALS) + 1)]
    for v, r in res.items():
        cells = []
        for k in FINALS:
            s = spread(r["finals"][k])
            cells.append(f"{s['mean']:.3f} ({s['min']:.2f}-{s['max']:.2f})")
        lines.append(f"| {LABELS[v]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_json(res: dict, smooth: int) -> dict:
    """Per variant: finals (mean/min/max over seeds) and, per curve, the seed-mean's first and last step
    values and its means over the first and last `smooth` steps."""
    out = {}
    for v, r in res.items():
        curves = {}
        for k in CURVES:
            mean = seed_band(r["curves"][k])[0]
            curves[k] = {"first": float(mean[0]), "last": float(mean[-1]), f"first{smooth}": float(mean[:smooth].mean()),
                         f"last{smooth}": float(mean[-smooth:].mean()), "steps": len(mean)}
        out[v] = {"final": {k: spread(r["finals"][k]) for k in FINALS}, "curves": curves}
    return out


# -----------------------------------------------------------------------------

def main(argv=None) -> dict:
    args, passthrough = parse_args(argv)
    t0 = time.time()
    out = os.path.abspath(args.out)
    variants, seeds = args.variants.split(","), list(range(args.seeds))
    os.makedirs(out, exist_ok=True)
    if not args.plot_only:
        # one video cache for every run; one torch thread per process unless told otherwise
        env = {**os.environ, "PARAVT_CACHE": os.path.join(out, "cache"),
               "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        if args.skip_sft:
            ckpt = resolve_warm_start(args.skip_sft)
        else:
            sft_dir = os.path.join(out, "sft")
            run_once(sft_command(args, sft_dir, passthrough), sft_dir, env)
            ckpt = resolve_warm_start(sft_dir)
        print(f"warm start: {ckpt}", flush=True)
        for seed in seeds:                       # seed-major: a partial study already covers every variant
            for v in variants:
                run_dir = os.path.join(out, f"{v}-s{seed}")
                run_once(rl_command(args, v, seed, ckpt, run_dir, passthrough), run_dir, env)
    res = collect(out, variants, seeds)
    png = plot(res, os.path.join(out, "paradox.png"), args.smooth, len(seeds))
    md = table(res, len(seeds))
    with open(os.path.join(out, "paradox.md"), "w") as f:
        f.write(md)
    print(md)
    print(f"figure: {png}")
    result = {"variants": summary_json(res, args.smooth), "seeds": seeds, "figure": png,
              "table": os.path.join(out, "paradox.md"), "seconds": round(time.time() - t0, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
