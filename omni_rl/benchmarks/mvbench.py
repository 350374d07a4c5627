"""MVBench (OpenGVLab/MVBench): 20 tasks of multiple-choice video questions.

Layout: ``json/<task>.json`` (a list of ``{"video", "question", "candidates",
"answer"}``, the answer being the right candidate's text; some tasks add ``start`` and
``end``) and the videos either as the ``main`` branch's zips extract them
(``video/<folder>/...``, the official notebook's folders) or as the ``video`` branch
holds them (``<folder>/...`` with pre-cut ``*_segment`` clips, lmms-eval's folders).

Scoring follows lmms-eval 0.7.2's ``mvbench`` task (unchanged since 0.7.1): its prompt,
16 greedy tokens, and its denominator, the rows whose response is not exactly empty
(``accuracy_responded``); overall is the mean of the tasks' accuracies. The answer is
read by omni_rl's ``multiple_choice`` parser, not lmms-eval's ``mcq_acc``, which reads
"X. text" as X and otherwise the first standalone letter A-E anywhere, case folded: it
reads "A person ... so the answer is C" and "a dog" as A, where omni_rl reads C and
no letter.
"""

from __future__ import annotations

import logging
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
    grouped,
    lettered,
    mean,
    media_file,
    read_json,
    register_benchmark,
    render,
)
from omni_rl.errors import OmniRLError

log = logging.getLogger(__name__)

# task -> (official folder under video/, lmms-eval's folder on the video branch)
TASKS = {
    "action_sequence": ("star/Charades_v1_480", "star/Charades_segment"),
    "action_prediction": ("star/Charades_v1_480", "star/Charades_segment"),
    "action_antonym": ("ssv2_video", "ssv2_video_mp4"),
    "fine_grained_action": ("Moments_in_Time_Raw/videos", "Moments_in_Time_Raw/videos"),
    "unexpected_action": ("FunQA_test/test", "FunQA_test/test"),
    "object_existence": ("clevrer/video_validation", "clevrer/video_validation"),
    "object_interaction": ("star/Charades_v1_480", "star/Charades_segment"),
    "object_shuffle": ("perception/videos", "perception/videos"),
    "moving_direction": ("clevrer/video_validation", "clevrer/video_validation"),
    "action_localization": ("sta/sta_video", "sta/sta_video_segment"),
    "scene_transition": ("scene_qa/video", "scene_qa/video"),
    "action_count": ("perception/videos", "perception/videos"),
    "moving_count": ("clevrer/video_validation", "clevrer/video_validation"),
    "moving_attribute": ("clevrer/video_validation", "clevrer/video_validation"),
    "state_change": ("perception/videos", "perception/videos"),
    "fine_grained_pose": ("nturgbd", "nturgbd_convert"),
    "character_order": ("perception/videos", "perception/videos"),
    "egocentric_navigation": ("vlnqa", "vlnqa"),
    "episodic_reasoning": ("tvqa/frames_fps3_hq", "tvqa/video_fps3_hq_segment"),
    "counterfactual_inference": ("clevrer/video_validation", "clevrer/video_validation"),
}

PROTOCOL = Protocol(
    nframes=32,
    prompt="Question:{question}\nOption:\n{options}\nOnly give the best option.\n",
    max_new_tokens=16,
    answer_parser="multiple_choice",
    metric="accuracy_responded",
)
LMMS_EVAL_SCORING = Variant(
    follows=f"lmms-eval {LMMS_EVAL}, lmms_eval/tasks/mvbench",
    parser=(
        "lmms-eval's mcq_acc: 'X. text' is X, else the first standalone letter A-E, case folded; here omni_rl's "
        "multiple_choice parser, which reads a stated answer after reasoning and never the article 'A' as option A"
    ),
    denominator="rows whose response is not exactly empty (lmms-eval drops empty responses only)",
    metric="accuracy_responded",
)


def _video(root: Path, task: str, name: str) -> tuple[Path | None, bool]:
    """(the video file, whether it is an uncut original) for a row of ``task``."""
    official, segments = TASKS[task]
    cut = media_file(root, [f"{segments}/{name}", f"video/{segments}/{name}"]) if segments != official else None
    if cut is not None:
        return cut, False
    return media_file(root, [f"video/{official}/{name}", f"{official}/{name}"]), True


def read(root: Path, protocol: Protocol) -> Reading:
    reading = Reading()
    uncut = 0
    for task in TASKS:
        path = root / "json" / f"{task}.json"
        if not path.is_file():
            continue
        records = read_json(path)
        if not isinstance(records, list):
            raise OmniRLError(f"{path}: expected a JSON list of questions")
        for index, record in enumerate(records):
            where, row_id = f"{path}:{index}", f"{task}-{index}"
            candidates = [str(c) for c in record.get("candidates") or []]
            if record.get("answer") not in candidates:
                reading.fail(row_id, where, f"answer {record.get('answer')!r} is not one of the candidates")
                continue
            video, whole = _video(root, task, str(record.get("video", "")))
            if video is None:
                reading.fail(row_id, where, f"video {record.get('video')!r} not found under {root} (task {task})")
                continue
            bounded = whole and "start" in record and "end" in record
            uncut += bounded
            row = {
                "id": row_id,
                "origin": where,
                "problem": str(record["question"]),
                "problem_type": "multiple_choice",
                "answer": "ABCDEFGHIJ"[candidates.index(record["answer"])],
                "options": candidates,
                "videos": [str(video)],
                "task": task,
                "data_source": f"mvbench/{task}",
                "read_whole_despite_bounds": bool(bounded),
            }
            row["benchmark_prompt"] = render(protocol, row, options=lettered(candidates, "({letter}) {text}"))
            reading.rows.append(row)
    if uncut:
        log.warning(
            "mvbench: %d questions ask about a [start, end] part of an uncut video; the whole video is sampled "
            "(lmms-eval reads the video branch's pre-cut *_segment clips instead; counted in the results)",
            uncut,
        )
    return reading


def aggregate(scored: list[Scored], metric: str) -> dict[str, float]:
    """Accuracy (percent) per task, and overall as the mean of the tasks."""
    per_task = {task: accuracy(items, metric) for task, items in grouped(scored, "task").items()}
    return {"accuracy": mean(list(per_task.values())), **{f"accuracy/{k}": v for k, v in per_task.items()}}


MVBENCH = register_benchmark(
    Benchmark(
        name="mvbench",
        protocol=PROTOCOL,
        read=read,
        aggregate=aggregate,
        metrics=ACCURACIES,
        layout="json/<task>.json and the videos under video/<folder>/ or <folder>/",
        variants={"lmms-eval": LMMS_EVAL_SCORING},
    )
)
