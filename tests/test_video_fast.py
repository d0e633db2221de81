"""
Tests for the fast paths of video.py: sparse sampling that seeks (same frames as the sequential rule),
the decoded-frame cache and the decode pool.

    python -m pytest tests/test_video_fast.py -q

Identity is checked against method="sequential" (today's nearest-frame rule, decoding from the start):
the same times and the same pixels, on the real files of ../shared/real_videos (both nasa streams, with
B-frames), a generated long-GOP file (keyframe every 250 frames, as x264 writes by default) and a
generated file with B-frames and open GOPs.
"""
import contextlib
import os
import threading
import time
from pathlib import Path

import av
import numpy as np
import pytest
import torch

import video
from video import VideoError

REAL = Path(__file__).resolve().parents[2] / "shared" / "real_videos"
NASA = REAL / "nasa_13013.mp4"
FPS, GOP, N = 30, 250, 3600            # the generated long file: 2 minutes at 30 fps


def write_long(path: Path, num_frames: int, gop: int, **kw) -> Path:
    chunks = (video.synthetic_frames(min(600, num_frames - i), 64, 96, seed=i, first=i)
              for i in range(0, num_frames, 600))
    video.write_video(path, chunks, FPS, gop=gop, **kw)
    return path


@pytest.fixture(scope="module")
def long_gop(tmp_path_factory) -> Path:
    return write_long(tmp_path_factory.mktemp("vid") / "long_gop.mp4", N, GOP)


@pytest.fixture(scope="module")
def bframes(tmp_path_factory) -> Path:
    """40 s with 3 B-frames between references and open GOPs; the premise (packets out of presentation
    order) is checked in the test that uses it."""
    opts = {"x264-params": "bframes=3:b-adapt=0:open-gop=1:scenecut=0"}
    return write_long(tmp_path_factory.mktemp("vid") / "bframes.mp4", 1200, GOP, encoder_options=opts)


def same(a: video.Clip, b: video.Clip) -> None:
    np.testing.assert_array_equal(a.times, b.times)
    assert a.frames.shape == b.frames.shape and torch.equal(a.frames, b.frames)


def test_bframes_premise(bframes):
    with av.open(str(bframes)) as c:
        pts = [p.pts for p in c.demux(c.streams.video[0]) if p.pts is not None]
    assert any(a > b for a, b in zip(pts, pts[1:])), "no B-frames: packets are in presentation order"


@pytest.mark.parametrize("k", [2, 8, 64])
@pytest.mark.parametrize("which", ["long_gop", "bframes"])
def test_seek_overview_equals_sequential_generated(request, which, k):
    path = request.getfixturevalue(which)
    seq = video.sample_overview(path, nframes=k, method="sequential")
    fast = video.sample_overview(path, nframes=k, method="seek")
    same(seq, fast)
    assert [video.read_frame_index(f) for f in fast.frames] == [round(t * FPS) for t in fast.times]
    if len(seq.frames) and video.probe(path).num_frames / k >= GOP:  # targets a GOP or more apart: skips most
        assert fast.decoded < seq.decoded / 2, (fast.decoded, seq.decoded)


@pytest.mark.parametrize("path, stream", [(NASA, None), (NASA, 1), (REAL / "av1_video.mkv", None),
                                          (REAL / "h265_video.mp4", None), (REAL / "h264_10bits.mp4", None)])
@pytest.mark.parametrize("k", [2, 4, 8, 64, None])  # None: the 2 fps rule
def test_seek_overview_equals_sequential_real(path, stream, k):
    rule = dict(nframes=k, fps=2.0, max_frames=768)
    seq = video.sample_overview(path, **rule, stream=stream, method="sequential")
    fast = video.sample_overview(path, **rule, stream=stream, method="seek")
    same(seq, fast)


def test_seek_decodes_less_on_nasa():
    """nasa stream 0 has a keyframe at 8.08 s: K = 2 targets 3.25 s and 9.75 s, so the second is reached by seeking."""
    seq = video.sample_overview(NASA, nframes=2, method="sequential")
    fast = video.sample_overview(NASA, nframes=2, method="seek")
    same(seq, fast)
    assert fast.decoded < seq.decoded


@pytest.mark.parametrize("keys", [
    "every_second",   # claims a keyframe every second: most seeks land before the target (still right)
    "shifted",        # every real keyframe placed 0.5 s early
    "none",           # no keyframe known: decodes from the start
])
def test_wrong_keyframe_list_still_gives_the_same_frames(long_gop, keys):
    """The keyframe list only steers seeking; the frames come from the trust rule, so a wrong list costs
    time, never correctness."""
    real = video.keyframe_times(long_gop)
    fake = {"every_second": np.arange(0.0, N / FPS, 1.0), "shifted": real - 0.5, "none": np.array([])}[keys]
    targets = video.uniform_targets(0.0, N / FPS, 16)
    out = []
    for kf, fn in ((fake, "sparse"), (None, "seq")):
        count = [0]
        container, vs = video._open(long_gop, None)
        with container:
            if fn == "sparse":
                out.append(video._pick_sparse(container, vs, str(long_gop), targets, kf, FPS, None, 32, count))
            else:
                out.append(video._pick(video._frames(container, vs, str(long_gop), 0.0, count), targets, None, 32))
    assert [t for t, _ in out[0]] == [t for t, _ in out[1]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(out[0], out[1]))


