"""Charades-STA: find the [start, end] of a sentence's moment in a video.

Two layouts, as distributed:
- the original annotations, ``charades_sta_test.txt``: one query per line,
  ``VIDEOID START END##sentence``, with videos ``Charades_v1_480/<VIDEOID>.mp4``;
- lmms-lab/charades_sta: ``data/test-*.parquet`` (columns video "3MSZA.mp4", caption,
  timestamp [start, end]) with the same video folder. Its timestamps are stored as
  float16 (24.3 reads 24.296875) and are used as stored, as lmms-eval does.

Metrics: mIoU and R@0.3/0.5/0.7 (the share of queries with IoU at least 0.3, 0.5,
0.7), in percent.

Scoring follows lmms-eval 0.7.2's ``temporal_grounding_charades`` task, the first
release that scores it in the harness (0.7.1 wrote a submission file for an offline
script): its prompt, 50 greedy tokens, and its denominator, every query, one without
a readable span scoring IoU 0. lmms-eval reads the first "start - end" pair of the
sentences that mention a start, an end or "happens"; here omni_rl's
``temporal_grounding`` parser reads one bracketed pair or exactly two times, and
refuses a span that ends before it starts (lmms-eval swaps the two).
"""

from __future__ import annotations

from pathlib import Path

from omni_rl.benchmarks.base import (
    LMMS_EVAL,
    Benchmark,
    Protocol,
    Reading,
    Scored,
    Variant,
    find_table,
    mean,
    read_table,
    register_benchmark,
    render,
)

# lmms-eval's prompt, its spelling kept ("seonds") so that prompts match token for token
PROTOCOL = Protocol(
    nframes=32,
    prompt=(
        "Please find the visual event described by a sentence in the video, determining its starting and "
        "ending times. The format should be: 'The event happens in the start time - end time'. For example, "
        "The event 'person turn a light on' happens in the 24.3 - 30.4 seonds. Now I will give you the "
        "textual sentence: {question}. Please return its start time and end time."
    ),
    max_new_tokens=50,
    answer_parser="temporal_grounding",
    metric="iou",
)
LMMS_EVAL_SCORING = Variant(
    follows=f"lmms-eval {LMMS_EVAL}, lmms_eval/tasks/charades_sta",
    parser=(
        "lmms-eval 0.7.2's extract_time: the first 'start - end' pair of the sentences naming a start, end or "
        "'happens'; here omni_rl's temporal_grounding parser (one bracketed pair or exactly two times)"
    ),
    denominator=(
        "every query (no readable span: IoU 0); lmms-eval keys its results by video, caption and timestamp, so "
        "identical queries count once there"
    ),
    metric="iou",
)
VIDEO_DIRS = ("Charades_v1_480", "videos", "")


def _video(root: Path, name: str) -> Path | None:
    name = name if name.endswith(".mp4") else f"{name}.mp4"
    for folder in VIDEO_DIRS:
        if (root / folder / name).is_file():
            return root / folder / name
    return None


def _queries(root: Path):
    """(where, video, sentence, [start, end] or a reason) of every query."""
    text = root / "charades_sta_test.txt"
    if text.is_file():
        for number, line in enumerate(text.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            head, _, sentence = line.partition("##")
            parts = head.split()
            try:
                span: list[float] | str = [float(parts[1]), float(parts[2])]
            except (IndexError, ValueError):
                span = f"expected 'VIDEOID START END##sentence', got {line[:80]!r}"
            yield f"{text}:{number}", parts[0] if parts else "", sentence.strip(), span
        return
    table = find_table(root, "data/test-*.parquet", "*.parquet")
    if table is not None:
        for index, record in enumerate(read_table(table)):
            stamp = record.get("timestamp")
            span = [float(x) for x in stamp] if isinstance(stamp, (list, tuple)) and len(stamp) == 2 else "no timestamp"
            yield f"{table}:{index}", str(record.get("video", "")), str(record.get("caption", "")), span


def read(root: Path, protocol: Protocol) -> Reading:
    reading = Reading()
    for index, (where, video_name, sentence, span) in enumerate(_queries(root)):
        row_id = f"{Path(video_name).stem}-{index}"
        if isinstance(span, str):
            reading.fail(row_id, where, span)
            continue
        if span[1] < span[0]:
            reading.fail(row_id, where, f"end {span[1]} is before start {span[0]}")
            continue
        video = _video(root, video_name)
        if video is None:
            reading.fail(row_id, where, f"video {video_name} not found under {root}/Charades_v1_480")
            continue
        row = {
            "id": row_id,
            "origin": where,
            "problem": sentence,  # as written: lmms-eval adds ". " after it, period or not
            "problem_type": "temporal_grounding",
            "answer": span,
            "videos": [str(video)],
            "task": "charades_sta",
            "data_source": "charades_sta",
        }
        row["benchmark_prompt"] = render(protocol, row)
        reading.rows.append(row)
    return reading


def aggregate(scored: list[Scored], metric: str) -> dict[str, float]:
    """mIoU and recall at IoU 0.3, 0.5 and 0.7, in percent."""
    ious = [s.score for s in scored]
    out = {"mIoU": 100.0 * mean(ious)}
    for threshold in (0.3, 0.5, 0.7):
        out[f"R@{threshold}"] = 100.0 * mean([float(iou >= threshold) for iou in ious])
    return out


register_benchmark(
    Benchmark(
        name="charades_sta",
        protocol=PROTOCOL,
        read=read,
        aggregate=aggregate,
        metrics=("iou",),
        layout="charades_sta_test.txt or data/test-*.parquet, and Charades_v1_480/<video>.mp4",
        variants={"lmms-eval": LMMS_EVAL_SCORING},
    )
)
