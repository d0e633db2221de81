"""
ParaVT's Tool Prior Paradox (arXiv 2605.20342) in miniature, on a CPU (docs/experiments.md, "The Tool Prior Paradox in
miniature"): an SFT warm start that crops every question (450 steps, on K = 32 and gated overviews), then five GRPO
variants x --seeds (VARIANTS: temperature 1.0, the same steps, group, prompts and rate; ungated runs see K = DENSE,
where the tool is never needed, gated ones K ~ GATING), each evaluated greedily on its seed's held-out questions at
K = DENSE and K = SPARSE (a glyph between overview frames: the tool is needed). The claim: vanilla GRPO loses the
tool calls and the format, and with them the accuracy where the tool is needed; gating and anchoring keep them.
Outputs under --out: paradox.png (sampled curves against RL step: the seed mean, its moving average, a min-max band),
paradox.md (the held-out table), <variant>-s<seed>/ (the run dirs); last line: one JSON object.

    python bench/paradox.py                                   # the study: under an hour on 2 CPU cores
    python bench/paradox.py --skip-sft runs/paradox/sft       # reuse a warm start
    python bench/paradox.py --plot-only                       # redraw from the run dirs under --out
    python bench/paradox.py --dry-run                         # print the commands it would run
Any flag this script does not know is passed to every train.py call (e.g. --max-turns 2).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from common import ROOT, checkpoint_dir  # bench/common.py (puts the repo on sys.path)

import data

# The five variants: their label and train.py flags on top of the common RL flags (see rl_command).
VARIANTS = {
    "vanilla": ("vanilla GRPO (K = 32)", ["--recipe", "vanilla", "--gating", "0", "--anchoring", "none"]),
    "gating": ("+ nFrames gating", ["--recipe", "vanilla", "--gating", "1", "--anchoring", "none"]),
    "anchoring": ("+ exploration anchoring", ["--recipe", "vanilla", "--gating", "0", "--anchoring", "sequence"]),
    "para-grpo": ("PARA-GRPO", ["--recipe", "para_grpo", "--gating", "1", "--anchoring", "sequence"]),
    "para+vtgr": ("PARA-GRPO + VTGR tool term", ["--recipe", "combined", "--gating", "1", "--anchoring", "sequence"]),
}
DENSE, SPARSE = 32, 8                                    # ungated overview / the overview where needles need the tool
GATING = "4,8,16,32"                                     # gated overviews (SFT's extra copies and gated RL)
CURVES = {"format_compliance": "format compliance", "tool_call_ratio": "tool-call ratio",     # metric: plot title
          "acc_tool_needed": "accuracy, tool needed", "acc_tool_not_needed": "accuracy, tool not needed"}
FINALS = ("accuracy", "acc_tool_needed", "acc_tool_not_needed", "tool_call_ratio", "format_compliance")


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Unknown flags are passed to every train.py call.")
    p.add_argument("--out", default="runs/paradox", help="output folder: run dirs, video cache, paradox.png/.md")
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (0 .. N-1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--skip-sft", metavar="DIR", default=None,
                   help="reuse a warm start: a checkpoint dir, or a run dir (its newest checkpoint)")
    p.add_argument("--plot-only", action="store_true", help="only redraw the figure and table from the run dirs")
    p.add_argument("--dry-run", action="store_true", help="print the commands the study would run (last line: JSON)")
    p.add_argument("--sft-steps", type=int, default=450, help="SFT warm-start steps (at train.py's SFT batch)")
    p.add_argument("--rl-steps", type=int, default=24, help="RL steps of every run")
    p.add_argument("--group-size", type=int, default=16, help="GRPO samples per prompt (the default run's)")
    p.add_argument("--prompts-per-step", type=int, default=1, help="prompts per RL step (rollouts = this x group)")
    p.add_argument("--lr", type=float, default=2e-4, help="RL learning rate of every run")
    p.add_argument("--n-eval", type=int, default=48, help="held-out questions per seed")
    p.add_argument("--temperature", type=float, default=1.0, help="RL sampling temperature (format fragility needs 1.0)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    p.add_argument("--smooth", type=int, default=8, help="moving-average window of the plotted curves (steps)")
    args, passthrough = p.parse_known_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.seeds < 1 or args.smooth < 1 or args.jobs < 1:
        p.error("--seeds, --smooth and --jobs must be >= 1")
    return args, passthrough


def sft_command(args, run_dir: str, passthrough: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--stage", "sft", "--set", "always_call=1", "--set", "sft_gated_overviews=1",
            "--gating-choices", GATING, "--run-dir", run_dir, "--seed", "0", "--sft-steps", str(args.sft_steps),
            "--n-eval", str(args.n_eval), "--overview-nframes", str(DENSE), "--save-every", str(args.sft_steps),
            *passthrough]


def rl_command(args, variant: str, seed: int, ckpt: str, run_dir: str, passthrough: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--stage", "rl", "--model", ckpt, "--run-dir", run_dir,
            "--seed", str(seed), "--temperature", str(args.temperature), "--lr", str(args.lr),
            "--rl-steps", str(args.rl_steps), "--group-size", str(args.group_size),
            "--prompts-per-step", str(args.prompts_per_step), "--n-eval", str(args.n_eval),
            "--overview-nframes", str(DENSE), "--gating-choices", GATING, "--save-every", str(args.rl_steps),
            "--keep-last", "1", *VARIANTS[variant][1], *passthrough]


def run_once(cmds: list[list[str]], run_dir: str, env: dict) -> dict:
    """Run commands one after another (output to run_dir/train.log); returns {"cmd", "seconds"} and writes it to
    run_dir/final.json. A run dir whose final.json holds the same commands is not run again (an interrupted
    study resumes); any other run dir is this study's own output and is started afresh."""
    done, key = os.path.join(run_dir, "final.json"), [c[1:] for c in cmds]   # the interpreter may differ by machine
    if os.path.exists(done) and json.load(open(done)).get("cmd") == key:
        print(f"reusing {run_dir}", flush=True)
        return json.load(open(done))
    shutil.rmtree(run_dir, ignore_errors=True)      # train.py refuses a run dir holding another run
    os.makedirs(run_dir, exist_ok=True)
    print(f"running {run_dir} ...", flush=True)
    t0, log = time.time(), os.path.join(run_dir, "train.log")
    with open(log, "w") as f:
        for cmd in cmds:
            print("$ " + " ".join(cmd), file=f, flush=True)
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)}\nfailed; the end of {log}:\n" + open(log).read()[-2000:])
    result = {"cmd": key, "seconds": round(time.time() - t0, 1)}
    with open(done, "w") as f:
        json.dump(result, f)
    print(f"  {run_dir} done in {result['seconds']:.0f} s", flush=True)
    return result


