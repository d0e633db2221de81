"""bench/plan.py, the projection of the papers' steps on 8 x H200, through its last-line JSON: the rollout budget's
waves and that both recipes fit (the admission rule of the engine, on paper), the update's micro-batch, the K/V
part in pool blocks, the asynchronous layouts beside the colocated step; and bench/rehearsal.py --ci, which measures
each part beside the plan's."""
import functools
import json
import subprocess
import sys

import pytest

import ops
import policy
from conftest import BENCH, bench_module

pytestmark = [pytest.mark.bench, pytest.mark.slow]   # each test runs bench/plan.py, roles.py or rehearsal.py in a process


@functools.lru_cache(maxsize=None)
def plan(*flags: str) -> dict:
    """The last-line JSON of `python bench/plan.py FLAGS` (each set of flags run once per session)."""
    out = subprocess.run([sys.executable, str(BENCH / "plan.py"), *flags], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flags, recipe, expected, fits", [
    ((), "Video-o3", (2, 2), True),                                # 4 groups of 45 GB a GPU: two fit, two waves
    (("--rollout-memory-gb", "1000"), "Video-o3", (4, 1), False),  # all at once: 180 GB of K/V, more than HBM
    ((), "ParaVT", (1, 1), True),                                  # fewer prompts than GPUs: one group, one wave
    (("--rollout-memory-gb", "40"), "Video-o3", (1, 4), False),    # a group larger than the budget: one at a time
])
def test_waves(flags, recipe, expected, fits):
    r = plan(*flags)["recipes"][recipe]
    assert (r["concurrency"], r["waves"]) == expected and r["fits"] == fits


def test_both_recipes_fit_eight_h200_under_the_budget():
    for name, r in plan()["recipes"].items():
        assert r["fits"], name
        assert r["kv_gb_per_gpu"] <= r["budget_gb"] + 1e-6, name
        assert r["mem_rollout_gb"] < 141, name


def test_a_small_budget_means_more_waves_and_more_decode_time():
    big, small = plan()["recipes"]["Video-o3"], plan("--rollout-memory-gb", "50")["recipes"]["Video-o3"]
    assert (small["concurrency"], small["waves"]) == (1, 4)
    assert small["rollout_s"] > big["rollout_s"] and small["kv_gb_per_gpu"] < big["kv_gb_per_gpu"]


def test_host_time_and_tools_count_in_the_rollout():
    """A decode step's launched ops cost host time that the device's cannot hide once it is larger (1,125 ops a layer:
    ~0.4 s a step, more than the device's); tools in the decode loop add their whole time, beside it only what the decoding does not cover."""
    flags = ("--tool-s", "1.0", "--tool-workers", "8")
    base = plan("--ops-per-layer-step", "0", "--tool-s", "0")["recipes"]["Video-o3"]
    slow = plan("--ops-per-layer-step", "1125", *flags)["recipes"]["Video-o3"]
    fast = plan("--ops-per-layer-step", "40", *flags)["recipes"]["Video-o3"]
    in_loop = plan("--ops-per-layer-step", "40", "--tools-overlap", "0", *flags)["recipes"]["Video-o3"]
    assert base["decode_host_s"] == base["tool_s"] == 0 and slow["decode_host_s"] > slow["decode_device_s"]
    assert fast["decode_host_s"] < fast["decode_device_s"] and fast["rollout_s"] == pytest.approx(base["rollout_s"])
    assert fast["tool_stall_s"] == 0 and in_loop["tool_stall_s"] > 0                 # 64 rows x 6 turns x 5 crops
    assert in_loop["rollout_s"] == pytest.approx(base["rollout_s"] + in_loop["tool_stall_s"], rel=1e-3)


def plan_module():
    """bench/plan.py as a module (its `project` called with other layouts and GPU counts)."""
    return bench_module("plan")


