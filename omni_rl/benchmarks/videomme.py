"""Video-MME (lmms-lab/Video-MME), with and without subtitles.

Layout: ``videomme/test-00000-of-00001.parquet`` (columns video_id, duration, domain,
sub_category, url, videoID, question_id, task_type, question, options ["A. ...", ...],
answer "A".."D"), the videos as ``data/<videoID>.mp4`` (or .MP4, .mkv) and the
subtitles as ``subtitle/<videoID>.srt``.

With subtitles, the prompt holds the subtitle lines shown at the sampled frames'
times (Video-MME's rule): the frames the decoder samples under ``protocol.nframes``
or ``fps`` (qwen-vl-utils' count, even and within the frame limits).

Scoring follows lmms-eval 0.7.2's ``videomme`` tasks: their prompts, 16 greedy tokens
and their denominator, every row (``accuracy``; 0.7.1 counted every row too). The answer
is read by omni_rl's ``multiple_choice`` parser. lmms-eval 0.7.2 reads it with its
shared ``extract_mcq_answer``, which ranks the letters it finds and puts a leading one
first ("A person ... so the answer is C" reads A; omni_rl reads C); lmms-eval 0.7.1
and Video-MME's own ``eval_your_results.py`` take the first capital A-D after
removing "The answer is"-like prefixes. Video-MME's own script counts only the rows
where it finds a letter: ``--set protocol.metric=accuracy_answered`` divides so.
"""

from __future__ import annotations

import re
from pathlib import Path

from omni_rl.benchmarks.base import (
    ACCURACIES,
    LMMS_EVAL,
    Benchmark,
    Protocol,
    Reading,
    Scored,
    Variant,
    accuracy,
    find_table,
    grouped,
    lettered,
    media_file,
    option_texts,
    read_table,
    register_benchmark,
    render,
)
from omni_rl.errors import OmniRLError
from omni_rl.preprocess.video import VideoBudget, sample_indices

# lmms-eval's instruction, "and the subtitles" included, with and without subtitles
INSTRUCTION = (
    "Select the best answer to the following multiple-choice question based on the video and the subtitles. "
    "Respond with only the letter (A, B, C, or D) of the correct option."
)
PROTOCOL = Protocol(
    nframes=32,
    prompt=INSTRUCTION + "\n{question}\n{options}\n\nAnswer with the option's letter from the given choices directly.",
    max_new_tokens=16,
    answer_parser="multiple_choice",
    metric="accuracy",
)
SUBTITLE_PROTOCOL = Protocol(
    nframes=32,
    prompt="This video's subtitles are listed below: \n{subtitles}\n"
    + INSTRUCTION
    + "\n{question}\n{options}\nThe best answer is:",
    max_new_tokens=16,
    answer_parser="multiple_choice",
    metric="accuracy",
)
LMMS_EVAL_SCORING = Variant(
    follows=f"lmms-eval {LMMS_EVAL}, lmms_eval/tasks/videomme",
    parser=(
        "lmms-eval 0.7.2's extract_mcq_answer (ranked formats, a leading letter first; 0.7.1 and Video-MME's "
        "script: the first capital A-D); here omni_rl's multiple_choice parser"
    ),
    denominator="every row (Video-MME's own script: rows where it finds a letter, metric accuracy_answered)",
    metric="accuracy",
)
SRT_TIME = re.compile(r"(\d+):(\d+):(\d+)[,.](\d+)\s*-->\s*(\d+):(\d+):(\d+)[,.](\d+)")
TAG = re.compile(r"<[^>]+>")
KEPT = ("video_id", "videoID", "duration", "domain", "sub_category", "task_type")


def parse_srt(text: str) -> list[tuple[float, float, str]]:
    """(start s, end s, text) of every cue of an .srt file; markup tags removed."""
    cues = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n").strip()):
        lines = block.strip().split("\n")
        for i, line in enumerate(lines):
            if m := SRT_TIME.search(line):
                g = [int(x) for x in m.groups()]
                start = g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000
                end = g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000
                words = TAG.sub("", " ".join(lines[i + 1 :])).strip()
                if words:
                    cues.append((start, end, words))
                break
    return cues


