"""
Does a tiny checkpoint's vision tower keep the synthetic task's glyph colours apart?

For each palette colour, one temporal patch (two 64x64 frames) with the white mark and a needle glyph of that
colour goes through `model.visual`; the cosine similarity of the flattened features of each colour pair is
printed. Near 1 means the tower maps the two colours to the same features, and no language model after it can
read them apart (the cause of the seed-to-seed spread of the default run: docs/experiments.md).

    python bench/colour_probe.py runs/default/ckpt-sft-000500 runs/seed1/ckpt-sft-000500
    python bench/colour_probe.py init:0 init:1                 # the random init of seeds 0 and 1

The last line is one JSON object: {checkpoint: {"red-green": cosine, ...}}.
"""
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import model as model_lib  # noqa: E402
import rollout  # noqa: E402


def features(model, processor, rgb: tuple[int, int, int]) -> torch.Tensor:
    frames = torch.full((2, 3, 64, 64), 90, dtype=torch.uint8)                  # (T, 3, H, W) background
    frames[:, :, 32:, :] = torch.tensor(rgb)[:, None, None]                      # the needle glyph
    frames[:, :, :32, 32:] = torch.tensor(rgb)[:, None, None]
    frames[:, :, :32, :32] = 255                                                 # the mark
    batch = processor.video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
    with torch.no_grad():
        out = model.model.visual(batch["pixel_values_videos"], grid_thw=batch["video_grid_thw"])
    out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "pooler_output", out)
    return out.reshape(-1).float()


def main(argv: list[str]) -> dict:
    result = {}
    for name in argv or ["init:0"]:
        if name.startswith("init:"):
            model, processor = model_lib.build_tiny(seed=int(name[5:]), corpus=rollout.prompt_corpus())
        else:
            model, processor = model_lib.load_model(name, device="cpu", tiny_corpus=rollout.prompt_corpus())
        f = {c: features(model, processor, rgb) for c, rgb in data.PALETTE.items()}
        result[name] = {f"{a}-{b}": round(float(torch.nn.functional.cosine_similarity(f[a], f[b], dim=0)), 4)
                        for a, b in itertools.combinations(f, 2)}
        print(name, "  ".join(f"{k} {v:.4f}" for k, v in result[name].items()), flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
