"""
The "one policy" contract: the rollout engine (rollout.Engine over kvcache.GroupKV) and the trainer (rollout.collate,
then policy.py's forward) feed the model exactly the same inputs, checked on every trajectory of a run.

Why: GRPO's ratio, the decoupled loss and the mismatch figures compare the sampling policy's log-probs with the
trainer's, and these are one policy only if both forwards see the same tokens, M-RoPE positions, vision grids and
pixels. The engine builds its inputs a chunk at a time (a prompt prefilled once for its group, each chunk's positions
shifted by the row's next position, sampled tokens fed one a step), the trainer once over the whole row
(get_rope_index). A difference between the two is a bug no loss curve shows, so it raises (ContractError) instead of
training on it.

A row is fed in segments, one per assistant turn (segment k is turn k):
    segment 0   the prompt chunk: prompt + the forced "<think>\\n" (GroupKV.add_prompts, once for the group's rows)
    segment k   the chunk GroupKV.extend prefills before turn k: turn k - 1's last token, the tool responses, the
                next "<think>\\n"
and each segment goes on with the decode steps of its turn (GroupKV.step: one token a row, all three M-RoPE
components the row's next position): every token of the turn but its last, which is fed with the next chunk (the
final turn's never). A chunk appended to a row that retires at max_context before it is fed is no segment. So the
segments follow from the roles alone (`segments`): a POLICY run is a turn, a trailing ENV run was never fed.

A segment's digest is "ids:positions:grid:pixels", four blake2b-64 hex digests (PARTS) of:
    ids        int64: the chunk's length l, its ids (l,), then each decoded token
    positions  int64: the chunk's positions (3, l) row-major as fed, then (t, h, w) of each decoded token
    grid       uint8: the chunk's mm_token_type_ids (l,); int64: its video_grid_thw (n, 3) (none without videos)
    pixels     `pixel_digest` of the chunk's pixel_values_videos (none without videos): SHA-256 (16 bytes) of the
               dtype, the shape and the raw bytes of the tensor the trajectory stores (Trajectory.videos)
(int64 in the machine's byte order). The engine hashes as it feeds (`Digest`, running hashes per row, copied from
the group's prompt digest; the pixels once per tensor, most in the tool threads) into Trajectory.digests; collate
recomputes them from its own inputs (`row_digests`) and `check_row` compares.
Shapes: ids, types (l,) or (n,); positions (3, l) or (3, n) for (t, h, w); grid (n_videos, 3); pixels (n_patches, d).
"""
import hashlib
import struct

import torch

PARTS = ("ids", "positions", "grid", "pixels")
RECORD = True                        # rollout.Engine records Trajectory.digests (off: the bench's baseline)


class ContractError(ValueError):
    """The trainer's inputs of a trajectory differ from what the rollout fed the model: a bug, not a sample to skip."""


def _raw(t: torch.Tensor, dtype: torch.dtype | None = None):
    """The bytes of a tensor (cast to dtype first), as a flat uint8 array for hashlib (no copy when contiguous)."""
    t = t.detach().cpu()
    if dtype is not None:
        t = t.to(dtype)
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def pixel_digest(pixels: torch.Tensor | None, cache: dict) -> bytes:
    """SHA-256 (its first 16 bytes) of a pixel tensor's dtype, shape and bytes (b"" for None): the fastest of hashlib's
    where the CPU has SHA instructions, as pixels are most of the bytes. cache: {id(tensor): (tensor, digest)} (the
    tensor held: its id stays its own), so that a tensor fed to several rows (a group's overview) is hashed once."""
    if pixels is None:
        return b""
    hit = cache.get(id(pixels))
    if hit is None:
        h = hashlib.sha256(f"{pixels.dtype}{tuple(pixels.shape)}".encode())
        h.update(_raw(pixels))
        hit = cache[id(pixels)] = (pixels, h.digest()[:16])
    return hit[1]