def read_curves(run_dir: str) -> dict[str, np.ndarray]:
    """RL rows of run_dir/metrics.jsonl -> {metric: (steps,) array}, indexed by RL step 1..n (nan where a step
    logged no value, e.g. no question of its draw needed the tool)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: missing (run the study first, or point --out at it)")
    rows = [json.loads(l) for l in open(path) if l.strip()]
    rows = sorted((r for r in rows if r.get("stage") == "rl"), key=lambda r: r["step"])
    return {k: np.array([r.get(k, np.nan) for r in rows], dtype=float) for k in (*CURVES, "step")}


def score_predictions(path: str, records: list[dict], nframes: int) -> dict:
    """Held-out figures of one predictions file: MCQ accuracy over all, over the questions whose K-frame overview
    needs the tool and over the others (data.tool_needed), tool-call ratio and format compliance over all."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: missing (the run did not finish)")
    rows = {str(r["id"]): r for r in map(json.loads, open(path)) if r}
    groups = {"accuracy": [], "acc_tool_needed": [], "acc_tool_not_needed": []}
    for rec in records:
        row = rows.get(rec["id"])
        if row is None:
            raise ValueError(f"{path}: no prediction for {rec['id']}")
        if rec["task"] != "mcq":
            continue
        right = float((row.get("answer") or "").strip().upper() == rec["answer"])
        groups["accuracy"].append(right)
        groups["acc_tool_needed" if data.tool_needed(rec, nframes) else "acc_tool_not_needed"].append(right)
    out = {k: float(np.mean(v)) if v else float("nan") for k, v in groups.items()}
    out["tool_call_ratio"] = float(np.mean([r["calls"] > 0 for r in rows.values()]))
    out["format_compliance"] = float(np.mean([bool(r.get("format_compliant")) for r in rows.values()]))
    out["n_needed"] = len(groups["acc_tool_needed"])
    return out