def test_async_step_is_the_rollout_on_r_beside_the_update_on_t_and_the_weights_send():
    """Each recipe's asynchronous layout (R rollout GPUs, T trainer GPUs) is plan's own projection evaluated twice:
    its rollout (waves, time) is the colocated rollout on R GPUs, its update (rows in flight, time, memory) the
    colocated update on T; with staleness >= 1 the step is the largest of the rollout and the update, each plus a
    copy of the bf16 weights (2 bytes a parameter) to or from a host at --host-copy-gbps, and their gloo send at
    --gloo-gbps, the update also after rank 0 deals the trainers' shares of the items; on-policy it is their sum. A
    rollout GPU holds the sampler's bf16 weights, its K/V, the workspace and, where the KL is in the reward (ParaVT),
    the reference: its rollout is the colocated one under the budget that leaves plus the KL's two forwards, and the
    trainers' update has no reference forward. The printed JSON's "async" section is this projection."""
    mod = plan_module()
    kw = mod.settings(mod.parser().parse_args([]))
    out, slow_link = plan()["recipes"], plan("--gloo-gbps", "0.001")["recipes"]
    weights = 2 * mod.PARAMS
    copy, send = weights / (mod.HOST_COPY_GBPS * 1e9), weights / (mod.GLOO_GBPS * 1e9)
    for name, r in mod.RECIPES.items():
        R, T = r["layout"]
        a = mod.project(name, r, layout=(R, T), **kw)
        on_r = mod.project(name, {**r, "gpus": R}, **{**kw, "budget_gb": a["budget_gb"]})
        on_t = mod.project(name, {**r, "gpus": T, "ref_forward": r["ref_forward"] and not r["kl_in_reward"]}, **kw)
        assert (a["concurrency"], a["waves"]) == (on_r["concurrency"], on_r["waves"])
        assert a["rollout_s"] == pytest.approx(on_r["rollout_s"] + a["kl_s"]) and (a["kl_s"] > 0) == r["kl_in_reward"]
        assert (a["update_rows"], a["update_s"], a["mem_train_gb"]) == (on_t["update_rows"], on_t["update_s"],
                                                                          on_t["mem_train_gb"])
        assert a["step_s"] == pytest.approx(max(a["rollout_s"] + copy, on_t["update_s"] + copy + a["message_s"], send))
        assert send < a["step_s"]                      # the defaults: the send hides behind the longer side
        on_policy = mod.project(name, {**r, "offpolicy": 0}, layout=(R, T), **kw)
        assert on_policy["step_s"] == pytest.approx(a["rollout_s"] + on_t["update_s"] + 2 * copy + send
                                                    + a["message_s"])
        held = (2 + 2 * r["kl_in_reward"]) * mod.PARAMS / 2 ** 30         # the sampler's weights (+ the reference)
        assert a["mem_rollout_gb"] == pytest.approx(held + a["kv_gb_per_gpu"] + kw["workspace_gb"])
        assert a["fits"], name
        j = out[name]["async"]
        assert (j["rollout_gpus"], j["trainer_gpus"], j["offpolicy"]) == (R, T, r["offpolicy"]) and j["offpolicy"] >= 1
        for k in ("rollout_s", "update_s", "copy_s", "send_s", "step_s", "kl_s", "message_s"):
            assert j[k] == pytest.approx(a[k], abs=0.01), (name, k)
        assert j["sync_step_s"] == out[name]["step_s"]
        assert j["speedup"] == pytest.approx(out[name]["step_s"] / a["step_s"], abs=0.01)
        slow = slow_link[name]["async"]                # a slow link: the weights' send or the deal sets the step
        assert slow["send_s"] == pytest.approx(weights / 0.001e9, abs=0.01) and slow["step_s"] == pytest.approx(
            max(slow["send_s"], slow["update_s"] + slow["copy_s"] + slow["message_s"]), abs=0.01)
        assert slow["step_s"] > slow["rollout_s"] + slow["copy_s"]


def test_async_speedup_follows_the_rollout_waves():
    """The update on T GPUs is the colocated update x 8 / T (the same tokens; without the reference forward where the
    KL is in the reward: the rollout GPUs run it), and the rollout on R <= 8 GPUs costs at least the colocated rollout
    (more groups a GPU), so a split cannot beat sync / max(rollout on 8, update on T) (< 2). With the code's decode
    attention (fp32 slabs: kv_written_per_read bytes written per bf16 K/V byte read, each read again) the decode is
    bound by K/V traffic: ParaVT's one rollout GPU, holding the bf16 sampler and the reference, takes its 7 groups
    (14.8 GB each with a turn's sub-agents) in 2 waves of 6 under the 100.5 GB they leave, Video-o3's 4 GPUs 8 groups
    of 45 GB in 4 waves of 2: both rollouts outlast the colocated step, speed-ups < 1."""
    out = plan()["recipes"]
    for name, r in out.items():
        a, spec = r["async"], bench_module("plan").RECIPES[name]
        kept = 5 / (5 + spec["ref_forward"]) if spec["kl_in_reward"] else 1.0      # the update's 4 + 1 (+ 1) forwards
        assert a["update_s"] == pytest.approx(r["update_s"] * 8 / a["trainer_gpus"] * kept, abs=0.02), name
        assert a["rollout_s"] >= r["rollout_s"], name
        assert a["speedup"] <= r["step_s"] / max(r["rollout_s"], a["update_s"]) + 0.01 and a["speedup"] < 2, name
        assert max(a["rollout_busy"], a["trainer_busy"]) == pytest.approx(1.0, abs=0.02), name   # idle: its copy
    p, v = out["ParaVT"]["async"], out["Video-o3"]["async"]
    assert (out["ParaVT"]["concurrency"], out["ParaVT"]["waves"], p["concurrency"], p["waves"]) == (1, 1, 6, 2)
    assert p["speedup"] < 1 and p["rollout_busy"] >= 0.98 and p["trainer_busy"] < 0.5    # the update hides beside
    assert p["trainer_busy"] == pytest.approx(p["update_s"] / p["step_s"], abs=0.01)
    assert (out["Video-o3"]["waves"], v["concurrency"], v["waves"]) == (2, 2, 4) and v["speedup"] < 1