class Digest:
    """The running hashes (one per PARTS) of one fed segment of a row."""

    def __init__(self, hashes: list | None = None):
        self.h = hashes if hashes is not None else [hashlib.blake2b(digest_size=8) for _ in PARTS]
        self.tokens, self.positions = [], []         # decode steps not yet hashed (`step`: hashed at `hexdigest`)

    def chunk(self, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor, grid: torch.Tensor | None,
              pixels: bytes) -> "Digest":
        """A prefilled chunk: ids, types (l,), positions (3, l) as fed, grid (n, 3) or None, pixel_digest bytes."""
        self._flush()
        h_ids, h_pos, h_grid, h_pix = self.h
        h_ids.update(struct.pack("=q", len(ids)))
        h_ids.update(_raw(ids, torch.int64))
        h_pos.update(_raw(positions, torch.int64))
        h_grid.update(_raw(types, torch.uint8))
        if grid is not None:
            h_grid.update(_raw(grid, torch.int64))
        h_pix.update(pixels)
        return self

    def step(self, token: int, pos: int) -> None:
        """A decode step: one token at position `pos` in all three components (kept, hashed with the segment's
        others at `hexdigest`: the same bytes, one update instead of two a row a step)."""
        self.tokens.append(token)
        self.positions.append(pos)

    def steps(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Decode steps at once: ids (m,), positions (3, m) (the same bytes as m calls of `step`)."""
        self._flush()
        self.h[0].update(_raw(ids, torch.int64))
        self.h[1].update(_raw(positions.t(), torch.int64))

    def copy(self) -> "Digest":
        """An independent copy (a group's rows go on from their shared prompt's digest)."""
        self._flush()
        return Digest([h.copy() for h in self.h])

    def _flush(self) -> None:
        if self.tokens:
            self.h[0].update(struct.pack(f"={len(self.tokens)}q", *self.tokens))
            self.h[1].update(struct.pack(f"={3 * len(self.positions)}q", *(p for p in self.positions for _ in range(3))))
            self.tokens, self.positions = [], []

    def hexdigest(self) -> str:
        """The segment's digest: "ids:positions:grid:pixels"."""
        self._flush()
        return ":".join(h.hexdigest() for h in self.h)


def segments(sampled: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, chunk end, end) of each fed segment of a row whose sampled (POLICY) tokens are `sampled` (n,) bool:
    tokens start .. chunk end - 1 were prefilled as one chunk, chunk end .. end - 1 decoded one a step."""
    edges = torch.diff(sampled.to(torch.int8), prepend=sampled.new_zeros(1, dtype=torch.int8),
                       append=sampled.new_zeros(1, dtype=torch.int8))
    firsts = (edges == 1).nonzero()[:, 0].tolist()           # each turn's first token
    ends = (edges == -1).nonzero()[:, 0].tolist()            # one past each turn's last token
    starts = [0] + [e - 1 for e in ends[:-1]]                # a chunk opens with the last turn's last token
    return list(zip(starts, firsts, [e - 1 for e in ends]))


def row_digests(ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor, sampled: torch.Tensor,
                videos: list, cache: dict) -> list[str]:
    """The digests of a row's fed segments from whole-row inputs: ids, types (mm_token_type_ids), sampled (n,),
    positions (3, n), videos the row's (pixels, grid) entries in order (one per chunk with video tokens)."""
    out, entries = [], iter(videos)
    for s, c, e in segments(sampled):
        pixels, grid = next(entries, (None, None)) if bool(types[s:c].any()) else (None, None)
        d = Digest().chunk(ids[s:c], types[s:c], positions[:, s:c], grid, pixel_digest(pixels, cache))
        d.steps(ids[c:e], positions[:, c:e])
        out.append(d.hexdigest())
    return out


def check_row(traj, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor, sampled: torch.Tensor,
              cache: dict) -> None:
    """Raise ContractError unless `row_digests` of the trainer's inputs of `traj` (a rollout.Trajectory) are its
    recorded Trajectory.digests; the message names the record, the sample, the turn and the parts that differ."""
    got, want = row_digests(ids, types, positions, sampled, traj.videos, cache), traj.digests
    name = f"record {traj.record_id!r} sample {traj.sample}"
    if traj.parent is not None:
        name += f" (sub-agent of row {traj.parent[0]}, call {traj.parent[1]})"
    if len(got) != len(want):
        raise ContractError(f"{name}: the rollout fed {len(want)} segments, the trainer's row has {len(got)} turns")
    for k, (a, b) in enumerate(zip(want, got)):
        if a != b:
            parts = [p for p, x, y in zip(PARTS, a.split(":"), b.split(":")) if x != y] or list(PARTS)
            raise ContractError(f"{name}: turn {k} (segment {k}) differs in {', '.join(parts)}: "
                                f"rollout {a}, trainer {b}")