def spread(values: list[float]) -> dict:
    """Mean, min and max over the values that exist (nan: a seed without such a question; all nan: nan)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return {k: float(getattr(v, k)()) if len(v) else float("nan") for k in ("mean", "min", "max")}


def collect(out: str, variants: list[str], seeds: list[int], n_eval: int) -> dict:
    """{variant: {"curves": {metric: [per-seed arrays]}, "finals": {K: {metric: [per-seed values]}}}}."""
    held = {s: data.make_split(os.path.join(out, "cache", "synthetic"), n_eval, seed=2000 + s) for s in seeds}
    res = {}
    for v in variants:
        dirs = {s: os.path.join(out, f"{v}-s{s}") for s in seeds}
        curves = [read_curves(d) for d in dirs.values()]
        finals = {}
        for k in (SPARSE, DENSE):
            scored = [score_predictions(os.path.join(d, f"eval-k{k}.jsonl"), held[s], k) for s, d in dirs.items()]
            finals[k] = {m: [x[m] for x in scored] for m in (*FINALS, "n_needed")}
        res[v] = {"curves": {k: [c[k] for c in curves] for k in CURVES}, "finals": finals}
    return res


def seed_band(curves: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seeds, steps) -> mean, min, max over seeds per step (nan where no seed has a value); runs of unequal
    length are cut to the shortest."""
    n = min(len(c) for c in curves)
    stack = np.stack([c[:n] for c in curves])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # an all-nan step stays nan
        return np.nanmean(stack, 0), np.nanmin(stack, 0), np.nanmax(stack, 0)


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Centred mean over `window` steps (fewer at the ends), nan steps skipped; same length as x."""
    out = np.full(len(x), np.nan)
    for i in range(len(x)):
        seg = x[max(0, i - window // 2): i + (window + 1) // 2]
        if np.isfinite(seg).any():
            out[i] = np.nanmean(seg)
    return out


def plot(res: dict, path: str, smooth: int, n_seeds: int) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(1, len(CURVES), figsize=(16, 3.8))
    for ax, key in zip(axes, CURVES):
        for c, (v, r) in enumerate(res.items()):
            mean, lo, hi = seed_band(r["curves"][key])
            steps = np.arange(1, len(mean) + 1)
            ax.plot(steps, mean, ".", color=f"C{c}", alpha=0.2, markersize=3)
            ax.plot(steps, moving_average(mean, smooth), color=f"C{c}", label=VARIANTS[v][0])
            ax.fill_between(steps, moving_average(lo, smooth), moving_average(hi, smooth), color=f"C{c}", alpha=0.1)
        ax.set_title(f"{CURVES[key]} (sampled)", fontsize=10)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.02)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"Tool Prior Paradox in miniature: seed mean (points) and its {smooth}-step moving average, "
                 f"band = min-max over {n_seeds} seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def table(res: dict, n_seeds: int) -> str:
    cols = ("MCQ accuracy", "tool needed", "tool not needed", "tool-call ratio", "format")
    lines = [f"Held-out evaluation (greedy, each seed's held-out questions): mean over {n_seeds} seed(s) "
             "(min-max over seeds).", ""]
    for k in (SPARSE, DENSE):
        n_needed = spread(next(iter(res.values()))["finals"][k]["n_needed"])["mean"]
        lines += [f"K = {k} overview frames ({n_needed:.0f} MCQs per seed need the tool on average):", "",
                  "| variant | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
        for v, r in res.items():
            cells = []
            for m in FINALS:
                s = spread(r["finals"][k][m])
                cells.append("-" if np.isnan(s["mean"]) else f"{s['mean']:.3f} ({s['min']:.2f}-{s['max']:.2f})")
            lines.append(f"| {VARIANTS[v][0]} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def summary_json(res: dict, smooth: int) -> dict:
    """Per variant: finals at both K (mean/min/max over seeds) and, per curve, the seed mean's means over the
    first and last `smooth` steps."""
    out = {}
    window_mean = lambda x: float(np.mean(x[np.isfinite(x)])) if np.isfinite(x).any() else None   # noqa: E731
    for v, r in res.items():
        curves = {}
        for k in CURVES:
            mean = seed_band(r["curves"][k])[0]
            curves[k] = {f"first{smooth}": window_mean(mean[:smooth]), f"last{smooth}": window_mean(mean[-smooth:]),
                         "steps": len(mean)}
        out[v] = {"final": {f"k{k}": {m: spread(r["finals"][k][m]) for m in FINALS} for k in (SPARSE, DENSE)},
                  "curves": curves}
    return out


def run_commands(args, out: str, ckpt: str, variant: str, seed: int, passthrough: list[str]) -> list[list[str]]:
    """One run's commands: RL from the warm start `ckpt`, then its last checkpoint evaluated greedily at K = SPARSE
    and DENSE on the split train.py --seed s holds out (2000 + s)."""
    run_dir = os.path.join(out, f"{variant}-s{seed}")
    final = os.path.join(run_dir, f"ckpt-rl-{args.rl_steps:06d}")
    return [rl_command(args, variant, seed, ckpt, run_dir, passthrough),
            *([sys.executable, str(ROOT / "eval.py"), "--model", final, "--synthetic-n", str(args.n_eval), "--synthetic-seed",
               str(2000 + seed), "--overview-nframes", str(k), "--out", os.path.join(run_dir, f"eval-k{k}.jsonl")]
              for k in (SPARSE, DENSE))]


def main(argv=None) -> dict:
    args, passthrough = parse_args(argv)
    t0 = time.time()
    out = os.path.abspath(args.out)
    variants, seeds = args.variants.split(","), list(range(args.seeds))
    sft_dir = os.path.join(out, "sft")
    if args.dry_run:                                                       # nothing runs
        ckpt = args.skip_sft or os.path.join(sft_dir, f"ckpt-sft-{args.sft_steps:06d}")
        cmds = {"sft": None if args.skip_sft else sft_command(args, sft_dir, passthrough),
                "runs": {f"{v}-s{s}": run_commands(args, out, ckpt, v, s, passthrough) for s in seeds for v in variants}}
        print(json.dumps(cmds))
        return cmds
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "PARAVT_CACHE": os.path.join(out, "cache")}      # one video cache for every run
    if not args.plot_only:
        if args.skip_sft:
            ckpt = checkpoint_dir(args.skip_sft, "paradox.py")
        else:
            run_once([sft_command(args, sft_dir, passthrough)], sft_dir, env)
            ckpt = checkpoint_dir(sft_dir, "paradox.py")
        print(f"warm start: {ckpt}", flush=True)
        one = {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}   # a core per run
        with ThreadPoolExecutor(args.jobs) as pool:          # seed-major: a partial study covers every variant
            jobs = [pool.submit(run_once, run_commands(args, out, ckpt, v, s, passthrough),
                                os.path.join(out, f"{v}-s{s}"), one) for s in seeds for v in variants]
            for f in jobs:
                f.result()
    res = collect(out, variants, seeds, args.n_eval)
    png = plot(res, os.path.join(out, "paradox.png"), args.smooth, len(seeds))
    md = table(res, len(seeds))
    with open(os.path.join(out, "paradox.md"), "w") as f:
        f.write(md)
    print(md)
    print(f"figure: {png}")
    result = {"variants": summary_json(res, args.smooth), "seeds": seeds, "figure": png,
              "table": os.path.join(out, "paradox.md"), "seconds": round(time.time() - t0, 1)}
    print(json.dumps(result, default=str).replace("NaN", "null"))     # no question of a kind: null, strict JSON
    return result


if __name__ == "__main__":
    main()
