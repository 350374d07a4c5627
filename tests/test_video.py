import numpy as np
import pytest
from qwen_vl_utils.vision_process import smart_nframes

from omni_rl.errors import OmniRLError
from omni_rl.preprocess import video as video_mod
from omni_rl.preprocess.synthetic import moving_square, write_video
from omni_rl.preprocess.video import VideoBudget, read_video, sample_indices


def test_moving_square_moves_the_right_way():
    frames = moving_square("right", 1.0, 10, 64, 48)
    assert frames.shape == (10, 48, 64, 3) and frames.dtype == np.uint8
    red = frames[..., 0] > 128
    first_x = np.nonzero(red[0])[1].mean()
    last_x = np.nonzero(red[-1])[1].mean()
    assert last_x > first_x + 10
    down = moving_square("down", 1.0, 10, 64, 48)[..., 0] > 128
    assert np.nonzero(down[-1])[0].mean() > np.nonzero(down[0])[0].mean() + 5


@pytest.mark.parametrize(
    ("total", "fps", "sample_fps", "max_frames"),
    [(30, 15, 2.0, None), (300, 30, 2.0, None), (3000, 30, 2.0, 16), (90, 30, 1.0, None)],
)
def test_sample_indices_follow_qwen_vl_utils(total, fps, sample_fps, max_frames):
    spec = {"fps": sample_fps} | ({"max_frames": max_frames} if max_frames else {})
    budget = VideoBudget(fps=sample_fps, max_frames=max_frames or 768)
    indices = sample_indices(total, fps, budget)
    assert len(indices) == smart_nframes(spec, total_frames=total, video_fps=fps)
    assert len(indices) % 2 == 0
    assert indices[0] == 0 and indices[-1] == total - 1
    assert indices == sorted(indices)


def test_decord_and_pyav_decode_identical_frames(tmp_path):
    path = write_video(tmp_path / "clip.mp4", moving_square("left", 2.0, 15, 96, 64), 15)
    a = read_video(path)
    b = read_video(path, backends=("pyav",))
    assert a.backend == "decord" and b.backend == "pyav"
    assert a.total_frames == b.total_frames == 30 and a.fps == pytest.approx(15.0)
    assert a.indices == b.indices
    np.testing.assert_array_equal(a.frames, b.frames)
    meta = a.metadata()
    assert meta["frames_indices"] == a.indices and meta["total_num_frames"] == 30
    assert a.timestamps[-1] == pytest.approx(29 / 15)


class LiveArrays:
    """Counts the frame arrays a PyAV container's decoded frames hand out that are
    still alive, and the most alive at once (``av.open`` replaced by ``open``)."""

    def __init__(self, real_open):
        self.real_open, self.live, self.peak = real_open, 0, 0

    def _track(self, array):
        import weakref

        self.live += 1
        self.peak = max(self.peak, self.live)
        weakref.finalize(array, self._release)
        return array

    def _release(self):
        self.live -= 1

    def open(self, *args, **kwargs):
        counter, container = self, self.real_open(*args, **kwargs)

        class Frame:
            def __init__(self, frame):
                self.frame, self.time = frame, frame.time

            def to_ndarray(self, **kw):
                return counter._track(self.frame.to_ndarray(**kw))

        class Container:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                container.close()

            def __getattr__(self, name):
                return getattr(container, name)

            def decode(self, stream):
                return (Frame(f) for f in container.decode(stream))

        return Container()


def test_pyav_decodes_only_the_sampled_frames(tmp_path, monkeypatch):
    import av

    path = write_video(tmp_path / "long.mp4", moving_square("right", 10.0, 30, 160, 120), 30)
    budget = VideoBudget()
    # the reference: every frame decoded into memory, then sampled (the decoder before streaming)
    with av.open(str(path)) as container:
        every = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    indices = sample_indices(len(every), 30.0, budget)
    arrays = LiveArrays(av.open)
    monkeypatch.setattr(av, "open", arrays.open)
    frames, fps, total, got = video_mod._decode_pyav(path, budget)
    assert fps == 30.0 and total == len(every) == 300 and got == indices
    assert arrays.peak == len(frames) == len(indices) == 20  # never more frames held than kept
    np.testing.assert_array_equal(frames, np.stack([every[i] for i in indices]))
    decord_frames, _, _, decord_indices = video_mod._decode_decord(path, budget)
    assert got == decord_indices
    np.testing.assert_array_equal(frames, decord_frames)