def subtitles_at(cues: list[tuple[float, float, str]], times: list[float]) -> str:
    """The cues shown at any of ``times``, in order, each once, one per line.
    lmms-eval 0.7.2 differs on purpose in three details: it lists the cues in a set's
    order (not time), merges cues with the same start and end, and samples its frames
    at ``linspace(0, n - 1, 32)`` rounded down with a cue's end excluded (a cue ending
    on a sampled frame's time can be in or out by one frame)."""
    return "\n".join(text for start, end, text in cues if any(start <= t <= end for t in times))


def frame_times(total_frames: int, fps: float, protocol: Protocol) -> list[float]:
    """The times (s) of the frames the decoder samples from a video under ``protocol``
    (qwen-vl-utils' count: even, within the frame limits; spread evenly). From the
    header's count and rate (``probe``: no demuxing of hour-long files), which are the
    decoder's at a constant rate. At a variable rate the header may state another rate
    than the frames' mean (an mkv its first frames', an mp4 with B-frames one from
    decode times), and the subtitles then follow other times than the frames."""
    return [i / fps for i in sample_indices(total_frames, fps, VideoBudget(**protocol.frame_sampling()))]


def probe(path: Path) -> tuple[int, float]:
    """(frame count, fps) from the container's header."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            frames = stream.frames or int(float(stream.duration * stream.time_base) * fps if stream.duration else 0)
    except (av.error.FFmpegError, IndexError) as err:
        raise OmniRLError(f"{path}: cannot read the video's header ({err})") from None
    if fps <= 0 or frames <= 0:
        raise OmniRLError(f"{path}: the header gives no frame rate or frame count")
    return frames, fps


def _subtitles(root: Path, video_id: str, video: Path, protocol: Protocol) -> str:
    srt = root / "subtitle" / f"{video_id}.srt"
    if not srt.is_file():
        return "No subtitles available"
    frames, fps = probe(video)
    cues = parse_srt(srt.read_text(encoding="utf-8", errors="replace"))
    return subtitles_at(cues, frame_times(frames, fps, protocol))


def reader(with_subtitles: bool):
    def read(root: Path, protocol: Protocol) -> Reading:
        reading = Reading()
        table = find_table(root, "videomme/*.parquet", "*.parquet")
        if table is None:
            return reading
        for index, record in enumerate(read_table(table)):
            where = f"{table}:{index}"
            row_id = str(record.get("question_id") or index)
            video_id = str(record.get("videoID", ""))
            video = media_file(root, [f"data/{video_id}{ext}" for ext in (".mp4", ".MP4", ".mkv")])
            if video is None:
                reading.fail(row_id, where, f"video data/{video_id}.mp4 not found under {root}")
                continue
            options = option_texts(record.get("options"))
            answer = str(record.get("answer", "")).strip()
            if answer not in "ABCDEFGHIJ"[: len(options)] or not answer:
                reading.fail(row_id, where, f"answer {answer!r} is not a letter of the {len(options)} options")
                continue
            row = {
                "id": row_id,
                "origin": where,
                "problem": str(record.get("question", "")),
                "problem_type": "multiple_choice",
                "answer": answer,
                "options": options,
                "videos": [str(video)],
                **{k: record.get(k) for k in KEPT},
                "data_source": f"videomme/{record.get('duration')}",
            }
            extra = {"options": lettered(options)}
            try:
                if with_subtitles:
                    extra["subtitles"] = _subtitles(root, video_id, video, protocol)
            except OmniRLError as err:
                reading.fail(row_id, where, str(err))
                continue
            row["benchmark_prompt"] = render(protocol, row, **extra)
            reading.rows.append(row)
        return reading

    return read


def aggregate(scored: list[Scored], metric: str) -> dict[str, float]:
    """Accuracy (percent) overall and per duration, domain and task type."""
    out = {"accuracy": accuracy(scored, metric)}
    for key in ("duration", "domain", "task_type"):
        out |= {f"accuracy/{key}/{k}": accuracy(v, metric) for k, v in grouped(scored, key).items()}
    return out


LAYOUT = "videomme/test-*.parquet, data/<videoID>.mp4 and (with subtitles) subtitle/<videoID>.srt"
for name, protocol, with_subtitles in (("videomme", PROTOCOL, False), ("videomme_w_subtitle", SUBTITLE_PROTOCOL, True)):
    register_benchmark(
        Benchmark(
            name=name,
            protocol=protocol,
            read=reader(with_subtitles),
            aggregate=aggregate,
            metrics=ACCURACIES,
            layout=LAYOUT,
            variants={"lmms-eval": LMMS_EVAL_SCORING},
            rows_of="videomme" if with_subtitles else None,
        )
    )
