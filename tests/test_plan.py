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