def test_keep_frames_converts_only_the_frames_it_keeps():
    converted = []

    class Frame:
        def __init__(self, i):
            self.i, self.time = i, i / 10

        def to_ndarray(self, format):
            converted.append(self.i)
            return np.full((2, 2, 3), self.i, np.uint8)

    kept, times = video_mod.keep_frames((Frame(i) for i in range(50)), [0, 7, 7, 49])
    assert times == [i / 10 for i in range(50)] and converted == [0, 7, 49]
    assert [int(k[0, 0, 0]) for k in kept] == [0, 7, 7, 49]


# a phone-style variable frame rate: 30 frames at 30 fps, then 10 at 5 fps (3 s shown)
VFR_TIMES = [i / 30 for i in range(30)] + [1 + 0.2 * i for i in range(10)]


def every_frame(path, count):
    import decord

    return decord.VideoReader(str(path), num_threads=1).get_batch(list(range(count))).asnumpy()


def kept_frames(clip, path, count):
    """The ordinal of each of ``clip``'s frames in ``path``, whose frames are greys set
    apart by 5 or 6 levels."""
    levels = every_frame(path, count)[:, 32, 32, 0].astype(int)
    return [int(np.abs(levels - level).argmin()) for level in clip.frames[:, 0, 32, 32]]


# mp4 states the mean rate (40 frames / 2.83 s); mkv the first frames' (30)
@pytest.mark.parametrize(("suffix", "container_fps"), [("mp4", 40 / (2.8 + 1 / 30)), ("mkv", 30.0)])
@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_a_variable_frame_rate_is_sampled_evenly_in_time(tmp_path, backend, suffix, container_fps):
    import av

    frames = np.stack([np.full((64, 64, 3), 6 * k, np.uint8) for k in range(len(VFR_TIMES))])
    path = write_video(tmp_path / f"vfr.{suffix}", frames, 30, times=VFR_TIMES)
    with av.open(str(path)) as container:
        assert float(container.streams.video[0].average_rate) == pytest.approx(container_fps, rel=1e-3)
    clip = read_video(path, VideoBudget(nframes=6), backends=(backend,))
    assert clip.backend == backend and clip.total_frames == 40
    # the rate the processors are told is the frames' own over their span, whatever the container says
    assert clip.fps == pytest.approx(39 / 2.8, rel=1e-6)
    # a Python float, as a cached entry's fps reads back: the processors make the frames'
    # second_per_grid_ts of it, float64 from numpy's (a temporal position moved by one)
    assert type(clip.fps) is float and type(clip.sampled_fps) is float
    assert clip.indices == [0, 8, 16, 23, 31, 39]
    # index i stands for i / fps: 0, 0.574, 1.149, 1.651, 2.226, 2.8 s; the frames shown
    # nearest are those at 0, 0.567, 1.2, 1.6, 2.2 and 2.8 s (decode order: 0.267 s for 8)
    assert kept_frames(clip, path, 40) == [0, 17, 31, 33, 36, 39]
    told = np.array(clip.timestamps)  # where the processor places them
    assert np.abs(told - np.array(VFR_TIMES)[[0, 17, 31, 33, 36, 39]]).max() < 0.06
    assert clip.metadata()["fps"] == clip.fps and clip.metadata()["frames_indices"] == clip.indices
    # caches made when frames were kept in decode order miss: the key names the rule
    assert VideoBudget().key()["frames"] == "shown nearest an even time grid"


def test_a_constant_rate_keeps_the_container_rate_and_the_frames_themselves():
    times = [i * 1001 / 30000 for i in range(9000)]  # 29.97 fps, 5 minutes
    fps = 30000 / 1001
    assert video_mod.frame_rate(times, fps) == fps
    grid = sample_indices(9000, fps, VideoBudget(fps=2.0))
    assert video_mod.frames_at(times, grid, fps) == grid
    # a stated rate the frames drift from (30 stated, 29.97 shown): the frames' own rate
    assert video_mod.frame_rate(times, 30.0) == pytest.approx(fps, rel=1e-9)
    assert video_mod.frames_at([0.0, 0.1, 0.2, 3.0], [0, 1, 2, 3], 1.0) == [0, 2, 3, 3]  # 1 s, 2 s: nearer 0.2 s, 3 s
    assert not video_mod.rising([0.0, 1.0, 1.0, 2.0]) and not video_mod.rising([0.0, None, 2.0])


def test_frames_without_rising_times_are_sampled_in_decode_order_and_the_log_says_so(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="omni_rl.preprocess.video"):
        told, indices, shown = video_mod.sample_frames(tmp_path / "x.mp4", 30, [0.0] * 30, 10.0, VideoBudget())
    assert told == 10.0 and indices == shown == sample_indices(30, 10.0, VideoBudget())
    assert "x.mp4: the frame times do not rise" in caplog.text