def test_keyframe_times_long_gop(long_gop):
    np.testing.assert_allclose(video.keyframe_times(long_gop), np.arange(0, N, GOP) / FPS, atol=1e-9)


def test_keyframe_times_bframes_are_presentation_times():
    """nasa stream 0: the index stores decode times (-0.08 s, 8.0 s); the keyframes show at 0 s and 8.08 s."""
    np.testing.assert_allclose(video.keyframe_times(NASA), [0.0, 8.08], atol=1e-9)


@pytest.mark.parametrize("start, end, kw", [
    (0.0, 120.0, dict(level=None, fps=1, max_frames=4)),     # 4 frames 30 s apart: seeks
    (7.9, 100.0, dict(level=None, fps=1, max_frames=16)),    # ParaVT sub-agent crop of a long window
    (20.0, 24.0, dict(fps=2.0, max_frames=128)),             # a short dense window (Video-o3's crop)
])
def test_seek_crop_equals_sequential(long_gop, start, end, kw):
    seq = video.crop(long_gop, start, end, method="sequential", **kw)
    fast = video.crop(long_gop, start, end, method="seek", **kw)
    same(seq, fast)
    assert np.all((fast.times >= start) & (fast.times <= end))


def test_seek_crop_equals_sequential_nasa():
    for stream in (None, 1):
        same(video.crop(NASA, 1.0, 12.5, level=None, fps=0.2, max_frames=128, stream=stream, method="sequential"),
             video.crop(NASA, 1.0, 12.5, level=None, fps=0.2, max_frames=128, stream=stream, method="seek"))


def test_bad_method():
    with pytest.raises(ValueError, match="auto, seek, sequential"):
        video.sample_overview(NASA, nframes=4, method="fast")


@pytest.mark.parametrize("method", ["seek", "auto"])
def test_truncated_file_still_reads_as_truncated(tmp_path, method):
    path = tmp_path / "cut.mp4"
    write_long(path, 600, 60, faststart=True)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 10])
    with pytest.raises(VideoError, match="truncated"):
        video.sample_overview(path, nframes=4, method=method)


# ----------------------------------------------------------------------------- cache

def test_cache_hits_share_tensors_and_count(long_gop):
    cache = video.FrameCache()
    a = video.sample_overview(long_gop, nframes=8, cache=cache)
    b = video.sample_overview(long_gop, nframes=8, cache=cache)
    c = video.sample_overview(long_gop, nframes=8, max_pixels=32 * 32, cache=cache)  # another key
    assert b.frames is a.frames and b.decoded == 0 and a.decoded > 0 and c.frames.shape[-2:] == (32, 32)
    s = cache.stats()
    assert (s["hits"], s["misses"], s["entries"]) == (1, 2, 2) and s["hit_rate"] == pytest.approx(1 / 3)
    assert 0 < s["seconds_saved"] <= s["decode_seconds"]
    same(a, video.sample_overview(long_gop, nframes=8))


def test_cache_key_changes_with_the_file(tmp_path):
    path = write_long(tmp_path / "v.mp4", 60, GOP)
    cache = video.FrameCache()
    video.sample_overview(path, nframes=4, cache=cache)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # same size, new mtime: an edited file
    video.sample_overview(path, nframes=4, cache=cache)
    assert cache.stats()["misses"] == 2


def test_cache_memory_bound_evicts_oldest(long_gop):
    one = video.sample_overview(long_gop, nframes=4).frames.numel()
    cache = video.FrameCache(max_bytes=2 * one)
    for mp in (None, 10**6, 10**7):  # three keys, each frame kept at 64x96: `one` bytes each
        video.sample_overview(long_gop, nframes=4, max_pixels=mp, cache=cache)
    s = cache.stats()
    assert s["bytes"] <= 2 * one and s["entries"] == 2
    video.sample_overview(long_gop, nframes=4, cache=cache)  # the first, evicted: a miss again
    assert cache.stats()["misses"] == 4


