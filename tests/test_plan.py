"""bench/plan.py, the projection of the papers' steps on 8 x H200: the rollout budget's waves and that both
recipes fit (the admission rule of the engine, on paper)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import plan  # noqa: E402


@pytest.mark.parametrize("groups, group_kv, budget, expected", [
    (4, 45.0, 115.7, (2, 2)),      # Video-o3 on one GPU: two groups fit, two waves
    (4, 10.0, 115.7, (4, 1)),      # everything fits at once
    (0.875, 11.1, 115.7, (1, 1)),  # fewer prompts than GPUs: one group on the GPUs that have one
    (3, 50.0, 40.0, (1, 3)),       # a group larger than the budget: one at a time (and `fits` is false)
])
def test_waves(groups, group_kv, budget, expected):
    assert plan.waves(groups, group_kv, budget) == expected


def test_both_recipes_fit_eight_h200_under_the_budget():
    out = subprocess.run([sys.executable, str(BENCH / "plan.py")], capture_output=True, text=True, check=True)
    recipes = json.loads(out.stdout.strip().splitlines()[-1])["recipes"]
    for name, r in recipes.items():
        assert r["fits"], name
        assert r["kv_gb_per_gpu"] <= r["budget_gb"] + 1e-6, name
        assert r["mem_rollout_gb"] < 141, name
    assert recipes["Video-o3"]["waves"] > 1           # 4 groups of 45 GB per GPU do not fit at once


def test_a_small_budget_means_more_waves_and_more_decode_time():
    run = lambda *a: json.loads(subprocess.run([sys.executable, str(BENCH / "plan.py"), *a], capture_output=True,
                                               text=True, check=True).stdout.strip().splitlines()[-1])["recipes"]
    big, small = run()["Video-o3"], run("--rollout-memory-gb", "50")["Video-o3"]
    assert (small["concurrency"], small["waves"]) == (1, 4)
    assert small["rollout_s"] > big["rollout_s"] and small["kv_gb_per_gpu"] < big["kv_gb_per_gpu"]


def test_the_update_holds_the_micro_batch_train_py_forms():
    """The update's memory counts the rows train.micro_batches puts in one micro-batch at the recipe's lengths
    (plan.update_rows): under train.py's defaults (--micro-batch 8, --micro-batch-tokens 16,384) one row at both
    recipes' lengths (17k and 36k tokens), so no row is padded; a budget that lets rows share a forward puts more
    rows in flight and the update needs more memory. Before, the plan assumed one row whatever the flags."""
    assert plan.update_rows([36000] * 64, 8, 16384) == 1 and plan.update_rows([900] * 64, 8, 16384) == 8
    assert plan.update_rows([100, 5000, 100, 100], 8, 10000) == 2 and plan.update_rows([], 8, 16384) == 0
    run = lambda *a: json.loads(subprocess.run([sys.executable, str(BENCH / "plan.py"), *a], capture_output=True,
                                               text=True, check=True).stdout.strip().splitlines()[-1])["recipes"]
    default, wide = run(), run("--micro-batch-tokens", "131072")
    for name in default:
        assert default[name]["update_rows"] == 1, name
        assert wide[name]["update_rows"] == min(8, 131072 // wide[name]["seq_tokens"]) > 1, name
        assert wide[name]["parts_gb"]["activations"] > 2 * default[name]["parts_gb"]["activations"], name
        assert wide[name]["mem_train_gb"] > default[name]["mem_train_gb"], name


def test_memory_parts_kv_counts_whole_blocks_and_one_prompt_copy_per_group():
    """The K/V part in pool blocks: each sequence rounds up to kvcache.BLOCK tokens; the shared prompt is stored
    once per group (G copies unshared); a sub-agent is a prompt and a row of its own; one process stores bf16 keys too."""
    import kvcache
    m = dict(plan.QWEN3VL_8B, layers=1)
    per_block = kvcache.BLOCK * plan.kv_bytes_per_token(m)
    kv = lambda gpus=2, **k: plan.memory_parts(m, gpus, **{**dict(prompts=1, rows=2, overview_tokens=kvcache.BLOCK + 1,
                                                      suffix_tokens=1, flight_tokens=1, flight_patches=0,
                                                      policy_tokens=1), **k})["kv"]
    assert kv() == (2 + 2 * 1) * per_block
    assert kv(shared=False) == (2 * 2 + 2 * 1) * per_block
    assert kv(subagents=4, subagent_prompt=kvcache.BLOCK, subagent_tokens=3) == (4 + 4 * 2) * per_block
    assert kv(gpus=1) == kv()                # one process: keys stored in the values' bf16


def test_rehearsal_ci_runs_every_step_and_reports_every_part(tmp_path):
    """`python bench/rehearsal.py --ci`: the rehearsal of the real run at CI sizes (Qwen's vocabulary and tokenizer,
    8 KV heads x 128, the paravt preset, --precision bf16, gradient checkpointing, 2 FSDP2 gloo ranks): both tool
    modes' rollouts with two rounds of parallel crops, the RL update, the SFT step with TDAM; its last line is
    the JSON of every part measured beside plan.memory_parts, and the parts the plan computes from parameter
    counts (weights, reference, AdamW, gradients) and the K/V it counts in pool blocks agree with the tensors'
    bytes and the pool's blocks in use; the activations, backward and loss it projects from token counts are
    within 25 % of the live tensors' bytes (FSDP2's all-gathered weights included)."""
    import os
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARAVT_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, str(BENCH / "rehearsal.py"), "--ci", "--out", str(tmp_path / "r.json")],
                       cwd=str(BENCH.parent), capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ranks"] == 2 and len(out["per_rank"]) == 2
    assert json.loads((tmp_path / "r.json").read_text())["parts"].keys() == out["parts"].keys()
    parts = out["parts"]
    assert set(parts) == {"weights_shard", "weights_rollout", "reference", "optimizer", "grads", "kv", "activations",
                          "backward", "loss"}
    assert all(p["measured_gb"] > 0 and p["plan_gb"] > 0 for p in parts.values()), parts
    for k in ("weights_shard", "weights_rollout", "reference", "optimizer", "grads", "kv"):
        assert parts[k]["ratio"] == pytest.approx(1.0, abs=0.01), (k, parts[k])
    for k in ("activations", "backward", "loss"):         # counted tensor by tensor: the plan's formulas hold
        assert 0.8 <= parts[k]["ratio"] <= 1.25, (k, parts[k])
    assert out["kv_pool_gb"] >= parts["kv"]["measured_gb"]
    z = out["sizes"]
    assert out["shape"]["vocab"] == 151936 and out["shape"]["kv_heads"] == 8 and out["shape"]["head_dim"] == 128
    assert z["tokens_interleaved"] > z["tokens_subagent"] > z["overview_tokens"] > 0
    assert z["subagents_per_turn"] == 2 and z["subagent_tokens"] > 0     # two parallel crops, each a sub-agent
    assert z["sft_policy_tokens"] > 0 and z["tdam_no_answer"] == 0 and all(v > 0 for v in out["sft_gb"].values())
    # the Video-o3 update (issue 54, item 4): 8 rows over the ranks, one unpadded row a micro-batch as
    # train.micro_batches forms them (no dense mask reaches SDPA), every part within 25 % of the plan
    vo3 = out["videoo3"]
    assert vo3["rows"] == [4, 4] and vo3["dense_masks"] == 0
    assert vo3["sizes"]["flight_rows"] == vo3["sizes"]["planned_rows"] == 1
    for k, p in vo3["parts"].items():
        assert p["measured_gb"] > 0 and 0.8 <= p["ratio"] <= 1.25, (k, p)