def rows_in_flight(lengths: list[int], micro_batch: int, micro_batch_tokens: int) -> int:
    """The largest micro-batch policy.micro_batches forms from rows of these lengths."""
    return max([sl.stop - sl.start for sl in policy.micro_batches(lengths, micro_batch, micro_batch_tokens)] + [0])


def test_the_update_holds_the_micro_batch_train_py_forms():
    """The update's memory counts the rows policy.micro_batches puts in one micro-batch at the recipe's lengths:
    under train.py's defaults (--micro-batch 8, --micro-batch-tokens 16,384) one row at both recipes' lengths (17k
    and 36k tokens), so no row is padded; a budget that lets rows share a forward puts more rows in flight and the
    update needs more memory."""
    assert rows_in_flight([36000] * 64, 8, 16384) == 1 and rows_in_flight([900] * 64, 8, 16384) == 8
    assert rows_in_flight([100, 5000, 100, 100], 8, 10000) == 2 and rows_in_flight([], 8, 16384) == 0
    default, wide = plan()["recipes"], plan("--micro-batch-tokens", "131072")["recipes"]
    for name in default:
        assert default[name]["update_rows"] == 1, name
        assert wide[name]["update_rows"] == min(8, 131072 // wide[name]["seq_tokens"]) > 1, name
        assert wide[name]["parts_gb"]["activations"] > 2 * default[name]["parts_gb"]["activations"], name
        assert wide[name]["mem_train_gb"] > default[name]["mem_train_gb"], name


def test_memory_parts_kv_counts_whole_blocks_and_one_prompt_copy_per_group():
    """The K/V part in pool blocks (`plan.py --parts`): each sequence rounds up to kvcache.BLOCK tokens; the shared
    prompt is stored once per group (G copies unshared); a sub-agent is a prompt and a row of its own; one process
    stores bf16 keys too."""
    import kvcache
    per_block = kvcache.BLOCK * 1 * 8 * 128 * 2 * 2          # one layer, 8 KV heads x 128, K and V, bf16
    base = dict(model={"layers": 1}, gpus=2, prompts=1, rows=2, overview_tokens=kvcache.BLOCK + 1, suffix_tokens=1,
                flight_tokens=1, flight_patches=0, policy_tokens=1)
    cases = [base, {**base, "shared": False},
             {**base, "subagents": 4, "subagent_prompt": kvcache.BLOCK, "subagent_tokens": 3}, {**base, "gpus": 1}]
    kv = [parts["kv"] for parts in plan("--parts", json.dumps(cases))]
    assert kv == [(2 + 2 * 1) * per_block, (2 * 2 + 2 * 1) * per_block, (4 + 4 * 2) * per_block, (2 + 2 * 1) * per_block]


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
    # policy.micro_batches forms them (no dense mask reaches SDPA), every part within 25 % of the plan
    vo3 = out["videoo3"]
    assert vo3["rows"] == [4, 4] and vo3["dense_masks"] == 0
    assert vo3["sizes"]["flight_rows"] == vo3["sizes"]["planned_rows"] == 1
    for k, p in vo3["parts"].items():
        assert p["measured_gb"] > 0 and 0.8 <= p["ratio"] <= 1.25, (k, p)


# -----------------------------------------------------------------------------
# the plan's coefficients are the code's (bench/roles.py measures each role)

@functools.lru_cache(maxsize=None)
def roles() -> dict:
    """The last-line JSON of `python bench/roles.py --ci` (run once per session)."""
    out = subprocess.run([sys.executable, str(BENCH / "roles.py"), "--ci"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_plans_coefficients_are_the_codes():
    """Each coefficient bench/plan.py projects with (ROLES) is within 15 % of what bench/roles.py measures the code
    doing: a rollout rank's resident bytes a parameter, a trainer's, rank 0's host copy and buckets of a version, a
    trainer's share of a step's items per visual token, the decode attention's bytes written per K/V byte read; and
    the plan's memory arithmetic charges a trainer the coefficient it declares."""
    measured, plan_mod = roles(), bench_module("plan")
    for key, assumed in plan_mod.ROLES.items():
        assert abs(measured[key] - assumed) <= 0.15 * assumed, (key, measured[key], assumed)
    assert measured["policy_as_sampler_bytes_per_param"] > 2 * measured["rollout_bytes_per_param"]  # the old rank
    P, T = plan_mod.PARAMS, 7
    parts = plan_mod.memory_parts(plan_mod.QWEN3VL_8B, T, 1, 8, 16384, 1000, 17000, 4 * 16384, 8000)
    charged = (parts["weights_shard"] + parts["optimizer"] + parts["grads"]) * T / P
    assert charged == plan_mod.ROLES["trainer_bytes_per_param"]


def test_plan_projects_with_the_roles_file(tmp_path):
    """--roles FILE: the plan says where its coefficients come from and projects with them (a costlier decode
    attention, a larger message); without it, the fallbacks, marked as such; a file without a key is refused."""
    base = plan()
    assert base["roles_source"].startswith("fallbacks")
    costly = dict(roles(), kv_written_per_read=20.0,
                  message_bytes_per_visual_token=2 * 12566.0)
    path = tmp_path / "costly.json"
    path.write_text(json.dumps(costly))
    r = plan("--roles", str(path))
    assert r["roles_source"] == f"measured: {path}" and r["roles"]["kv_written_per_read"] == 20.0
    assert r["recipes"]["Video-o3"]["decode_device_s"] > base["recipes"]["Video-o3"]["decode_device_s"]
    a, b = r["recipes"]["Video-o3"]["async"], base["recipes"]["Video-o3"]["async"]
    assert a["message_gb_per_trainer"] == pytest.approx(2 * b["message_gb_per_trainer"], rel=1e-3)
    path.write_text(json.dumps({"kv_written_per_read": 1.0}))
    done = subprocess.run([sys.executable, str(BENCH / "plan.py"), "--roles", str(path)], capture_output=True, text=True)
    assert done.returncode != 0 and "rollout_bytes_per_param" in done.stderr


def test_paravt_release_layout_fits_h100_and_h200():
    """ParaVT's asynchronous layout (1 rollout GPU + 7 trainers) at 8B with the code's coefficients: the rollout GPU
    holds the bf16 sampler and the reference (the KL is in the reward) and its K/V under the budget they leave; it fits
    141 GB and 80 GB GPUs, with the headroom the plan prints; the KL's forwards count in the rollout, not the update."""
    for hbm in ("141", "80"):
        a = plan("--hbm-gb", hbm)["recipes"]["ParaVT"]["async"]
        assert a["fits"] and a["rollout_headroom_gb"] > 0 and a["train_headroom_gb"] > 0, (hbm, a)
        assert a["kl_s"] > 0 and a["mem_rollout_gb"] <= float(hbm)


def test_the_plan_prices_the_exact_mode_beside_the_fast_one():
    """The exact mode costs what its tiles and unfused scores cost: its step exceeds the fast one, its update most
    (every GEMM of the loss on ops.EXACT_ROWS-row tiles), and a wave of more rows than one tile reads the weights once
    a tile: with 4 groups of 16 rows a wave, ceil(64 / EXACT_ROWS) tiles and that many weight reads a decode step."""
    mod = bench_module("plan")
    for name, r in plan()["recipes"].items():
        e = r["exact"]
        assert e["step_s"] == pytest.approx(e["rollout_s"] + e["update_s"], abs=0.02)
        assert e["update_s"] > r["update_s"] and e["rollout_s"] >= r["rollout_s"] - 0.01 and e["slowdown"] > 1, name
    spec = mod.RECIPES["Video-o3"]
    row = mod.project("Video-o3", spec, True, 0.4, 0.7, 0.8, 10.0, None)
    wide = mod.exact_mode(spec, dict(row, concurrency=4), 0.4, 0.7, 0.8)
    narrow = mod.exact_mode(spec, dict(row, concurrency=1), 0.4, 0.7, 0.8)
    tiles = -(-4 * spec["group"] // ops.EXACT_ROWS)
    assert wide["decode_tiles"] == tiles > narrow["decode_tiles"] == 1
    steps = (spec["rounds"] + 1) * spec["turn_tokens"] * row["waves"]
    extra = (tiles - 1) * 2 * mod.TEXT_PARAMS / (mod.HBM_BW * 0.7) / 0.8 * steps
    assert wide["rollout_s"] - narrow["rollout_s"] == pytest.approx(extra, rel=1e-6)