def test_disk_cache_round_trip_corruption_and_cap(long_gop, tmp_path):
    d = tmp_path / "frames"
    a = video.sample_overview(long_gop, nframes=8, cache=video.FrameCache(disk_dir=str(d)))
    files = list(d.glob("*.pt"))
    assert len(files) == 1 and not list(d.glob("*.tmp"))  # written atomically: no temporary left
    fresh = video.FrameCache(disk_dir=str(d))  # a new process: memory empty, disk warm
    same(a, video.sample_overview(long_gop, nframes=8, cache=fresh))
    assert fresh.stats()["disk_hits"] == 1 and fresh.stats()["misses"] == 0
    files[0].write_bytes(files[0].read_bytes()[:100])  # torn file: a miss, rewritten
    fresh = video.FrameCache(disk_dir=str(d))
    same(a, video.sample_overview(long_gop, nframes=8, cache=fresh))
    assert fresh.stats()["misses"] == 1 and len(list(d.glob("*.pt"))) == 1
    capped = video.FrameCache(disk_dir=str(d), disk_max_bytes=files[0].stat().st_size + 100)
    for mp in (10**6, 10**7):  # two more keys with files of the same size: one fits under the cap
        video.sample_overview(long_gop, nframes=8, max_pixels=mp, cache=capped)
    assert len(list(d.glob("*.pt"))) == 1  # the cap keeps only the newest
    fresh = video.FrameCache(disk_dir=str(d))
    video.sample_overview(long_gop, nframes=8, max_pixels=10**7, cache=fresh)
    assert fresh.stats()["disk_hits"] == 1


def _entry(i: int) -> tuple[tuple, video.Clip]:
    """A FrameCache key and a small clip whose pixels say which key it belongs to (for the disk-race tests)."""
    frames = torch.full((2, 3, 16, 16), i, dtype=torch.uint8)
    return ("v.mp4", 1000, 1, None, ("K", i), None, 32), video.Clip(frames, np.array([0.5, 1.5]), "v.mp4", 2)


def _store_one(d: str) -> str:
    """Path of the disk file of entry 0 (written by a throwaway cache): the size of every entry's file."""
    cache = video.FrameCache(disk_dir=d)
    cache._store(*_entry(0), 0.1)
    return cache._file(_entry(0)[0])


def test_disk_cache_file_pruned_by_another_rank_is_a_miss_not_an_error(tmp_path, monkeypatch):
    """Ranks share disk_dir: a file another rank prunes between this one's steps (after the read, before
    marking it used; during the read) is a hit already read or a miss, never FileNotFoundError."""
    d = str(tmp_path)
    key, clip = _entry(7)
    video.FrameCache(disk_dir=d)._store(key, clip, 0.5)
    utime, load = os.utime, torch.load

    def pruned_then(real):
        def call(path, *a, **k):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)          # the other rank's prune lands just before this call
            return real(path, *a, **k)
        return call

    monkeypatch.setattr(os, "utime", pruned_then(utime))
    fresh = video.FrameCache(disk_dir=d)
    got = fresh._load(key, "v.mp4")       # read before the prune: a disk hit
    assert got is not None and torch.equal(got.frames, clip.frames) and fresh.stats()["disk_hits"] == 1
    monkeypatch.undo()
    video.FrameCache(disk_dir=d)._store(key, clip, 0.5)
    monkeypatch.setattr(torch, "load", pruned_then(load))
    fresh = video.FrameCache(disk_dir=d)
    assert fresh._load(key, "v.mp4") is None and fresh.stats()["disk_hits"] == 0   # gone before the read: a miss


def test_disk_cache_prune_tolerates_files_vanishing_after_listing(tmp_path, monkeypatch):
    """Pruning lists disk_dir, then stats and removes: a file another rank removes in between is skipped."""
    d = str(tmp_path)
    for i in range(3):
        video.FrameCache(disk_dir=d)._store(*_entry(i), 0.1)
    size = os.path.getsize(video.FrameCache(disk_dir=d)._file(_entry(0)[0]))
    scandir = os.scandir

    def racing(path):
        entries = list(scandir(path))
        os.remove(next(e.path for e in entries if e.name.endswith(".pt")))   # pruned by another rank
        return iter(entries)

    monkeypatch.setattr(os, "scandir", racing)
    capped = video.FrameCache(disk_dir=d, disk_max_bytes=2 * size)
    capped._store(*_entry(3), 0.1)
    monkeypatch.undo()
    assert sum(f.stat().st_size for f in tmp_path.glob("*.pt")) <= 2 * size