def test_frames_an_edit_list_hides_are_not_counted(tmp_path, caplog):
    """An mp4 trimmed by its edit list: the first 5 of 40 frames lie before the start.
    decord counts them but returns shown frames by index, so it is refused for PyAV,
    which decodes only the 35 shown frames."""
    import av

    frames = np.stack([np.full((64, 64, 3), 6 * k, np.uint8) for k in range(40)])
    source = write_video(tmp_path / "full.mp4", frames, 10)
    trimmed = tmp_path / "trimmed.mp4"
    with av.open(str(source)) as src, av.open(str(trimmed), "w") as out:
        stream = src.streams.video[0]
        copy = out.add_stream_from_template(stream)
        shift = round(0.5 / stream.time_base)
        for packet in src.demux(stream):
            if packet.dts is not None:
                packet.pts, packet.dts, packet.stream = packet.pts - shift, packet.dts - shift, copy
                out.mux(packet)
    with pytest.raises(OmniRLError, match="5 frames lie before the start"):
        read_video(trimmed, VideoBudget(nframes=8), backends=("decord",))
    with caplog.at_level("WARNING", logger="omni_rl.preprocess.video"):
        clip = read_video(trimmed, VideoBudget(nframes=8))
    assert clip.backend == "pyav" and clip.total_frames == 35 and clip.fps == pytest.approx(10.0)
    assert "decoded by pyav (decord: 5 frames lie before the start" in caplog.text
    levels = every_frame(source, 40)[:, 32, 32, 0].astype(int)
    kept = [int(np.abs(levels - level).argmin()) for level in clip.frames[:, 0, 32, 32]]
    assert kept == [5 + i for i in sample_indices(35, 10.0, VideoBudget(nframes=8))]


def test_pyav_is_the_fallback_when_decord_fails(tmp_path, monkeypatch):
    path = write_video(tmp_path / "clip.mp4", moving_square("up", 1.0, 10, 64, 64), 10)

    def broken(*_):
        raise RuntimeError("decord cannot open this")

    monkeypatch.setitem(video_mod.DECODERS, "decord", broken)
    clip = video_mod.read_video(path)
    assert clip.backend == "pyav"


def test_bad_files_raise_an_error_naming_the_file(tmp_path):
    with pytest.raises(OmniRLError, match=r"missing\.mp4: no such video file"):
        read_video(tmp_path / "missing.mp4")
    fake = tmp_path / "notes.mp4"
    fake.write_text("this is not a video")
    with pytest.raises(OmniRLError, match=r"notes.mp4: cannot decode video \(decord: .*; pyav: .*\)"):
        read_video(fake)


def test_make_synthetic_media_tool_writes_a_dataset(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from omni_rl.preprocess.motion import ROUTED_KINDS
    from omni_rl.preprocess.rows import read_rows

    tool = Path(__file__).parent.parent / "tools" / "make_synthetic_media.py"
    args = ["--out", str(tmp_path), "--videos", "2", "--tones", "1", "--images", "1", "--seconds", "2"]
    result = subprocess.run([sys.executable, str(tool), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows, failures = read_rows(result.stdout.strip())
    assert not failures and len(rows) == 2 * 4 + 1 + 1
    assert {r.problem_type for r in rows} == {"multiple_choice", "counting", "temporal_grounding"}
    assert read_video(tmp_path / rows[0].videos[0]).total_frames == 20
    motion = ["--out", str(tmp_path / "motion"), "--videos", "8", "--motion", "--decoy-every", "4"]
    result = subprocess.run([sys.executable, str(tool), *motion], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows, failures = read_rows(result.stdout.strip())
    assert not failures and len(rows) == 8 and {r.problem_type for r in rows} == {"multiple_choice"}
    assert {r.fields["data_source"] for r in rows} == {f"video_{k}" for k in ("direction", "order", "count", "when")}
    assert [bool(r.fields.get("decoy")) for r in rows] == [False, False, False, True] * 2
    routed = ["--out", str(tmp_path / "routed"), "--videos", "6", "--motion", "--kinds", *ROUTED_KINDS]
    result = subprocess.run([sys.executable, str(tool), *routed], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "grounding: the best answer without the clip, [0.25, 1.5], scores mean IoU 0.279" in result.stderr
    rows, failures = read_rows(result.stdout.strip())  # every answer valid for its reward
    assert not failures and [r.problem_type for r in rows] == ["multiple_choice", "counting", "temporal_grounding"] * 2