def test_disk_cache_shared_by_concurrent_writers(tmp_path):
    """Two caches (two ranks) on one disk_dir, capped below three files, storing and reading eight keys from
    four threads: every read is the right clip or a miss, and nothing raises."""
    d = str(tmp_path)
    size = os.path.getsize(_store_one(d))
    caches = [video.FrameCache(max_bytes=0, disk_dir=d, disk_max_bytes=int(2.5 * size)) for _ in range(2)]
    errors, hits = [], [0]

    def hammer(cache, seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                i = int(rng.integers(8))
                key, clip = _entry(i)
                got = cache._load(key, "v.mp4")
                if got is None:
                    cache._store(key, clip, 0.1)
                else:
                    assert torch.equal(got.frames, clip.frames)
                    hits[0] += 1
        except BaseException as e:        # noqa: BLE001 -- a thread's exception, reported by the assert below
            errors.append(repr(e))

    threads = [threading.Thread(target=hammer, args=(caches[t % 2], t)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and hits[0] > 0
    assert not list(tmp_path.glob("*.tmp"))


def test_cache_missing_file_is_a_video_error(tmp_path):
    with pytest.raises(VideoError, match="no such file"):
        video.FrameCache().overview(tmp_path / "nope.mp4", nframes=4)


# ----------------------------------------------------------------------------- pool

def test_pool_results_equal_direct_calls(long_gop):
    with video.DecodePool(workers=2, timeout=60) as pool:
        futs = [pool.submit_overview(long_gop, nframes=k) for k in (4, 8)]
        futs.append(pool.submit_crop(long_gop, 30.0, 34.0, level="coarse", fps=2.0, max_frames=128))
        got = [pool.result(f) for f in futs]
        s = pool.stats()
    same(got[0], video.sample_overview(long_gop, nframes=4))
    same(got[1], video.sample_overview(long_gop, nframes=8))
    same(got[2], video.crop(long_gop, 30.0, 34.0, level="coarse", fps=2.0, max_frames=128))
    assert s["tasks"] == 3 and s["errors"] == 0 and s["decode_seconds"] > 0


def test_pool_bad_video_is_an_error_naming_the_file(tmp_path, long_gop):
    bad = tmp_path / "bad.mp4"
    bad.write_text("not a video")
    with video.DecodePool(workers=2, timeout=60) as pool:
        f_bad, f_ok = pool.submit_overview(bad, nframes=4), pool.submit_overview(long_gop, nframes=4)
        with pytest.raises(VideoError, match="not a readable video") as e:
            pool.result(f_bad)
        assert e.value.path == str(bad)
        assert len(pool.result(f_ok).times) == 4  # one bad file does not spoil the others
        with pytest.raises(VideoError, match="past the end"):
            pool.result(pool.submit_crop(long_gop, 500.0, 510.0, fps=2.0, max_frames=128))
        assert pool.stats()["errors"] == 2


def test_pool_deadline_stops_a_slow_decode(long_gop):
    """The deadline is checked between frames: a sequential decode of 3600 frames cannot finish in 1 ms."""
    with video.DecodePool(workers=1, timeout=0.001) as pool:
        with pytest.raises(VideoError, match="timed out after 0.001 s") as e:
            pool.result(pool.submit_overview(long_gop, nframes=64, method="sequential"))
    assert e.value.path == str(long_gop)


def test_pool_gives_up_on_a_stuck_worker(monkeypatch):
    """A worker stuck where the deadline is never checked (inside FFmpeg) is abandoned, and the task
    queued behind it reports the stalled pool: neither call hangs."""
    monkeypatch.setattr(video.DecodePool, "GRACE_S", 0.2)
    pool = video.DecodePool(workers=1, timeout=0.2)
    stuck = pool._submit("stuck.mp4", time.sleep, 3.0)
    queued = pool._submit("queued.mp4", time.sleep, 0.0)
    t0 = time.monotonic()
    with pytest.raises(VideoError, match="stuck.mp4: decoding timed out"):
        pool.result(stuck)
    with pytest.raises(VideoError, match="queued.mp4: decode pool stalled"):
        pool.result(queued)
    assert time.monotonic() - t0 < 2.5 and pool.stats()["timeouts"] == 1
    pool.close()


def test_prefetch_fills_the_cache(long_gop):
    cache = video.FrameCache()
    with video.DecodePool(workers=2, timeout=60, cache=cache) as pool:
        for f in pool.prefetch_overviews([(long_gop, dict(nframes=8)), (long_gop, dict(nframes=4))]):
            f.result(timeout=60)
        clip = pool.result(pool.submit_overview(long_gop, nframes=8))
    assert clip.decoded == 0 and cache.stats()["hits"] == 1 and cache.stats()["misses"] == 2
    with pytest.raises(ValueError, match="needs a DecodePool with a cache"):
        video.DecodePool(1, timeout=60).prefetch_overviews([(long_gop, {})])


def test_concurrent_requests_for_one_key_decode_once(long_gop):
    cache = video.FrameCache()
    with video.DecodePool(workers=2, timeout=60, cache=cache) as pool:
        clips = [pool.result(f) for f in [pool.submit_overview(long_gop, nframes=16) for _ in range(4)]]
    assert cache.stats()["misses"] == 1 and all(c.frames is clips[0].frames for c in clips)
